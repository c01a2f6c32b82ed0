"""The plan's pipeline schedule on this rank: torch.distributed.pipelining's ScheduleGPipe,
Schedule1F1B or ScheduleInterleaved1F1B over the rank's stages, the loss on the last stage, and
each step's inputs and targets (this rank's replica's share of the global batch).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)

from partc.cost.torch_profiler import CPU_CLOCK
from partc.emit.stage_graph import flatten_inputs
from partc.errors import LaunchError
from partc.frontend.model_file import ModelFile
from partc.options import TrainOptions
from partc.plans.plan import Plan
from partc.run.checkpoint import Checkpoint
from partc.run.rank_setup import TiedGroup
from partc.run.stage_runner import LocalStage, TimedStage, synced_clock
from partc.run.training import check_inputs, next_batch, split_batch


class P2PTimer:
    """The time this rank spends posting and waiting for the schedule's sends and receives, and,
    on gloo, the step's receives posted at its start: wall time (`seconds`) and the computing
    thread's CPU time in those calls (`cpu_seconds`).

    The CPU time is the calls' own cost (the device's `p2p_post_cpu_s` prices it per tensor) and
    the link's work done on the computing thread: gloo writes a send's bytes into the socket from
    the thread that posts it when the socket takes them (perf on a launched rank:
    `Pair::sendAsyncMode` -> `writev` -> `tcp_sendmsg` -> `_copy_from_iter`; an isend of 1 MiB
    took 0.34 ms of CPU against 69 us for 1 B, bench/gloo_p2p.py). The link's price
    (`send_forward_s`, work on both ranks' cores in the simulator) holds that copy, so the CPU
    between passes is measured without these calls (`cpu_between_passes`), or a calibration from
    the run would count the copy twice.

    torch's schedules post every p2p batch with `schedules._batch_p2p` and wait with
    `schedules._wait_batch_p2p` (module functions, looked up at each call), and batch one rank's
    operations for several stages together, so the time is the rank's, not a stage's. `install`
    wraps the two functions of this process (a launch worker runs one schedule); on CUDA the
    device is synchronised before the clock is read after a wait, since NCCL's wait only orders
    streams.

    Early receives (`post_receives`, gloo and one stage per rank): torch posts a receive right
    before the computation that needs it, and a gloo send moves its bytes only once the
    receiver's "ready" notice has been handled on the sender's side. When it has not, the bytes
    wait for the sender's gloo IO thread, which on a core whose other processes compute runs only
    at the next scheduler tick (bench/gloo_spin.py, docs/benchmarks.md). Posted at the step's
    start, every notice is there long before its send, and gloo writes the bytes from the
    sending thread at once. The receive buffers are the stage's own (one per micro-batch, kept
    across steps), so this allocates nothing; the schedule's later posts of the same receives
    get the early ones' handles."""

    def __init__(self, device: torch.device, early_receives: bool = False) -> None:
        self.device = device
        self.early_receives = early_receives
        self.seconds = 0.0
        self.cpu_seconds = 0.0
        self.early_taken = 0  # early receives the schedule has taken, over the run
        self._early: dict[int, dist.Work] = {}  # id(receive buffer) -> its posted work

    def install(self) -> None:
        import torch.distributed.pipelining.schedules as schedules

        post = getattr(schedules._batch_p2p, "__wrapped__", schedules._batch_p2p)
        wait = getattr(schedules._wait_batch_p2p, "__wrapped__", schedules._wait_batch_p2p)

        def timed_post(p2p_ops: list[dist.P2POp], desc: str | None = None) -> list[dist.Work]:
            start, cpu = time.perf_counter(), CPU_CLOCK()
            try:
                early: list[dist.Work] = []
                rest: list[dist.P2POp] = []
                for op in p2p_ops:
                    work = self._early.pop(id(op.tensor), None) if op.op is dist.irecv else None
                    if work is None:
                        rest.append(op)
                    else:
                        early.append(work)
                self.early_taken += len(early)
                return early + post(rest, desc)  # torch's _batch_p2p([]) is []
            finally:
                self.seconds += time.perf_counter() - start
                self.cpu_seconds += CPU_CLOCK() - cpu

        def timed_wait(*args: Any, **kwargs: Any) -> Any:
            start, cpu = time.perf_counter(), CPU_CLOCK()
            try:
                return wait(*args, **kwargs)
            finally:
                self.seconds += synced_clock(self.device) - start
                self.cpu_seconds += CPU_CLOCK() - cpu

        timed_post.__wrapped__ = post  # type: ignore[attr-defined]
        timed_wait.__wrapped__ = wait  # type: ignore[attr-defined]
        schedules._batch_p2p = timed_post
        schedules._wait_batch_p2p = timed_wait

    def post_receives(self, stages: Sequence[PipelineStage], microbatches: int) -> None:
        """Post every receive of this step (forward inputs, then input gradients, in micro-batch
        order: the order each peer sends them) before the schedule runs. A no-op until the
        schedule has set its stages up (its first step)."""
        if not self.early_receives:
            return
        if self._early:
            raise LaunchError(f"{len(self._early)} early receives of the last step were never "
                              "taken by the schedule", hint="report this as a partc bug")
        ops: list[dist.P2POp] = []
        for pipe in stages:
            if len(pipe.args_recv_info) < microbatches:
                return
            ops += [op for i in range(microbatches) for op in pipe.get_fwd_recv_ops(i)]
            if pipe.has_backward and not pipe.is_last:
                if len(pipe.grad_recv_info) < microbatches:
                    return
                ops += [op for i in range(microbatches) for op in pipe.get_bwd_recv_ops(i)]
        start, cpu = time.perf_counter(), CPU_CLOCK()
        for op in ops:
            work = dist.irecv(op.tensor, group=op.group, tag=op.tag, group_src=op.group_peer)
            if work is not None:  # None: this rank is not in the op's group (never, here)
                self._early[id(op.tensor)] = work
        self.seconds += time.perf_counter() - start
        self.cpu_seconds += CPU_CLOCK() - cpu


