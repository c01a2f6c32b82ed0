"""The pipeline schedule simulator: torch's action orders, closed forms, memory, errors, speed.

The action orders are checked against torch 2.13 itself, two ways, with no process group:
- the schedules' real `_step_microbatches` run once per rank on recording stand-in stages whose
  p2p op lists are empty (so nothing is sent and no process group is needed); the order in which
  torch calls `forward_one_chunk` / `backward_one_chunk` is what a rank runs;
- the schedule IR (`pipeline_order`) that the classes compute in their constructors.
"""
from __future__ import annotations

import json
import math
import random
from typing import Any

import pytest

from partc.options import SCHEDULES
from partc.solve import host_p2p
from partc.solve.memory import in_flight_microbatches
from partc.solve.simulator import (
    Event,
    PipelineSpec,
    Simulation,
    StageTiming,
    TiedSync,
    action_order,
    host_programs,
    simulate,
)

schedules = pytest.importorskip("torch.distributed.pipelining.schedules")


def uniform(schedule: str, s: int, m: int, chunks: int = 1, tf: float = 1.0, tb: float = 2.0,
            comm: float = 0.0, act: float = 1.0, static: float = 0.0, **kw: Any) -> PipelineSpec:
    """A pipeline of identical virtual stages."""
    stage = StageTiming(tf, tb, comm, comm, act, static)
    return PipelineSpec(schedule, s, m, (stage,) * (s * chunks), **kw)


