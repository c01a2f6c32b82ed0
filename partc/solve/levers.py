"""Memory levers per pipeline rank: which ranks of a cut recompute their activations and which
shard their optimizer state (and their gradients) across their data-parallel replicas.

A `PipelineShape` says which levers its ranks may use (`activation_checkpointing`, `sharding`),
and the solver prices the cut with them on every rank, so that the cut is chosen knowing the
memory they free. A lever costs time, though: checkpointing recomputes each micro-batch's forward
before its backward, sharding replaces part of the optimizer step by an all-gather of the updated
weights, and sharded gradients replace the all-reduce by a reduce of every micro-batch's
gradients. So once a cut is fixed, `choose_levers` gives each rank the cheapest combination of
the allowed levers under which the exact memory model (partc.solve.memory.stage_memory) fits the
device: recompute and shard only where memory binds (or where sharding is faster by itself: the
step it splits can cost more than the all-gather on a fast network).

Precondition: the cut fits with every allowed lever on (the search checked it). Postcondition:
every rank's levers are a subset of the shape's, and its exact memory fits whenever that
precondition held.
"""
from __future__ import annotations

from dataclasses import replace
from itertools import product
from typing import Collection, Sequence

from partc.errors import SearchError
from partc.graph.opgraph import Param
from partc.options import SHARDINGS, Sharding
from partc.solve.memory import (
    gradient_buckets,
    optimizer_partition,
    param_memory,
    partition_owners,
)
from partc.solve.stage_problem import (
    RankLevers,
    StageProblem,
    step_dispatch_s,
    step_seconds_of,
    sync_bytes,
)


def lever_options(problem: StageProblem) -> list[RankLevers]:
    """Every combination of the levers the problem's shape allows that keeps the forced ones
    (`StageProblem.forced_levers`: what the user pinned)."""
    shape, forced = problem.shape, problem.forced_levers
    ckpts = (True,) if forced.activation_checkpointing else \
        (False, True) if shape.activation_checkpointing else (False,)
    # each sharding includes the ones before it (gradients: the optimizer state too): a shape
    # allows its own and the lighter ones
    allowed = SHARDINGS[:SHARDINGS.index(shape.sharding) + 1]
    shardings: tuple[Sharding, ...] = (shape.sharding,) if forced.sharding != "none" else allowed
    return [RankLevers(c, s) for c, s in product(ckpts, shardings)]


def rank_parameters(problem: StageProblem, assignment: Sequence[int]) -> list[list[Param]]:
    """Per pipeline rank, the distinct parameters its stages hold (a tied one once), in graph
    order of their first use."""
    graph = problem.table.graph
    held: list[dict[str, Param]] = [{} for _ in range(problem.shape.stages)]
    for b, k in enumerate(assignment):
        for name in problem.blocks.blocks[b].params:
            p = graph.param(name)
            held[problem.rank_of(k)].setdefault(p.name, p)
    return [list(h.values()) for h in held]


def step_seconds(problem: StageProblem, params: Sequence[Param], rank: int,
                 levers: RankLevers) -> float:
    """One rank's optimizer step: the step of what it updates (all its parameters, or sharded
    the largest share ZeroRedundancyOptimizer gives a replica, `optimizer_partition`), and
    sharded, each replica's broadcast of the weights it updated to the others (torch's
    `_sync_params`: one broadcast per owner on the replicas' group, one after the other)."""
    training = problem.training
    device = problem.cluster.device
    # the price of each parameter's step, as launched runs measured it where the costs were
    # calibrated from them (CostTable.optimizer_factor; 1 otherwise)
    factor = problem.table.optimizer_factor
    dispatch = step_dispatch_s(training, device) * factor
    # (0 for buffers and frozen parameters, which the step does not update)
    optimized = [(p, seconds * factor) for p in params
                 if (seconds := step_seconds_of(p, training, device))]
    shape = problem.shape
    # each of the rank's optimizers (one per chunk it holds) starts its step from caches the
    # backward and the transfers evicted (DeviceSpec.step_cold_s; 0 where not measured)
    cold = device.step_cold_s * shape.chunks * factor if optimized else 0.0
    if levers.sharding == "none" or shape.replicas < 2 or not optimized:
        return sum(seconds + dispatch for _, seconds in optimized) + cold
    owned = optimizer_partition([p.numel for p, _ in optimized], shape.replicas)
    step = max(sum(optimized[i][1] + dispatch for i in part) for part in owned) + cold
    group = shape.rank_devices(rank)
    broadcasts = problem.cluster.broadcasts_s(
        [sum(param_memory(optimized[i][0], training)[0] for i in part) for part in owned], group)
    return step + broadcasts