class StageLoss:
    """loss_fn on the last stage's flat outputs, rebuilt into the model's output structure.

    The schedule splits `target` along dim 0 into micro-batches but only if it is one tensor; a
    model's target may be any structure (BERT's is a pair). So the schedule gets the sample
    indices [0, batch) as its target, and each micro-batch's loss slices the real target (every
    tensor whose dim 0 is the batch) with its contiguous chunk of indices.
    """

    def __init__(self, loss_fn: Callable[[Any, Any], torch.Tensor], spec: pytree.TreeSpec,
                 device: torch.device) -> None:
        self.loss_fn = loss_fn
        self.spec = spec
        self.device = device
        self.target: Any = None  # this replica's target of the current step
        self.batch = 0
        # this step's time in the loss's forwards (the schedule calls it after each forward of
        # the last stage, outside the stage's own timing; its backward is inside the stage's)
        self.forward_s = 0.0
        self.forward_cpu_s = 0.0  # their CPU time (CPU_CLOCK)

    def set_target(self, target: Any, batch: int) -> torch.Tensor:
        """Remember this step's target; returns the index tensor to hand the schedule."""
        self.target, self.batch = target, batch
        self.forward_s = self.forward_cpu_s = 0.0
        return torch.arange(batch)

    def __call__(self, outputs: Any, index: torch.Tensor) -> torch.Tensor:
        start, cpu = synced_clock(self.device), CPU_CLOCK()
        lo, hi = int(index[0]), int(index[-1]) + 1
        target = pytree.tree_map(
            lambda t: t[lo:hi] if isinstance(t, torch.Tensor) and t.dim() and
            t.shape[0] == self.batch else t, self.target)
        flat = list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]
        try:
            return self.loss_fn(pytree.tree_unflatten(flat, self.spec), target)
        finally:
            self.forward_s += synced_clock(self.device) - start
            self.forward_cpu_s += CPU_CLOCK() - cpu


