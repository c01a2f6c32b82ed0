"""A discrete-event simulator of one training iteration of a pipeline-parallel schedule.

A pipeline of S ranks (devices) runs V = S * chunks virtual stages; virtual stage k lives on rank
k % S (torch's "loop" stage-to-rank mapping; chunks > 1 only for interleaved 1F1B). M
micro-batches each go forward through every virtual stage and backward through them in reverse.
Each rank runs its actions strictly in the order torch.distributed.pipelining's schedule class
(torch 2.13) runs them, one at a time; `action_order` reproduces those orders:

- "gpipe" -> `ScheduleGPipe`: every forward, then every backward, micro-batches in ascending order.
- "1f1b" -> `Schedule1F1B._step_microbatches`: min(M, S - rank) warm-up forwards, then backward /
  forward alternation, then the remaining backwards.
- "interleaved-1f1b" -> `ScheduleInterleaved1F1B._calculate_single_rank_operations` (its
  `_get_warmup_ops` and `_get_1f1b_rank_ops`), which `_PipelineScheduleRuntime` executes in order.

Timing model: F(k, i) starts once its rank is free and F(k-1, i) has finished plus stage k-1's
`send_forward_s`; B(k, i) once its rank is free, F(k, i) is done and B(k+1, i) has finished plus
stage k+1's `send_backward_s` (for the last virtual stage, once its own forward is done).
Transfers delay the dependency only: they are asynchronous p2p and occupy neither rank. With
`host_sends` (gloo) each rank instead runs the posts and waits torch's schedule issues around
its computations, and a transfer is a rendezvous (it starts once both sides posted it) whose
latency is a wait and whose bytes are copied on both ranks' cores (partc.solve.host_p2p; a
custom `order` keeps the delay model, with the send on its sender's action). Where several
devices share a core (`core_sharing`: a
CPU node with more gloo processes than cores, each pinned to core local_rank % cores), a rank's
action progresses at 1/k of its speed while k of the core's ranks are busy (processor sharing:
`_run_shared`), except that a rank which starts computing after a wait runs ahead of its
core-mates by `wake_credit_s` of work first, as Linux's fair scheduler lets it
(partc.solve.shared_cores); the rest of the model is unchanged. After its
last backward a rank runs its data-parallel gradient all-reduce, then the gradient sums of the
parameters it shares with other ranks (tied weights, `TiedSync`, in order: each one starts when
the last of its ranks gets there, a synchronisation point), then its optimizer step. The
simulator is pure Python with no torch import, so the partition solver can call it in a loop.

docs/simulator.md describes the model, its assumptions and the output format.
"""
from __future__ import annotations

import gc
import math
from collections import deque
from dataclasses import dataclass
from typing import Any, Literal, Sequence

from partc.options import SCHEDULES, Schedule
from partc.solve import host_p2p
from partc.solve.shared_cores import SharedCores

Action = tuple[str, int, int]
"""One compute action: ("F" or "B", virtual stage, micro-batch)."""

# Event kinds in the order their events sort when they start at the same time on the same rank.
_KINDS = ("forward", "backward", "allreduce", "tied", "optimizer")
_KIND_RANK = {kind: position for position, kind in enumerate(_KINDS)}


def _check_time(name: str, value: object) -> None:
    """Times and byte counts are finite, non-negative real numbers (bool is rejected: a typo)."""
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or value < 0):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


