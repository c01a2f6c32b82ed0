"""The pipelining runtime's own cost per micro-batch: measured on this machine for
`partc calibrate`, as `DeviceSpec.microbatch_overhead_s`.

Every forward and backward a pipeline stage runs in `partc launch` goes through more than its
operators: torch.distributed.pipelining's stage bookkeeping (receive buffers, output checks, the
saved inputs and outputs, `stage_backward`'s gradient plumbing), partc's wrappers (precision,
contiguous outputs) and the call into the TorchScript stage. On a large stage this is noise; on a
stage of a few milliseconds it is a tenth of the time (measured on this repository's 2-core CPU:
0.1-0.35 ms per pass on 2-4 ms MLP stages).

`measure_microbatch_overhead` runs the real thing on two processes of this machine (gloo on the
CPU, each pinned to its core as launch pins its workers; NCCL on two GPUs): a two-stage
Schedule1F1B pipeline over TimedStage (partc.run.stage_runner, what launch times) of a small
TorchScript stage, with launch's p2p timing and early receives (partc.run.schedule.P2PTimer),
and takes

- inside each pass: the time TimedStage measures per forward and backward minus the stage
  module's own time for the same pass run alone;
- between the passes (on a CPU, where the runtime's host work takes the core the stages compute
  on): the computing thread's CPU time over each step beyond what its passes and loss took, per
  pass: torch's schedule loop, the step's setup (the p2p posts and waits are left out, as are
  gloo's IO threads: their CPU is the link's, priced with it; a gloo send copies its bytes on
  the posting thread, P2PTimer). A rank pays it
  between its passes, on its own core, shared with its core-mates where processes share cores
  (left out, 4-process launches ran 4-5% longer than the schedule replayed from their own
  measured passes; bench/launch_timeline.py found this CPU there, docs/benchmarks.md).

A fourth number is measured apart, in one process (`measure_cold_pass`): what a pass costs more
when it starts from caches other work evicted. Where pipeline processes share a core each pass
follows a core-mate's turn, and the code and data the runtime and the stage touch come back from
memory. On this repository's 2-core CPU a 64-wide stage of a few microseconds warm paid
0.25-0.36 ms more a forward and 0.35-0.53 ms a backward after the last-level cache was flushed,
whatever its size (one layer or sixteen), while a flush of only the core's own 1 MB cache cost
it 5-36 us: the penalty is the fetch from DRAM. The launched MLP x4 plan's middle stages (four
processes on two cores) ran 0.22-0.30 ms a forward and 0.34 ms a backward over their price, as
the same stage files did in one process beside a busy core-mate when flushed before every pass
(docs/benchmarks.md). The pipeline above cannot show it: its two small stages touch too little
to evict each other, on one core or two.

Each of the first three is taken per timed step (the step's mean over its passes) and the
median over the steps is kept, the stage module's own time re-measured before and after the
pipeline: a step pays its passes' mean, while a slower second of this shared machine falling on
a few steps is the machine's, not the runtime's (12 steps of one mean moved the value by 40-70%
between two calibrations of an idle VM, 91-181 us on five back-to-back runs). The result is the
mean of the two passes and the two stages inside, plus the mean between: the solver adds it to
every stage's forward and backward. The CPU in the p2p posts and waits is kept apart, per pass
(one tensor received or sent each here): the device's `p2p_post_cpu_s`, which the solver adds
once per tensor a pass moves (a middle stage's two).
"""
from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import torch

from partc.cost.torch_profiler import CPU_CLOCK, cpu_settings, flush_cpu_caches
from partc.errors import PartcError
from partc.hardware.calibration import CalibrationResult, RuntimeCalibration
from partc.hardware.local import free_port, spawn_measurement

WIDTH = 64  # features of the small stage's layers
MICROBATCH = 32  # samples per micro-batch
MICROBATCHES = 16  # per step
STEPS = 60  # timed steps, after two warm-up steps (each some 10 ms here)
# blocks of warm then cold pass pairs: a warm pass straight after a cold one is itself half cold
# (139 against 30 us a forward here), so each block's first warm pairs are left out
COLD_BLOCKS, COLD_BLOCK_PAIRS, WARM_SETTLE = 8, 12, 3


class OverheadError(PartcError):
    """The runtime overhead cannot be measured here (too few GPUs, a failed worker)."""


