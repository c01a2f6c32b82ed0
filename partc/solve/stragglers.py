"""A training step's expected time when devices do not run every step at their priced speed.

A pipeline step waits for its slowest stage, and data-parallel replicas wait for each other at
the step's gradient all-reduce. Where each device's speed moves from step to step on its own
(measured: this project's 2-core VM runs the same kernel in a fast or a 1.3-2.9x slower mode,
each core switching on its own every few seconds; docs/benchmarks.md, "Measured plan quality on
this machine"), the step's expected time is above its time at the mean speed, and more so for a
balanced cut than for one bound by one stage anyway: the max of independent times exceeds the
max of their means.

`expected_iteration_s` prices that. The device's speed modes (`DeviceSpec.speed_spread`,
measured by `partc calibrate`: (probability, factor) pairs whose weighted factor is 1, so the
profiled time is the mean one) apply to each *speed unit* on its own: a device, or a core
where processes share one (they share its mode). In one draw, each unit takes a mode, every
pipeline rank runs its computations (forward, backward, optimizer step) at the slowest factor
among the units its replicas run on (the replicas of a stage meet at the all-reduce; taking
their slowest for every micro-batch is an upper bound of the replicas' own pipelines'), and the
schedule is simulated; transfers keep their price. The expectation is exact over every draw
while there are at most `EXACT_DRAWS` of them, and otherwise the mean over `SAMPLED_DRAWS` draws
from a fixed seed (the same inputs always give the same number). Torch-free, like the rest of
the solver.
"""
from __future__ import annotations

import itertools
import math
import random
from dataclasses import replace
from typing import Sequence

from partc.solve.simulator import PipelineSpec, simulate

Modes = tuple[tuple[float, float], ...]
"""(probability, factor) pairs of one device's speed, factors of its priced time."""
Unit = tuple[int, int]
"""A speed unit: (node, core) of ClusterSpec.core_of, one per device unless devices share cores."""

EXACT_DRAWS = 256  # at most this many distinct draws are enumerated exactly
SAMPLED_DRAWS = 64  # beyond that, this many seeded draws
SEED = 0


def rank_factor_draws(rank_units: Sequence[Sequence[Unit]], modes: Modes
                      ) -> list[tuple[float, tuple[float, ...]]]:
    """The distribution of per-rank time factors: (weight, factor of each rank) pairs whose
    weights sum to 1, identical factor tuples merged, in a fixed order. `rank_units[r]` are the
    speed units rank r's replicas run on; a rank's factor in a draw is the largest of its
    units'."""
    if not modes or all(f == 1.0 for _, f in modes):
        return [(1.0, tuple(1.0 for _ in rank_units))]
    units = sorted({u for group in rank_units for u in group})
    position = {u: i for i, u in enumerate(units)}
    groups = [tuple(position[u] for u in group) for group in rank_units]
    if any(not g for g in groups):
        raise ValueError("every rank runs on at least one speed unit")
    shared = len({u for g in groups for u in g}) < sum(len(set(g)) for g in groups)
    draws: dict[tuple[float, ...], float] = {}
    if not shared:
        # ranks on disjoint units draw independently: each rank's factor is the max of its
        # units' draws, a small distribution of its own
        per_rank = [_max_of(modes, len(set(g))) for g in groups]
        count = math.prod(len(d) for d in per_rank)
        if count <= EXACT_DRAWS:
            for combo in itertools.product(*per_rank):
                key = tuple(f for _, f in combo)
                draws[key] = draws.get(key, 0.0) + math.prod(p for p, _ in combo)
        else:
            rng = random.Random(SEED)
            for _ in range(SAMPLED_DRAWS):
                key = tuple(_draw(rng, d) for d in per_rank)
                draws[key] = draws.get(key, 0.0) + 1.0 / SAMPLED_DRAWS
    else:
        count = len(modes) ** len(units)
        combos: list[tuple[float, tuple[float, ...]]] = []
        if count <= EXACT_DRAWS:
            for combo in itertools.product(modes, repeat=len(units)):
                combos.append((math.prod(p for p, _ in combo), tuple(f for _, f in combo)))
        else:
            rng = random.Random(SEED)
            combos = [(1.0 / SAMPLED_DRAWS, tuple(_draw(rng, modes) for _ in units))
                      for _ in range(SAMPLED_DRAWS)]
        for weight, factors in combos:
            key = tuple(max(factors[u] for u in g) for g in groups)
            draws[key] = draws.get(key, 0.0) + weight
    return sorted(((w, k) for k, w in draws.items()), key=lambda wk: wk[1])


def _max_of(modes: Modes, n: int) -> Modes:
    """The distribution of the largest of `n` independent draws from `modes`."""
    ordered = sorted(modes, key=lambda m: m[1])
    out = []
    below = 0.0
    for p, f in ordered:
        at_most = below + p
        weight = at_most ** n - below ** n
        if weight > 0:
            out.append((weight, f))
        below = at_most
    return tuple(out)


def _draw(rng: random.Random, modes: Modes) -> float:
    x = rng.random()
    for p, f in modes:
        x -= p
        if x < 0:
            return f
    return modes[-1][1]


def scaled(spec: PipelineSpec, factors: Sequence[float]) -> PipelineSpec:
    """`spec` with every computation of rank r (its virtual stages' forward and backward, its
    optimizer step) taking `factors[r]` times as long; transfers and all-reduces unchanged."""
    S = spec.num_ranks
    if len(factors) != S:
        raise ValueError(f"one factor per rank ({S}), got {len(factors)}")
    stages = tuple(replace(t, forward_s=t.forward_s * factors[k % S],
                           backward_s=t.backward_s * factors[k % S])
                   for k, t in enumerate(spec.stages))
    optimizer = tuple(s * factors[r] for r, s in enumerate(spec.optimizer_s))
    return replace(spec, stages=stages, optimizer_s=optimizer)


def expected_iteration_s(spec: PipelineSpec, rank_units: Sequence[Sequence[Unit]],
                         modes: Modes) -> float:
    """The iteration time of `spec` averaged over the speed units' independent modes (module
    docstring); the simulated time itself where there is no spread."""
    draws = rank_factor_draws(rank_units, modes)
    if len(draws) == 1 and all(f == 1.0 for f in draws[0][1]):
        return simulate(spec).iteration_s
    return math.fsum(w * simulate(scaled(spec, factors)).iteration_s for w, factors in draws)