def _check_count(name: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


@dataclass(frozen=True)
class StageTiming:
    """One virtual stage, per micro-batch.

    `send_forward_s` of the last virtual stage and `send_backward_s` of the first have no receiver
    and are ignored, as are transfers between two virtual stages on the same rank (S = 1), which
    torch hands over locally without p2p.
    """

    forward_s: float
    """Forward compute time of one micro-batch."""
    backward_s: float
    """Backward compute time of one micro-batch (includes recomputation under checkpointing)."""
    send_forward_s: float
    """Transfer time of its outputs to virtual stage k + 1 (0 for the last)."""
    send_backward_s: float
    """Transfer time of its input gradients to virtual stage k - 1 (0 for the first)."""
    activation_bytes: float
    """Bytes a micro-batch holds on the device from the end of its forward to the end of its
    backward."""
    static_bytes: float = 0.0
    """Bytes held all the time (weights, gradients, optimizer state, buffers)."""
    send_forward_latency_s: float = 0.0
    """Of `send_forward_s`, the links' per-message latencies: with `host_sends` a wait before
    the bytes move, not CPU work (the rest is)."""
    send_backward_latency_s: float = 0.0
    """Of `send_backward_s`, the links' per-message latencies."""

    def __post_init__(self) -> None:
        for name in ("forward_s", "backward_s", "send_forward_s", "send_backward_s",
                     "activation_bytes", "static_bytes", "send_forward_latency_s",
                     "send_backward_latency_s"):
            _check_time(name, getattr(self, name))
        if self.send_forward_latency_s > self.send_forward_s or \
                self.send_backward_latency_s > self.send_backward_s:
            raise ValueError("a send's latency cannot exceed the send's time")


@dataclass(frozen=True)
class TiedSync:
    """A parameter several pipeline ranks hold (a tied weight): after their backwards and
    gradient all-reduces, each of `ranks` waits for the others, then they all-reduce its
    gradient, taking `seconds`."""

    ranks: tuple[int, ...]
    seconds: float

    def __post_init__(self) -> None:
        if not isinstance(self.ranks, tuple) or len(self.ranks) < 2 or len(set(self.ranks)) != \
                len(self.ranks):
            raise ValueError(f"a tied sync needs two or more distinct ranks, got {self.ranks!r}")
        for rank in self.ranks:
            _check_count("tied rank", rank, 0)
        _check_time("seconds", self.seconds)


@dataclass(frozen=True)
class PipelineSpec:
    """What to simulate: a schedule, the pipeline shape and every virtual stage's costs.

    `chunks` (virtual stages per rank) is derived: len(stages) // num_ranks. `allreduce_s` and
    `optimizer_s` are per rank; empty means zero. `tied` are the cross-rank gradient sums, in
    the order the ranks run them.
    """

    schedule: Schedule
    num_ranks: int
    num_microbatches: int
    stages: tuple[StageTiming, ...]
    allreduce_s: tuple[float, ...] = ()
    optimizer_s: tuple[float, ...] = ()
    tied: tuple[TiedSync, ...] = ()
    host_sends: bool = False  # transfers are the processes' own work (gloo): partc.solve.host_p2p
    # per rank, the pipeline ranks whose devices share its core, itself included (a rank appears
    # once per replica on that core: replicas run in lockstep); empty: every rank has its own
    core_sharing: tuple[tuple[int, ...], ...] = ()
    # where ranks share cores: the CPU seconds a rank that starts computing after a wait runs
    # ahead of its core-mates before they share the core again (ClusterSpec.wake_credit_s;
    # partc.solve.shared_cores); 0 is processor sharing
    wake_credit_s: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.stages, tuple) or not all(
                isinstance(stage, StageTiming) for stage in self.stages):
            raise ValueError("stages must be a tuple of StageTiming, one per virtual stage")
        _check_count("num_ranks", self.num_ranks, 1)
        if not self.stages or len(self.stages) % self.num_ranks:
            raise ValueError(
                f"the number of virtual stages ({len(self.stages)}) must be a positive multiple "
                f"of num_ranks ({self.num_ranks})")
        _validate_shape(self.schedule, self.num_ranks, self.num_microbatches, self.chunks)
        for name in ("allreduce_s", "optimizer_s"):
            values = getattr(self, name)
            if not isinstance(values, tuple) or len(values) not in (0, self.num_ranks):
                raise ValueError(f"{name} must be a tuple of one time per rank ({self.num_ranks}) "
                                 f"or empty, got {values!r}")
            for rank, value in enumerate(values):
                _check_time(f"{name}[{rank}]", value)
        _check_time("wake_credit_s", self.wake_credit_s)
        if not isinstance(self.tied, tuple) or not all(isinstance(t, TiedSync)
                                                       for t in self.tied):
            raise ValueError("tied must be a tuple of TiedSync")
        for sync in self.tied:
            if max(sync.ranks) >= self.num_ranks:
                raise ValueError(f"tied sync ranks {sync.ranks} outside 0..{self.num_ranks - 1}")
        if self.core_sharing:
            if len(self.core_sharing) != self.num_ranks or any(
                    rank not in group or not all(isinstance(r, int) and 0 <= r < self.num_ranks
                                                 for r in group)
                    for rank, group in enumerate(self.core_sharing)):
                raise ValueError("core_sharing must hold, per rank, the ranks sharing its core "
                                 f"(itself included), got {self.core_sharing!r}")

    @property
    def shares_cores(self) -> bool:
        """Whether some core runs more than one busy rank at a time."""
        return any(len(group) > 1 for group in self.core_sharing)

    @property
    def chunks(self) -> int:
        """Virtual stages per rank."""
        return len(self.stages) // self.num_ranks

    @property
    def num_stages(self) -> int:
        """V, the number of virtual stages."""
        return len(self.stages)