def valid_shapes(max_ranks: int = 6, max_mb: int = 16,
                 chunk_choices: tuple[int, ...] = (1, 2, 3)) -> list[tuple[str, int, int, int]]:
    """(schedule, S, M, chunks) that torch's schedule classes accept."""
    shapes = []
    for s in range(1, max_ranks + 1):
        for m in range(1, max_mb + 1):
            shapes.append(("gpipe", s, m, 1))
            if m >= s:
                shapes.append(("1f1b", s, m, 1))
            if m % max(1, m // s) == 0:
                shapes.extend(("interleaved-1f1b", s, m, v) for v in chunk_choices)
    return shapes


# -- action orders against torch ---------------------------------------------------------------

class RecordingStage:
    """Stands in for a PipelineStage: records compute calls, has no p2p ops to run."""

    def __init__(self, stage_index: int, num_stages: int, group_size: int, group_rank: int,
                 log: list[tuple[str, int, int]]) -> None:
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.group_size = group_size
        self.group_rank = group_rank
        self.is_first = stage_index == 0
        self.is_last = stage_index == num_stages - 1
        self.has_backward = True
        self.submod = object()  # not an FSDPModule: the runtime skips unshard/reshard
        self.output_chunks: list[Any] = []
        self.stage_index_to_group_rank: dict[int, int] = {}
        self._log = log

    def clear_runtime_states(self) -> None:
        pass

    def get_fwd_recv_ops(self, mb: int) -> list[Any]:
        return []

    def get_fwd_send_ops(self, mb: int) -> list[Any]:
        return []

    def get_bwd_recv_ops(self, mb: int) -> list[Any]:
        return []

    def get_bwd_send_ops(self, mb: int) -> list[Any]:
        return []

    def forward_one_chunk(self, mb: int, *args: Any, **kwargs: Any) -> None:
        self._log.append(("F", self.stage_index, mb))

    def backward_one_chunk(self, mb: int, loss: Any = None, full_backward: bool = True,
                           last_backward: bool = False) -> None:
        self._log.append(("B", self.stage_index, mb))

    def perform_reduce_grad(self, scale: int) -> None:
        pass

    def set_local_fwd_input(self, output: Any, mb: int) -> None:
        pass

    def set_local_bwd_input(self, grads: Any, mb: int) -> None:
        pass

    def get_local_bwd_output(self, mb: int) -> None:
        return None


def torch_runtime_order(schedule: str, s: int, m: int, chunks: int = 1) -> list[list[tuple]]:
    """Each rank's compute calls when torch's own `_step_microbatches` runs its schedule."""
    orders = []
    for rank in range(s):
        log: list[tuple[str, int, int]] = []
        sched: Any
        if schedule == "interleaved-1f1b":
            stages = [RecordingStage(rank + j * s, s * chunks, s, rank, log)
                      for j in range(chunks)]
            sched = schedules.ScheduleInterleaved1F1B(stages, m)
            sched._initialize_stages = lambda *a, **k: None  # shape inference needs real p2p
        else:
            cls = schedules.ScheduleGPipe if schedule == "gpipe" else schedules.Schedule1F1B
            sched = cls(RecordingStage(rank, s, s, rank, log), m)
            sched._initialize_stage = lambda *a, **k: None
        sched._step_microbatches()
        orders.append(log)
    return orders


def torch_ir_order(schedule: str, s: int, m: int, chunks: int = 1) -> list[list[tuple]]:
    """The compute actions of the schedule's `pipeline_order` IR (idle slots and REDUCE_GRAD
    dropped)."""
    kinds = {schedules._ComputationType.FORWARD: "F",
             schedules._ComputationType.FULL_BACKWARD: "B"}
    if schedule == "interleaved-1f1b":
        stages = [RecordingStage(j * s, s * chunks, s, 0, []) for j in range(chunks)]
        sched: Any = schedules.ScheduleInterleaved1F1B(stages, m)
    else:
        cls = schedules.ScheduleGPipe if schedule == "gpipe" else schedules.Schedule1F1B
        sched = cls(RecordingStage(0, s, s, 0, []), m)
    return [[(kinds[a.computation_type], a.stage_index, a.microbatch_index)
             for a in sched.pipeline_order[rank] if a is not None and a.computation_type in kinds]
            for rank in range(s)]


RUNTIME_SHAPES = [
    ("gpipe", 1, 3, 1), ("gpipe", 3, 5, 1), ("gpipe", 4, 2, 1),
    ("1f1b", 1, 3, 1), ("1f1b", 2, 2, 1), ("1f1b", 4, 4, 1), ("1f1b", 4, 9, 1), ("1f1b", 3, 7, 1),
    ("interleaved-1f1b", 1, 3, 2), ("interleaved-1f1b", 2, 4, 2), ("interleaved-1f1b", 4, 8, 2),
    ("interleaved-1f1b", 4, 3, 2), ("interleaved-1f1b", 3, 2, 3), ("interleaved-1f1b", 4, 6, 3),
    ("interleaved-1f1b", 4, 10, 2), ("interleaved-1f1b", 3, 12, 4), ("interleaved-1f1b", 4, 8, 1),
]


@pytest.mark.parametrize("schedule,s,m,chunks", RUNTIME_SHAPES)
def test_action_order_is_what_torch_runtime_runs(schedule: str, s: int, m: int,
                                                 chunks: int) -> None:
    assert action_order(schedule, s, m, chunks) == torch_runtime_order(schedule, s, m, chunks)


def test_action_order_matches_torch_pipeline_order_ir() -> None:
    for schedule, s, m, chunks in valid_shapes(max_ranks=5, max_mb=12):
        mine = action_order(schedule, s, m, chunks)
        ir = torch_ir_order(schedule, s, m, chunks)
        if schedule == "1f1b":
            # torch 2.13's Schedule1F1B._get_pipeline_order numbers the last rank's forwards from
            # 1 (it pre-increments a counter that no warm-up forward has set); the runtime
            # (`_step_microbatches`, checked above) runs micro-batches 0 .. M-1. Accept either.
            last = [(k, st, mb + 1 if k == "F" else mb) for k, st, mb in mine[-1]]
            assert ir[-1] in (mine[-1], last), (s, m)
            ir, mine = ir[:-1], mine[:-1]
        assert mine == ir, (schedule, s, m, chunks)


def test_action_order_shape() -> None:
    for schedule, s, m, chunks in valid_shapes():
        order = action_order(schedule, s, m, chunks)
        assert len(order) == s
        every = [a for ops in order for a in ops]
        assert len(every) == len(set(every)) == 2 * s * chunks * m
        for rank, ops in enumerate(order):
            assert all(stage % s == rank for _, stage, _ in ops)


S2M4 = {
    "gpipe": [
        ["F0.0", "F0.1", "F0.2", "F0.3", "B0.0", "B0.1", "B0.2", "B0.3"],
        ["F1.0", "F1.1", "F1.2", "F1.3", "B1.0", "B1.1", "B1.2", "B1.3"]],
    "1f1b": [
        ["F0.0", "F0.1", "B0.0", "F0.2", "B0.1", "F0.3", "B0.2", "B0.3"],
        ["F1.0", "B1.0", "F1.1", "B1.1", "F1.2", "B1.2", "F1.3", "B1.3"]],
}


@pytest.mark.parametrize("schedule", sorted(S2M4))
def test_action_order_small_table(schedule: str) -> None:
    # The S=2, M=4 tables in docs/simulator.md.
    got = [[f"{k}{st}.{mb}" for k, st, mb in ops] for ops in action_order(schedule, 2, 4)]
    assert got == S2M4[schedule]


def test_interleaved_small_table() -> None:
    # docs/simulator.md: S=2, M=4, chunks=2 (virtual stages 0, 2 on rank 0; 1, 3 on rank 1).
    got = [" ".join(f"{k}{st}.{mb}" for k, st, mb in ops)
           for ops in action_order("interleaved-1f1b", 2, 4, 2)]
    assert got == [
        "F0.0 F0.1 F2.0 F2.1 F0.2 B2.0 F0.3 B2.1 F2.2 B0.0 F2.3 B0.1 B2.2 B2.3 B0.2 B0.3",
        "F1.0 F1.1 F3.0 B3.0 F3.1 B3.1 F1.2 B1.0 F1.3 B1.1 F3.2 B3.2 F3.3 B3.3 B1.2 B1.3",
    ]


# -- closed forms ----------------------------------------------------------------------------------

@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("s,m", [(1, 1), (1, 5), (2, 2), (2, 7), (4, 4), (4, 9), (8, 32)])
@pytest.mark.parametrize("tf,tb", [(1.0, 1.0), (1.0, 2.0), (0.3, 0.2)])
def test_gpipe_and_1f1b_closed_form(schedule: str, s: int, m: int, tf: float, tb: float) -> None:
    sim = simulate(uniform(schedule, s, m, tf=tf, tb=tb))
    assert sim.iteration_s == pytest.approx((m + s - 1) * (tf + tb))
    assert sim.last_backward_s == pytest.approx(sim.iteration_s)
    assert sim.bubble_fraction == pytest.approx((s - 1) / (m + s - 1))
    assert sim.busy_s == pytest.approx([m * (tf + tb)] * s)


@pytest.mark.parametrize("s,m,chunks", [
    (2, 2, 2), (2, 4, 2), (4, 4, 2), (4, 8, 2), (4, 12, 3), (8, 16, 4), (3, 9, 2), (1, 4, 3),
    (4, 8, 1),  # chunks=1 is allowed by torch and gives the plain 1F1B bubble
    (4, 5, 2), (4, 6, 2), (4, 10, 2), (8, 12, 2),  # M >= S, not a multiple of S
    (4, 1, 2), (4, 2, 3), (4, 3, 2), (8, 5, 4),  # M < S
])
@pytest.mark.parametrize("tf,tb", [(1.0, 1.0), (1.0, 2.0), (2.0, 1.0)])
def test_interleaved_closed_form(s: int, m: int, chunks: int, tf: float, tb: float) -> None:
    # With equal stages and no communication, torch's interleaved order loses S - 1 slots of
    # (tf + tb) when M >= S: the bubble shrinks from (S-1)/(M+S-1) to (S-1)/(v*M+S-1). When
    # M < S (one round of M micro-batches) the pipeline cannot fill: micro-batch 0 still crosses
    # all v*S virtual stages in series, and the other M - 1 follow one slot apart, so the
    # iteration is (v*S + M - 1) slots. Both: (v*max(M, S) + min(M, S) - 1) * (tf + tb).
    v = chunks
    slots = v * max(m, s) + min(m, s) - 1
    sim = simulate(uniform("interleaved-1f1b", s, m, chunks, tf=tf, tb=tb))
    assert sim.iteration_s == pytest.approx(slots * (tf + tb))
    assert sim.busy_s == pytest.approx([v * m * (tf + tb)] * s)
    assert sim.bubble_fraction == pytest.approx(1 - v * m / slots)
    if m % s == 0:
        assert sim.bubble_fraction == pytest.approx((s - 1) / (v * m + s - 1))


def test_interleaving_reduces_the_bubble() -> None:
    plain = simulate(uniform("1f1b", 4, 8, 1, tf=2.0, tb=4.0))
    # Same model split in twice as many virtual stages of half the cost each.
    inter = simulate(uniform("interleaved-1f1b", 4, 8, 2, tf=1.0, tb=2.0))
    assert sum(plain.busy_s) == pytest.approx(sum(inter.busy_s))
    assert inter.iteration_s < plain.iteration_s
    assert inter.bubble_fraction == pytest.approx(3 / 19)
    assert plain.bubble_fraction == pytest.approx(3 / 11)


@pytest.mark.parametrize("m", range(2, 11))
@pytest.mark.parametrize("tf,tb,cf,cb", [
    (1.0, 1.0, 0.25, 0.25), (1.0, 2.0, 0.1, 0.4), (2.0, 3.0, 1.5, 0.0), (0.5, 0.5, 3.0, 2.0)])
def test_communication_on_two_ranks(m: int, tf: float, tb: float, cf: float, cb: float) -> None:
    # Rank 0 sends activations to rank 1 in cf, rank 1 sends gradients back in cb.
    stages = (StageTiming(tf, tb, cf, 0.0, 1.0), StageTiming(tf, tb, 0.0, cb, 1.0))
    base = (m + 1) * (tf + tb)
    # GPipe: rank 1 starts cf late and rank 0's backwards start cb after rank 1's first one;
    # the forwards (backwards) then arrive tf (tb) apart, as fast as the receiver works.
    gpipe = simulate(PipelineSpec("gpipe", 2, m, stages))
    assert gpipe.iteration_s == pytest.approx(base + cf + cb)
    # 1F1B keeps two micro-batches in flight on rank 0, so every pair of micro-batches waits for
    # one whole round trip rank 0 -> rank 1 -> rank 0: ceil(M / 2) round trips of cf + cb.
    one_f_one_b = simulate(PipelineSpec("1f1b", 2, m, stages))
    assert one_f_one_b.iteration_s == pytest.approx(base + math.ceil(m / 2) * (cf + cb))
    # Transfers are not busy time.
    assert gpipe.busy_s == one_f_one_b.busy_s == pytest.approx([m * (tf + tb)] * 2)


def test_transfers_between_stages_on_one_rank_are_free() -> None:
    # S = 1 with two virtual stages: torch hands activations over locally, no p2p.
    with_comm = simulate(uniform("interleaved-1f1b", 1, 4, 2, comm=5.0))
    without = simulate(uniform("interleaved-1f1b", 1, 4, 2))
    assert with_comm.iteration_s == without.iteration_s == pytest.approx(2 * 4 * 3.0)


def test_unused_sends_of_first_and_last_stage_are_ignored() -> None:
    stages = (StageTiming(1.0, 2.0, 0.0, 7.0, 1.0), StageTiming(1.0, 2.0, 9.0, 0.0, 1.0))
    assert simulate(PipelineSpec("1f1b", 2, 4, stages)).iteration_s == pytest.approx(15.0)


def test_allreduce_and_optimizer_follow_the_last_backward() -> None:
    spec = uniform("1f1b", 4, 8, allreduce_s=(0.5, 0.25, 6.0, 0.0),
                   optimizer_s=(0.1, 0.2, 0.3, 0.4))
    sim = simulate(spec)
    base = simulate(uniform("1f1b", 4, 8))
    last_b = {r: max(e.end_s for e in base.events if e.rank == r and e.kind == "backward")
              for r in range(4)}
    for r in range(4):
        (reduce,) = [e for e in sim.events if e.rank == r and e.kind == "allreduce"]
        (step,) = [e for e in sim.events if e.rank == r and e.kind == "optimizer"]
        assert (reduce.stage, reduce.microbatch, step.stage, step.microbatch) == (-1, -1, -1, -1)
        assert reduce.start_s == pytest.approx(last_b[r])
        assert reduce.end_s == pytest.approx(last_b[r] + spec.allreduce_s[r])
        assert step.start_s == reduce.end_s
        assert step.end_s == pytest.approx(reduce.end_s + spec.optimizer_s[r])
    # Rank 0 ends last without them (the last backward is its B(0, 7)); rank 2 ends last with
    # them: it finishes its backwards two backwards (4 s) earlier but reduces for 6 s.
    assert base.iteration_s == pytest.approx(11 * 3.0)
    assert last_b[2] == pytest.approx(11 * 3.0 - 2 * 2.0)
    assert sim.iteration_s == pytest.approx(last_b[2] + 6.0 + 0.3)
    assert sim.iteration_s == pytest.approx(max(last_b[r] + spec.allreduce_s[r]
                                                + spec.optimizer_s[r] for r in range(4)))
    # The bubble is about the forward/backward span only.
    assert sim.bubble_fraction == base.bubble_fraction


def test_tied_gradients_wait_for_the_last_of_their_ranks() -> None:
    # Ranks 0 and 3 hold a tied weight (an embedding and its output head): each waits for the
    # other, then both reduce it; rank 1 and 2 go on to their optimizer step at once.
    spec = uniform("1f1b", 4, 8, optimizer_s=(0.1, 0.1, 0.1, 0.1),
                   tied=(TiedSync((0, 3), 0.5),))
    sim = simulate(spec)
    base = simulate(uniform("1f1b", 4, 8, optimizer_s=(0.1, 0.1, 0.1, 0.1)))
    last_b = {r: max(e.end_s for e in base.events if e.rank == r and e.kind == "backward")
              for r in range(4)}
    assert last_b[0] > last_b[3]  # under 1F1B the first rank finishes last
    tied = {e.rank: e for e in sim.events if e.kind == "tied"}
    assert set(tied) == {0, 3}
    assert tied[3].start_s == pytest.approx(last_b[3])  # it waits from its own last backward
    assert tied[0].end_s == tied[3].end_s == pytest.approx(last_b[0] + 0.5)
    steps = {e.rank: e for e in sim.events if e.kind == "optimizer"}
    assert steps[3].start_s == pytest.approx(last_b[0] + 0.5)
    assert steps[1].start_s == pytest.approx(last_b[1])
    assert sim.iteration_s == pytest.approx(last_b[0] + 0.5 + 0.1)
    # sums run in order: a second one over ranks 0 and 1 starts after rank 0's first
    two = simulate(uniform("1f1b", 4, 8, tied=(TiedSync((0, 3), 0.5), TiedSync((0, 1), 0.25))))
    assert two.iteration_s == pytest.approx(last_b[0] + 0.75)
    with pytest.raises(ValueError):
        TiedSync((1,), 0.1)
    with pytest.raises(ValueError):
        uniform("1f1b", 2, 4, tied=(TiedSync((0, 2), 0.1),))


def _starts(sim: object, rank: int, kind: str) -> list[float]:
    return [e.start_s for e in sim.events if e.rank == rank and e.kind == kind]  # type: ignore[attr-defined]


def test_host_sends_are_rendezvous_copies_on_both_cores() -> None:
    """gloo (`host_sends`): a transfer starts once the sender has posted it and the receiver
    has posted its receive (partc's runtime posts a step's receives at its start), and its copy
    is work on both ends' cores. GPipe, 2 ranks, 2 micro-batches, forward 1, backward 2, a copy
    of 0.5 each way, by hand:
    - rank 0 ends F0 at 1 and posts its send; the copy starts; rank 0 computes F1 meanwhile,
      so core 0 runs two things at half speed: the copy ends at 2, F1 at 2.5; rank 1 computes
      F0 2..3;
    - F1's copy starts when rank 0 posts it at 2.5 and shares core 1 with F0: both end at 3.5
      (rank 0 waits on its sends); rank 1: F1 3.5..4.5, B0 4.5..6.5, then B1 while B0's
      gradient copies (6.5..7.5, half speed), B1 ends 9; rank 0: B0 7.5..9.5, B1's gradient
      copies 9..10 beside it (B0 ends at 10), B1 10..12."""
    stages = (StageTiming(1.0, 2.0, 0.5, 0.0, 1.0), StageTiming(1.0, 2.0, 0.0, 0.5, 1.0))
    sim = simulate(PipelineSpec("gpipe", 2, 2, stages, host_sends=True))
    assert _starts(sim, 0, "forward") == pytest.approx([0.0, 1.0])
    assert [e.end_s for e in sim.events if e.rank == 0 and e.kind == "forward"] == \
        pytest.approx([1.0, 2.5])
    assert _starts(sim, 1, "forward") == pytest.approx([2.0, 3.5])
    assert _starts(sim, 1, "backward") == pytest.approx([4.5, 6.5])
    assert _starts(sim, 0, "backward") == pytest.approx([7.5, 10.0])
    assert sim.iteration_s == pytest.approx(12.0)
    assert sim.busy_s == pytest.approx([6.0, 6.0])  # the computations' own time
    # rank 1's all-reduce waits for its last send to be received
    assert [e.start_s for e in sim.events if e.rank == 1 and e.kind == "allreduce"] == \
        pytest.approx([10.0])
    # the same link time as latency is a wait, not work: rank 0's F1 is not slowed, its output
    # arrives at 2.5, when rank 1 ends F0; then F1 2.5..3.5, B0 3.5..5.5, B1 5.5..7.5 on rank 1,
    # B0 6..8 and B1 8..10 on rank 0
    stages = (StageTiming(1.0, 2.0, 0.5, 0.0, 1.0, send_forward_latency_s=0.5),
              StageTiming(1.0, 2.0, 0.0, 0.5, 1.0, send_backward_latency_s=0.5))
    sim = simulate(PipelineSpec("gpipe", 2, 2, stages, host_sends=True))
    assert [e.end_s for e in sim.events if e.rank == 0 and e.kind == "forward"] == \
        pytest.approx([1.0, 2.0])
    assert _starts(sim, 1, "forward") == pytest.approx([1.5, 2.5])
    assert sim.iteration_s == pytest.approx(10.0)
    # a transfer between virtual stages of one rank costs nothing either way
    local = uniform("interleaved-1f1b", 1, 4, 2, comm=5.0, host_sends=True)
    assert simulate(local).iteration_s == pytest.approx(2 * 4 * 3.0)
    with pytest.raises(ValueError, match="latency"):
        StageTiming(1.0, 2.0, 0.5, 0.0, 1.0, send_forward_latency_s=0.6)


def test_host_sends_under_1f1b_meet_at_the_fused_exchanges() -> None:
    """Schedule1F1B defers a forward's send and waits on it together with the next backward's
    receive (and a backward's send with the next forward's receive). 2 ranks, 2 micro-batches,
    forward 1, backward 2, transfers of 0.5 latency (no copy work), by hand: rank 0 computes F0,
    F1 (0..2) and posts F1's send with B0's receive at 2; rank 1 computes F0 1.5..2.5, B0
    2.5..4.5 and only then posts B0's send with F1's receive: both arrive at 5, though F1's
    output was ready at 2. Rank 1: F1 5..6, B1 6..8; rank 0: B0 5..7, B1 (received 8.5)
    8.5..10.5."""
    stages = (StageTiming(1.0, 2.0, 0.5, 0.0, 1.0, send_forward_latency_s=0.5),
              StageTiming(1.0, 2.0, 0.0, 0.5, 1.0, send_backward_latency_s=0.5))
    sim = simulate(PipelineSpec("1f1b", 2, 2, stages, host_sends=True))
    assert _starts(sim, 0, "forward") == pytest.approx([0.0, 1.0])
    assert _starts(sim, 1, "forward") == pytest.approx([1.5, 5.0])
    assert _starts(sim, 1, "backward") == pytest.approx([2.5, 6.0])
    assert _starts(sim, 0, "backward") == pytest.approx([5.0, 8.5])
    assert sim.iteration_s == pytest.approx(10.5)
    # without host sends the transfer overlaps rank 1's B0: F1 starts when B0 ends
    nccl = simulate(PipelineSpec("1f1b", 2, 2, stages))
    assert _starts(nccl, 1, "forward")[1] == pytest.approx(4.5)


class P2PRecordingStage(RecordingStage):
    """A RecordingStage whose p2p ops are the simulator's transfer keys (the producing action:
    F(k, i) = k * M + i, B(k, i) = V * M + k * M + i), and which logs its computations so."""

    def __init__(self, stage_index: int, num_stages: int, group_size: int, m: int,
                 log: list[tuple[int, Any]]) -> None:
        super().__init__(stage_index, num_stages, group_size, stage_index % group_size, [])
        self.m, self.vm, self.plog = m, num_stages * m, log

    def get_fwd_recv_ops(self, mb: int) -> list[Any]:
        return [] if self.is_first else [(self.stage_index - 1) * self.m + mb]

    def get_fwd_send_ops(self, mb: int) -> list[Any]:
        return [] if self.is_last else [self.stage_index * self.m + mb]

    def get_bwd_recv_ops(self, mb: int) -> list[Any]:
        return [] if self.is_last else [self.vm + (self.stage_index + 1) * self.m + mb]

    def get_bwd_send_ops(self, mb: int) -> list[Any]:
        return [] if self.is_first else [self.vm + self.stage_index * self.m + mb]

    def forward_one_chunk(self, mb: int, *args: Any, **kwargs: Any) -> None:
        self.plog.append((host_p2p.COMPUTE, self.stage_index * self.m + mb))

    def backward_one_chunk(self, mb: int, loss: Any = None, full_backward: bool = True,
                           last_backward: bool = False) -> None:
        self.plog.append((host_p2p.COMPUTE, self.vm + self.stage_index * self.m + mb))


def _canonical(program: list[tuple[int, Any]]) -> list[tuple[int, Any]]:
    """Consecutive waits as one (waiting on a then b is waiting on both), keys sorted."""
    out: list[tuple[int, Any]] = []
    for what, arg in program:
        if what == host_p2p.COMPUTE:
            out.append((what, arg))
        elif what == host_p2p.WAIT and out and out[-1][0] == host_p2p.WAIT:
            out[-1] = (what, tuple(sorted(out[-1][1] + tuple(arg))))
        else:
            out.append((what, tuple(sorted(arg))))
    return out


@pytest.mark.parametrize("schedule,s,m,chunks", valid_shapes(4, 8, (1, 2, 4)))
def test_host_p2p_programs_are_what_torch_posts_and_waits(
        monkeypatch: pytest.MonkeyPatch, schedule: str, s: int, m: int, chunks: int) -> None:
    """The posts and waits of `host_p2p.programs` are the ones torch 2.13's own
    `_step_microbatches` issues (its `_batch_p2p`, `_sorted_batch_p2p`, `_wait_batch_p2p`
    recorded), around the same computations, with GPipe's and 1F1B's receives posted at the
    step's start as partc's runtime does on gloo."""
    log: list[tuple[int, Any]] = []

    def post(ops: list[Any], desc: str | None = None) -> list[Any]:
        if ops:
            log.append((host_p2p.POST, tuple(ops)))
        return list(ops)

    def wait(work: list[Any]) -> None:
        if work:
            log.append((host_p2p.WAIT, tuple(work)))

    monkeypatch.setattr(schedules, "_batch_p2p", post)
    monkeypatch.setattr(schedules, "_sorted_batch_p2p",
                        lambda ops, desc=None: {0: post(ops)} if ops else {})
    monkeypatch.setattr(schedules, "_wait_batch_p2p", wait)
    v = s * chunks
    want = host_programs(schedule, s, m, chunks)
    for rank in range(s):
        log.clear()
        sched: Any
        if schedule == "interleaved-1f1b":
            stages = [P2PRecordingStage(rank + j * s, v, s, m, log) for j in range(chunks)]
            sched = schedules.ScheduleInterleaved1F1B(stages, m)
            sched._initialize_stages = lambda *a, **k: None
        else:
            cls = schedules.ScheduleGPipe if schedule == "gpipe" else schedules.Schedule1F1B
            stage = P2PRecordingStage(rank, s, s, m, log)
            sched = cls(stage, m)
            sched._initialize_stage = lambda *a, **k: None
        sched._step_microbatches()
        if schedule != "interleaved-1f1b":
            # partc's runtime posts the step's receives first, and torch's later posts of them
            # take those (partc.run.schedule.P2PTimer)
            early = tuple(k for i in range(m) for k in stage.get_fwd_recv_ops(i)) + \
                tuple(k for i in range(m) for k in stage.get_bwd_recv_ops(i))
            later = [(what, tuple(k for k in arg if k not in early)) if what == host_p2p.POST
                     else (what, arg) for what, arg in log]
            log[:] = ([(host_p2p.POST, early)] if early else []) + \
                [(what, arg) for what, arg in later if arg != ()]
        assert _canonical(log) == _canonical(want[rank]), f"rank {rank}"


@pytest.mark.parametrize("schedule,chunks", [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2)])
def test_host_sends_complete_and_cost_time(schedule: str, chunks: int) -> None:
    """Every schedule's posts and waits complete (no deadlock), on shared cores too, and moving
    bytes never makes an iteration faster."""
    free = simulate(uniform(schedule, 4, 8, chunks, comm=0.0, host_sends=True))
    for sharing in ((), ((0, 2), (1, 3), (0, 2), (1, 3))):
        sim = simulate(uniform(schedule, 4, 8, chunks, comm=0.3, host_sends=True,
                               core_sharing=sharing))
        assert sim.iteration_s > free.iteration_s
        assert len([e for e in sim.events if e.kind in ("forward", "backward")]) == \
            2 * 4 * chunks * 8


