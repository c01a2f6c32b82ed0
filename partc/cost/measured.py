"""The measured CostTable: `partc profile` (docs/cost-model.md, "Measured").

For each profiled micro-batch size b (default: the capture's B and 2B):

1. torch, on the target device, whole model without the profiler: forward time T_f(b) and backward
   time T_b(b) (medians), and the per-node profile (partc.cost.torch_profiler): each node's forward
   and backward share, and which nodes have a backward at all.
2. onnxruntime, same device, same program exported to ONNX: each node's forward kernel time.
3. saved-for-backward bytes per node (saved-tensor hooks).

Forward: ORT prices the nodes it has kernels for (the "onnxruntime" set M); their times are scaled
by one factor per batch size so that, together with torch's share for the nodes outside M, they add
up to T_f(b). Backward: per op kind, ratio r_k = sum(torch bwd) / sum(torch fwd) over the nodes of
that kind that have a backward; a node's backward is its forward x r_k ("torch"-priced nodes keep
their own torch backward share), scaled per batch size so that the sum is T_b(b) (this spreads
AccumulateGrad and the autograd engine's own time). Nodes without a backward get 0.
Repeated operators (the same operator at the same place of repeated blocks, on the same shapes:
partc.cost.repeats) get their group's mean forward and backward at each size, so the solver does
not cut where one node's timing noise happens to make a stage cheap. Each node's forward,
backward and saved bytes are then a `Curve` through its values at the profiled sizes.

When the model has no ONNX export (or `method="torch"`, or `auto` on a device onnxruntime has no
execution provider for, or a bf16-mixed precision, which onnxruntime cannot autocast), every node is
priced by torch's own per-node shares of T_f and T_b; the profile records which method priced which
node, and why `auto` fell back to torch (`calibration.fallback`).

Precision: every forward runs under `precision_autocast` (bf16 autocast for bf16-mixed), the way
launch runs a stage, and so do the saved-activation measurements.
"""
from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass, replace
from functools import partial
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

import torch
import torch.utils._pytree as pytree
from torch.export import ExportedProgram

from partc.cost.activations import (
    gemm_scratch_bytes,
    saved_activation_bytes,
    storage_bytes,
)
from partc.cost.neighbours import busy_neighbours, shares_core
from partc.cost.ort_profiler import (
    OrtTiming,
    ProfileError,
    TimingChoice,
    choose_provider,
    onnx_feeds,
    time_onnx,
)
from partc.cost.precision_scalars import saturate_scalars
from partc.cost.repeats import pooled, repeated_nodes
from partc.cost.speed_probe import PROBE, SpeedProbe, SpeedProbeResult
from partc.cost.table import CostSource, CostTable, Curve, NodeCost, needs_backward
from partc.cost.torch_profiler import (
    CPU_CLOCK,
    CPU_CLOCK_NAME,
    TOTALS_BUDGET_S,
    WALL_CLOCK,
    Clock,
    LossCost,
    TimedProgram,
    TorchTiming,
    buffers_restored,
    cpu_settings,
    flat_inputs,
    inputs_on,
    node_owner,
    precision_autocast,
    program_module,
    time_loss,
    time_nodes,
    time_totals,
    to_device,
    totals_program,
)
from partc.errors import ModelFileError, PartcError, summarize_exception
from partc.frontend.capture import CaptureResult, capture_graph
from partc.frontend.export import export_program
from partc.frontend.model_file import Inputs, ModelFile, inputs_to_meta, is_out_of_memory
from partc.frontend.onnx_export import OnnxExport, export_onnx
from partc.graph.opgraph import OpGraph
from partc.hardware.local import (
    cpu_model,
    cpu_vector_bytes,
    pinned_to_core,
    threads_beyond_cores,
)
from partc.options import PRECISIONS, PROFILE_METHODS, Precision, ProfileMethod
from partc.progress import Progress
from partc.version import __version__

_T = TypeVar("_T")