@dataclass(frozen=True)
class PipelineOverhead:
    """What `measure_microbatch_overhead` found (seconds)."""

    # the mean of forward_s and backward_s, plus the mean of between_s: what the config takes
    microbatch_overhead_s: float
    forward_s: tuple[float, float]  # per stage: runtime time per forward beyond the module's
    backward_s: tuple[float, float]  # per stage: the same for a backward
    # per stage: the computing thread's CPU time per pass between its passes, its p2p posts and
    # waits left out (0 on CUDA, where the host runs ahead of the device)
    between_s: tuple[float, float] = (0.0, 0.0)
    # per stage: the computing thread's CPU in its p2p posts and waits, per pass (each pass of
    # the two-stage pipeline has one transfer end: the device's `p2p_post_cpu_s`; 0 on CUDA)
    p2p_s: tuple[float, float] = (0.0, 0.0)

    @property
    def p2p_post_cpu_s(self) -> float:
        """The mean of `p2p_s`: the device's `p2p_post_cpu_s`."""
        return statistics.mean(self.p2p_s)

    def measurements(self) -> dict[str, float]:
        """The raw numbers, for the device config's comments."""
        return {"pipeline_forward_overhead_s": statistics.mean(self.forward_s),
                "pipeline_backward_overhead_s": statistics.mean(self.backward_s),
                "pipeline_between_passes_cpu_s": statistics.mean(self.between_s),
                "pipeline_p2p_post_cpu_s": self.p2p_post_cpu_s,
                "pipeline_boundary_bytes": float(MICROBATCH * WIDTH * 4)}


def measure_microbatch_overhead(device: str = "cpu") -> PipelineOverhead:
    """Measure the runtime's overhead per pass on `device` ("cpu" or "cuda[:N]", which needs two
    GPUs); see the module docstring. Takes a few seconds."""
    kind = "cuda" if device.startswith("cuda") else "cpu"
    if kind == "cuda" and torch.cuda.device_count() < 2:
        raise OverheadError("measuring the pipeline runtime on CUDA needs two GPUs",
                            hint="run partc calibrate on a machine with 2+ GPUs")
    found = spawn_measurement(_worker, (kind, free_port()), 2, "pipeline overhead",
                              OverheadError, "partc-overhead-")
    fwd = (found["0"]["forward_s"], found["1"]["forward_s"])
    bwd = (found["0"]["backward_s"], found["1"]["backward_s"])
    between = (found["0"]["between_s"], found["1"]["between_s"])
    p2p = (found["0"]["p2p_s"], found["1"]["p2p_s"])
    return PipelineOverhead(
        microbatch_overhead_s=statistics.mean([*fwd, *bwd]) + statistics.mean(between),
        forward_s=fwd, backward_s=bwd, between_s=between, p2p_s=p2p)


@dataclass(frozen=True)
class ColdPass:
    """What `measure_cold_pass` found: the extra seconds of a stage's forward and backward from
    evicted caches over the same pass warm."""

    forward_s: float
    backward_s: float

    @property
    def pass_s(self) -> float:
        """The mean of the two: the device's `cold_pass_s`."""
        return (self.forward_s + self.backward_s) / 2

    def measurements(self) -> dict[str, float]:
        """The raw numbers, for the device config's comments."""
        return {"cold_forward_s": self.forward_s, "cold_backward_s": self.backward_s}


def _cold_and_warm_runs() -> Iterator[tuple[bool, bool]]:
    """The order `measure_cold_pass` and `measure_cold_step` run in: blocks of warm runs then
    blocks of cold ones (flushed before), so the machine's speed that second is in both; per run
    (cold, kept). The first block is left out (the allocator, the interpreter, optimizer states
    being made), and so are each warm block's first runs, half cold after a cold block."""
    for block in range(COLD_BLOCKS + 1):
        for cold in (False, True):
            for i in range(COLD_BLOCK_PAIRS):
                yield cold, bool(block) and (cold or i >= WARM_SETTLE)


def measure_cold_pass(device: str = "cpu") -> ColdPass:
    """Measure, in this process, the extra time of a pass of the calibration's small stage
    (launch's StageRunner, the computing thread's CPU time) when the last-level cache is flushed
    before it (`flush_cpu_caches`), against the same pass warm, in alternating blocks so that the
    machine's speed that second is in both; the medians' differences (see the module docstring).
    CPU only: on a GPU the host runs ahead of the device, and a cold host start is hidden behind
    the kernels before it (0 there)."""
    from partc.run.stage_runner import StageRunner

    if not device.startswith("cpu"):
        return ColdPass(0.0, 0.0)
    cpu = torch.device("cpu")
    with torch.jit.optimized_execution(False), cpu_settings(cpu):
        runner = StageRunner(_stage_module(0).train(), cpu, bf16=False, checkpointing=False,
                             last=False)
        x = torch.randn(MICROBATCH, WIDTH, requires_grad=True)
        times: dict[bool, tuple[list[float], list[float]]] = {False: ([], []), True: ([], [])}
        for cold, kept in _cold_and_warm_runs():
            if cold:
                flush_cpu_caches()
            start = CPU_CLOCK()
            out = runner(x)
            out = out[0] if isinstance(out, tuple) else out
            mid = CPU_CLOCK()
            if cold:
                flush_cpu_caches()
            mid2 = CPU_CLOCK()
            torch.autograd.backward(out, torch.ones_like(out))
            end = CPU_CLOCK()
            x.grad = None
            if kept:
                times[cold][0].append(mid - start)
                times[cold][1].append(end - mid2)
        runner.zero_grad(set_to_none=True)
    fwd, bwd = (max(0.0, statistics.median(times[True][k]) - statistics.median(times[False][k]))
                for k in (0, 1))
    return ColdPass(forward_s=fwd, backward_s=bwd)


