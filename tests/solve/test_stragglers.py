"""partc.solve.stragglers: a step's expected time over the devices' independent speed modes."""
from __future__ import annotations

import math

import pytest

from partc.solve.simulator import PipelineSpec, StageTiming, simulate
from partc.solve.stragglers import (
    EXACT_DRAWS,
    SAMPLED_DRAWS,
    expected_iteration_s,
    rank_factor_draws,
    scaled,
)

TWO = ((0.5, 0.8), (0.5, 1.2))  # a fast and a slow mode, mean factor 1


def pipeline(times: list[float], microbatches: int = 8, schedule: str = "1f1b",
             send_s: float = 0.0) -> PipelineSpec:
    stages = tuple(StageTiming(forward_s=t, backward_s=2 * t, send_forward_s=send_s,
                               send_backward_s=send_s, activation_bytes=0.0) for t in times)
    return PipelineSpec(schedule=schedule, num_ranks=len(times),  # type: ignore[arg-type]
                        num_microbatches=microbatches, stages=stages,
                        optimizer_s=tuple(0.1 * t for t in times))


def test_the_max_of_independent_draws_is_exact() -> None:
    draws = rank_factor_draws([((0, 0), (0, 1))], TWO)  # one rank, two replicas on two devices
    assert draws == [(pytest.approx(0.25), (0.8,)), (pytest.approx(0.75), (1.2,))]
    three = rank_factor_draws([((0, 0),), ((0, 1),)], ((0.2, 0.5), (0.3, 1.0), (0.5, 1.3)))
    assert len(three) == 9 and math.fsum(w for w, _ in three) == pytest.approx(1.0)
    assert dict((f, w) for w, f in three)[(1.3, 0.5)] == pytest.approx(0.5 * 0.2)


def test_a_balanced_pipeline_on_independent_devices_expects_more_than_its_price() -> None:
    """The step waits for its slowest stage: E[max] > max of the means. The same stages on one
    speed unit (processes sharing a core share its mode) scale together: the price holds."""
    spec = pipeline([1.0, 1.0])
    priced = simulate(spec).iteration_s
    apart = expected_iteration_s(spec, [((0, 0),), ((0, 1),)], TWO)
    together = expected_iteration_s(spec, [((0, 0),), ((0, 0),)], TWO)
    assert together == pytest.approx(priced)  # every time scaled by f, E[f] = 1
    # the steady state runs at E[max] = 0.75 * 1.2 + 0.25 * 0.8 = 1.1 of its price, the fill
    # and drain at the mean: a few percent in all at 8 micro-batches
    assert priced * 1.05 < apart < priced * 1.1
    # every one of the four draws, equally likely, simulated
    expect = 0.0
    for f0 in (0.8, 1.2):
        for f1 in (0.8, 1.2):
            expect += 0.25 * simulate(scaled(spec, [f0, f1])).iteration_s
    assert apart == pytest.approx(expect)
    # no spread, or one mode: the simulated time itself
    assert expected_iteration_s(spec, [((0, 0),), ((0, 1),)], ()) == priced
    assert expected_iteration_s(spec, [((0, 0),), ((0, 1),)], ((1.0, 1.0),)) == priced


def test_an_unbalanced_cut_loses_less_to_the_spread_than_a_balanced_one() -> None:
    """Why cpsat's balanced cut gains less than predicted on a noisy machine: its step is a max
    over equals, an unbalanced one is bound by one stage anyway."""
    units = [((0, 0),), ((0, 1),)]
    balanced, unbalanced = pipeline([1.0, 1.0]), pipeline([0.6, 1.3])
    b0, u0 = simulate(balanced).iteration_s, simulate(unbalanced).iteration_s
    b1 = expected_iteration_s(balanced, units, TWO)
    u1 = expected_iteration_s(unbalanced, units, TWO)
    assert b0 < u0 and b1 / b0 > u1 / u0


def test_scaling_leaves_transfers_and_scales_every_computation() -> None:
    spec = pipeline([1.0, 2.0], send_s=0.5)
    two = scaled(spec, [2.0, 1.0])
    assert [s.forward_s for s in two.stages] == [2.0, 2.0]
    assert [s.backward_s for s in two.stages] == [4.0, 4.0]
    assert [s.send_forward_s for s in two.stages] == [0.5, 0.5]
    assert two.optimizer_s == pytest.approx((0.2, 0.2))
    with pytest.raises(ValueError, match="one factor per rank"):
        scaled(spec, [1.0])


def test_many_units_are_sampled_from_a_fixed_seed() -> None:
    """Past EXACT_DRAWS combinations the expectation is a seeded sample: the same inputs always
    give the same number, near the exact one."""
    four = ((0.25, 0.9), (0.25, 0.95), (0.25, 1.0), (0.25, 1.15))
    units = [((0, r),) for r in range(6)]
    assert len(four) ** len(units) > EXACT_DRAWS
    draws = rank_factor_draws(units, four)
    assert math.fsum(w for w, _ in draws) == pytest.approx(1.0)
    assert len(draws) <= SAMPLED_DRAWS and draws == rank_factor_draws(units, four)
    spec = pipeline([1.0] * 6, microbatches=12)
    sampled = expected_iteration_s(spec, units, four)
    assert sampled == expected_iteration_s(spec, units, four)
    # the exact expectation of this (balanced) step, enumerating by rank groups of shared
    # units, is above the price; the sample is within a few percent of it
    priced = simulate(spec).iteration_s
    assert priced < sampled < priced * 1.2
    # shared units past the limit are sampled too (ranks on 5 cores, two on each of the first)
    shared = [((0, r % 5),) for r in range(6)]
    assert len(rank_factor_draws(shared, four)) <= SAMPLED_DRAWS


def test_every_rank_needs_a_unit() -> None:
    with pytest.raises(ValueError, match="at least one speed unit"):
        rank_factor_draws([((0, 0),), ()], TWO)