def build_schedule(plan: Plan, pipes: Sequence[TimedStage], M: int, loss_fn: Callable[..., Any],
                   chunk_spec: tuple[Any, ...] | None) -> Any:
    """The plan's schedule class over this rank's pipeline stages."""
    name = plan.training.shape.schedule
    if name == "interleaved-1f1b":
        # a list of the base class, as torch's (invariant) list annotation asks
        return ScheduleInterleaved1F1B(list(pipes), M, loss_fn=loss_fn,
                                       args_chunk_spec=chunk_spec)
    if len(pipes) != 1:
        raise LaunchError(f"schedule {name} runs one stage per rank, the plan gives this rank "
                          f"{len(pipes)}", hint="re-run partc compile")
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}.get(name)
    if cls is None:
        raise LaunchError(f"unknown schedule {name!r} in the plan",
                          hint="use a plan written by this partc")
    return cls(pipes[0], M, loss_fn=loss_fn, args_chunk_spec=chunk_spec)


@dataclass
class RankRun:
    """One rank's training, set up: what the step loop works with."""

    plan: Plan
    options: TrainOptions
    device: torch.device
    rank: int
    replica: int
    replicas: int
    stages: list[LocalStage]
    tied: list[TiedGroup]
    loss_fn: StageLoss | None  # on the rank holding the last stage
    data: Any  # the batch iterator, on the first and last stage's ranks
    pending: Any  # the first batch, drawn during setup
    in_spec: pytree.TreeSpec | None
    batched: tuple[bool, ...]  # per flat model input, on the first stage's rank
    resume: Checkpoint | None
    schedule: Any  # the torch.distributed.pipelining schedule over this rank's stages
    model_file: ModelFile
    p2p: P2PTimer  # this rank's time in p2p sends and receives
    metrics_group: Any  # the gloo group of launch's per-step metrics gather (rank_setup)

    @property
    def start(self) -> int:
        return self.resume.step if self.resume is not None else 0

    @property
    def num_stages(self) -> int:
        return self.plan.num_stages

    @property
    def is_first(self) -> bool:
        return any(local.spec.index == 0 for local in self.stages)

    @property
    def batch(self) -> int:
        return int(self.plan.training.global_batch_size)

    def next_inputs(self, step: int) -> tuple[list[torch.Tensor], Any]:
        """This rank's part of step's batch: first-stage inputs and last-stage target (the
        index target of `StageLoss`)."""
        if self.data is None:
            return [], None
        batch, R = self.batch, self.replicas
        inputs, whole_target = self.pending if self.pending is not None else \
            next_batch(self.data, self.options.seed, step)
        self.pending = None
        args: list[torch.Tensor] = []
        target = None
        if self.is_first:
            flat = flat_model_inputs(inputs, self.in_spec)
            check_inputs(flat, self.plan, self.batched)
            args = [t.to(self.device) for t in split_batch(flat, batch, R)[self.replica]]
        if self.loss_fn is not None:
            self.model_file.check_target(whole_target, batch)
            mine = pytree.tree_map(lambda t: t.to(self.device) if isinstance(t, torch.Tensor)
                                   else t, split_batch(whole_target, batch, R)[self.replica])
            target = self.loss_fn.set_target(mine, batch // R)
        return args, target


def no_loss(outputs: Any, target: Any) -> torch.Tensor:
    raise AssertionError("the loss runs on the last stage only")


def flat_model_inputs(inputs: Any, in_spec: pytree.TreeSpec | None) -> list[Any]:
    """The model inputs of a batch as the flat tensors stage 0 takes."""
    if in_spec is not None:
        return flatten_inputs(inputs, in_spec)
    return [t for t in pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor)]
