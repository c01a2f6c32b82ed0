"""One rank of a `partc launch` run: the plan's stages trained with torch.distributed's own
pipeline x data parallelism (started by torchrun / the elastic agent, see partc.run.launch).

Per rank, in order:
1. the plan is validated (schema, stage-file hashes) and its layout checked against WORLD_SIZE;
2. the process group (NCCL with CUDA, gloo on CPU, as plan.yaml's cluster says) and a DeviceMesh
   ("pp", "dp") from partc.run.rank_layout; one extra group per tied parameter and replica
   (partc.run.rank_setup);
3. the rank's stage file(s) are loaded (TorchScript) and get their weights by FQN: the last
   checkpoint when resuming, else --init-from, else the stage file's own, else (meta plans) the
   model's own initialisation (partc.run.stage_runner);
4. each stage is wrapped for the plan's precision (bf16 autocast) and its activation
   checkpointing (per stage, as plan.yaml says), then in DistributedDataParallel over the "dp"
   group when the plan has replicas (its optimizer a ZeroRedundancyOptimizer over that group
   where the stage shards its optimizer state), then in a PipelineStage with its input/output
   shapes from plan.yaml (no shape-inference round trip);
5. the plan's schedule (ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B) runs each step on
   the global batch; the loss (the model file's loss_fn on the last stage, the model's output
   structure rebuilt from the flat stage outputs) is averaged over micro-batches by the schedule's
   gradient scaling and over replicas by DDP (partc.run.schedule);
6. gradients of tied parameters are summed over the stages holding them, then each stage's
   optimizer (the plan's) steps;
7. rank 0 gathers loss, per-stage times and peak memory (one small gather per step over a gloo
   group of its own, posted at the step's end and waited at the next one's, so no rank waits for
   another to report; times read after synchronising a CUDA device), shows progress one step
   behind, writes the metrics file
   (partc.plans.run_metrics) and prints a summary (partc.run.reporting); every
   --checkpoint-every steps each stage's replica 0 writes its checkpoint (partc.run.checkpoint).
"""
from __future__ import annotations

import contextlib
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, TextIO

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch.distributed.pipelining.microbatch import TensorChunkSpec, _Replicate

from partc.cost.torch_profiler import CPU_CLOCK, cpu_settings, device_profile
from partc.errors import LaunchError, PartcError
from partc.frontend.model_file import ModelFile
from partc.hardware.local import batch_schedule_gloo_io
from partc.options import TrainOptions
from partc.plans.plan import Plan, load_plan, refuse_plan_artifact
from partc.plans.run_metrics import (
    CLOCK_CPU,
    CLOCK_CUDA,
    MEMORY_CPU_PROFILER,
    MEMORY_CUDA,
    MEMORY_NONE,
    StageMetrics,
    StepMetrics,
)
from partc.run.gradient_sharding import GradientSharder
from partc.run.rank_layout import RankLayout, rank_layout
from partc.run.rank_setup import (
    RankEnv,
    init_process_group,
    metrics_group,
    pipeline_groups,
    rank_env,
    resume_point,
    tied_groups,
)
from partc.run.reference import live_tensor_bytes, peak_above_start
from partc.run.reporting import Reporter, RunSummary
from partc.run.schedule import (
    P2PTimer,
    RankRun,
    StageLoss,
    build_schedule,
    flat_model_inputs,
    no_loss,
)
from partc.run.stage_runner import (
    GradSyncTimer,
    LocalStage,
    cpu_between_passes,
    load_local_stages,
    save_checkpoint,
    sum_tied_gradients,
    synced_clock,
    wrap_for_pipeline,
)
from partc.run.step_trace import prepare_trace_directory, write_step_trace
from partc.run.training import batched_flags, global_batches, next_batch, output_spec, step_seed
from partc.solve.memory import METRICS_RANK_FIELDS, METRICS_STAGE_FIELDS


