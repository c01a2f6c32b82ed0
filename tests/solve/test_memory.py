"""The memory model against torch's measured peak of real training steps on CPU.

Each example model is captured, its CostTable built (saved-for-backward bytes measured with
saved-tensor hooks), and `stage_memory` for the whole model as one stage is compared with the peak
of a real training step of the captured program measured by torch.profiler (allocation events,
running sum, plus what was live before the step); then both stages of real two-process pipelines
(torch.distributed.pipelining over gloo) against their own peaks. docs/memory-model.md explains the
terms; running this file as a script prints its table of predicted vs measured peaks:

    .venv/bin/python tests/solve/test_memory.py
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

# E402: OMP_NUM_THREADS is set above, before torch (and partc, which imports it) is imported.
import pytest  # noqa: E402
import torch  # noqa: E402

from partc.cost.activations import saved_activations, storage_bytes  # noqa: E402
from partc.cost.roofline import analytic_cost_table  # noqa: E402
from partc.cost.table import CostTable, Curve  # noqa: E402
from partc.cost.torch_profiler import allocation_events  # noqa: E402
from partc.errors import MemoryConfigError  # noqa: E402
from partc.frontend.capture import CaptureResult, capture_graph  # noqa: E402
from partc.graph.opgraph import GraphOutput, OpGraph, OpNode, Param, TensorSpec  # noqa: E402
from partc.hardware.configs import ConfigError, load_device  # noqa: E402
from partc.hardware.local import cpu_vector_bytes  # noqa: E402
from partc.hardware.specs import OP_CLASSES, DeviceSpec  # noqa: E402
from partc.options import OPTIMIZERS, PRECISIONS, SCHEDULES, TrainingConfig  # noqa: E402
from partc.run.reference import measure_training_peak, peak_above_start  # noqa: E402
from partc.run.training import build_optimizer  # noqa: E402
from partc.solve.memory import (  # noqa: E402
    CPU_RNG_STATE_BYTES,
    StageMemory,
    forward_scratch,
    in_flight_microbatches,
    kernel_scratch,
    stage_boundary,
    stage_memory,
    usable_memory,
)

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
TEST_MODELS = ROOT / "tests" / "models"

# Micro-batch size per example: large enough that activations are a real share of the peak.
BATCH = {"mlp": 64, "transformer": 16, "gpt2": 8, "bert": 8, "resnet": 16}
MODELS = tuple(BATCH)
# Tolerance asserted here; docs/memory-model.md states it and the errors actually measured.
TOLERANCE = 0.05

_captures: dict[tuple[str, int], tuple[CaptureResult, CostTable]] = {}


def cpu_device() -> DeviceSpec:
    """configs/devices/cpu.yaml, or a stand-in when it is not written yet, with this machine's
    SIMD width: the memory model reads no other device number, only the table's saved bytes and
    the graph, and these tests measure this machine's kernels (an AVX2 CPU blocks a
    convolution's channels by 8, an AVX-512 one by 16)."""
    try:
        device = load_device("cpu")
    except ConfigError:
        device = DeviceSpec(name="cpu", kind="cpu", memory_bytes=2**34,
                            peak_flops={"float32": 1e11}, memory_bandwidth=1e10,
                            efficiency={c: 0.5 for c in OP_CLASSES}, bandwidth_efficiency=0.5,
                            op_overhead_s=1e-6)
    return replace(device, vector_bytes=cpu_vector_bytes())


def captured(name: str, batch: int | None = None) -> tuple[CaptureResult, CostTable]:
    """The example captured at `batch` (default: its BATCH size) and its CostTable (cached)."""
    key = (name, batch or BATCH[name])
    if key not in _captures:
        result = capture_graph(_model_path(name), key[1], onnx=False)
        table = analytic_cost_table(result.graph, cpu_device(),
                                    saved=saved_activations(result.capture))
        _captures[key] = (result, table)
    return _captures[key]


@dataclass(frozen=True)
class Comparison:
    model: str
    case: str
    predicted: StageMemory
    measured: int
    run: str = ""  # the PIPE_RUNS entry, for the real pipelines
    stage: int = 0  # the rank's stage, for the real pipelines

    @property
    def error(self) -> float:
        return (self.predicted.total - self.measured) / self.measured


def compare(name: str, case: str) -> Comparison:
    """Predicted vs measured peak of the whole model as one stage. Cases: '<optimizer>' (M=1),
    'gpipe-3' (3 micro-batches, AdamW), 'checkpoint-3' (the same with checkpointing)."""
    result, table = captured(name)
    m = BATCH[name]
    optimizer, count, ckpt = {"gpipe-3": ("adamw", 3, False),
                              "checkpoint-3": ("adamw", 3, True)}.get(case, (case, 1, False))
    config = TrainingConfig(optimizer=optimizer, schedule="gpipe", activation_checkpointing=ckpt)
    predicted = stage_memory(table, [n.name for n in result.graph.nodes], microbatch_size=m,
                             num_microbatches=count, stage_index=0, num_stages=1, config=config)
    return Comparison(name, case, predicted,
                      measure_training_peak(result.capture, m, count, optimizer, ckpt))


# ---- (a) one stage, one micro-batch; (b) GPipe growth; (c) checkpointing -------------------------
@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("case", ["adamw", "sgd", "gpipe-3", "checkpoint-3"])
def test_whole_model_peak_matches_torch(name: str, case: str) -> None:
    c = compare(name, case)
    assert abs(c.error) <= TOLERANCE, (
        f"{name} {case}: predicted {c.predicted.total / 1e6:.2f} MB, measured "
        f"{c.measured / 1e6:.2f} MB ({c.error:+.1%}); terms {c.predicted.to_dict()}")


def test_gpipe_activations_grow_with_micro_batches() -> None:
    result, table = captured("gpt2")
    nodes = [n.name for n in result.graph.nodes]
    config = TrainingConfig(schedule="gpipe")
    one, three = (stage_memory(table, nodes, microbatch_size=8, num_microbatches=k, stage_index=0,
                               num_stages=1, config=config) for k in (1, 3))
    assert three.activations == pytest.approx(3 * one.activations, rel=1e-6)
    assert three.parameters == one.parameters and three.optimizer_state == one.optimizer_state
    ckpt = stage_memory(table, nodes, microbatch_size=8, num_microbatches=3, stage_index=0,
                        num_stages=1, config=TrainingConfig(schedule="gpipe",
                                                            activation_checkpointing=True))
    # Checkpointing keeps only the inputs (and the loss's tensors) per micro-batch and recomputes
    # one micro-batch's activations at a time (less the token ids: the input batch holds them),
    # remaking the outputs nothing in the stage saves (the logits) beside the kept ones.
    ids = table.tensor_bytes(result.graph.inputs[0].name, 8)
    logits = sum(table.tensor_bytes(o.tensor, 8) for o in result.graph.outputs)
    assert logits > 0
    assert ckpt.recompute == pytest.approx(table.sum_saved_bytes(nodes, 8) - ids + logits, abs=1)
    assert ckpt.activations + ckpt.recompute < three.activations / 2