def test_ranks_sharing_a_core_share_its_time() -> None:
    # Two ranks on one core: whenever both compute, each runs at half speed. GPipe on two equal
    # stages with no transfers: all the work of both ranks, one core's worth at a time.
    spec = uniform("gpipe", 2, 4, core_sharing=((0, 1), (0, 1)))
    assert simulate(spec).iteration_s == pytest.approx(2 * 4 * 3.0)
    assert simulate(uniform("gpipe", 2, 4)).iteration_s == pytest.approx(5 * 3.0)
    # the busy time is the work, unchanged
    assert simulate(spec).busy_s == pytest.approx([12.0, 12.0])
    # four ranks on two cores (0 and 2 on one, 1 and 3 on the other): between the two
    four = simulate(uniform("1f1b", 4, 8, core_sharing=((0, 2), (1, 3), (0, 2), (1, 3))))
    alone = simulate(uniform("1f1b", 4, 8))
    assert alone.iteration_s < four.iteration_s < 2 * alone.iteration_s
    # a rank with its own core (a singleton group) runs as without sharing
    own = uniform("1f1b", 3, 6, tf=1.0, tb=2.5, comm=0.3, core_sharing=((0,), (1,), (2,)))
    assert simulate(own).events == simulate(uniform("1f1b", 3, 6, tf=1.0, tb=2.5,
                                                    comm=0.3)).events
    with pytest.raises(ValueError, match="core_sharing"):
        uniform("1f1b", 2, 4, core_sharing=((1,), (0,)))