def run_rank(plan_path: str | Path, options: TrainOptions, out: TextIO = sys.stdout,
             err: TextIO = sys.stderr) -> RunSummary | None:
    """Train the plan on this rank (see the module docstring); rank 0 returns the summary."""
    env = rank_env()
    plan = load_plan(plan_path)
    if options.expect is not None:  # plan.yaml could have changed since the launcher checked it
        plan.require_digest(options.expect)
    plan.check_stage_files()
    if options.metrics is not None:  # under torchrun nothing checked it before this rank started
        refuse_plan_artifact(options.metrics, "--metrics", plan.pinned_files())
    if options.trace is not None:
        prepare_trace_directory(options.trace)
    layout = rank_layout(plan)
    if env.world_size != layout.world_size:
        raise LaunchError(f"the plan runs on {layout.world_size} processes, torchrun started "
                          f"{env.world_size}", hint=f"start {layout.world_size} processes in all "
                          "(--nnodes x --nproc-per-node), or use `partc launch PLAN`")
    device = init_process_group(plan, env)
    try:
        # Stages run as plain TorchScript graphs with eager autograd: the optimising executor's
        # profiling runs and differentiable subgraphs are slower on these graphs, make the first
        # steps slow, and recompute differently under activation checkpointing.
        with torch.jit.optimized_execution(False), cpu_settings(device):
            run = _set_up(plan, layout, env, device, options)
            # every process group exists now, each with its socket loop
            batch_schedule_gloo_io()
            reporter = Reporter(plan, options, run.start, out, err) if env.rank == 0 else None
            try:
                if reporter is not None:
                    reporter.begin(layout, run.resume, data_source=_data_source(run.model_file))
                return _train(run, reporter)
            finally:
                if reporter is not None:
                    reporter.close()
    finally:
        dist.destroy_process_group()