# How this partc measures, beyond the file format: bumped when the same options measure
# differently. A profile records it (calibration.revision), and the profile cache neither finds
# nor extends an entry of another revision: sizes measured two ways would make one curve.
# 2: busy neighbours run the plan's precision. 3: denormals flushed to zero on CPU, as launch
# computes. 4: GEMM working buffers measured. 5: repeated operators priced at their group's
# mean (partc.cost.repeats). 6: freed memory kept by the C allocator on CPU, as launch computes
# (partc.cost.torch_profiler.cpu_settings); the revision recorded in the profile. 7: the sizes'
# whole-model totals timed in rounds together (time_interleaved), an extension timing the
# entry's sizes again with its own (extend_profile). 8: the nodes that keep their own result
# recorded (CostTable.keeps_result), for the memory model's stage boundaries. 9: the machine's
# speed probed in the totals' rounds (partc.cost.speed_probe), which a calibrated config's
# reference corrects the profile by (partc.cost.speed_correction).
MEASUREMENT_REVISION = 9


@dataclass(frozen=True)
class ProfileOptions:
    """What `partc profile` measures and how."""

    device: str = "cpu"  # "cpu" | "cuda" | "cuda:N"
    batch_sizes: tuple[int, ...] = ()  # empty: the capture's B and 2B
    method: ProfileMethod = "auto"  # auto: onnxruntime when the ONNX export worked, else torch
    threads: int = 1  # intra-op threads (CPU): one per partc CPU "device"
    warmup: int = 3
    runs: int = 10
    precision: Precision = "fp32"  # bf16-mixed: forward under bf16 autocast, timed in torch
    # CPU: processes kept busy training the same model while measuring (partc.cost.neighbours):
    # the other devices of the host, which run at the same time in training
    neighbours: int = 0
    # CPU: wall seconds each size's whole-model totals are timed for (torch_profiler.time_totals;
    # they set every stage's time there). Not part of a cache entry's key, like runs and warmup.
    totals_budget_s: float = TOTALS_BUDGET_S


def check_options(options: ProfileOptions) -> None:
    """Raise a ProfileError for a method or precision partc does not know."""
    if options.method not in PROFILE_METHODS:
        raise ProfileError(f"unknown profiling method {options.method!r}",
                           hint=f"use one of {', '.join(PROFILE_METHODS)}")
    if options.precision not in PRECISIONS:
        raise ProfileError(f"unknown precision {options.precision!r}",
                           hint=f"use one of {', '.join(PRECISIONS)}")
    if not options.totals_budget_s > 0:
        raise ProfileError(f"totals_budget_s must be > 0, got {options.totals_budget_s!r}",
                           hint="the wall seconds each size's whole-model totals are timed for")


def cpu_clocked(options: ProfileOptions, device: torch.device) -> bool:
    """Whether the measurement times by CPU time (torch_profiler.CPU_CLOCK): on a CPU whose
    measuring core a busy neighbour shares (more neighbours than the other cores), where the wall
    clock would include the neighbour's turns, which the simulator shares out itself. Such a
    measurement times every node in torch."""
    return device.type == "cpu" and options.neighbours > 0 and shares_core(options.neighbours)


def timing_choice(options: ProfileOptions, device: torch.device) -> TimingChoice:
    """How forward times are measured on `device` (`choose_provider` with this onnxruntime's
    providers)."""
    import onnxruntime as ort

    return choose_provider(options.method, device.type, ort.get_available_providers(),
                           options.precision)


@contextlib.contextmanager
def intra_op_threads(device: torch.device, threads: int) -> Iterator[None]:
    """torch's intra-op threads set to `threads` while measuring on CPU, restored after, and
    the CPU settings launch computes under (`cpu_settings`)."""
    before = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(threads)
    try:
        with cpu_settings(device):
            yield
    finally:
        torch.set_num_threads(before)