@pytest.mark.parametrize("host_sends", [False, True])
def test_a_woken_rank_runs_ahead_of_its_core_mate_by_the_wake_credit(host_sends: bool) -> None:
    # Two ranks on one core, GPipe, no transfers. Rank 1 waits for F(0, 0) and wakes at f while
    # rank 0 goes straight on to F(0, 1). Processor sharing: both forwards run at half speed
    # and end together at 3f. With a credit W < f: rank 1 runs alone for W, then they share;
    # its forward ends at f + W + 2 (f - W) = 3f - W, rank 0's (f - W of it done by then) at 3f.
    f, b, w = 1.0, 2.0, 0.4
    shared = ((0, 1), (0, 1))

    def first_forwards(credit: float) -> tuple[float, float]:
        sim = simulate(uniform("gpipe", 2, 2, tf=f, tb=b, host_sends=host_sends,
                               core_sharing=shared, wake_credit_s=credit))
        at = {(e.kind, e.stage, e.microbatch): e for e in sim.events if e.microbatch >= 0}
        return at["forward", 1, 0].end_s, at["forward", 0, 1].end_s

    assert first_forwards(0.0) == pytest.approx((3 * f, 3 * f))
    assert first_forwards(w) == pytest.approx((3 * f - w, 3 * f))
    # a credit over the whole forward: it runs alone, then rank 0 finishes alone
    assert first_forwards(5 * f) == pytest.approx((2 * f, 3 * f))
    # the work is the same whatever the order: one core does all of it
    for credit in (0.0, w, 5 * f):
        sim = simulate(uniform("gpipe", 2, 2, tf=f, tb=b, host_sends=host_sends,
                               core_sharing=shared, wake_credit_s=credit))
        assert sim.iteration_s == pytest.approx(2 * 2 * (f + b))
        assert sim.busy_s == pytest.approx([2 * (f + b)] * 2)