# The group a cold optimizer step is timed over: 20 parameters of 16K float32 elements, AdamW's
# working set 6.3 MiB, within any cache partc prices (the step's bytes term is the cache's there)
STEP_PARAMS, STEP_NUMEL = 20, 1 << 14


def measure_cold_step(device: str = "cpu") -> float:
    """Measure, in this process, the extra CPU time of an optimizer step (AdamW, as launch
    builds it) over a group within the cache when the last-level cache is flushed before it,
    against the same step warm, in alternating blocks; the medians' difference: the device's
    `step_cold_s`. launch's steps follow the backward's and the transfers' work, so they start
    cold; the step's bytes term prices each parameter's first pass from memory, and what comes
    back besides (the step's code, its temporaries' memory) is this. Measured on an AMD EPYC VM
    (bench/optimizer_stream.py --cold, docs/benchmarks.md runs BM-BN): groups within the cache
    0.5-0.7 ms slower cold. CPU only (0 on a GPU: the host's fetch hides behind the kernels)."""
    from partc.run.training import build_optimizer

    if not device.startswith("cpu"):
        return 0.0
    cpu = torch.device("cpu")
    with cpu_settings(cpu):
        params = [torch.nn.Parameter(torch.randn(STEP_NUMEL)) for _ in range(STEP_PARAMS)]
        for p in params:
            p.grad = torch.randn_like(p)
        step = build_optimizer("adamw", params)
        assert step is not None  # every parameter requires grad
        times: dict[bool, list[float]] = {False: [], True: []}
        for cold, kept in _cold_and_warm_runs():
            if cold:
                flush_cpu_caches()
            start = CPU_CLOCK()
            step.step()
            took = CPU_CLOCK() - start
            if kept:
                times[cold].append(took)
    return max(0.0, statistics.median(times[True]) - statistics.median(times[False]))


def _stage_module(seed: int) -> torch.jit.ScriptModule:
    torch.manual_seed(seed)
    module = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(),
                                 torch.nn.Linear(WIDTH, WIDTH))
    return torch.jit.trace(module, (torch.randn(MICROBATCH, WIDTH),))


def _alone_s(module: torch.nn.Module, device: torch.device, first: bool
             ) -> tuple[list[float], list[float]]:
    """The module's own forward and backward times for one micro-batch, one per run."""
    from partc.run.stage_runner import synced_clock

    x = torch.randn(MICROBATCH, WIDTH, device=device, requires_grad=not first)
    fwd, bwd = [], []
    for i in range(40):
        start = synced_clock(device)
        y = module(x)
        mid = synced_clock(device)
        y.backward(torch.ones_like(y))
        end = synced_clock(device)
        if i >= 10:
            fwd.append(mid - start)
            bwd.append(end - mid)
    module.zero_grad(set_to_none=True)
    return fwd, bwd