def parse_device(text: str) -> torch.device:
    """A profiling device: 'cpu', 'cuda' or 'cuda:N', checked to exist here."""
    try:
        device = torch.device(text)
    except RuntimeError:
        raise ProfileError(f"unknown device {text!r}",
                           hint="use --device cpu or cuda[:N]") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ProfileError(f"device {text} requested but torch sees no CUDA device here",
                               hint="profile on the GPU machine, or use --device cpu")
        index = device.index or 0
        if index >= torch.cuda.device_count():
            raise ProfileError(f"device {text} does not exist ({torch.cuda.device_count()} GPU(s))",
                               hint=f"use cuda:0 .. cuda:{torch.cuda.device_count() - 1}")
        return torch.device("cuda", index)
    if device.type != "cpu":
        raise ProfileError(f"cannot profile on {text}", hint="use --device cpu or cuda[:N]")
    return device


def device_label(device: torch.device) -> str:
    """A human name for the profiled device, recorded in the profile."""
    if device.type == "cuda":
        return f"cuda:{device.index or 0} ({torch.cuda.get_device_name(device)})"
    return f"cpu ({cpu_model()})"


def _versions() -> dict[str, str]:
    out = {"torch": str(torch.__version__), "partc": __version__}
    for pkg in ("onnxruntime", "onnx"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "unknown"
    return dict(sorted(out.items()))


def _program_at(result: CaptureResult, b: int) -> ExportedProgram:
    cap = result.capture
    if b == cap.batch_size:
        return cap.exported
    if b == cap.scaled_batch_size and cap.scaled is not None:
        return cap.scaled
    inputs = cap.model_file.inputs(b)
    if cap.on_meta:
        inputs = inputs_to_meta(inputs)
    return export_program(cap.model, inputs, f"{cap.model_file.name} (batch size {b})")


def _onnx_at(result: CaptureResult, b: int, program: ExportedProgram,
             progress: Progress) -> OnnxExport | None:
    if b == result.capture.batch_size:
        return result.onnx
    export = export_onnx(replace(result.capture, exported=program, batch_size=b), progress)
    return export if export.status == "ok" else None


@dataclass
class _Measurement:
    batch_size: int
    torch: TorchTiming
    ort: OrtTiming | None
    saved: dict[str, int]
    loss: LossCost  # the loss function's times and saved bytes
    batch_bytes: int = 0  # one batch of batch_size samples as batches() yields it
    gemm_scratch: int = 0  # partc.cost.activations.gemm_scratch_bytes
    # what times the whole-model totals, with the other sizes' (None: the nodes' sums stand)
    totals: TimedProgram | None = None
    # nodes that keep their own result (partc.cost.activations.saved_activation_bytes)
    keeps_result: frozenset[str] = frozenset()


def _module_at(result: CaptureResult, program: ExportedProgram, b: int, device: torch.device,
               progress: Progress, weights: dict[str, torch.Tensor],
               precision: Precision) -> torch.fx.GraphModule:
    """`program` (at batch `b`) runnable on `device` under `precision` (`saturate_scalars`).
    A meta model's weights are materialised once: later sizes take `weights` (the first one's,
    filled here) where shapes allow, since every size is alive at once while the totals are
    timed (a model built on meta may be one whose weights a CPU holds once, not three
    times)."""
    cap = result.capture
    module = program_module(program)
    saturate_scalars(module, precision)  # as the stage files hold them
    if cap.on_meta and weights:
        own = module.state_dict(keep_vars=True)
        module.load_state_dict({k: v for k, v in weights.items()
                                if k in own and own[k].shape == v.shape
                                and own[k].dtype == v.dtype}, strict=False, assign=True)
    where = "materialising the model (random weights)" if cap.on_meta else "moving the model"
    with progress.step(f"{where} to {device} at batch {b}"):
        to_device(module, device)
    if cap.on_meta:
        for k, v in module.state_dict(keep_vars=True).items():
            weights.setdefault(k, v)
    return module


class MeasuringOutOfMemory(ProfileError):
    """The whole model at a measured batch size does not fit the measuring device's memory (a
    model too large for one device is what partc plans for: compile prices it by the roofline
    instead, partc.cost.plan_costs.solve_costs)."""


def _within_memory(result: CaptureResult, device: torch.device, b: int,
                   measure: Callable[[], _T]) -> _T:
    """`measure()`, with an out-of-memory error while measuring at batch `b` raised as a
    MeasuringOutOfMemory once the failed attempt's tensors are freed: outside the handler, so
    that neither the error nor its context holds the frames that hold them."""
    try:
        return measure()
    except (RuntimeError, MemoryError) as exc:
        if not is_out_of_memory(exc):
            raise
        summary = summarize_exception(exc)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    raise MeasuringOutOfMemory(
        f"measuring {result.graph.model_name} at batch {b} ran out of memory on "
        f"{device.type}: {summary}",
        hint="the whole model at that batch does not fit one device: measure smaller batch "
             "sizes (partc profile --batch-sizes), or price it without measuring "
             "(--costs analytic)")


@contextlib.contextmanager
def _program_runs(result: CaptureResult, device: torch.device) -> Iterator[None]:
    """A kernel error of the captured program on the measuring device is the model's (an
    operator this device has no kernel for), not partc's: a ProfileError. A model captured on
    meta can take a path meant for another device (HF Mixtral on meta: `histc` of integers,
    which only CUDA implements)."""
    try:
        yield
    except (RuntimeError, NotImplementedError) as exc:
        if is_out_of_memory(exc):
            raise  # the size's, not the device's kernels (_within_memory)
        on_meta = result.capture.on_meta
        raise ProfileError(
            f"the captured program does not run on {device.type}: {summarize_exception(exc)}",
            hint=(f"a model built on the meta device may take a path meant for another device: "
                  f"build it on {device.type}, or price it without measuring (--costs analytic)"
                  if on_meta else "price it without measuring (--costs analytic), or compile for "
                  "a cluster whose devices run it")) from exc


def _measure(result: CaptureResult, b: int, device: torch.device, use_ort: bool,
             options: ProfileOptions, progress: Progress,
             clock: Clock = WALL_CLOCK,
             weights: dict[str, torch.Tensor] | None = None) -> _Measurement:
    cap = result.capture
    program = _program_at(result, b)
    module = _module_at(result, program, b, device, progress, {} if weights is None else weights,
                        options.precision)
    inputs = inputs_on(cap.model_file.inputs(b), device)
    # Every training-mode forward below updates the model's own buffers (batch-norm statistics),
    # which emit saves into the stage files: without the restore a plan's weights would depend
    # on whether its profile came from the cache.
    with buffers_restored(module):
        # by CPU time where a neighbour shares this core (with --method auto, instead of
        # onnxruntime: said here, so a profile's method is never a silent choice)
        clocked = " (CPU time: a neighbour shares this core)" if clock is CPU_CLOCK else ""
        with progress.step(f"torch: saved activations, fwd/bwd per node at batch {b}{clocked}"):
            # saved bytes under the precision's autocast: bf16-mixed saves bf16 activations
            keepers: set[str] = set()
            with _program_runs(result, device):
                with precision_autocast(options.precision, device.type):
                    saved = saved_activation_bytes(module, inputs, keeps_result=keepers)
                timing = time_nodes(module, inputs, b, device, warmup=options.warmup,
                                    runs=max(3, options.runs // 2), precision=options.precision,
                                    clock=clock)
        with progress.step(f"torch: the loss function at batch {b}"):
            loss, batch_bytes = _time_loss(cap.model_file, module, inputs, b, device, options,
                                             clock)
        gemm_scratch = gemm_scratch_bytes(module, inputs, device, options.precision)
    ort_timing = None
    if use_ort:
        export = _onnx_at(result, b, program, progress)
        if export is None or export.model is None:
            progress.warn(f"no ONNX export at batch {b}: priced in torch")
        else:
            owner = node_owner(module)
            onnx_to_node = {o: owner.get(fx, fx) for o, fx in export.node_to_fx.items()}
            named: dict[str, torch.Tensor] = dict(module.state_dict(keep_vars=True))
            for fqn, names in cap.tied.items():
                for alias in names:
                    if fqn in named:
                        named.setdefault(alias, named[fqn])
            for placeholder, value in zip(
                    program.graph_signature.user_inputs,
                    flat_inputs(module, inputs), strict=False):
                named[placeholder] = value
            with progress.step(f"onnxruntime ({device.type}): forward per node at batch {b}"):
                feeds = onnx_feeds(export.model, {k: v for k, v in named.items()
                                                  if isinstance(v, torch.Tensor)})
                del named
                ort_timing = time_onnx(export.model, feeds, onnx_to_node, b, device,
                                       threads=options.threads, warmup=options.warmup,
                                       runs=options.runs)
                del feeds
    totals = totals_program(module, inputs, device)  # (its scripting puts buffers back)
    del module, inputs
    gc.collect()
    return _Measurement(batch_size=b, torch=timing, ort=ort_timing, saved=saved, loss=loss,
                        batch_bytes=batch_bytes, gemm_scratch=gemm_scratch, totals=totals,
                        keeps_result=frozenset(keepers))


def _time_totals(result: CaptureResult, measurements: list[_Measurement],
                 device: torch.device, options: ProfileOptions, progress: Progress, clock: Clock,
                 weights: dict[str, torch.Tensor],
                 retime: tuple[int, ...] = ()
                 ) -> tuple[dict[int, tuple[float, float]], SpeedProbeResult | None]:
    """Every size's whole-model totals timed together (`time_totals`: in rounds, so the sizes'
    ratios are taken in the same moments), into `measurements` in place; the sizes `retime`
    (a profile's earlier ones) in the same rounds, returned: {size: (forward, backward)}; and,
    on a CPU at one thread (the conditions `partc calibrate` measures its reference in), the
    speed probe timed in the same rounds (partc.cost.speed_probe)."""
    timed = [m for m in measurements if m.totals is not None]
    programs = [m.totals for m in timed if m.totals is not None]
    again: list[int] = []
    for b in retime:
        module = _module_at(result, _program_at(result, b), b, device, progress, weights,
                            options.precision)
        inputs = inputs_on(result.capture.model_file.inputs(b), device)
        program = totals_program(module, inputs, device)
        del module, inputs
        if program is not None:
            programs.append(program)
            again.append(b)
    if not programs:
        return {}, None
    probe = SpeedProbe(options.precision, clock) \
        if device.type == "cpu" and options.threads == 1 else None
    sizes = ", ".join(str(m.batch_size) for m in timed) + (
        f" (and {', '.join(map(str, again))} again)" if again else "")
    with progress.step(f"torch: whole-model totals at batch {sizes}, timed in turn"), \
            contextlib.ExitStack() as restored:
        for timed_module, _ in programs:  # training-mode forwards: buffers put back (_measure)
            restored.enter_context(buffers_restored(timed_module))
        totals = time_totals(programs, device, options.warmup, max(3, options.runs // 2),
                             options.precision, clock, options.totals_budget_s,
                             each_round=probe)
    for m, (fwd, bwd) in zip(timed, totals, strict=False):
        m.torch = replace(m.torch, model_forward_s=fwd, model_backward_s=bwd)
        m.totals = None
    del programs
    gc.collect()
    return (dict(zip(again, totals[len(timed):], strict=True)),
            probe.result() if probe is not None else None)


def _time_loss(model_file: ModelFile, module: torch.fx.GraphModule, inputs: Inputs, b: int,
               device: torch.device, options: ProfileOptions, clock: Clock = WALL_CLOCK
               ) -> tuple[LossCost, int]:
    """The model file's loss function timed on the program's outputs at batch b, with the
    target of its first batch of b samples (`ModelFile.data`, synthetic without batches()); and
    the bytes of that batch, inputs and target, as the model file yields it."""
    with torch.no_grad(), precision_autocast(options.precision, device.type):
        out = module(*inputs[0], **inputs[1])
    first = next((t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)), None)
    shape = tuple(first.shape) if first is not None else None
    del out
    batch, target = model_file.first_batch(b, output_shape=shape)
    batch_bytes = storage_bytes(pytree.tree_leaves((batch, target)))
    target = pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t,
                             target)
    try:
        return time_loss(module, inputs, model_file.loss(), target, device,
                         warmup=options.warmup, runs=max(3, options.runs // 2),
                         precision=options.precision, clock=clock), batch_bytes
    except Exception as exc:  # the user's loss_fn: one line, as verify reports it
        raise ModelFileError(f"loss_fn(output, target) in {model_file.path} raised "
                             f"{summarize_exception(exc)}",
                             hint="check loss_fn against the model's output and batches()' "
                                  "target (partc verify runs it too)") from exc


def profile_model(model_path: str | Path, batch_size: int, options: ProfileOptions | None = None,
                  progress: Progress | None = None,
                  check_sizes: Callable[[CaptureResult, tuple[int, ...]], None] | None = None
                  ) -> CostTable:
    """Capture the model at `batch_size` and measure its CostTable on `options.device`.
    `check_sizes(capture, sizes)` runs between the capture and the measurement (it may refuse
    sizes the device cannot hold: partc.plans.measurable_sizes.profile_within_memory)."""
    options = options or ProfileOptions()
    progress = progress or Progress()
    check_options(options)
    device = parse_device(options.device)
    # measured oversubscribed, the profile would price a device this machine cannot be
    beyond = threads_beyond_cores(options.threads) if device.type == "cpu" else None
    if beyond is not None:
        raise ProfileError(*beyond)
    # no ONNX export when torch times the forward anyway (it takes as long as a capture)
    onnx = timing_choice(options, device).provider is not None
    with intra_op_threads(device, options.threads):
        result = capture_graph(model_path, batch_size, onnx=onnx, progress=progress)
        if check_sizes is not None:
            check_sizes(result, profile_sizes(result, options))
        return measure_costs(result, device, options, progress)


def profile_sizes(result: CaptureResult, options: ProfileOptions) -> tuple[int, ...]:
    """The batch sizes a profile of this capture measures: `options.batch_sizes`, by default
    the capture's B and 2B; two or more."""
    graph = result.graph
    sizes = tuple(sorted(set(options.batch_sizes or (graph.batch_size, 2 * graph.batch_size))))
    if len(sizes) < 2:
        raise PartcError(f"profiling needs two or more batch sizes, got {list(sizes)}",
                         hint="pass --batch-sizes with at least two values, e.g. 2,4")
    return sizes


def measure_costs(result: CaptureResult, device: torch.device, options: ProfileOptions,
                  progress: Progress) -> CostTable:
    """The measured CostTable of a capture (see the module docstring for the method)."""
    sizes = profile_sizes(result, options)
    return _measure_sizes(result, device, replace(options, batch_sizes=sizes), progress)[0]


def extend_profile(part: CostTable, result: CaptureResult, device: torch.device,
                   options: ProfileOptions, progress: Progress) -> CostTable:
    """`part` (a measured profile of this capture, measured as `options` say) with the sizes of
    `options.batch_sizes` it lacks measured and merged in. Its own sizes' totals are timed
    again in the same rounds as the new ones' and its nodes at those sizes scaled to them (their
    shares kept): all of a profile's totals are then one sitting's, and the slope between an
    earlier size and the new one is not the machine's speed at two times (on this VM the MLP's
    size 64 re-timed 5-12% slower than its entry had it, minutes apart)."""
    missing = tuple(b for b in options.batch_sizes if b not in part.source.batch_sizes)
    table, retimed = _measure_sizes(result, device, replace(options, batch_sizes=missing),
                                    progress, retime=part.source.batch_sizes)
    for b, (fwd, bwd) in sorted(retimed.items()):
        was_fwd, was_bwd = part.total_forward_s(b), part.total_backward_s(b)
        part = part.scaled_at(b, fwd / was_fwd if was_fwd else 1.0,
                              bwd / was_bwd if was_bwd else 1.0)
    return part.merged(table)


def _measure_sizes(result: CaptureResult, device: torch.device, options: ProfileOptions,
                   progress: Progress, retime: tuple[int, ...] = ()
                   ) -> tuple[CostTable, dict[int, tuple[float, float]]]:
    """The measured CostTable at `options.batch_sizes`, one or more (a single size gives costs
    proportional to the micro-batch: the part of a table `CostTable.merged` adds to another);
    and the totals of the sizes `retime` timed in the same rounds (`_time_totals`)."""
    check_options(options)
    sizes = tuple(sorted(set(options.batch_sizes)))
    choice = timing_choice(options, device)
    if choice.fallback:
        progress.warn(choice.fallback)
    exported = result.onnx is not None and result.onnx.status == "ok"
    shared = cpu_clocked(options, device)
    use_ort = choice.provider is not None and exported and not shared
    if options.method == "onnxruntime" and not use_ort:
        if shared:
            raise ProfileError(
                f"with {options.neighbours} busy neighbours one shares the measuring core, and "
                "onnxruntime's times would include its turns",
                hint="use --method torch (it times the work by CPU time) or fewer --neighbours")
        raise ProfileError("the model has no ONNX export, so onnxruntime cannot profile it",
                           hint="use --method torch (or auto)")
    if choice.provider is not None and not exported and result.onnx is not None:
        progress.warn("pricing every node in torch (no ONNX export)")
    neighbours = options.neighbours if device.type == "cpu" else 0
    clock = CPU_CLOCK if shared else WALL_CLOCK
    # on a CPU this process is the node's device 0, pinned to its core as launch pins rank 0
    pinned = pinned_to_core(0, options.threads) if device.type == "cpu" \
        else contextlib.nullcontext()
    # (the neighbours start first: a child inherits its parent's pinning)
    with busy_neighbours(neighbours, result.capture.model_file.path, max(sizes),
                         options.precision, progress), pinned:
        weights: dict[str, torch.Tensor] = {}
        measurements = [
            _within_memory(result, device, b, partial(_measure, result, b, device, use_ort,
                                                       options, progress, clock, weights))
            for b in sizes]
        retimed, probe = _within_memory(result, device, max((*sizes, *retime)), partial(
            _time_totals, result, measurements, device, options, progress, clock, weights,
            retime))
        weights.clear()  # the materialised weights of a meta model, before combining
    return combine(result.graph, measurements, device, options, use_ort,
                   fallback=choice.fallback, cpu_time=clock is CPU_CLOCK,
                   speed_probe=probe), retimed


def combine(graph: OpGraph, measurements: list[_Measurement], device: torch.device,
            options: ProfileOptions, use_ort: bool, fallback: str = "",
            cpu_time: bool = False, speed_probe: SpeedProbeResult | None = None) -> CostTable:
    """Join torch and onnxruntime measurements into per-node `Curve`s; `fallback` (why `auto`
    timed in torch), `cpu_time` (timed by the CPU clock: a neighbour shared the core) and
    `speed_probe` (the machine's speed while the totals were timed) are recorded in the
    calibration."""
    kinds = {n.name: n.kind for n in graph.nodes}
    names = [n.name for n in graph.nodes]
    differentiable = set().union(*(m.torch.differentiable for m in measurements)) & set(names)
    if not differentiable:
        differentiable = needs_backward(graph)

    # Backward / forward ratio per op kind, from torch's per-node profile at every batch size.
    kind_fwd: dict[str, float] = {}
    kind_bwd: dict[str, float] = {}
    for m in measurements:
        for n in differentiable:
            f = m.torch.node_forward_s.get(n, 0.0)
            if f > 0:
                kind_fwd[kinds[n]] = kind_fwd.get(kinds[n], 0.0) + f
                kind_bwd[kinds[n]] = (kind_bwd.get(kinds[n], 0.0)
                                      + m.torch.node_backward_s.get(n, 0.0))
    ratios = {k: kind_bwd[k] / kind_fwd[k] for k in sorted(kind_fwd)}
    repeats = repeated_nodes(graph)

    per_node: dict[str, dict[str, list[tuple[float, float]]]] = {
        n: {"forward": [], "backward": [], "saved": []} for n in names}
    method: dict[str, str] = {}
    validation: dict[str, Any] = {}
    for m in measurements:
        b = float(m.batch_size)
        t = m.torch
        torch_fwd_total = sum(t.node_forward_s.get(n, 0.0) for n in names) or 1.0
        torch_fwd = {n: t.node_forward_s.get(n, 0.0) * t.model_forward_s / torch_fwd_total
                     for n in names}
        ort_nodes = set(m.ort.node_forward_s) & set(names) if m.ort is not None else set()
        fwd = dict(torch_fwd)
        if ort_nodes:
            assert m.ort is not None
            ort_total = sum(m.ort.node_forward_s[n] for n in ort_nodes)
            share = sum(torch_fwd[n] for n in ort_nodes)
            scale = share / ort_total if ort_total else 0.0
            for n in ort_nodes:
                fwd[n] = m.ort.node_forward_s[n] * scale
        raw_bwd = {}
        for n in names:
            if n not in differentiable:
                raw_bwd[n] = 0.0
            elif n in ort_nodes:
                raw_bwd[n] = fwd[n] * ratios.get(kinds[n], 1.0)
            else:
                raw_bwd[n] = t.node_backward_s.get(n, 0.0)
        raw_total = sum(raw_bwd.values()) or 1.0
        bwd = {n: v * t.model_backward_s / raw_total for n, v in raw_bwd.items()}
        # repeated operators (blocks, layers) priced alike: the noise of each one's own
        # measurement is not a reason to cut there (partc.cost.repeats)
        fwd, bwd = pooled(fwd, repeats), pooled(bwd, repeats)
        for n in names:
            per_node[n]["forward"].append((b, fwd[n]))
            per_node[n]["backward"].append((b, bwd[n]))
            per_node[n]["saved"].append((b, float(m.saved.get(n, 0))))
            if n in ort_nodes:
                method[n] = "onnxruntime"
            elif fwd[n] > 0 or bwd[n] > 0:
                method.setdefault(n, "torch")
        validation[str(m.batch_size)] = {
            "torch_forward_s": _r(t.model_forward_s),
            "torch_backward_s": _r(t.model_backward_s),
            "loss_forward_s": _r(m.loss.forward_s),
            "loss_backward_s": _r(m.loss.backward_s),
            "ort_forward_s": _r(m.ort.model_run_s) if m.ort is not None else None,
            "ort_kernels_s": _r(sum(m.ort.node_forward_s.values()) + m.ort.unmapped_s)
            if m.ort is not None else None,
        }
    nodes = {}
    for n in names:
        p = per_node[n]
        nodes[n] = NodeCost(forward=Curve.measured(p["forward"]),
                            backward=Curve.measured(p["backward"]),
                            saved=Curve.measured(p["saved"]), method=method.get(n, "none"))
    loss = NodeCost(
        forward=Curve.measured([(m.batch_size, m.loss.forward_s) for m in measurements]),
        backward=Curve.measured([(m.batch_size, m.loss.backward_s) for m in measurements]),
        saved=Curve.measured([(m.batch_size, float(m.loss.saved_bytes)) for m in measurements]),
        method="torch")
    batch_bytes = Curve.measured([(m.batch_size, float(m.batch_bytes)) for m in measurements])
    provider = next((m.ort.provider for m in measurements if m.ort is not None), "")
    source = CostSource(
        kind="measured", device=device_label(device), device_kind=device.type, provider=provider,
        precision=options.precision,
        threads=options.threads if device.type == "cpu" else 0, graph_hash=graph.content_hash(),
        model=graph.model_name, batch_sizes=tuple(m.batch_size for m in measurements),
        versions=_versions(),
        calibration={"backward_ratios": {k: _r(v) for k, v in ratios.items()},
                     "measured": validation, "warmup": options.warmup, "runs": options.runs,
                     "revision": MEASUREMENT_REVISION,
                     **({"busy_neighbours": options.neighbours}
                        if options.neighbours and device.type == "cpu" else {}),
                     **({"clock": CPU_CLOCK_NAME} if cpu_time else {}),
                     **({PROBE: speed_probe.to_dict()} if speed_probe is not None else {}),
                     **({"fallback": fallback} if fallback else {})})
    return CostTable(graph=graph, source=source, nodes=nodes, loss=loss, batch_bytes=batch_bytes,
                     gemm_scratch_bytes=max(m.gemm_scratch for m in measurements),
                     cpu_vector_bytes=cpu_vector_bytes() if device.type == "cpu" else 0,
                     keeps_result=frozenset().union(*(m.keeps_result for m in measurements)))


def _r(x: float) -> float:
    return float(f"{x:.6g}")