def test_the_wake_credit_only_acts_where_cores_are_shared() -> None:
    for host_sends in (False, True):
        alone = uniform("1f1b", 4, 8, tf=1.0, tb=2.5, comm=0.3, host_sends=host_sends)
        assert simulate(alone).events == simulate(
            uniform("1f1b", 4, 8, tf=1.0, tb=2.5, comm=0.3, host_sends=host_sends,
                    wake_credit_s=0.5)).events
    # on shared cores it moves events, and keeps every schedule complete and no faster than
    # the work allows
    sharing = ((0, 2), (1, 3), (0, 2), (1, 3))
    for schedule in ("gpipe", "1f1b"):
        plain = simulate(uniform(schedule, 4, 8, comm=0.3, host_sends=True,
                                 core_sharing=sharing))
        credited = simulate(uniform(schedule, 4, 8, comm=0.3, host_sends=True,
                                    core_sharing=sharing, wake_credit_s=0.5))
        assert plain.events != credited.events
        assert credited.busy_s == plain.busy_s
        assert credited.iteration_s >= 8 * 2 * 3.0  # each core's two ranks' work, at least
    for bad in (-1e-3, math.inf, math.nan):
        with pytest.raises(ValueError, match="wake_credit_s"):
            uniform("1f1b", 2, 4, core_sharing=((0, 1), (0, 1)), wake_credit_s=bad)