def gradient_reduce_seconds(problem: StageProblem, params: Sequence[Param], rank: int,
                            kept_whole: Collection[str] = ()) -> float:
    """One micro-batch's reduces of a rank whose gradients are sharded: each bucket
    (`gradient_buckets`, the parameters in backward order, each to the replica owning it in
    ZeroRedundancyOptimizer's partition) reduced onto its owner as the backward forms it, one
    after the other, holding up the backward (partc.run.gradient_sharding). `kept_whole`
    (parameters other ranks hold too, StageProblem.tied_across_ranks) are all-reduced instead
    (`allreduce_seconds`)."""
    training = problem.training
    optimized = [(p, g) for p in params if (g := sync_bytes(p, training)[0])]
    if problem.shape.replicas < 2 or not optimized:
        return 0.0
    owners = partition_owners(optimizer_partition([p.numel for p, _ in optimized],
                                                  problem.shape.replicas), len(optimized))
    order = [i for i in reversed(range(len(optimized))) if optimized[i][0].name not in kept_whole]
    group = problem.shape.rank_devices(rank)
    sizes = [optimized[i][1] for i in order]
    return problem.cluster.reduces_s(
        [sum(sizes[j] for j in bucket)
         for bucket in gradient_buckets(sizes, [owners[i] for i in order],
                                        problem.shape.replicas)], group)


def allreduce_seconds(problem: StageProblem, params: Sequence[Param], rank: int,
                      levers: RankLevers, kept_whole: Collection[str] = ()) -> float:
    """A rank's gradient all-reduce over its replicas after its last backward: every gradient
    (DDP's), or with sharded gradients only those of `kept_whole`."""
    if problem.shape.replicas < 2:
        return 0.0
    grads = sum(sync_bytes(p, problem.training)[0] for p in params
                if levers.sharding != "gradients" or p.name in kept_whole)
    return problem.cluster.allreduce_s(grads, problem.shape.rank_devices(rank))


def can_shard(params: Sequence[Param]) -> bool:
    """Whether torch's ZeroRedundancyOptimizer takes these parameters: it refuses trainable
    parameters of more than one dtype."""
    return len({p.dtype for p in params if p.kind == "parameter" and p.trainable}) <= 1


def recompute_seconds(problem: StageProblem, assignment: Sequence[int], rank: int) -> float:
    """What checkpointing adds to one rank per step: every micro-batch's forward again."""
    m = problem.shape.microbatch_size
    forward = sum(problem.blocks.blocks[b].forward.at(m) for b, k in enumerate(assignment)
                  if problem.rank_of(k) == rank)
    return problem.shape.num_microbatches * forward


def choose_levers(problem: StageProblem, assignment: Sequence[int]) -> tuple[RankLevers, ...]:
    """Per rank, the cheapest allowed levers whose exact memory fits (module docstring); ties go
    to fewer levers. A rank that fits under none keeps every allowed lever (the search does not
    hand such cuts here). A rank whose parameters ZeroRedundancyOptimizer refuses (`can_shard`)
    is not sharded; SearchError when the user pinned sharding for it."""
    S = problem.shape.stages
    options = lever_options(problem)
    everything = RankLevers(problem.shape.activation_checkpointing, problem.shape.sharding)
    params = rank_parameters(problem, assignment)
    if problem.forced_levers.sharding != "none":
        for d, held in enumerate(params):
            if not can_shard(held):
                raise SearchError(
                    f"--sharding {problem.forced_levers.sharding}: pipeline rank {d} holds "
                    "trainable parameters of several dtypes, which torch's "
                    "ZeroRedundancyOptimizer cannot shard", hint="use --sharding none")
    if len(options) == 1:
        return (everything,) * S
    usable = problem.usable_bytes()
    nodes, relayed = problem.rank_nodes(assignment)
    tied = problem.tied_across_ranks(assignment)
    chosen = []
    for d in range(S):
        shardable = can_shard(params[d])
        allowed = options if shardable else [o for o in options if o.sharding == "none"]
        base = step_seconds(problem, params[d], d, RankLevers()) \
            + allreduce_seconds(problem, params[d], d, RankLevers(), tied)
        recompute = recompute_seconds(problem, assignment, d)
        reduces = problem.shape.num_microbatches * gradient_reduce_seconds(
            problem, params[d], d, tied)

        def cost(levers: RankLevers, d: int = d, recompute: float = recompute,
                 base: float = base, reduces: float = reduces) -> tuple[float, int]:
            added = recompute if levers.activation_checkpointing else 0.0
            if levers.sharding != "none":
                added += step_seconds(problem, params[d], d, levers) \
                    + allreduce_seconds(problem, params[d], d, levers, tied) - base
            if levers.sharding == "gradients":
                added += reduces
            return (added, int(levers.activation_checkpointing)
                    + SHARDINGS.index(levers.sharding))

        pick = everything if shardable else replace(everything, sharding="none")
        for levers in sorted(allowed, key=cost):
            if problem.rank_memory_with(d, nodes[d], relayed[d], levers, tied).total <= usable:
                pick = levers
                break
        chosen.append(pick)
    return tuple(chosen)