def test_the_last_stage_keeps_what_the_loss_function_saves() -> None:
    # GPipe keeps the loss's saved tensors of every micro-batch awaiting its backward on the last
    # stage: the table's loss.saved (measured on the model file's loss function; analytic, one
    # fp32 copy of the logits), nothing on the others.
    result, table = captured("gpt2")
    nodes = [n.name for n in result.graph.nodes]
    logits = sum(table.tensor_bytes(o.tensor, 8) for o in result.graph.outputs)
    assert table.loss.saved.at(8) == pytest.approx(logits)
    # GPT-2's loss_fn reshapes the target slice seq[:, 1:]: nll_loss keeps that copy too
    measured = replace(table, loss=replace(table.loss, saved=Curve.line(4.0, (logits + 1024) / 8)))
    config = TrainingConfig(schedule="gpipe")
    for index, stage in enumerate((nodes[:len(nodes) // 2], nodes[len(nodes) // 2:])):
        analytic, real = (stage_memory(t, stage, microbatch_size=8, num_microbatches=3,
                                       stage_index=index, num_stages=2, config=config)
                          for t in (table, measured))
        grown = 3 * (1024 + 4) if index == 1 else 0
        assert real.activations - analytic.activations == pytest.approx(grown, abs=3)


def test_bf16_saved_bytes_match_saved_tensors_under_autocast() -> None:
    """The roofline's bf16-mixed saved bytes (its fp32 count on meta, floating ones halved, the
    weight copies autocast keeps added) vs the saved tensors of the real float32 model run under
    bf16 autocast, as launch runs a stage (models whose CPU kernels keep bf16; see docs for
    attention on CPU)."""
    for name in ("mlp", "transformer", "resnet"):
        result, _ = captured(name)
        table = analytic_cost_table(result.graph, cpu_device(), precision="bf16-mixed",
                                    saved=saved_activations(result.capture))
        model = result.capture.model_file.build().train()
        args, kwargs = result.capture.model_file.inputs(BATCH[name])
        state = {t.untyped_storage()._cdata for t in [*model.parameters(), *model.buffers()]}
        seen: dict[int, torch.Tensor] = {}

        def pack(t: torch.Tensor, state: set[int] = state,
                 seen: dict[int, torch.Tensor] = seen) -> torch.Tensor:
            key = t.untyped_storage()._cdata
            if key not in state:
                seen.setdefault(key, t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                torch.autocast("cpu", dtype=torch.bfloat16):
            model(*args, **kwargs)
        measured = sum(t.untyped_storage().nbytes() for t in seen.values())
        predicted = table.sum_saved_bytes([n.name for n in result.graph.nodes], BATCH[name])
        assert predicted == pytest.approx(measured, rel=0.02), name


# ---- real pipelines of 2 and 3 stages (torch.distributed.pipelining, gloo) -----------------------
PIPE_MICROBATCHES = 4
# run -> (model, micro-batch size, where stage 1 begins: a module path for torch's own pipeline()
# split, or the OpGraph node indices where stages 1, 2, ... begin for a hand-made split of the
# MLP's layers, checkpointing)
PIPE_RUNS: dict[str, tuple[str, int, str, bool]] = {
    "mlp": ("mlp", 512, "6", False),
    "mlp-checkpointed": ("mlp", 512, "6", True),
    "transformer": ("transformer", 16, "blocks.2", False),
    # cut inside a block, before the attention's output projection: stage 1 receives the
    # attention's output and the residual stream
    "transformer-mid-block": ("transformer", 16, "blocks.2.attn.proj", False),
    # cut between the query and key projections of a dropout-free attention: stage 1 receives
    # the query, and the CPU's flash kernel keeps that buffer itself (the math path, under
    # dropout, keeps a scaled copy)
    "attention-after-query": ("split_attention", 16, "blocks.1.attn.k", False),
    # the middle stage ends with a math-path attention (dropout on its probabilities) and sends
    # its output: its peak is in a forward, the attention's inputs and output beside what it keeps
    "attention-ends-stage": ("dropout_attention", 16, "blocks.1,blocks.2.attn.proj", False),
    "mlp-grads-freed": ("mlp", 64, "6", False),
    "mlp-grads-freed-m2": ("mlp", 64, "6", False),
    "mlp-3": ("mlp", 256, "4,8", False),
    "mlp-3-grads-freed-m3": ("mlp", 64, "4,8", False),
}
# runs (and their stages) the model holds to 1 KiB under both schedules (every GPipe last stage
# is 12 B under). A cut inside the attention block, between the attention and its output
# projection, once missed a micro-batch of the attention's output on each side (+262,144 B on
# stage 0 under 1F1B and -1,048,588 B on stage 1 under GPipe: the fused kernel keeps its output,
# and the projection's input is a view of it, counted on the attention). A cut between the query
# and key projections counted a copy of the query that the flash kernel never makes (stage 1
# +262,144 B under 1F1B, +1,048,564 B under GPipe). Every first stage of the transformers was one
# or two residual-stream gradients over (an add's backward hands its operands the incoming
# gradient itself, a receive buffer until the last local use's gradient is summed in), which
# pipeline()'s unused copy of the tied weight (512,000 B, `_stage_parameters`) hid.
EXACT_RUNS = {"transformer": (0, 1), "transformer-mid-block": (0, 1),
              "attention-ends-stage": (0, 1, 2),
              "attention-after-query": (0, 1), "mlp": (0, 1), "mlp-3": (0, 1, 2),
              "mlp-3-grads-freed-m3": (0, 1), "mlp-grads-freed": (0,), "mlp-checkpointed": (0,)}
# runs whose optimizer frees the gradients between steps (launch's zero_grad(set_to_none=True)
# without a DDP bucket): under GPipe, stage 1's second backward holds all the gradients and the
# input gradient the first one sent, its peak there
GRADS_FREED = {"mlp-grads-freed", "mlp-grads-freed-m2", "mlp-3-grads-freed-m3"}
# runs with another micro-batch count than PIPE_MICROBATCHES: M = S, every micro-batch in flight
# on stage 0 under 1F1B (its backwards run back to back, as GPipe's: partc.solve.memory's
# M <= in-flight case). torch's Schedule1F1B refuses M < S, so that case is stage 0's alone.
RUN_MICROBATCHES = {"mlp-grads-freed-m2": 2, "mlp-3-grads-freed-m3": 3}


def _num_stages(run: str) -> int:
    split = PIPE_RUNS[run][2]
    return len(split.split(",")) + 1


def _bounds(split: str, total: int) -> list[int]:
    """Where each stage of a hand-made MLP split begins and the last ends (node indices)."""
    return [0, *(int(c) for c in split.split(",")), total]


def _microbatches(run: str) -> int:
    return RUN_MICROBATCHES.get(run, PIPE_MICROBATCHES)


class _Checkpointed(torch.nn.Module):
    """A stage module whose forward runs under torch.utils.checkpoint (non-reentrant)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=False)


def _pipeline_stage(run: str, rank: int) -> tuple[Any, Any, Any, Any]:
    """(PipelineStage, full-batch inputs, targets, loss_fn) of one rank of a PIPE_RUNS run."""
    from torch.distributed.pipelining import PipelineStage, SplitPoint, pipeline

    name, m, split, checkpointing = PIPE_RUNS[run]
    model_file = _model_file(name)
    model = model_file.build()
    gen = torch.Generator().manual_seed(0)
    count = m * _microbatches(run)
    if name == "mlp":
        # The OpGraph's nodes are the layers' Linear and ReLU in turn, then the head: a split
        # at node indices ("6": the first three Linear+ReLU layers on stage 0, the rest on 1)
        mods = [mod for layer in model.layers for mod in (layer, torch.nn.ReLU())] + [model.head]
        bounds = _bounds(split, len(mods))
        part: torch.nn.Module = torch.nn.Sequential(*mods[bounds[rank]:bounds[rank + 1]])
        if checkpointing:
            part = _Checkpointed(part)
        stage = PipelineStage(part, rank, len(bounds) - 1, torch.device("cpu"))
        x = torch.randn(count, model.layers[0].in_features, generator=gen)
        y = torch.randint(0, model.head.out_features, (count,), generator=gen)
        return stage, x, y, torch.nn.functional.cross_entropy
    (ids,), _ = model_file.inputs(count)
    y = torch.randint(0, int(ids.max()) + 1, ids.shape, generator=gen)
    pipe = pipeline(model, mb_args=(ids[:m],),
                    split_spec={path: SplitPoint.BEGINNING for path in split.split(",")})
    return pipe.build_stage(rank, torch.device("cpu")), ids, y, model_file.loss()


def _model_file(name: str) -> Any:
    """The example's loaded model file."""
    from partc.frontend.model_file import load_model_file

    return load_model_file(_model_path(name))


def _model_path(name: str) -> Path:
    """An example's model file, or a test model's (tests/models) where no example has the name."""
    example = EXAMPLES / f"{name}.py"
    return example if example.exists() else TEST_MODELS / f"{name}.py"


def _stage_parameters(submod: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters a stage module computes with. pipeline()'s stage of a model with a tied
    weight also carries the unused module that owns the tie's other name (the transformer's
    first stage has `head`, with its own copy of the embedding: 512,000 B never read), which
    partc's stages do not hold; counted, it put every such first stage that much above what
    partc runs."""
    if not isinstance(submod, torch.fx.GraphModule):
        return list(submod.parameters())
    found: dict[int, torch.nn.Parameter] = {}
    for node in submod.graph.nodes:
        if node.op == "call_module":
            for p in submod.get_submodule(node.target).parameters():
                found.setdefault(id(p), p)
        elif node.op == "get_attr":
            owner, _, name = node.target.rpartition(".")
            attr = getattr(submod.get_submodule(owner), name)
            if isinstance(attr, torch.nn.Parameter):
                found.setdefault(id(attr), attr)
    return list(found.values())


def _pipeline_rank(rank: int, init_file: str, world: int) -> None:
    """One rank of each `world`-stage pipeline of PIPE_RUNS under Schedule1F1B and ScheduleGPipe
    (AdamW): prints each run's peak bytes on this rank, measured over two training steps from an
    empty start (the runtime allocates its buffers lazily in the first)."""
    import warnings

    import torch.distributed as dist
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    last = rank == world - 1
    for run in (r for r in PIPE_RUNS if _num_stages(r) == world):
        for schedule_name, schedule_class in (("1f1b", Schedule1F1B), ("gpipe", ScheduleGPipe)):
            stage, x, y, loss_fn = _pipeline_stage(run, rank)
            schedule = schedule_class(stage, n_microbatches=_microbatches(run), loss_fn=loss_fn)
            params = _stage_parameters(stage.submod)
            opt = build_optimizer("adamw", params)
            live = storage_bytes([*params, *stage.submod.buffers(), x if rank == 0 else None,
                                   y if last else None])

            def step(schedule: Any = schedule, x: Any = x, y: Any = y, opt: Any = opt,
                     freed: bool = run in GRADS_FREED) -> None:
                if rank == 0:
                    schedule.step(x)
                elif last:
                    schedule.step(target=y, return_outputs=False)
                else:
                    schedule.step()
                opt.step()
                opt.zero_grad(set_to_none=freed)

            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                        profile_memory=True) as prof:
                step()
                step()
            # the last rank's targets: step data its process holds (host_data, as launch's)
            held = storage_bytes([y]) if last else 0
            print(f"PEAK {run} {schedule_name} {rank} {live + peak_above_start(prof)} {held}",
                  flush=True)
            del stage, schedule, opt, params, prof, step  # step's defaults hold schedule, opt
    dist.destroy_process_group()


def run_pipeline(directory: Path, world: int = 2) -> list[Comparison]:
    """Run `_pipeline_rank` on `world` processes (the PIPE_RUNS of that many stages) and compare
    each rank's peak with stage_memory."""
    import subprocess

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    init = directory / f"pipeline-init-{world}"
    procs = [subprocess.Popen([sys.executable, __file__, "pipeline-rank", str(rank), str(init),
                               str(world)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for rank in range(world)]
    measured: dict[tuple[str, str, int], tuple[int, int]] = {}
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-2000:]
        for line in out.splitlines():
            if line.startswith("PEAK "):
                _, name, schedule, rank, peak, held = line.split()
                measured[(name, schedule, int(rank))] = int(peak), int(held)
    comparisons = []
    for (run, schedule, rank), (peak, held) in sorted(measured.items()):
        name, m, split, checkpointing = PIPE_RUNS[run]
        result, table = captured(name, m)
        graph = result.graph
        names = [n.name for n in graph.nodes]
        bounds = _bounds(split, len(names)) if split[0].isdigit() else \
            [0, *(next(i for i, n in enumerate(graph.nodes) if n.module.startswith(path))
                  for path in split.split(",")), len(names)]
        predicted = stage_memory(table, names[bounds[rank]:bounds[rank + 1]],
                                 microbatch_size=m, num_microbatches=_microbatches(run),
                                 stage_index=rank, num_stages=world, host_data=held,
                                 gradients_resident=run not in GRADS_FREED,
                                 config=TrainingConfig(
                                     schedule=schedule, activation_checkpointing=checkpointing))
        cut = "" if split[0].isdigit() else f", cut before {split}"
        case = f"{schedule}{', checkpointing' if checkpointing else ''}" \
               f"{', gradients freed' if run in GRADS_FREED else ''}{cut}, stage {rank} of " \
               f"{world}, M={_microbatches(run)}"
        comparisons.append(Comparison(name, case, predicted, peak, run, rank))
    return comparisons


def test_two_stage_pipeline_peaks_match_torch(tmp_path: Path) -> None:
    """Both ranks of a real 2-stage pipeline, under 1F1B and GPipe: this checks the communication
    term (torch's preallocated receive/gradient buffers, held sends) against the runtime."""
    _check_pipeline(run_pipeline(tmp_path), world=2)


@pytest.mark.slow  # default run under 15 min; `make test-slow` runs it
def test_three_stage_pipeline_peaks_match_torch(tmp_path: Path) -> None:
    """Every rank of real 3-stage pipelines: the middle stage receives activations and sends
    them, and receives gradients and sends them (its communication term's every part), at M = 4
    and at M = S = 3 with the gradients freed."""
    _check_pipeline(run_pipeline(tmp_path, world=3), world=3)


def _check_pipeline(comparisons: list[Comparison], world: int) -> None:
    runs = [r for r in PIPE_RUNS if _num_stages(r) == world]
    assert runs and len(comparisons) == 2 * world * len(runs)
    for c in comparisons:
        assert abs(c.error) <= TOLERANCE, (c.case, c.predicted.to_dict(), c.measured, c.error)
        if c.stage in EXACT_RUNS.get(c.run, ()):
            assert abs(c.predicted.total - c.measured) <= 1 << 10, (c.run, c.case, c.measured,
                                                                    c.predicted.to_dict())
        if "gradients freed" in c.case:  # exact enough to be never below
            assert c.predicted.total >= c.measured, (c.case, c.predicted.to_dict(), c.measured)


# ---- static terms --------------------------------------------------------------------------------
def test_parameter_terms_count_tied_weights_once_and_follow_precision() -> None:
    result, table = captured("transformer")
    graph = result.graph
    nodes = [n.name for n in graph.nodes]
    assert graph.tied_parameters  # tok.weight is head.weight
    elements = graph.num_parameters
    kw: dict[str, Any] = dict(microbatch_size=4, num_microbatches=1, stage_index=0, num_stages=1)
    fp32 = stage_memory(table, nodes, config=TrainingConfig(optimizer="adamw"), **kw)
    assert fp32.parameters == table.param_bytes(nodes) + table.buffer_bytes(nodes)
    assert fp32.gradients == 4 * elements
    # Adam's two moments per element, and its `step` counter (a float32 scalar) per tensor
    tensors = sum(1 for p in graph.params if p.kind == "parameter" and p.trainable)
    assert fp32.optimizer_state == 8 * elements + 4 * tensors
    for optimizer, per_element, per_tensor in (("sgd", 0, 0), ("sgd-momentum", 4, 0),
                                                ("adam", 8, 4)):
        got = stage_memory(table, nodes, config=TrainingConfig(optimizer=optimizer), **kw)
        assert got.optimizer_state == per_element * elements + per_tensor * tensors
    bf16_table = analytic_cost_table(graph, cpu_device(), precision="bf16-mixed",
                                     saved=saved_activations(result.capture))
    bf16 = stage_memory(bf16_table, nodes, config=TrainingConfig(precision="bf16-mixed"), **kw)
    # as launch runs it (torch autocast): float32 weights, gradients and Adam's two states
    assert (bf16.parameters, bf16.gradients, bf16.optimizer_state) == \
        (4 * elements, 4 * elements, 8 * elements + 4 * tensors)
    # bf16 activations, plus a bf16 copy of each matrix operator's weight: at this small batch
    # the copies are most of it
    copies = 2 * sum(p.numel for p in graph.params if p.kind == "parameter")
    assert 0.5 * fp32.activations < bf16.activations < fp32.activations
    assert bf16.activations > copies * 0.9


# ---- (d) schedules, boundaries, validation -------------------------------------------------------
def test_in_flight_counts_of_gpipe_and_1f1b() -> None:
    assert [in_flight_microbatches("gpipe", i, 4, 8) for i in range(4)] == [8, 8, 8, 8]
    assert [in_flight_microbatches("1f1b", i, 4, 8) for i in range(4)] == [4, 3, 2, 1]
    assert [in_flight_microbatches("1f1b", i, 4, 2) for i in range(4)] == [2, 2, 2, 1]


def test_interleaved_in_flight_matches_torch_schedule() -> None:
    """Peak of (forwards - backwards) over the action order torch's own ScheduleInterleaved1F1B
    computes for each rank (its order needs no process group)."""
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, _ComputationType

    backward = {_ComputationType.FULL_BACKWARD, _ComputationType.BACKWARD_INPUT}
    for ranks, chunks, count in [(2, 2, 4), (4, 2, 8), (4, 3, 8), (4, 2, 16), (3, 2, 6),
                                 (4, 4, 4), (8, 2, 8), (2, 1, 4)]:
        schedule = object.__new__(ScheduleInterleaved1F1B)
        schedule.pp_group_size, schedule.n_local_stages = ranks, chunks
        schedule._n_microbatches = count
        schedule.number_of_rounds = max(1, count // ranks)
        schedule.microbatches_per_round = count // schedule.number_of_rounds
        for rank in range(ranks):
            live = peak = 0
            for action in schedule._calculate_single_rank_operations(rank):
                if action is None:
                    continue
                live += 1 if action.computation_type == _ComputationType.FORWARD else \
                    -1 if action.computation_type in backward else 0
                peak = max(peak, live)
            assert in_flight_microbatches("interleaved-1f1b", rank, ranks, count, chunks) == peak, \
                (ranks, chunks, count, rank)


def _two_branch_graph(check: bool = False, join: str = "add") -> OpGraph:
    """x -> a = linear(x) -> {b = relu(a), c = linear(a)} -> d = join(b, c) -> out; with `check`,
    a metadata assertion on a at the end."""
    def t(name: str) -> TensorSpec:
        return TensorSpec(name, (4, 8), "float32", 0)

    def node(name: str, kind: str, inputs: tuple[str, ...], params: tuple[str, ...] = ()) -> OpNode:
        return OpNode(name=name, target=f"aten.{kind}.default", kind=kind, module="",
                      module_type="", inputs=inputs, params=params, outputs=(t(name),), flops=0,
                      flops_per_sample=0, bytes_read=0, bytes_written=0, is_view=False)

    return OpGraph(
        model_name="two_branch", batch_size=4, on_meta=False, inputs=(t("x"),),
        outputs=(GraphOutput("d", "<output>"),),
        params=(Param("w1", (8, 8), "float32", "parameter", True),
                Param("w2", (8, 8), "float32", "parameter", True)),
        nodes=(node("a", "linear", ("x",), ("w1",)), node("b", "relu", ("a",)),
               node("c", "linear", ("a",), ("w2",)), node("d", join, ("b", "c")))
        + ((replace(node("chk", "_assert_tensor_metadata", ("a",)), outputs=()),) if check
           else ()))


def test_stage_boundary_on_a_two_branch_graph() -> None:
    graph = _two_branch_graph()
    assert stage_boundary(graph, {"a", "b"}) == (["x"], ["a", "b"])
    assert stage_boundary(graph, {"c", "d"}) == (["a", "b"], ["d"])
    assert stage_boundary(graph, {"a", "b", "c", "d"}) == (["x"], ["d"])
    assert stage_boundary(graph, {"b", "c"}) == (["a"], ["b", "c"])
    with pytest.raises(MemoryConfigError, match="does not have"):
        stage_boundary(graph, {"a", "zz"})
    # A metadata check elsewhere does not make a tensor cross stages.
    checked = _two_branch_graph(check=True)
    assert stage_boundary(checked, {"a", "b", "c", "d"}) == (["x"], ["d"])
    assert stage_boundary(checked, {"chk"}) == ([], [])


def test_cut_sends_what_the_next_stage_receives() -> None:
    result, _ = captured("resnet")
    graph = result.graph
    names = [n.name for n in graph.nodes]
    first, second = names[: len(names) // 2], names[len(names) // 2:]
    _, sends = stage_boundary(graph, first)
    receives, _ = stage_boundary(graph, second)
    graph_inputs = {t.name for t in graph.inputs}
    assert sends and set(sends) == {t for t in receives if t not in graph_inputs}


def test_communication_of_a_middle_stage() -> None:
    """Receive and output-gradient buffers for every micro-batch (torch preallocates them), sent
    outputs of the in-flight micro-batches unless the stage saves them anyway, and what
    Schedule1F1B's send works keep referenced in the steady state."""
    graph = _two_branch_graph()
    from partc.cost.table import Curve, NodeCost

    zero = Curve.line(0.0, 0.0)
    table = CostTable(graph=graph, source=analytic_cost_table(graph, cpu_device()).source,
                      nodes={n.name: NodeCost(zero, zero, Curve.line(0.0, 32.0), "analytic")
                             for n in graph.nodes})
    tensor = 4 * 8 * 4  # every tensor is [4, 8] float32 at m=4
    kw: dict[str, Any] = dict(microbatch_size=4, stage_index=1, num_stages=3,
                              config=TrainingConfig(schedule="1f1b"))
    # Stage {b, c} receives a, sends b (relu: saved by itself) and c (linear: not saved here).
    got = stage_memory(table, ["b", "c"], num_microbatches=6, **kw)
    in_flight = 2  # stage 1 of 3 under 1F1B
    buffers = 6 * (tensor + 2 * tensor)  # a's receive buffers, b's and c's gradient buffers
    held = in_flight * tensor  # c's outputs; b's are among the saved activations
    steady = tensor + 2 * tensor  # a's gradient being sent; the kept warm-up send of b and c
    assert got.communication == buffers + held + steady
    # Each node saves 128 bytes per micro-batch; c's is its input a, which is a receive buffer.
    assert got.activations == in_flight * (2 * 32 * 4 - tensor)
    # With no forward after a backward (M = in-flight), the steady-state terms vanish.
    short = stage_memory(table, ["b", "c"], num_microbatches=2, **kw)
    assert short.communication == 2 * (tensor + 2 * tensor) + held


def _uniform_table(graph: OpGraph) -> CostTable:
    """Every node saves 32 bytes per sample: only the graph's shapes matter. The loss is the
    roofline's (it keeps one fp32 copy of the outputs)."""
    from partc.cost.table import Curve, NodeCost

    zero = Curve.line(0.0, 0.0)
    analytic = analytic_cost_table(graph, cpu_device())
    return CostTable(graph=graph, source=analytic.source, loss=analytic.loss,
                     nodes={n.name: NodeCost(zero, zero, Curve.line(0.0, 32.0), "analytic")
                            for n in graph.nodes})


def test_relayed_tensors_hold_receive_and_gradient_buffers() -> None:
    """A stage that passes a tensor on from an earlier stage to a later one holds a receive buffer
    and a gradient-receive buffer per micro-batch for it (a shared receive buffer when it reads
    the tensor itself), and sends its gradient back."""
    graph = _two_branch_graph()
    table = _uniform_table(graph)
    tensor = 4 * 8 * 4
    kw: dict[str, Any] = dict(microbatch_size=4, stage_index=1, num_stages=3,
                              num_microbatches=6, config=TrainingConfig(schedule="1f1b"))
    plain = stage_memory(table, ["b"], **kw)
    # b reads a; a is relayed on to the stage of c: a's receive buffer is shared, its gradient's
    # is not, and the gradient sent back is the one formed anyway.
    assert stage_memory(table, ["b"], relayed=["a"], **kw).communication \
        == plain.communication + 6 * tensor
    # x is relayed without being read here: its buffers and nothing else (no gradient: data).
    assert stage_memory(table, ["b"], relayed=["x"], **kw).communication \
        == plain.communication + 6 * tensor
    # relayed twice (two virtual stages of one rank): counted twice
    assert stage_memory(table, ["b"], relayed=["x", "x"], **kw).communication \
        == plain.communication + 12 * tensor


def test_exact_memory_counts_a_relayed_skip_connection() -> None:
    """A long skip cut into three stages: the middle stage's memory includes the relay (the
    emitted plan relays it there: tests/emit/test_compile.py)."""
    from partc.hardware.configs import load_cluster
    from partc.solve.coarsen import coarsen
    from partc.solve.stage_problem import PipelineShape, StageProblem

    result = capture_graph(ROOT / "tests" / "models" / "long_skip.py", 4, onnx=False)
    table = analytic_cost_table(result.graph, cpu_device(), saved=saved_activations(result.capture))
    blocks = coarsen(table, 64)
    problem = StageProblem.build(blocks, table, load_cluster("cpu-4"), TrainingConfig(),
                                 PipelineShape(stages=3, replicas=1, num_microbatches=4,
                                               microbatch_size=4))
    n = problem.num_blocks
    assignment = [0] * (n // 3) + [1] * (n // 3) + [2] * (n - 2 * (n // 3))
    assert problem.valid(assignment)
    relayed = [t for t in problem.tensors
               if 1 in problem.crossings(assignment, t)[:-1]]
    assert relayed, "the skip connection crosses the middle stage"
    exact = problem.exact_memory(assignment)
    nodes = [nm for b, k in enumerate(assignment) if k == 1 for nm in blocks.blocks[b].nodes]
    without = stage_memory(table, nodes, microbatch_size=4, num_microbatches=4, stage_index=1,
                           num_stages=3, config=problem.training)
    assert exact[1].communication > without.communication
    assert exact[1].total > without.total


@pytest.mark.parametrize("join", ["mul", "add"])
def test_gradient_of_a_fork_lives_through_the_other_branch(join: str) -> None:
    """x -> a -> {b = relu(a), c = linear(a)} -> d = join(b, c): a's gradient is summed from c's
    backward to a's, and b's gradient (from d's backward) stays alive through c's backward. A
    product's backward makes a fresh gradient for each operand; a sum's hands both its own
    incoming gradient (AddBackward0 returns `grad` twice), so b's and c's are one tensor."""
    graph = _two_branch_graph(join=join)
    table = _uniform_table(graph)
    got = stage_memory(table, ["a", "b", "c", "d"], microbatch_size=4, stage_index=0,
                       num_stages=1, num_microbatches=1, config=TrainingConfig(optimizer="sgd"))
    tensor = 4 * 8 * 4  # every tensor, and every node's saved bytes (the uniform table)
    weight = 8 * 8 * 4
    # The peak is c's backward: its output's and input's gradients, w2's, and b's gradient,
    # formed by d's backward and waiting for b's, with a, b and c's saves still held; under a
    # sum b's gradient is c's output's.
    pending = tensor if join == "mul" else 0
    peak = 3 * tensor + (tensor + tensor + weight + pending)
    loss = tensor  # the loss's copy of d, freed by then
    assert got.workspace == peak - 4 * tensor - loss


@pytest.mark.parametrize("cin,cout,k,stride,hw,batch,input_grad", [
    (32, 32, 3, 1, 16, 16, True), (32, 64, 3, 2, 16, 16, True), (32, 64, 1, 2, 16, 16, True),
    (32, 128, 1, 1, 16, 16, True), (128, 32, 1, 1, 16, 16, True), (3, 32, 3, 1, 16, 16, True),
    (3, 32, 3, 1, 16, 16, False), (64, 64, 3, 1, 8, 2, True), (32, 64, 3, 2, 16, 2, True)])
def test_conv_backward_scratch_covers_onednn(tmp_path: Path, cin: int, cout: int, k: int,
                                             stride: int, hw: int, batch: int,
                                             input_grad: bool) -> None:
    """kernel_scratch of a CPU convolution against torch.profiler's peak of its real backward,
    above the gradients it returns: never below, and within one input-sized buffer."""
    torch.manual_seed(0)
    torch.set_num_threads(1)

    class Conv(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = torch.nn.Conv2d(cin, cout, k, stride=stride, padding=k // 2, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.conv(x)

    module = Conv()
    x = torch.randn(batch, cin, hw, hw, requires_grad=input_grad)
    y = module(x)
    g = torch.randn_like(y)
    y.backward(g, retain_graph=True)  # warm oneDNN's primitive cache
    x.grad = None
    module.conv.weight.grad = None
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True) as prof:
        y.backward(g, retain_graph=True)
    returned = (x.numel() * 4 if input_grad else 0) + module.conv.weight.numel() * 4
    measured = peak_above_start(prof) - returned

    model_file = tmp_path / "conv.py"
    model_file.write_text(
        "import torch\n"
        f"def build_model():\n    return torch.nn.Conv2d({cin}, {cout}, {k}, stride={stride}, "
        f"padding={k // 2}, bias=False)\n"
        f"def example_inputs(b):\n    return (torch.randn(b, {cin}, {hw}, {hw}),)\n")
    graph = capture_graph(model_file, batch, onnx=False).graph
    conv = next(n for n in graph.nodes if n.kind in ("conv2d", "convolution"))
    table = analytic_cost_table(graph, cpu_device())
    requires = {conv.inputs[0]} if input_grad else set()
    predicted = kernel_scratch(table, conv, batch, False, requires)
    assert predicted >= measured, (predicted, measured)
    assert predicted - measured <= max(x.numel() * 4, 64 * 1024), (predicted, measured)


def test_the_conv_channel_block_is_the_priced_cpus_register_of_floats() -> None:
    """The convolution scratch pads channels to the table's CPU's float32 lanes: a config's
    `vector_bytes` for the roofline, the measuring machine's for a profile; unrecorded, AVX-512's
    (what the term was first measured on), so older plans price as before."""
    from partc.solve.memory import conv_channel_block

    graph = captured("resnet")[0].graph
    for vector, block in ((64, 16), (32, 8), (16, 4), (0, 16)):
        table = analytic_cost_table(graph, replace(cpu_device(), vector_bytes=vector))
        assert (table.cpu_vector_bytes, conv_channel_block(table)) == (vector, block)
    gpu = analytic_cost_table(graph, load_device("h100-80gb"))
    assert gpu.cpu_vector_bytes == 0


@pytest.mark.parametrize("exponent", [3.0, 2.0, 0.5])
def test_pow_backward_scratch_matches_autograd(tmp_path: Path, exponent: float) -> None:
    """kernel_scratch of x ** c against torch.profiler's peak of its real backward above the
    gradient it returns: pow_backward's two result-sized factors (HF GPT-2's tanh GELU cubes its
    input; a stage of it peaked there, 1 MiB above the model without them)."""
    x = torch.randn(8, 64, 256, requires_grad=True)
    y = x ** exponent
    g = torch.randn_like(y)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True) as prof:
        y.backward(g, retain_graph=True)
    measured = peak_above_start(prof) - x.numel() * 4

    model_file = tmp_path / "cube.py"
    model_file.write_text(
        "import torch\n"
        "class Pow(torch.nn.Module):\n"
        f"    def forward(self, x):\n        return x ** {exponent}\n"
        "def build_model():\n    return Pow()\n"
        "def example_inputs(b):\n    return (torch.randn(b, 64, 256),)\n")
    graph = capture_graph(model_file, 8, onnx=False).graph
    node = next(n for n in graph.nodes if n.kind == "pow")
    table = analytic_cost_table(graph, cpu_device())
    assert kernel_scratch(table, node, 8, False, {node.inputs[0]}) == measured
    assert kernel_scratch(table, node, 8, False, set()) == 0  # no input gradient, no backward


_ATTENTION_MODEL = """
import torch
import torch.nn.functional as F
H, D = 4, {head}
class Attention(torch.nn.Module):
    def forward(self, x, memory, mask):
        b, sq, sk = x.shape[0], x.shape[1], memory.shape[1]
        q = x.view(b, sq, H, D).transpose(1, 2)
        k, v = (t.view(b, sk, H, D).transpose(1, 2) for t in memory.split(H * D, dim=-1))
        return F.scaled_dot_product_attention(q, k, v, attn_mask={mask}, dropout_p=0.1,
                                              is_causal={causal})
def build_model():
    return Attention()
def example_inputs(b):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(b, {sq}, H * D, dtype=torch.{dtype}),
            torch.randn(b, {sk}, 2 * H * D, dtype=torch.{dtype}),
            torch.rand(b, 1, {sq}, {sk}, generator=g) > 0.2)
"""


@pytest.mark.parametrize("precision, dtype, sq, sk, head, mask", [
    ("fp32", "float32", 32, 32, 32, "causal"), ("fp32", "float32", 16, 64, 16, "bool"),
    ("bf16-mixed", "bfloat16", 32, 32, 32, "causal"),
    ("bf16-mixed", "bfloat16", 64, 16, 32, "bool"), ("bf16-mixed", "float32", 32, 32, 32, "bool")])
def test_math_attention_forward_scratch_matches_torch(tmp_path: Path, precision: str, dtype: str,
                                                      sq: int, sk: int, head: int,
                                                      mask: str) -> None:
    """forward_scratch of a CPU's math-path attention (dropout on) against torch.profiler's
    peak of its real forward above what it saves and returns (a stage ending in one peaked in
    its forward, 257,920 B above a model without it). Under bf16-mixed, inputs in bfloat16 (a
    projection's output) and in float32 (which autocast casts)."""
    bf16 = precision == "bf16-mixed"
    model_file = tmp_path / "attention.py"
    model_file.write_text(_ATTENTION_MODEL.format(
        head=head, sq=sq, sk=sk, dtype=dtype,
        mask="mask" if mask == "bool" else "None", causal=mask == "causal"))
    b = 8
    graph = capture_graph(model_file, b, onnx=False).graph
    node = next(n for n in graph.nodes if n.kind == "scaled_dot_product_attention")
    table = analytic_cost_table(graph, cpu_device())

    from partc.frontend.model_file import load_model_file

    module = load_model_file(model_file)
    (x, memory, attn_mask), _ = module.inputs(b)
    x.requires_grad_()
    memory.requires_grad_()
    inputs = {t.untyped_storage().data_ptr() for t in (x, memory, attn_mask)}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True) as prof:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16), \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = module.build()(x, memory, attn_mask)
    out = y.untyped_storage()
    saved = sum(n for ptr, n in kept.items() if ptr not in inputs and ptr != out.data_ptr())
    measured = peak_above_start(prof) - saved - out.nbytes()
    assert measured > 0
    assert forward_scratch(table, node, b, bf16) == measured


_SENT_AND_USED_MODEL = """
import torch
class SentAndUsed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(64)
        self.up = torch.nn.Linear(64, 256)
    def forward(self, x):
        h = self.norm(x)
        return h, self.up(h)
def build_model():
    torch.manual_seed(0)
    return SentAndUsed()
def example_inputs(b):
    return (torch.randn(b, 32, 64),)
"""


def test_a_sent_and_used_tensor_has_one_gradient_at_its_last_use(tmp_path: Path) -> None:
    """A stage sends h and also feeds it to a projection (BERT's attention block output, sent to
    the next stage's residual add): the projection's backward forms h's local gradient, and
    autograd then adds the received one into it in place, not into a third buffer. The model's
    backward transient against torch.profiler's peak of the stage's real backward (both outputs'
    gradients received, as PipelineStage runs it; gradients resident): counting a sum there too
    put BERT's 4-stage first stage 262,144 B over its launched peak."""
    from partc.solve.memory import _backward_transient, _requires_grad

    model_file = tmp_path / "sent_and_used.py"
    model_file.write_text(_SENT_AND_USED_MODEL)
    b = 8
    graph = capture_graph(model_file, b, onnx=False).graph
    table = analytic_cost_table(graph, cpu_device())
    nodes = [n.name for n in graph.nodes]
    sent = {o.tensor for o in graph.outputs}
    norm_out = next(n.outputs[0] for n in graph.nodes if n.kind == "layer_norm")
    keeper = next(n.name for n in graph.nodes if n.kind == "linear")
    predicted, _ = _backward_transient(table, nodes, b, False, _requires_grad(graph),
                                       {keeper: norm_out.nbytes}, set(sent))

    from partc.frontend.model_file import load_model_file

    module = load_model_file(model_file)
    model = module.build()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    (x,), _ = module.inputs(b)
    h, y = model(x)
    received = [torch.randn_like(h), torch.randn_like(y)]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True) as prof:
        torch.autograd.backward([h, y], received)
    assert predicted == peak_above_start(prof)


def test_checkpointing_keeps_the_cpu_generator_state_per_micro_batch() -> None:
    """torch.utils.checkpoint keeps torch.get_rng_state() per checkpointed forward: the solver's
    torch-free constant is torch's size (the checkpointed MLP's first stage was 5,056 B per
    in-flight micro-batch under its measured peak without it)."""
    assert CPU_RNG_STATE_BYTES == torch.get_rng_state().numel()


def test_gradients_freed_between_steps_are_not_held_before_the_first_backward() -> None:
    """Without a DDP bucket launch frees the gradients each step: where every micro-batch is in
    flight at the first backward (GPipe; the first stage of a short 1F1B) the peak holds all the
    activations and only the gradients formed so far; where forwards go on between backwards
    (M > in-flight) the later backwards hold as many activations and all gradients."""
    result, table = captured("transformer")
    nodes = [n.name for n in result.graph.nodes]
    config = TrainingConfig(optimizer="adamw", schedule="gpipe")
    kw: dict[str, Any] = dict(microbatch_size=4, num_microbatches=3, stage_index=0,
                              num_stages=1, config=config)
    resident = stage_memory(table, nodes, **kw)
    freed = stage_memory(table, nodes, gradients_resident=False, **kw)
    assert freed.total < resident.total
    assert freed.gradients < resident.gradients  # not all formed at the peak
    assert freed.activations == resident.activations  # 3 micro-batches in flight at the peak
    # at the least the later backwards: all gradients, two micro-batches, their transient
    assert freed.total >= resident.total - resident.activations / 3
    # 1F1B on the last of 2 ranks (one in flight) with forwards between backwards: the same peak
    steady = dict(kw, num_microbatches=4, stage_index=1, num_stages=2,
                  config=TrainingConfig(optimizer="adamw", schedule="1f1b"))
    assert stage_memory(table, nodes, gradients_resident=False, **steady).total == \
        stage_memory(table, nodes, **steady).total
    for memory in (resident, freed):
        assert memory.total == sum(memory.to_dict()[k] for k in memory.to_dict() if k != "total")


def test_training_config_validation() -> None:
    assert TrainingConfig().optimizer in OPTIMIZERS
    assert set(PRECISIONS) == {"fp32", "bf16-mixed"} and "1f1b" in SCHEDULES
    with pytest.raises(MemoryConfigError) as err:
        TrainingConfig(optimizer="adam-w")
    assert "adamw" in err.value.hint
    with pytest.raises(MemoryConfigError, match="precision"):
        TrainingConfig(precision="fp16")
    with pytest.raises(MemoryConfigError, match="schedule"):
        TrainingConfig(schedule="zero-bubble")
    for margin in (-0.1, 1.0, float("nan"), "0.1", True):
        with pytest.raises(MemoryConfigError, match="memory_margin"):
            TrainingConfig(memory_margin=margin)  # type: ignore[arg-type]
    with pytest.raises(MemoryConfigError, match="activation_checkpointing"):
        TrainingConfig(activation_checkpointing="yes")  # type: ignore[arg-type]
    assert usable_memory(80 * 2**30, TrainingConfig(memory_margin=0.1)) == int(72 * 2**30)
    with pytest.raises(MemoryConfigError):
        usable_memory(0, TrainingConfig())


def test_schedule_parameter_validation() -> None:
    with pytest.raises(MemoryConfigError, match="out of range"):
        in_flight_microbatches("1f1b", 4, 4, 8)
    with pytest.raises(MemoryConfigError, match="chunks"):
        in_flight_microbatches("1f1b", 0, 4, 8, chunks=2)
    with pytest.raises(MemoryConfigError, match="multiple"):
        in_flight_microbatches("interleaved-1f1b", 0, 4, 9, chunks=2)
    with pytest.raises(MemoryConfigError, match="num_microbatches"):
        in_flight_microbatches("gpipe", 0, 2, 0)
    result, table = captured("mlp")
    with pytest.raises(MemoryConfigError, match="microbatch_size"):
        stage_memory(table, [result.graph.nodes[0].name], microbatch_size=0, num_microbatches=1,
                     stage_index=0, num_stages=1, config=TrainingConfig())


# ---- the docs table ------------------------------------------------------------------------------
def main() -> None:
    """Print docs/memory-model.md's table: predicted vs measured peak per example and case."""
    import tempfile
    import warnings

    warnings.filterwarnings("ignore")
    cases = ("adamw", "sgd", "gpipe-3", "checkpoint-3")
    print(f"torch {torch.__version__}, CPU, micro-batch sizes {BATCH}")
    print("| model | case | predicted MB | measured MB | error |")
    print("|---|---|---:|---:|---:|")
    rows = [compare(name, case) for name in MODELS for case in cases]
    with tempfile.TemporaryDirectory() as tmp:
        rows += run_pipeline(Path(tmp)) + run_pipeline(Path(tmp), world=3)
    for c in rows:
        print(f"| {c.model} | {c.case} | {c.predicted.total / 1e6:.2f} | {c.measured / 1e6:.2f} | "
              f"{c.error:+.1%} |")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    if sys.argv[1:2] == ["pipeline-rank"]:
        _pipeline_rank(int(sys.argv[2]), sys.argv[3], int(sys.argv[4]))
    else:
        main()


_MASKED_ATTENTION = '''
import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(32, 96)

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(h).view(h.shape[0], h.shape[1], 3, 2, 16).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), attn_mask=mask)
        return h + a.transpose(1, 2).reshape(h.shape)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 32)
        self.blocks = nn.ModuleList(Block() for _ in range(2))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        keep = ids != 0
        s = ids.shape[1]
        causal = torch.ones(s, s, dtype=torch.bool, device=ids.device).tril()
        mask = keep[:, None, None, :] & causal  # a (b, 1, s, s) boolean mask, as HF builds one
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h, mask)
        return h


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return Model()


def example_inputs(batch_size: int) -> tuple[torch.Tensor]:
    return (torch.randint(1, 50, (batch_size, 8)),)
'''


def test_a_boolean_attention_mask_is_not_kept_by_the_attention(tmp_path: Path) -> None:
    """scaled_dot_product_attention turns a boolean mask into a float one before any kernel and
    keeps that copy, never the boolean tensor: a stage that sends such a mask on (HF BERT's, cut
    between layers) holds it per micro-batch in flight in the runtime alone, which the memory
    model must count (measured: BERT's first stage was 16 KiB above its prediction)."""
    from partc.solve.memory import _first_saver

    q = torch.randn(2, 2, 8, 16, requires_grad=True)
    mask = torch.ones(2, 1, 8, 8, dtype=torch.bool).tril()
    kept: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        kept.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask)
    storages = {t.untyped_storage().data_ptr() for t in kept}
    assert kept and mask.untyped_storage().data_ptr() not in storages

    model = tmp_path / "masked.py"
    model.write_text(_MASKED_ATTENTION)
    result = capture_graph(model, 4, onnx=False)
    graph = result.graph
    names = [n.name for n in graph.nodes]
    cut = next(i for i, n in enumerate(graph.nodes) if n.module.startswith("blocks.1"))
    sends = stage_boundary(graph, names[:cut])[1]
    masks = [t for t in sends if graph.tensor(t).dtype == "bool"]
    assert masks, sends  # the mask crosses the cut, as BERT's does
    # nothing in the stage keeps the mask (so the runtime's hold on the sent output counts),
    # while the attention keeps its float inputs
    table = analytic_cost_table(graph, cpu_device())
    assert [_first_saver(table, t) for t in masks] == [None] * len(masks)
    attention = next(n for n in graph.nodes if n.kind == "scaled_dot_product_attention")
    assert _first_saver(table, attention.inputs[0]) == attention.name



def test_a_received_attention_input_is_saved_as_a_copy_on_a_cpu(tmp_path: Path) -> None:
    """With dropout on, as in training, a CPU runs attention's math path, which keeps scaled and
    reshaped copies of its query and key, never the received storage; its flash kernel (no
    dropout) and CUDA's fused kernels keep the inputs themselves. The graph does not show
    dropout, so on a CPU the memory model never takes a receive buffer for an attention's saved
    input (BERT cut between its query and key projections peaked 256 KiB above the model that
    did); on CUDA it does. Checked against torch's saved tensors."""
    from partc.solve.memory import _first_saver, _kept_as_is

    hidden = torch.randn(2, 8, 64, requires_grad=True)  # as received: (batch, seq, heads * dim)

    def keeps_received(dropout_p: float) -> bool:
        kept: list[torch.Tensor] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            kept.append(t)
            return t

        heads = hidden.view(2, 8, 4, 16).transpose(1, 2)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            torch.nn.functional.scaled_dot_product_attention(heads, heads, heads,
                                                             dropout_p=dropout_p)
        return any(t.untyped_storage().data_ptr() == hidden.untyped_storage().data_ptr()
                   for t in kept)

    assert not keeps_received(0.1)  # the math path
    assert keeps_received(0.0)  # the CPU flash kernel: the model over-counts one input there

    model = tmp_path / "masked.py"
    model.write_text(_MASKED_ATTENTION)
    graph = capture_graph(model, 4, onnx=False).graph
    attention = next(n for n in graph.nodes if n.kind == "scaled_dot_product_attention")
    query = attention.inputs[0]
    cpu = analytic_cost_table(graph, cpu_device())
    assert _first_saver(cpu, query) == attention.name
    gpu = analytic_cost_table(graph, load_device("h100-80gb"))
    for bf16 in (False, True):
        assert not _kept_as_is(cpu, query, attention.name, bf16)
        assert _kept_as_is(gpu, query, attention.name, bf16)

_ATTENTION_LAYER = '''
import torch
import torch.nn as nn
import torch.nn.functional as F

SEQ = {seq}


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(32, 96)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(h).view(h.shape[0], SEQ, 3, 2, 16).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2))
        return a.transpose(1, 2).reshape(h.shape)


def build_model() -> nn.Module:
    return Attention()


def example_inputs(batch_size: int) -> tuple[torch.Tensor]:
    return (torch.randn(batch_size, SEQ, 32),)
'''


@pytest.mark.parametrize("seq, threads", [(8, 1), (40, 1), (200, 1), (800, 1), (40, 2),
                                          (200, 2)])
def test_cpu_attention_backward_scratch_is_what_torch_allocates(tmp_path: Path, seq: int,
                                                                threads: int) -> None:
    """kernel_scratch of an attention node against torch.profiler on the real CPU backward:
    every byte the backward allocates beyond the query, key and value gradients, at sequence
    lengths across the kernel's three block sizes and at 1 and 2 intra-op threads (launch gives
    each process the node's cores shared out, `ClusterSpec.threads_per_device`)."""
    model = tmp_path / "attention.py"
    model.write_text(_ATTENTION_LAYER.format(seq=seq))
    result = capture_graph(model, 2, onnx=False)
    table = analytic_cost_table(result.graph, cpu_device())
    node = next(n for n in result.graph.nodes if n.kind == "scaled_dot_product_attention")
    predicted = kernel_scratch(table, node, 2, False, threads=threads)

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        q, k, v = (torch.randn(2, seq, 2, 16, requires_grad=True) for _ in range(3))
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
        grad = torch.randn_like(out)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                    profile_memory=True) as prof:
            out.backward(grad)
    finally:
        torch.set_num_threads(before)
    measured = peak_above_start(prof) - storage_bytes([q.grad, k.grad, v.grad])
    # each thread's row sum is allocated inside the parallel loop: whether they are all alive
    # at once depends on the threads' timing, so the prediction counts every one
    row_sums = (threads - 1) * 4 * min(32 if seq < 192 else 64 if seq < 768 else 256, seq)
    assert measured <= predicted <= measured + row_sums


_LINEAR_LAYER = '''import torch


def build_model():
    return torch.nn.Linear(256, 512, bias=False)


def example_inputs(batch_size: int) -> tuple[torch.Tensor]:
    return (torch.randn(batch_size, 256),)
'''


@pytest.mark.parametrize("precision", ["bf16-mixed", "fp32"])
def test_gemm_working_buffers_are_what_torch_allocates(tmp_path: Path, precision: str) -> None:
    """gemm_scratch_bytes (the profile's measurement) is the largest working buffer of the
    model's own matrix multiplies, each timed alone against torch.profiler: a linear layer's
    forward x @ W.T and its backward's g @ W and g.T @ x, in the layouts autograd gives them
    (oneDNN's bf16 GEMMs pack blocks: 401 KiB here on an avx512_bf16 Xeon, 0 in float32). The
    memory model charges it to a matrix node's backward, per intra-op thread."""
    from partc.cost.activations import gemm_scratch_bytes
    from partc.cost.torch_profiler import program_module

    model = tmp_path / "linear.py"
    model.write_text(_LINEAR_LAYER)
    rows = 512
    result = capture_graph(model, rows, onnx=False)
    module = program_module(result.capture.exported)
    inputs = ((torch.randn(rows, 256),), {})
    measured = gemm_scratch_bytes(module, inputs, torch.device("cpu"), precision)

    dtype = torch.bfloat16 if precision == "bf16-mixed" else torch.float32
    x, w, g = (torch.randn(*s, dtype=dtype) for s in ((rows, 256), (512, 256), (rows, 512)))
    expected = 0
    for a, b in ((x, w.t()), (g, w), (g.t(), x)):
        torch.mm(a, b)  # oneDNN's primitive cache, as the measurement's untimed run
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                    profile_memory=True) as prof:
            out = torch.mm(a, b)
        expected = max(expected, peak_above_start(prof) - out.numel() * out.element_size())
    assert measured == expected, (measured, expected)

    table = replace(analytic_cost_table(result.graph, cpu_device(), precision=precision),
                    gemm_scratch_bytes=measured)
    node = next(n for n in result.graph.nodes if n.kind in ("linear", "mm"))
    assert kernel_scratch(table, node, rows, precision == "bf16-mixed") == measured
    assert kernel_scratch(table, node, rows, precision == "bf16-mixed", threads=2) == 2 * measured


_FLOAT32_ACTIVATION = '''import torch


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(64, 64)
        self.down = torch.nn.Linear(64, 32)

    def forward(self, x):
        h = x + self.up(x)  # a residual stream: float32 + bfloat16 stays float32 under autocast
        return self.down(h)


def build_model():
    return Net()


def example_inputs(batch_size: int) -> tuple[torch.Tensor]:
    return (torch.randn(batch_size, 64),)
'''


def test_a_received_float32_input_of_a_bf16_matrix_op_is_saved_as_a_copy(tmp_path: Path) -> None:
    """Under bf16-mixed a stage that receives a float32 activation and feeds it to a matrix op
    keeps autocast's bfloat16 copy for backward, not the receive buffer: both are alive, so the
    memory model must not take the buffer for the saved tensor (GPT-2's `params` stage 1 was
    1 MiB below its measured peak). Checked against torch's saved tensors; in float32 the op
    keeps the received tensor itself."""
    from partc.solve.memory import _first_saver, _kept_as_is

    model = tmp_path / "float32_activation.py"
    model.write_text(_FLOAT32_ACTIVATION)
    graph = capture_graph(model, 4, onnx=False).graph
    down = next(n for n in graph.nodes if n.module == "down")
    received = down.inputs[0]  # the cut sends this to the stage holding `down`
    table = analytic_cost_table(graph, cpu_device())
    saver = _first_saver(table, received)
    assert saver == down.name

    layer = torch.nn.Linear(64, 32)
    for bf16 in (True, False):
        keeps_buffer = _linear_keeps_its_input(layer, bf16)  # as received, in float32
        assert _kept_as_is(table, received, saver, bf16) == keeps_buffer == (not bf16)


def _linear_keeps_its_input(layer: torch.nn.Linear, bf16: bool) -> bool:
    """Whether `layer`, run on a float32 input (under bf16 autocast or not), keeps that input's
    own storage among its saved tensors (torch's saved-tensor hooks), not a copy."""
    x = torch.randn(4, layer.in_features, requires_grad=True)
    kept: list[torch.Tensor] = []

    def keep(t: torch.Tensor) -> torch.Tensor:
        kept.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            layer(x)
    return any(t.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() for t in kept)


_SENT_FLOAT32 = '''import torch


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(64)
        self.proj = torch.nn.Linear(64, 64)
        self.head = torch.nn.Linear(64, 8)

    def forward(self, x):
        h = self.norm(x)  # float32 under autocast
        return self.head(h + self.proj(h))


def build_model():
    return Net()


def example_inputs(batch_size: int) -> tuple[torch.Tensor]:
    return (torch.randn(batch_size, 64),)
'''


def test_a_sent_float32_output_a_bf16_projection_consumes_is_held_by_the_send(
        tmp_path: Path) -> None:
    """Cut after `proj`: stage 0 sends the normalised `h` (float32) and computes `proj` from it.
    Under bf16-mixed `proj` keeps autocast's bfloat16 copy of `h` (torch's saved tensors say
    so), so `h` itself is held only by the send, per micro-batch in flight: the stage's kept
    outputs grow by exactly its float32 bytes over the model that took the copy for it (BERT's
    bf16 `cpsat` stage 0 peaked 261,632 bytes above that). In float32 `proj` keeps `h` itself."""
    from partc.solve.memory import _first_saver, _kept_as_is

    model = tmp_path / "sent_float32.py"
    model.write_text(_SENT_FLOAT32)
    result = capture_graph(model, 4, onnx=False)
    graph = result.graph
    proj = next(n for n in graph.nodes if n.module == "proj")
    h = proj.inputs[0]
    assert _first_saver(analytic_cost_table(graph, cpu_device()), h) == proj.name
    stage0 = [n.name for n in graph.nodes[:graph.nodes.index(proj) + 1]]
    layer = torch.nn.Linear(64, 64)
    comm = {}
    for bf16 in (True, False):
        precision = "bf16-mixed" if bf16 else "fp32"
        table = analytic_cost_table(graph, cpu_device(), precision=precision,
                                    saved=saved_activations(result.capture))
        keeps_it = _linear_keeps_its_input(layer, bf16)  # h, as sent, in float32
        assert _kept_as_is(table, h, proj.name, bf16) == keeps_it == (not bf16)
        comm[bf16] = stage_memory(table, stage0, microbatch_size=4, num_microbatches=4,
                                  stage_index=0, num_stages=2,
                                  config=TrainingConfig(precision=precision)).communication
    # 2 micro-batches in flight on stage 0 of 2 (1F1B, M=4); h is 4 x 64 float32 either way,
    # proj's output 4 x 64 in bfloat16 under bf16-mixed (its float32 size in fp32)
    h_bytes, out_bytes = 4 * 64 * 4, 4 * 64 * 4
    in_flight = 2
    # fp32: kept = proj's output only; bf16: h (float32) and proj's output (bfloat16); the
    # preallocated gradient buffers (M per sent tensor) and the sends of the last warm-up
    # forward, which Schedule1F1B keeps to the end of the step, follow the same dtypes
    assert comm[False] - comm[True] == in_flight * (out_bytes - out_bytes // 2 - h_bytes) \
        + 4 * (out_bytes - out_bytes // 2) + (out_bytes - out_bytes // 2)


_BIASED_CHAIN = '''import torch


class Chain(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(64, 128)  # over the data: no input gradient
        self.second = torch.nn.Linear(128, 128)
        self.third = torch.nn.Linear(128, 32)

    def forward(self, x):
        h = torch.relu(self.first(x))
        return self.third(torch.relu(self.second(h)))


def build_model():
    torch.manual_seed(0)
    return Chain()


def example_inputs(batch_size: int) -> tuple[torch.Tensor]:
    return (torch.randn(batch_size, 64),)
'''


def test_autocast_cast_cache_is_held_to_the_end_of_the_forward(tmp_path: Path) -> None:
    """Under bf16-mixed, autocast caches the bfloat16 copy of every trainable weight and bias a
    matrix op casts until the forward's autocast region ends; the backward keeps only the
    weights of ops whose input needs a gradient. The rest (here every bias, and the first
    layer's weight, which no backward needs) is held through the forward and freed as the region
    ends: exactly what torch frees there (BERT's and GPT-2's bf16 4-stage plans peaked 6,144 B
    over the model in a middle stage's forward, its bias copies). None under fp32."""
    from partc.solve.memory import _cast_cache_only, _in_order

    model_file = tmp_path / "chain.py"
    model_file.write_text(_BIASED_CHAIN)
    b = 8
    graph = capture_graph(model_file, b, onnx=False).graph
    ordered = _in_order(graph, [n.name for n in graph.nodes])
    predicted = sum(_cast_cache_only(graph, ordered, True))
    assert predicted == (64 * 128 + 128 + 128 + 32) * 2
    assert sum(_cast_cache_only(graph, ordered, False)) == 0

    from partc.frontend.model_file import load_model_file

    module = load_model_file(model_file)
    model = module.build()
    (x,), _ = module.inputs(b)
    # torch.profiler reports a free only of memory it saw allocated: profile the whole forward,
    # and take what is freed inside the region's exit
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True) as prof:
        region = torch.autocast("cpu", dtype=torch.bfloat16)
        region.__enter__()
        try:
            y = model(x)  # its graph, and what it saved, stay alive through the exit
        finally:
            with torch.profiler.record_function("autocast exit"):
                region.__exit__(None, None, None)
    assert prof.profiler is not None and prof.profiler.kineto_results is not None
    exits = [e for e in _tree(prof) if e.name == "autocast exit"]
    assert len(exits) == 1
    freed = -sum(size for _, size, _ in allocation_events(exits[0].children))
    assert freed == predicted
    y.sum().backward()  # the weights it kept were enough: the backward runs after the exit


def _tree(prof: Any) -> list[Any]:
    """Every event of a stopped profile's event tree."""
    found, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        found.append(event)
        stack.extend(event.children)
    return found