# -- memory ----------------------------------------------------------------------------------------

def test_1f1b_holds_min_s_minus_rank_m_microbatches() -> None:
    for s in range(1, 9):
        for m in range(s, 3 * s + 2):
            sim = simulate(uniform("1f1b", s, m, act=10.0, static=3.0))
            assert sim.peak_memory_bytes == tuple(3.0 + 10.0 * min(s - r, m) for r in range(s))


def test_gpipe_holds_every_microbatch() -> None:
    sim = simulate(uniform("gpipe", 4, 6, act=2.0, static=1.0))
    assert sim.peak_memory_bytes == (13.0,) * 4


def test_interleaved_holds_warmup_plus_one() -> None:
    # torch's _get_warmup_ops: (chunks - 1) * per_round + 2 * (S - 1 - rank) forwards, capped at
    # M * chunks, then one more forward before the first backward.
    s, m, v = 4, 8, 2
    sim = simulate(uniform("interleaved-1f1b", s, m, v, act=1.0))
    per_round = m // max(1, m // s)
    assert sim.peak_memory_bytes == tuple(
        float(min((v - 1) * per_round + 2 * (s - 1 - r) + 1, m * v)) for r in range(s))


def test_peaks_agree_with_memory_model_in_flight_count() -> None:
    # partc.solve.memory.in_flight_microbatches encodes the same reading of torch's schedules; the
    # simulated peak (one byte per micro-batch and virtual stage) must be its count.
    for schedule, s, m, chunks in valid_shapes(max_ranks=6, max_mb=14, chunk_choices=(1, 2, 3, 4)):
        sim = simulate(uniform(schedule, s, m, chunks, act=1.0))
        expected = tuple(float(in_flight_microbatches(schedule, r, s, m, chunks))
                         for r in range(s))
        assert sim.peak_memory_bytes == expected, (schedule, s, m, chunks)