def _worker(rank: int, kind: str, port: int, out: str) -> None:
    """One of the two pipeline processes; rank 0 writes both ranks' overheads to `out`."""
    import torch.distributed as dist
    from torch.distributed.pipelining import Schedule1F1B

    from partc.hardware.local import batch_schedule_gloo_io, pin_to_core
    from partc.run.schedule import P2PTimer
    from partc.run.stage_runner import StageRunner, TimedStage, cpu_between_passes

    torch.set_num_threads(1)
    if kind == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        pin_to_core(rank)
        backend = "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    batch_schedule_gloo_io()  # as launch runs gloo
    try:
        with torch.jit.optimized_execution(False), cpu_settings(device):
            module = _stage_module(rank).to(device).train()
            alone_before = _alone_s(module, device, first=rank == 0)
            last = rank == 1
            runner: torch.nn.Module = module if last else StageRunner(
                module, device, bf16=False, checkpointing=False, last=False)
            shape = (MICROBATCH, WIDTH)
            pipe = TimedStage(runner, rank, 2, device,
                              input_args=(torch.empty(shape, device=device,
                                                      requires_grad=rank > 0),),
                              output_args=(torch.empty(shape, device=device,
                                                       requires_grad=True),))
            loss_cpu = [0.0]

            def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
                cpu = CPU_CLOCK()
                try:
                    return _loss(output, target)
                finally:
                    loss_cpu[0] += CPU_CLOCK() - cpu

            schedule = Schedule1F1B(pipe, MICROBATCHES, loss_fn=loss_fn)
            # launch's p2p wrappers, and on gloo its early receives (partc.run.runtime)
            p2p = P2PTimer(device, early_receives=kind == "cpu")
            p2p.install()
            batch = torch.randn(MICROBATCH * MICROBATCHES, WIDTH, device=device)
            target = torch.zeros(MICROBATCH * MICROBATCHES, device=device)
            # per pass: forward, backward, between, posts and waits
            per_step: list[tuple[float, float, float, float]] = []
            for step in range(STEPS + 2):
                pipe.reset_times()
                loss_cpu[0] = p2p.cpu_seconds = 0.0
                began = CPU_CLOCK()  # the computing thread's, as launch's metrics take it
                p2p.post_receives([pipe], MICROBATCHES)
                if rank == 0:
                    schedule.step(batch)
                else:
                    schedule.step(target=target)
                step_cpu = CPU_CLOCK() - began
                module.zero_grad(set_to_none=True)
                if step >= 2:
                    per_step.append((pipe.forward_s / MICROBATCHES,
                                     pipe.backward_s / MICROBATCHES,
                                     cpu_between_passes(step_cpu, [pipe], loss_cpu[0],
                                                        p2p.cpu_seconds, 2 * MICROBATCHES),
                                     p2p.cpu_seconds / (2 * MICROBATCHES)))
            alone_after = _alone_s(module, device, first=rank == 0)
        # the module alone before and after the steps: a slower moment on one side would
        # otherwise be read as the runtime's
        alone = [statistics.median(alone_before[i] + alone_after[i]) for i in (0, 1)]
        fwd, bwd, between, posts = (statistics.median(column)
                                    for column in zip(*per_step, strict=True))
        # the host runs ahead of a GPU: its time between passes and in the posts is hidden
        host = 1.0 if kind == "cpu" else 0.0
        mine = torch.tensor([max(0.0, fwd - alone[0]), max(0.0, bwd - alone[1]),
                             between * host, posts * host], dtype=torch.float64, device=device)
        every = [torch.zeros(4, dtype=torch.float64, device=device) for _ in range(2)]
        dist.all_gather(every, mine)
        if rank == 0:
            Path(out).write_text(json.dumps({
                str(r): {"forward_s": float(t[0]), "backward_s": float(t[1]),
                         "between_s": float(t[2]), "p2p_s": float(t[3])}
                for r, t in enumerate(every)}))
    finally:
        dist.destroy_process_group()


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return output.float().mean() + 0.0 * target.sum()


def calibrate_machine(out_dir: str | Path, device: str = "cpu", *, name: str | None = None,
                      threads: int = 1, seconds: float = 20.0, measure_link: bool = True,
                      command: str | None = None,
                      devices: Sequence[int] = ()) -> CalibrationResult:
    """`partc calibrate`: the device and link measurements (partc.hardware.calibration.calibrate)
    with the pipelining runtime's overhead measured here, where two processes (or two GPUs) can
    run a pipeline; without them (one GPU) the device config has no `microbatch_overhead_s`."""
    from partc.hardware.calibration import calibrate, check_calibration_inputs

    # bad options or an unwritable -o fail before anything is measured
    kind = check_calibration_inputs(out_dir, device, name=name, threads=threads,
                                    seconds=seconds, devices=devices)[0]
    runtime = None
    if measure_link and (kind == "cpu" or torch.cuda.device_count() >= 2):
        found = measure_microbatch_overhead(kind)
        # the cold start is a host cost: on a GPU it hides behind the kernels (not measured)
        cold = measure_cold_pass(kind) if kind == "cpu" else None
        cold_step = measure_cold_step(kind) if kind == "cpu" else None
        runtime = RuntimeCalibration(
            found.microbatch_overhead_s, None if cold is None else cold.pass_s,
            found.p2p_post_cpu_s if kind == "cpu" else None,
            {**found.measurements(), **({} if cold is None else cold.measurements())},
            step_cold_s=cold_step)
    return calibrate(out_dir, device, name=name, threads=threads, seconds=seconds,
                     measure_link=measure_link, command=command, runtime=runtime,
                     devices=devices)


__all__ = ["ColdPass", "PipelineOverhead", "OverheadError", "calibrate_machine",
           "measure_cold_pass", "measure_cold_step", "measure_microbatch_overhead"]