@dataclass(frozen=True)
class Event:
    """One interval of work on one rank.

    `stage` is the virtual stage for forward/backward events and -1 for allreduce/optimizer ones
    (which cover all of the rank's stages); `microbatch` is -1 for allreduce/optimizer.
    """

    rank: int
    stage: int
    microbatch: int
    kind: str
    start_s: float
    end_s: float


@dataclass(frozen=True)
class Simulation:
    """The simulated iteration.

    `iteration_s`: time when the last rank finishes its optimizer step. `last_backward_s`: time
    when the last backward (over all ranks) ends. `bubble_fraction`: the idle share of the ranks'
    forward/backward span, 1 - sum(busy_s) / (num_ranks * last_backward_s), where busy_s is each
    rank's forward plus backward compute time; the all-reduce and optimizer step are outside it
    (0 when last_backward_s is 0). `events`: every forward, backward, all-reduce and optimizer
    interval, sorted by (start_s, rank, end_s, kind, stage, microbatch). `peak_memory_bytes`: per
    rank, the static bytes of its stages plus the most activation bytes it holds at once.
    `memory_timeline`: per rank, (time, bytes held including static) steps in order, starting at
    (0, static); a value holds until the next step, and two steps may share a time when an
    action takes no time; its maximum is the peak.
    """

    iteration_s: float
    bubble_fraction: float
    events: tuple[Event, ...]
    peak_memory_bytes: tuple[float, ...]
    memory_timeline: tuple[tuple[tuple[float, float], ...], ...]
    busy_s: tuple[float, ...]
    last_backward_s: float = 0.0
    schedule: Schedule | Literal[""] = ""  # "": not recorded
    num_microbatches: int = 0
    chunks: int = 1

    @property
    def num_ranks(self) -> int:
        return len(self.busy_s)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (dicts, lists, str, int, float) for YAML/JSON export; times rounded to ns."""
        def t(value: float) -> float:
            # Rounding to the nanosecond hides float noise of summed durations in exports.
            return round(value, 9)

        return {
            "schedule": self.schedule,
            "num_ranks": self.num_ranks,
            "num_microbatches": self.num_microbatches,
            "chunks": self.chunks,
            "iteration_s": t(self.iteration_s),
            "last_backward_s": t(self.last_backward_s),
            "bubble_fraction": self.bubble_fraction,
            "busy_s": [t(value) for value in self.busy_s],
            "peak_memory_bytes": list(self.peak_memory_bytes),
            "events": [{"rank": e.rank, "stage": e.stage, "microbatch": e.microbatch,
                        "kind": e.kind, "start_s": t(e.start_s), "end_s": t(e.end_s)}
                       for e in self.events],
            "memory_timeline": [[[t(time), held] for time, held in steps]
                                for steps in self.memory_timeline],
        }


# -- action orders ---------------------------------------------------------------------------------

def _validate_shape(schedule: object, num_ranks: object, num_microbatches: object,
                    chunks: object) -> None:
    """Reject what torch's schedule classes reject, with the reason."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r} (expected one of {', '.join(SCHEDULES)})")
    _check_count("num_ranks", num_ranks, 1)
    _check_count("num_microbatches", num_microbatches, 1)
    _check_count("chunks", chunks, 1)
    assert isinstance(num_ranks, int) and isinstance(num_microbatches, int)
    if schedule != "interleaved-1f1b" and chunks != 1:
        raise ValueError(f"schedule {schedule} runs one stage per rank, got chunks={chunks}; "
                         "use interleaved-1f1b for several virtual stages per rank")
    if schedule == "1f1b" and num_microbatches < num_ranks:
        # Schedule1F1B.__init__ raises the same: its warm-up assumes M >= S.
        raise ValueError(f"1f1b needs num_microbatches ({num_microbatches}) >= num_ranks "
                         f"({num_ranks}), as torch's Schedule1F1B requires")
    if schedule == "interleaved-1f1b":
        rounds = max(1, num_microbatches // num_ranks)
        if num_microbatches % rounds:
            # ScheduleInterleaved1F1B.__init__ raises the same.
            raise ValueError(
                f"interleaved-1f1b needs num_microbatches ({num_microbatches}) to be a multiple "
                f"of its rounds, max(1, num_microbatches // num_ranks) = {rounds}, as torch's "
                f"ScheduleInterleaved1F1B requires (any multiple of num_ranks works)")


def _gpipe_order(rank: int, m: int) -> list[Action]:
    # ScheduleGPipe._step_microbatches: all forwards, then all backwards, both ascending.
    return [("F", rank, i) for i in range(m)] + [("B", rank, i) for i in range(m)]


def _1f1b_order(rank: int, s: int, m: int) -> list[Action]:
    # Schedule1F1B._step_microbatches (not its `pipeline_order`, which the runtime never reads and
    # which numbers the last rank's forwards from 1 in torch 2.13).
    warmup = min(m, s - rank)
    ops: list[Action] = [("F", rank, i) for i in range(warmup)]
    forward, backward = warmup, 0
    while True:
        # "1B1F": the backward comes first, then a forward if any is left.
        ops.append(("B", rank, backward))
        backward += 1
        if forward == m:
            break
        ops.append(("F", rank, forward))
        forward += 1
    ops.extend(("B", rank, i) for i in range(backward, m))
    return ops


def _interleaved_order(rank: int, s: int, m: int, chunks: int) -> list[Action]:
    # ScheduleInterleaved1F1B._calculate_single_rank_operations with _get_warmup_ops
    # (multiply_factor=2) and _get_1f1b_rank_ops (enable_zero_bubble=False), Nones dropped: the
    # runtime skips them.
    rounds = max(1, m // s)
    per_round = m // rounds
    warmup = min((chunks - 1) * per_round + 2 * (s - 1 - rank), m * chunks)
    total = m * chunks
    steady = total - warmup
    next_forward = [0] * chunks
    next_backward = [0] * chunks

    def forward_stage(step: int) -> int:
        return ((step // per_round) % chunks) * s + rank

    def backward_stage(step: int) -> int:
        return (chunks - 1 - ((step - warmup) // per_round) % chunks) * s + rank

    ops: list[Action] = []

    def add(kind: str, stage: int, counters: list[int]) -> None:
        local = stage // s
        ops.append((kind, stage, counters[local]))
        counters[local] += 1

    # Warm-up forwards, then `steady` (forward, backward) pairs, then `warmup` cool-down backwards
    # (torch's op counter runs over warmup + steady + cooldown with cooldown == warmup).
    for op in range(warmup + steady + warmup):
        if op < warmup:
            add("F", forward_stage(op), next_forward)
        elif op < warmup + steady:
            add("F", forward_stage(op), next_forward)
            add("B", backward_stage(op), next_backward)
        else:
            add("B", backward_stage(op), next_backward)
    return ops


def action_order(schedule: Schedule, num_ranks: int, num_microbatches: int,
                 chunks: int = 1) -> list[list[Action]]:
    """Per rank, the ordered actions ("F"|"B", virtual stage, micro-batch) torch's schedule runs.

    Virtual stage k lives on rank k % num_ranks. Raises ValueError for a shape torch's schedule
    class rejects (see `PipelineSpec`).
    """
    _validate_shape(schedule, num_ranks, num_microbatches, chunks)
    s, m = num_ranks, num_microbatches
    if schedule == "gpipe":
        return [_gpipe_order(rank, m) for rank in range(s)]
    if schedule == "1f1b":
        return [_1f1b_order(rank, s, m) for rank in range(s)]
    return [_interleaved_order(rank, s, m, chunks) for rank in range(s)]


def host_programs(schedule: Schedule, num_ranks: int, num_microbatches: int,
                  chunks: int = 1) -> list[list[host_p2p.Item]]:
    """Per rank, its computations with the p2p posts and waits torch's schedule class issues
    around them (`partc.solve.host_p2p.programs`): what the simulator runs under `host_sends`."""
    orders = action_order(schedule, num_ranks, num_microbatches, chunks)
    return host_p2p.programs(schedule, orders, num_ranks, num_ranks * chunks, num_microbatches)


def _check_order(order: Sequence[Sequence[Action]], s: int, v: int, m: int) -> list[list[Action]]:
    """A custom order must hold every (F|B, stage, micro-batch) once, each on its stage's rank."""
    if len(order) != s:
        raise ValueError(f"order has {len(order)} ranks, expected {s}")
    seen: set[Action] = set()
    checked: list[list[Action]] = []
    for rank, ops in enumerate(order):
        rank_ops: list[Action] = []
        for action in ops:
            if not isinstance(action, (tuple, list)) or len(action) != 3:
                raise ValueError(f"rank {rank}: invalid action {action!r}, expected "
                                 "(\"F\" or \"B\", stage, micro-batch)")
            kind, stage, mb = action
            if kind not in ("F", "B") or not (0 <= stage < v) or not (0 <= mb < m):
                raise ValueError(f"rank {rank}: invalid action {action!r}")
            if stage % s != rank:
                raise ValueError(f"rank {rank}: action {action!r} belongs to rank {stage % s}")
            if action in seen:
                raise ValueError(f"rank {rank}: action {action!r} appears twice")
            seen.add(action)
            rank_ops.append((kind, stage, mb))
        checked.append(rank_ops)
    if len(seen) != 2 * v * m:
        raise ValueError(f"order has {len(seen)} actions, expected {2 * v * m} "
                         "(a forward and a backward per virtual stage and micro-batch)")
    return checked


# -- simulation ------------------------------------------------------------------------------------

def simulate(spec: PipelineSpec, order: Sequence[Sequence[Action]] | None = None) -> Simulation:
    """Simulate one training iteration of `spec`.

    `order` replaces the schedule's `action_order` (for experiments and tests); it must hold each
    action once, on the rank of its stage. Raises ValueError if the order deadlocks: some rank's
    next action waits on an action that can never run.
    """
    # The run allocates a few hundred thousand small acyclic objects (events, tuples); CPython's
    # cyclic collector would rescan them over and over as they accumulate (about half the run
    # time at S=64, M=512), and there are no cycles to find.
    collecting = gc.isenabled()
    gc.disable()
    try:
        return _simulate(spec, order)
    finally:
        if collecting:
            gc.enable()


def _simulate(spec: PipelineSpec, order: Sequence[Sequence[Action]] | None) -> Simulation:
    s, v, m = spec.num_ranks, spec.num_stages, spec.num_microbatches
    if order is None:
        orders = action_order(spec.schedule, s, m, spec.chunks)
    else:
        orders = _check_order(order, s, v, m)
    # Actions are integers: forward F(k, i) is k * M + i, backward B(k, i) is V * M + k * M + i,
    # so dependencies are index arithmetic and finish times a flat list (NaN = not run yet).
    vm = v * m
    programs = [[(0 if kind == "F" else vm) + stage * m + mb for kind, stage, mb in ops]
                for ops in orders]
    if spec.host_sends and order is None:
        return _simulate_host_p2p(spec, orders, programs)
    run = _run_shared if spec.shares_cores else _run
    start_of, finish, position = run(spec, programs)
    stuck = [rank for rank in range(s) if position[rank] < len(orders[rank])]
    if stuck:
        raise _deadlock(orders, position, stuck)
    forward_s, backward_s, _, _ = _durations(spec)
    return _replay(spec, programs, start_of, finish, forward_s, backward_s)


def _simulate_host_p2p(spec: PipelineSpec, orders: list[list[Action]],
                       programs: list[list[int]]) -> Simulation:
    """`host_sends` (gloo): the schedule's posts and waits around each computation, transfers
    as rendezvous work on both ends' cores (partc.solve.host_p2p)."""
    s, v, m = spec.num_ranks, spec.num_stages, spec.num_microbatches
    stages = spec.stages
    progs = host_p2p.programs(spec.schedule, orders, s, v, m)
    forward_s = [st.forward_s for st in stages]
    backward_s = [st.backward_s for st in stages]
    start_of, finish, position, ended = host_p2p.run(
        progs, forward_s, backward_s,
        [st.send_forward_s if k < v - 1 else 0.0 for k, st in enumerate(stages)],
        [st.send_backward_s if k > 0 else 0.0 for k, st in enumerate(stages)],
        [st.send_forward_latency_s for st in stages], [st.send_backward_latency_s for st in stages],
        spec.core_sharing or tuple((rank,) for rank in range(s)), m, spec.wake_credit_s)
    stuck = [rank for rank in range(s) if position[rank] < len(progs[rank])]
    if stuck:
        done = [sum(1 for what, _ in progs[rank][:position[rank]] if what == host_p2p.COMPUTE)
                for rank in range(s)]
        raise _deadlock(orders, done, stuck)
    return _replay(spec, programs, start_of, finish, forward_s, backward_s, ended)


def _run(spec: PipelineSpec, programs: list[list[int]]
         ) -> tuple[list[float], list[float], list[int]]:
    """Run every rank's program as early as its dependencies allow: (start time, finish time) per
    action (NaN for actions that never ran) and how far each rank got."""
    s, v, m = spec.num_ranks, spec.num_stages, spec.num_microbatches
    vm = v * m
    forward_s, backward_s, forward_delay, backward_delay = _durations(spec)
    finish = [math.nan] * (2 * vm)
    start_of = [math.nan] * (2 * vm)
    # Ranks blocked on an action, by its index: woken when it finishes, so every rank's next
    # action is examined once per wake-up rather than by rescanning all ranks.
    waiting: dict[int, list[int]] = {}
    position = [0] * s
    free_at = [0.0] * s
    ready = deque(range(s))

    while ready:
        rank = ready.popleft()
        program = programs[rank]
        count = len(program)
        pos = position[rank]
        clock = free_at[rank]
        while pos < count:
            action = program[pos]
            start = clock
            if action < vm:
                stage = action // m
                duration = forward_s[stage]
                if stage > 0:
                    dep = action - m
                    done = finish[dep]
                    if done != done:  # NaN: F(k - 1, i) has not run
                        waiting.setdefault(dep, []).append(rank)
                        break
                    done += forward_delay[stage - 1]
                    if done > start:
                        start = done
            else:
                stage = (action - vm) // m
                duration = backward_s[stage]
                dep = action - vm
                done = finish[dep]
                if done != done:  # its own forward has not run (only in an invalid order)
                    waiting.setdefault(dep, []).append(rank)
                    break
                if done > start:
                    start = done
                if stage < v - 1:
                    dep = action + m
                    done = finish[dep]
                    if done != done:  # B(k + 1, i) has not run
                        waiting.setdefault(dep, []).append(rank)
                        break
                    done += backward_delay[stage + 1]
                    if done > start:
                        start = done
            clock = start + duration
            finish[action] = clock
            start_of[action] = start
            pos += 1
            woken = waiting.pop(action, None)
            if woken:
                ready.extend(woken)
        position[rank] = pos
        free_at[rank] = clock
    return start_of, finish, position


def _run_shared(spec: PipelineSpec, programs: list[list[int]]
                ) -> tuple[list[float], list[float], list[int]]:
    """`_run` with ranks sharing cores (`PipelineSpec.core_sharing`): an event-driven replay in
    time order in which each running action advances at 1 / (busy ranks on its core) of its
    speed, re-rated whenever an action starts or ends."""
    s, v, m = spec.num_ranks, spec.num_stages, spec.num_microbatches
    vm = v * m
    forward_s, backward_s, forward_delay, backward_delay = _durations(spec)
    finish = [math.nan] * (2 * vm)
    start_of = [math.nan] * (2 * vm)
    position = [0] * s
    running = [False] * s
    left = [0.0] * s  # seconds of its own (unshared) work the running action still needs
    sharing = spec.core_sharing
    cores = SharedCores(sharing, spec.wake_credit_s)

    def ready_at(rank: int) -> float | None:
        """When the rank's next action may start: None while a dependency has not run or when
        the rank is done."""
        if position[rank] >= len(programs[rank]):
            return None
        action = programs[rank][position[rank]]
        if action < vm:
            stage = action // m
            if stage == 0:
                return 0.0
            done = finish[action - m]
            return None if done != done else done + forward_delay[stage - 1]
        stage = (action - vm) // m
        own = finish[action - vm]
        if own != own:
            return None
        if stage == v - 1:
            return own
        after = finish[action + m]
        return None if after != after else max(own, after + backward_delay[stage + 1])

    now = 0.0
    while True:
        for rank in range(s):
            if not running[rank]:
                at = ready_at(rank)
                if at is not None and at <= now:
                    action = programs[rank][position[rank]]
                    start_of[action] = now
                    cores.start(rank, now, [other for other in range(s) if running[other]])
                    running[rank] = True
                    left[rank] = forward_s[action // m] if action < vm else \
                        backward_s[(action - vm) // m]
        busy = [rank for rank in range(s) if running[rank]]
        waiting = [at for rank in range(s) if not running[rank]
                   for at in (ready_at(rank),) if at is not None]
        if not busy:
            if not waiting:
                return start_of, finish, position
            now = min(waiting)
            continue
        slow = cores.slowdowns(busy, [sum(1 for other in sharing[rank] if running[other])
                                      for rank in range(s)])
        step = min(min(left[rank] * slow[rank] for rank in busy), cores.catch_up_s(busy, slow))
        later = [at - now for at in waiting if at > now]
        if later and min(later) < step:
            step = min(later)
        now += step
        cores.advance(busy, slow, step)
        for rank in busy:
            if slow[rank] == math.inf:
                continue
            left[rank] -= step / slow[rank]
            if left[rank] <= 1e-12:
                action = programs[rank][position[rank]]
                finish[action] = now
                cores.finish(rank, now)
                position[rank] += 1
                running[rank] = False


def _durations(spec: PipelineSpec) -> tuple[list[float], list[float], list[float], list[float]]:
    """Per virtual stage: how long a forward and a backward occupy its rank, and the delay from
    their end to the earliest start of the dependent action on the next (forward) or previous
    (backward) stage. A transfer between stages of one rank costs nothing (torch passes it
    locally); otherwise it is the delay, or with `host_sends` part of the sender's action."""
    s, v = spec.num_ranks, spec.num_stages
    stages = spec.stages
    send_fwd = [st.send_forward_s if k < v - 1 and (k + 1) % s != k % s else 0.0
                for k, st in enumerate(stages)]
    send_bwd = [st.send_backward_s if k > 0 and (k - 1) % s != k % s else 0.0
                for k, st in enumerate(stages)]
    if spec.host_sends:
        return ([st.forward_s + x for st, x in zip(stages, send_fwd, strict=True)],
                [st.backward_s + x for st, x in zip(stages, send_bwd, strict=True)],
                [0.0] * v, [0.0] * v)
    return ([st.forward_s for st in stages], [st.backward_s for st in stages], send_fwd,
            send_bwd)


def _deadlock(orders: list[list[Action]], position: list[int], stuck: list[int]) -> ValueError:
    details = []
    for rank in stuck[:8]:
        kind, stage, mb = orders[rank][position[rank]]
        details.append(f"rank {rank} waits at {kind}(stage {stage}, mb {mb})")
    more = f" and {len(stuck) - 8} more ranks" if len(stuck) > 8 else ""
    return ValueError("deadlock: the action order cannot complete; " + "; ".join(details) + more)


def _replay(spec: PipelineSpec, programs: list[list[int]], start_of: list[float],
            finish: list[float], forward_s: Sequence[float], backward_s: Sequence[float],
            ended: Sequence[float] = ()) -> Simulation:
    """The Simulation of a completed run: events, busy time (the actions' own `forward_s` and
    `backward_s`), memory over time and the iteration (each rank's all-reduce, tied-gradient
    sums and optimizer step after its last backward, or after `ended`, when its pipeline
    program ended, where given)."""
    s, v, m = spec.num_ranks, spec.num_stages, spec.num_microbatches
    stages = spec.stages
    vm = v * m
    allreduce = spec.allreduce_s or (0.0,) * s
    optimizer = spec.optimizer_s or (0.0,) * s
    events: list[Event] = []
    busy: list[float] = []
    peaks: list[float] = []
    timelines: list[tuple[tuple[float, float], ...]] = []
    last_backward = 0.0
    iteration = 0.0
    reduced = [0.0] * s  # per rank: when its data-parallel all-reduce ends
    activation = [stage.activation_bytes for stage in stages]
    for rank in range(s):
        static = sum(stages[k].static_bytes for k in range(rank, v, s))
        held = 0.0
        most = 0.0
        steps: list[tuple[float, float]] = [(0.0, static)]
        rank_busy = 0.0
        end = 0.0
        for action in programs[rank]:
            start, end = start_of[action], finish[action]
            if action < vm:
                stage, mb = divmod(action, m)
                # Summed durations, not end - start, so equal stages give equal busy times.
                rank_busy += forward_s[stage]
                # Activations appear when the forward ends and go when the backward ends; a rank
                # runs serially, so its action order is its time order.
                held += activation[stage]
                kind = "forward"
            else:
                stage, mb = divmod(action - vm, m)
                rank_busy += backward_s[stage]
                held -= activation[stage]
                kind = "backward"
            if held > most:
                most = held
            if activation[stage]:
                steps.append((end, static + held))
            events.append(Event(rank, stage, mb, kind, start, end))
        last_backward = max(last_backward, end)
        if ended:
            end = max(end, ended[rank])
        reduced[rank] = end + allreduce[rank]
        events.append(Event(rank, -1, -1, "allreduce", end, reduced[rank]))
        busy.append(rank_busy)
        peaks.append(static + most)
        timelines.append(tuple(steps))

    # Tied gradients: each sum waits for the last of its ranks, then all of them reduce it.
    ready = list(reduced)
    for sync in spec.tied:
        start = max(ready[rank] for rank in sync.ranks)
        for rank in sync.ranks:
            events.append(Event(rank, -1, -1, "tied", ready[rank], start + sync.seconds))
            ready[rank] = start + sync.seconds
    for rank in range(s):
        step_end = ready[rank] + optimizer[rank]
        events.append(Event(rank, -1, -1, "optimizer", ready[rank], step_end))
        iteration = max(iteration, step_end)
    events.sort(key=lambda e: (e.start_s, e.rank, e.end_s, _KIND_RANK[e.kind], e.stage,
                               e.microbatch))
    bubble = 1.0 - sum(busy) / (s * last_backward) if last_backward > 0 else 0.0
    return Simulation(
        iteration_s=iteration, bubble_fraction=bubble, events=tuple(events),
        peak_memory_bytes=tuple(peaks), memory_timeline=tuple(timelines), busy_s=tuple(busy),
        last_backward_s=last_backward, schedule=spec.schedule, num_microbatches=m,
        chunks=spec.chunks)