def test_memory_timeline() -> None:
    stages = tuple(StageTiming(1.0, 2.0, 0.0, 0.0, act, static)
                   for act, static in ((4.0, 100.0), (8.0, 200.0), (1.0, 10.0), (2.0, 20.0)))
    sim = simulate(PipelineSpec("interleaved-1f1b", 2, 4, stages))
    for rank, steps in enumerate(sim.memory_timeline):
        static = sum(stages[k].static_bytes for k in range(rank, 4, 2))
        assert steps[0] == (0.0, static)
        assert steps[-1][1] == pytest.approx(static)  # everything released at the end
        assert max(b for _, b in steps) == sim.peak_memory_bytes[rank]
        times = [t for t, _ in steps]
        assert times == sorted(times)
        # Each step is the end of a forward (up) or a backward (down) on this rank.
        ends = {e.end_s for e in sim.events if e.rank == rank and e.kind in ("forward",
                                                                              "backward")}
        assert set(times[1:]) <= ends
    # Rank 0 (stages 0 and 2) peaks after F0.0 F0.1 F2.0 F2.1 F0.2 B2.0 F0.3: four micro-batches
    # of stage 0 and one of stage 2.
    assert sim.peak_memory_bytes[0] == 110.0 + 4 * 4.0 + 1 * 1.0


# -- event semantics -------------------------------------------------------------------------------

@pytest.mark.parametrize("schedule,s,m,chunks", [
    ("gpipe", 3, 5, 1), ("1f1b", 4, 7, 1), ("interleaved-1f1b", 3, 6, 2),
    ("interleaved-1f1b", 4, 3, 3)])
def test_events_start_as_soon_as_dependencies_allow(schedule: str, s: int, m: int,
                                                    chunks: int) -> None:
    rng = random.Random(s * 100 + m)
    v = s * chunks
    stages = tuple(StageTiming(rng.uniform(0.1, 2), rng.uniform(0.1, 4),
                               rng.uniform(0, 1) if k < v - 1 else 0.0,
                               rng.uniform(0, 1) if k > 0 else 0.0, 1.0) for k in range(v))
    sim = simulate(PipelineSpec(schedule, s, m, stages))
    at = {(e.kind, e.stage, e.microbatch): e for e in sim.events if e.microbatch >= 0}
    order = action_order(schedule, s, m, chunks)
    for rank, ops in enumerate(order):
        free = 0.0
        for kind, k, i in ops:
            e = at[("forward" if kind == "F" else "backward", k, i)]
            ready = [free]
            if kind == "F":
                assert e.end_s - e.start_s == pytest.approx(stages[k].forward_s)
                if k > 0:
                    ready.append(at[("forward", k - 1, i)].end_s + stages[k - 1].send_forward_s)
            else:
                assert e.end_s - e.start_s == pytest.approx(stages[k].backward_s)
                ready.append(at[("forward", k, i)].end_s)
                if k < v - 1:
                    ready.append(at[("backward", k + 1, i)].end_s + stages[k + 1].send_backward_s)
            assert e.rank == rank
            assert e.start_s == pytest.approx(max(ready))  # no earlier, no later
            free = e.end_s


def test_deterministic_sorted_and_exportable() -> None:
    spec = uniform("interleaved-1f1b", 4, 8, 2, tf=0.1, tb=0.2, comm=0.01,
                   allreduce_s=(0.3,) * 4, optimizer_s=(0.05,) * 4)
    a, b = simulate(spec), simulate(spec)
    assert a == b
    keys = [(e.start_s, e.rank) for e in a.events]
    assert keys == sorted(keys)
    data = a.to_dict()
    assert data == b.to_dict()
    assert json.loads(json.dumps(data)) == data
    assert data["schedule"] == "interleaved-1f1b"
    assert (data["num_ranks"], data["num_microbatches"], data["chunks"]) == (4, 8, 2)
    assert len(data["events"]) == len(a.events) == 2 * 8 * 8 + 2 * 4
    assert set(data["events"][0]) == {"rank", "stage", "microbatch", "kind", "start_s", "end_s"}
    for value in [data["iteration_s"]] + [e["end_s"] for e in data["events"]]:
        assert value == round(value, 9)
    assert len(data["memory_timeline"]) == 4
    assert isinstance(a.events[0], Event) and isinstance(a, Simulation)