def _loaded_everywhere(load: Callable[[], list[LocalStage]]) -> list[LocalStage]:
    """`load()` on every rank, agreeing on the outcome: a user error loading one rank's stages
    (a stage file that does not hold what plan.yaml lists, a checkpoint that does not fit) stops
    every rank with that rank's one line, instead of the others failing on a closed connection
    with tracebacks."""
    error: tuple[str, str] | None = None
    stages: list[LocalStage] = []
    try:
        stages = load()
    except PartcError as exc:
        error = (exc.message, exc.hint)
    errors: list[tuple[str, str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    for rank, found in enumerate(errors):
        if found is not None:
            raise LaunchError(f"rank {rank} cannot load its stages: {found[0]}", hint=found[1])
    return stages


def _set_up(plan: Plan, layout: RankLayout, env: RankEnv, device: torch.device,
            options: TrainOptions) -> RankRun:
    """Steps 2-5 of the module docstring: everything the step loop needs, on this rank."""
    rank = env.rank
    pp_group, dp_group = pipeline_groups(layout, device, rank)
    tied = tied_groups(plan, layout, rank)  # collective: every rank creates every group
    metrics = metrics_group()  # collective too
    model_file = plan.load_model_file()
    resume = resume_point(plan, options, env, device)
    stages = _loaded_everywhere(lambda: load_local_stages(plan, layout.stages_of(rank), device,
                                                          options, resume, model_file,
                                                          dp_group))
    wrap_for_pipeline(plan, stages, device, pp_group, dp_group)

    start = resume.step if resume is not None else 0
    first = any(s.spec.index == 0 for s in stages)
    last = any(s.spec.index == plan.num_stages - 1 for s in stages)
    data = global_batches(model_file, plan) if (first or last) else None
    pending = None
    if data is not None:
        for step in range(start):  # a resumed run continues with the batches it would have had
            next_batch(data, options.seed, step)
        if start < options.steps:
            pending = next_batch(data, options.seed, start)
    in_spec = pytree.treespec_loads(plan.model.input_spec) if plan.model.input_spec else None
    batched: tuple[bool, ...] = ()
    chunk_spec = None
    if first and pending is not None:
        if model_file.batches is not None:  # the values export baked in are the data's too
            # (shapes: every batch against the plan's, RankRun.next_inputs; examples made at the
            # micro-batch size, not a whole global batch more per rank)
            model_file.check_like_examples(pending[0], plan.training.global_batch_size,
                                           examples_at=plan.microbatch_size)
        # which inputs carry the batch in dim 0, from real data: a shared [1, S] input at
        # micro-batch 1 looks batched in the plan's shapes
        batched = batched_flags(flat_model_inputs(pending[0], in_spec),
                                plan.training.global_batch_size)
        chunk_spec = tuple(TensorChunkSpec(0) if b else _Replicate() for b in batched)
    loss_fn = StageLoss(model_file.loss(), output_spec(plan, model_file), device) if last \
        else None
    pipes = [s.pipe for s in stages if s.pipe is not None]
    schedule = build_schedule(plan, pipes, plan.training.shape.num_microbatches,
                              loss_fn if loss_fn is not None else no_loss, chunk_spec)
    _, replica = layout.coordinates(rank)
    return RankRun(plan=plan, options=options, device=device, rank=rank, replica=replica,
                   replicas=layout.replicas, stages=stages, tied=tied, loss_fn=loss_fn,
                   data=data, pending=pending, in_spec=in_spec, batched=batched, resume=resume,
                   schedule=schedule, model_file=model_file, metrics_group=metrics,
                   p2p=P2PTimer(device, early_receives=_early_receives(plan)))


def _early_receives(plan: Plan) -> bool:
    """Whether this run posts each step's receives at its start (P2PTimer): on gloo, with one
    stage per rank. The interleaved schedule receives activations and gradients from the same
    peer in an order of its own, which early posts would have to reproduce exactly.
    `PARTC_EARLY_RECEIVES=0` turns them off, to compare (docs/launch.md)."""
    if os.environ.get("PARTC_EARLY_RECEIVES") == "0":
        return False
    return plan.cluster.backend == "gloo" and plan.training.shape.schedule != "interleaved-1f1b"


def _data_source(model_file: ModelFile) -> str:
    return ("the model file's batches()" if model_file.batches is not None
            else "synthetic batches (the model file defines no batches())")


def _train(run: RankRun, reporter: Reporter | None) -> RunSummary | None:
    """The step loop: steps from the resume point to --steps, checkpoints on the way. Each
    step's metrics reach rank 0 while the next step runs (`_MetricsRows`): rank 0 reports a
    step at the next one's start where its rows are there by then, else once the next one has
    run, and the last after the loop."""
    options = run.options
    summary = RunSummary(resumed_from=run.start if run.resume is not None else None)
    run.p2p.install()
    metrics = _MetricsRows.allocate(run)
    reported: _Reported | None = None  # the step whose rows are in flight

    def report(rows: list[list[float]] | None) -> None:
        nonlocal reported
        if reporter is not None and reported is not None:
            assert rows is not None
            _record(summary, reporter, _step_metrics(run, rows, reported))
            if reported.traced:
                reporter.note(f"trace of step {reported.step + 1} -> {options.trace}")
        reported = None

    for step in range(run.start, options.steps):
        method = _memory_method(run, step)
        traced = options.trace is not None and step == _watched_step(run)
        if method == MEMORY_CPU_PROFILER or traced:
            # nothing of the last step's gather may run inside the probe: gloo allocates the
            # root's flat copy of the rows on its own thread
            report(metrics.collect())
        elif metrics.arrived():
            # written now rather than after this step: a step that then fails loses no line
            report(metrics.collect())
        began = synced_clock(run.device)
        previous = _step(run, step, method, metrics, traced)
        step_s = synced_clock(run.device) - began
        report(previous)
        reported = _Reported(step, step_s, method, traced)
        done = step + 1
        # known on the last stage's ranks only (their rows are posted: rank 0 waits for none)
        stop = _nonfinite_loss(run, step, metrics.row)
        if options.checkpoint_dir is not None and (
                done == options.steps
                or (options.checkpoint_every and done % options.checkpoint_every == 0)):
            report(metrics.collect())  # the step's line before its checkpoint's
            # every rank takes part, the first stage's writers maybe already writing: the
            # step's checkpoint is refused for all of them and every rank raises `stop`
            save_checkpoint(run.plan, options, done, run.stages, run.replica, run.rank,
                            stop=stop)
            if reporter is not None:
                reporter.note(f"checkpoint step {done} -> {options.checkpoint_dir}")
        elif stop is not None:
            # no rank writes a checkpoint of this step: the launcher ends them all
            raise stop
    report(metrics.collect())
    if reporter is not None:
        reporter.finish(summary)
        return summary
    return None


@dataclass(frozen=True)
class _Reported:
    """A step whose metrics rank 0 has yet to receive: what its report needs besides them."""

    step: int
    step_s: float
    memory_method: str
    traced: bool


def _watched_step(run: RankRun) -> int:
    """The step a profiler watches (CPU peak memory, --trace): the third of the run (optimizer
    state exists, and DDP rebuilt its gradient buckets in the second), else the last."""
    return min(run.start + 2, run.options.steps - 1)


def _memory_method(run: RankRun, step: int) -> str:
    """How this step's peak memory is measured: every step on CUDA (the allocator keeps the
    peak); on CPU the profiler watches one step (`_watched_step`)."""
    if run.device.type == "cuda":
        return MEMORY_CUDA
    return MEMORY_CPU_PROFILER if step == _watched_step(run) else MEMORY_NONE


class _MemoryProbe:
    """The peak memory of one step on this rank, by `method` (partc.plans.run_metrics); with
    `traced`, the step's torch.profiler trace too (one profiler serves both on CPU)."""

    def __init__(self, run: RankRun, method: str, traced: bool = False) -> None:
        self.run, self.method, self.traced = run, method, traced
        self.live = 0
        self.profiler: torch.profiler.profile | None = None
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> _MemoryProbe:
        if self.method == MEMORY_CUDA:
            torch.cuda.reset_peak_memory_stats(self.run.device)
        elif self.method == MEMORY_CPU_PROFILER:
            # every tensor alive at step start (after zero_grad: torch.profiler never reports
            # the free of memory allocated before it started, so last step's gradients would
            # count twice), pipeline receive buffers and DDP buckets included, + the
            # profiler's peak above that
            self.live = live_tensor_bytes()
        if self.traced or self.method == MEMORY_CPU_PROFILER:
            # one profiler for both: two cannot run at once
            self.profiler = self._stack.enter_context(device_profile(
                self.run.device, memory=self.method == MEMORY_CPU_PROFILER, shapes=self.traced))
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def peak_bytes(self) -> int | None:
        if self.method == MEMORY_CUDA:
            return int(torch.cuda.max_memory_allocated(self.run.device))
        if self.profiler is not None and self.method == MEMORY_CPU_PROFILER:
            return self.live + peak_above_start(self.profiler)
        return None

    def write_trace(self, step: int) -> None:
        """Write the traced step's files (partc.run.step_trace); call after the block."""
        assert self.traced and self.profiler is not None and self.run.options.trace is not None
        write_step_trace(self.profiler, self.run.options.trace, self.run.rank, step + 1,
                         [local.spec.index for local in self.run.stages], self.run.device,
                         str(self.run.plan.pinned_files()[0]))


# The per-rank row gathered onto rank 0 each step (float64): the rank's values, then a block per
# stage that the rank fills for the stages it runs. Its size is the memory model's
# (partc.solve.memory.metrics_row_bytes), which prices the buffers.
_RANK_FIELDS = METRICS_RANK_FIELDS
_HAS_LOSS, _LOSS, _P2P, _TIED, _PEAK, _BETWEEN, _P2P_CPU = range(_RANK_FIELDS)
# (CPU times: -1 on CUDA, where the host's clock does not time the device's work)
_PRESENT, _FORWARD, _BACKWARD, _OPTIMIZER, _ALLREDUCE = range(5)
_STAGE_FIELDS = METRICS_STAGE_FIELDS
_FORWARD_CPU, _BACKWARD_CPU, _OPTIMIZER_CPU = range(5, _STAGE_FIELDS)


@dataclass
class _MetricsRows:
    """The step's metrics buffers and their gather onto rank 0, over a gloo group of the run's
    processes (`group`, its own sockets and socket loop, on CUDA too: the row is the host's).

    Allocated once before the first step and reused: allocated per step, the previous step's
    were sometimes still referenced by gloo's worker thread when the next step's memory probe
    started (it runs once the main thread yields), adding 168 B to 1.5 KiB to a measured peak at
    random. The gather is asynchronous (`post`), waited (`collect`) before the row is filled
    again: waited at once, it made every process wait at every step's end for the slowest to
    report, a synchronisation of all ranks that no schedule has (3.0-3.2 ms a step on 4 gloo
    processes sharing 2 cores, docs/benchmarks.md). `row` is filled on the host; `gathered`:
    rank 0's one row per process."""

    row: torch.Tensor
    gathered: list[torch.Tensor] | None
    group: Any
    pending: dist.Work | None = None

    @classmethod
    def allocate(cls, run: RankRun) -> _MetricsRows:
        row = torch.zeros(_RANK_FIELDS + _STAGE_FIELDS * run.num_stages, dtype=torch.float64)
        gathered = ([torch.zeros_like(row) for _ in range(dist.get_world_size())]
                    if run.rank == 0 else None)
        return cls(row=row, gathered=gathered, group=run.metrics_group)

    def post(self) -> None:
        """Start gathering `row` onto rank 0; returns at once."""
        assert self.pending is None, "a metrics gather is already in flight"
        self.pending = dist.gather(self.row, gather_list=self.gathered, dst=0, group=self.group,
                                   async_op=True)

    def arrived(self) -> bool:
        """Whether a gather is in flight and done (`collect` would not wait)."""
        return self.pending is not None and self.pending.is_completed()

    def collect(self) -> list[list[float]] | None:
        """Wait for the gather in flight, if any; on rank 0 every process's row (None
        elsewhere, or when none was in flight)."""
        if self.pending is None:
            return None
        self.pending.wait()
        self.pending = None
        return [r.tolist() for r in self.gathered] if self.gathered is not None else None


def _step(run: RankRun, step: int, memory_method: str, metrics: _MetricsRows,
          traced: bool = False) -> list[list[float]] | None:
    """One training step on this rank (steps 5-6), its measurements posted to rank 0 at its
    end; returns, on rank 0, every rank's measurements of the step before (the gather in
    flight, waited before the row is filled again), None elsewhere or when there was none."""
    torch.manual_seed(step_seed(run.options.seed, step, run.rank))
    run.p2p.seconds = run.p2p.cpu_seconds = 0.0
    for local in run.stages:
        if local.optimizer is not None:
            # Under DDP the gradients are views into its buckets (gradient_as_bucket_view):
            # zeroed in place they stay so, and the non-last micro-batches' backwards (under
            # no_sync) accumulate into the buckets. Set to None, those backwards would allocate a
            # second copy of every gradient beside the buckets until the last one's all-reduce
            # (measured: +7 MiB on a 7 MiB-gradient BERT stage). Without replicas they are freed
            # between steps (the memory model prices both), as are sharded gradients.
            local.optimizer.zero_grad(set_to_none=not isinstance(local.grad_sync, GradSyncTimer))
    # The data first: the model file's generator frees the batch it held when it yields the next
    # one, a free the CPU profiler would not see (it never reports frees of memory allocated
    # before it started), so drawn inside the probe the batch counted twice.
    args, target = run.next_inputs(step)
    with _MemoryProbe(run, memory_method, traced) as memory:
        for local in run.stages:
            assert local.pipe is not None
            local.pipe.reset_times()
            if local.grad_sync is not None:
                local.grad_sync.reset()
        losses: list[torch.Tensor] | None = [] if run.loss_fn is not None else None
        # the computing thread's CPU, for what the step spends between its passes (gloo's IO
        # threads are left out, and the posts' copies measured apart: they are the link's, a
        # DDP all-reduce's its own)
        step_cpu = CPU_CLOCK()
        run.p2p.post_receives([local.pipe for local in run.stages if local.pipe is not None],
                              run.plan.training.shape.num_microbatches)
        run.schedule.step(*args, target=target, losses=losses, return_outputs=False)
        step_cpu = CPU_CLOCK() - step_cpu
        for local in run.stages:
            if isinstance(local.grad_sync, GradientSharder):
                local.grad_sync.finish()
        began = synced_clock(run.device)
        sum_tied_gradients(run.tied, run.stages)
        tied_s = synced_clock(run.device) - began if run.tied else 0.0
        for local in run.stages:
            local.optimizer_s = local.optimizer_cpu_s = 0.0
            if local.optimizer is not None:
                began, cpu = synced_clock(run.device), CPU_CLOCK()
                local.optimizer.step()
                local.optimizer_s = synced_clock(run.device) - began
                local.optimizer_cpu_s = CPU_CLOCK() - cpu
    V, M = run.num_stages, run.plan.training.shape.num_microbatches
    # long arrived: every rank posted it a step ago; returned, not reported here, so that
    # writing the line stays out of this step's time
    previous = metrics.collect()
    row = metrics.row
    row.zero_()
    if losses:
        row[_HAS_LOSS] = 1.0
        row[_LOSS] = float(torch.stack([loss.detach().float() for loss in losses]).mean())
    row[_P2P] = run.p2p.seconds
    row[_TIED] = tied_s
    # CPU between the passes, per pass of this rank: the step's CPU beyond its passes, loss and
    # p2p calls, and apart the CPU in those calls (a GPU's host runs ahead of the device: not
    # measured there)
    passes = 2 * run.plan.training.shape.num_microbatches * len(run.stages)
    row[_BETWEEN] = -1.0 if run.device.type == "cuda" else cpu_between_passes(
        step_cpu, [local.pipe for local in run.stages if local.pipe is not None],
        run.loss_fn.forward_cpu_s if run.loss_fn is not None else 0.0, run.p2p.cpu_seconds,
        passes)
    row[_P2P_CPU] = -1.0 if run.device.type == "cuda" else run.p2p.cpu_seconds / passes
    peak = memory.peak_bytes()
    row[_PEAK] = -1.0 if peak is None else float(peak)
    if traced:
        memory.write_trace(step)
    for local in run.stages:
        assert local.pipe is not None
        at = _RANK_FIELDS + _STAGE_FIELDS * local.spec.index
        row[at + _PRESENT] = 1.0
        # the last stage's forward includes the loss's, as the prediction does
        loss = run.loss_fn if local.spec.index == V - 1 else None
        loss_s, loss_cpu_s = (loss.forward_s, loss.forward_cpu_s) if loss is not None else (0, 0)
        row[at + _FORWARD] = (local.pipe.forward_s + loss_s) / M
        row[at + _BACKWARD] = local.pipe.backward_s / M
        row[at + _OPTIMIZER] = local.optimizer_s
        if run.device.type == "cuda":
            row[at + _FORWARD_CPU: at + _OPTIMIZER_CPU + 1] = -1.0
        else:
            row[at + _FORWARD_CPU] = (local.pipe.forward_cpu_s + loss_cpu_s) / M
            row[at + _BACKWARD_CPU] = local.pipe.backward_cpu_s / M
            row[at + _OPTIMIZER_CPU] = local.optimizer_cpu_s
        row[at + _ALLREDUCE] = (local.grad_sync.seconds() if local.grad_sync is not None
                                else 0.0)
    metrics.post()
    return previous


def _nonfinite_loss(run: RankRun, step: int, row: torch.Tensor) -> LaunchError | None:
    """The error that stops a run whose loss (this rank's, posted in `row`) is NaN or infinite,
    unless --allow-nonfinite-loss: before more steps spend a cluster's time on it (Megatron
    stops likewise), and before a checkpoint keeps the weights the step updated."""
    loss = float(row[_LOSS])
    if not row[_HAS_LOSS] or math.isfinite(loss) or run.options.allow_nonfinite_loss:
        return None
    replica = f" (replica {run.replica})" if run.replicas > 1 else ""
    return LaunchError(f"the loss is {loss} at step {step + 1}{replica}: the run stops there",
                       hint="lower --lr or check the data and loss_fn, then --resume from the "
                            "newest checkpoint; --allow-nonfinite-loss trains on")


def _step_metrics(run: RankRun, rows: list[list[float]], reported: _Reported) -> StepMetrics:
    """Rank 0: the step's metrics from every rank's row. Per stage, each value is the maximum
    over the ranks running it (its replicas: the slowest sets the step's pace); the legacy
    per-stage lists and the loss are means over replicas."""
    step, step_s = reported.step, reported.step_s
    V = run.num_stages
    shape = run.plan.training.shape
    with_loss = [r[_LOSS] for r in rows if r[_HAS_LOSS]]
    stages, mean_fwd, mean_bwd = [], [], []
    for k in range(V):
        at = _RANK_FIELDS + _STAGE_FIELDS * k
        mine = [r for r in rows if r[at + _PRESENT]]
        peaks = [int(r[_PEAK]) for r in mine if r[_PEAK] >= 0]
        stages.append(StageMetrics(
            index=k, pipeline_rank=run.plan.stages[k].rank,
            forward_s=max(r[at + _FORWARD] for r in mine),
            backward_s=max(r[at + _BACKWARD] for r in mine),
            p2p_s=max(r[_P2P] for r in mine),
            optimizer_s=max(r[at + _OPTIMIZER] for r in mine),
            forward_cpu_s=_cpu(r[at + _FORWARD_CPU] for r in mine),
            backward_cpu_s=_cpu(r[at + _BACKWARD_CPU] for r in mine),
            optimizer_cpu_s=_cpu(r[at + _OPTIMIZER_CPU] for r in mine),
            between_cpu_s=_cpu(r[_BETWEEN] for r in mine),
            p2p_cpu_s=_cpu(r[_P2P_CPU] for r in mine),
            ddp_allreduce_s=max(r[at + _ALLREDUCE] for r in mine),
            tied_sync_s=max(r[_TIED] for r in mine),
            peak_memory_bytes=max(peaks) if peaks else None))
        mean_fwd.append(sum(r[at + _FORWARD] for r in mine) / len(mine))
        mean_bwd.append(sum(r[at + _BACKWARD] for r in mine) / len(mine))
    samples = run.plan.training.global_batch_size
    return StepMetrics(
        step=step + 1, loss=sum(with_loss) / len(with_loss) if with_loss else 0.0,
        step_s=step_s, samples_per_s=samples / step_s if step_s > 0 else 0.0,
        stage_forward_s=tuple(mean_fwd), stage_backward_s=tuple(mean_bwd),
        stages=tuple(stages), num_microbatches=shape.num_microbatches, replicas=run.replicas,
        clock=CLOCK_CUDA if run.device.type == "cuda" else CLOCK_CPU,
        memory_method=reported.memory_method, traced=reported.traced)


def _cpu(values: Iterable[float]) -> float | None:
    """The replicas' largest CPU time, None where it was not measured (CUDA)."""
    values = list(values)
    return None if any(v < 0 for v in values) else max(values)


def _record(summary: RunSummary, reporter: Reporter, metrics: StepMetrics) -> None:
    metrics = reporter.stamp(metrics)
    step = metrics.step - 1
    summary.losses[step] = metrics.loss
    summary.step_s[step] = metrics.step_s
    summary.stage_forward_s.append(list(metrics.stage_forward_s))
    summary.stage_backward_s.append(list(metrics.stage_backward_s))
    summary.metrics.append(metrics)
    reporter.step(metrics)