def test_zero_times() -> None:
    sim = simulate(uniform("1f1b", 2, 2, tf=0.0, tb=0.0))
    assert (sim.iteration_s, sim.bubble_fraction) == (0.0, 0.0)
    assert sim.peak_memory_bytes == (2.0, 1.0)


def test_stress_large_interleaved() -> None:
    # S=64, chunks=2, M=512: 131,072 compute actions (a few tenths of a second).
    sim = simulate(uniform("interleaved-1f1b", 64, 512, 2, tf=1.0, tb=2.0, comm=0.05))
    assert len(sim.events) == 2 * 128 * 512 + 2 * 64
    assert sim.iteration_s > (2 * 512 + 63) * 3.0


# -- errors ----------------------------------------------------------------------------------------

def test_deadlock_is_reported() -> None:
    spec = uniform("gpipe", 2, 2)
    # Rank 0 wants B(0, 0) before F(0, 1); rank 1 wants F(1, 1) (which needs F(0, 1)) before its
    # first backward.
    order = [[("F", 0, 0), ("B", 0, 0), ("F", 0, 1), ("B", 0, 1)],
             [("F", 1, 0), ("F", 1, 1), ("B", 1, 0), ("B", 1, 1)]]
    with pytest.raises(ValueError, match="deadlock.*rank 0 waits at B\\(stage 0, mb 0\\)"):
        simulate(spec, order=order)
    # A backward before its own forward can never run either.
    order = [[("B", 0, 0), ("F", 0, 0), ("F", 0, 1), ("B", 0, 1)],
             [("F", 1, 0), ("B", 1, 0), ("F", 1, 1), ("B", 1, 1)]]
    with pytest.raises(ValueError, match="deadlock"):
        simulate(spec, order=order)
    # A valid custom order runs.
    order = [[("F", 0, 0), ("F", 0, 1), ("B", 0, 1), ("B", 0, 0)],
             [("F", 1, 0), ("F", 1, 1), ("B", 1, 1), ("B", 1, 0)]]
    assert simulate(spec, order=order).iteration_s == pytest.approx(9.0)


@pytest.mark.parametrize("order,message", [
    ([[("F", 0, 0), ("B", 0, 0)]], "order has 1 ranks"),
    ([[("F", 0, 0), ("B", 0, 0), ("F", 0, 1)], [("F", 1, 0), ("B", 1, 0), ("F", 1, 1),
                                                 ("B", 1, 1)]], "expected 8"),
    ([[("F", 1, 0)], []], "belongs to rank 1"),
    ([[("F", 0, 0), ("F", 0, 0)], []], "appears twice"),
    ([[("X", 0, 0)], []], "invalid action"),
    ([[("F", 0, 5)], []], "invalid action"),
])
def test_invalid_custom_order(order: list, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        simulate(uniform("gpipe", 2, 2), order=order)


@pytest.mark.parametrize("schedule,s,m,chunks,message", [
    ("pipedream", 2, 4, 1, "unknown schedule"),
    ("gpipe", 2, 0, 1, "num_microbatches must be an integer >= 1"),
    ("gpipe", 0, 4, 1, "num_ranks must be an integer >= 1"),
    ("gpipe", 2, 4, 2, "chunks=2"),
    ("1f1b", 2, 4, 2, "chunks=2"),
    ("1f1b", 4, 3, 1, "num_microbatches \\(3\\) >= num_ranks \\(4\\)"),
    ("interleaved-1f1b", 4, 9, 2, "multiple of its rounds.* = 2"),
    ("interleaved-1f1b", 4, 11, 2, "multiple of its rounds.* = 2"),
    ("interleaved-1f1b", 2, 4, 0, "chunks must be an integer >= 1"),
    ("gpipe", 2, True, 1, "num_microbatches"),
])
def test_invalid_shapes(schedule: str, s: int, m: int, chunks: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        action_order(schedule, s, m, chunks)
    if s >= 1 and chunks >= 1:
        with pytest.raises(ValueError, match=message):
            uniform(schedule, s, m, chunks)


@pytest.mark.parametrize("schedule,s,m", [("1f1b", 4, 3), ("interleaved-1f1b", 4, 9),
                                          ("interleaved-1f1b", 4, 11)])
def test_torch_rejects_the_same_shapes(schedule: str, s: int, m: int) -> None:
    with pytest.raises(ValueError):
        torch_ir_order(schedule, s, m, 2 if schedule == "interleaved-1f1b" else 1)


def test_invalid_specs() -> None:
    for bad in (-1.0, math.nan, math.inf, True, "1"):
        with pytest.raises(ValueError, match="forward_s must be a finite number >= 0"):
            StageTiming(bad, 1.0, 0.0, 0.0, 0.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="static_bytes"):
        StageTiming(1.0, 1.0, 0.0, 0.0, 0.0, -5.0)
    stage = StageTiming(1.0, 1.0, 0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="positive multiple of num_ranks"):
        PipelineSpec("gpipe", 2, 4, (stage,) * 3)
    with pytest.raises(ValueError, match="positive multiple of num_ranks"):
        PipelineSpec("gpipe", 2, 4, ())
    with pytest.raises(ValueError, match="tuple of StageTiming"):
        PipelineSpec("gpipe", 2, 4, [stage, stage])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="allreduce_s must be a tuple of one time per rank"):
        PipelineSpec("gpipe", 2, 4, (stage,) * 2, allreduce_s=(1.0,))
    with pytest.raises(ValueError, match="optimizer_s\\[1\\]"):
        PipelineSpec("gpipe", 2, 4, (stage,) * 2, optimizer_s=(1.0, -1.0))
    assert PipelineSpec("interleaved-1f1b", 2, 4, (stage,) * 6).chunks == 3
    assert SCHEDULES == ("gpipe", "1f1b", "interleaved-1f1b")
