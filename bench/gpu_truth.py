"""GPU truth: partc's analytic predictions vs measurements on this machine's GPU.

For a BERT-large-like (BertForMaskedLM) and a GPT-2-medium-like (GPT2LMHeadModel) model built from
configs here (random weights, nothing downloaded), per precision (fp32, bf16-mixed):

- whole-model forward and forward + backward, measured on the device (synchronised, median of
  --repeats, with min and max) vs partc's prediction from a device config (`plan_costs`: the
  analytic roofline with saved activations measured on meta);
- peak memory of a training step (forward, backward, AdamW step; torch.cuda.max_memory_allocated
  after the optimizer states exist) vs partc's single-stage peak (partc.solve.memory.stage_memory);
- with --stages K (default 4; 0 skips it): `partc compile --stages K --replicas 1` of each model
  on a K-device cluster of that device, and every stage's measured forward and backward time
  (its TorchScript stage file run as launch runs it, at the plan's precision) vs the plan's
  prediction;
- one end-to-end `partc launch` (--launch; one stage), traced (`--trace`: its top operators in
  the report), after its model is timed and profiled in the three forms a launch passes through
  (eager, exported, stage file; --no-forms skips it): where the launch is slower than the eager
  model, the forms and the kernels say which step of the way loses it.

Writes DIR/gpu_truth.md (tables) and DIR/gpu_truth.json. Needs only torch (CUDA), transformers and
partc; onnxruntime is not used (the capture skips ONNX). A few minutes on one GPU:

    python bench/gpu_truth.py --out results/gpu-truth          # cuda, shipped device config
    python bench/gpu_truth.py --out DIR --device-config DIR2/devices/NAME.yaml   # calibrated
    python bench/gpu_truth.py --out /tmp/t --device cpu --quick --stages 0       # smoke test
    python bench/gpu_truth.py --checked-against DIR/gpu_truth.json ... --config-name h100-80gb
                                        # the config's checked_against line from the reports
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import statistics
import subprocess
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, ContextManager

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import yaml  # noqa: E402

from partc.cost.activations import saved_activations  # noqa: E402
from partc.cost.plan_costs import plan_costs  # noqa: E402
from partc.cost.table import CostTable, SavedActivations  # noqa: E402
from partc.errors import summarize_exception  # noqa: E402
from partc.files import write_atomic  # noqa: E402
from partc.frontend.capture import CaptureResult, capture_graph  # noqa: E402
from partc.hardware.configs import list_clusters, load_cluster, load_device  # noqa: E402
from partc.hardware.specs import DeviceSpec  # noqa: E402
from partc.options import TrainingConfig  # noqa: E402
from partc.solve.memory import stage_memory  # noqa: E402

PRECISIONS = ("fp32", "bf16-mixed")


@dataclass(frozen=True)
class ModelCase:
    """One benchmark model: an HF class, its config and the shapes of a training batch."""

    name: str
    title: str
    config_class: str
    model_class: str
    config: dict[str, Any]
    vocab: int
    seq_len: int
    batch_size: int


def model_cases(quick: bool) -> list[ModelCase]:
    if quick:  # tiny configs: a CPU smoke test
        common = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                  "intermediate_size": 128, "max_position_embeddings": 64}
        return [
            ModelCase("bert", "BERT (tiny)", "BertConfig", "BertForMaskedLM",
                      {**common, "vocab_size": 128}, 128, 16, 2),
            ModelCase("gpt2", "GPT-2 (tiny)", "GPT2Config", "GPT2LMHeadModel",
                      {"vocab_size": 128, "n_embd": 64, "n_layer": 2, "n_head": 2,
                       "n_positions": 64, "use_cache": False, "bos_token_id": 0,
                       "eos_token_id": 0}, 128, 16, 2),
        ]
    return [
        ModelCase("bert-large", "BERT-large-like (BertForMaskedLM, 24 x 1024, seq 512)",
                  "BertConfig", "BertForMaskedLM",
                  {"vocab_size": 30522, "hidden_size": 1024, "num_hidden_layers": 24,
                   "num_attention_heads": 16, "intermediate_size": 4096,
                   "max_position_embeddings": 512}, 30522, 512, 8),
        ModelCase("gpt2-medium", "GPT-2-medium-like (GPT2LMHeadModel, 24 x 1024, seq 1024)",
                  "GPT2Config", "GPT2LMHeadModel",
                  {"vocab_size": 50257, "n_embd": 1024, "n_layer": 24, "n_head": 16,
                   "n_positions": 1024, "use_cache": False}, 50257, 1024, 4),
    ]


MODEL_FILE = '''"""{title}: random weights, written by bench/gpu_truth.py (a partc model file)."""
from __future__ import annotations

from typing import Any, Iterator

import torch
import torch.nn.functional as F
from transformers import {config_class}, {model_class}

VOCAB = {vocab}
SEQ_LEN = {seq_len}
CONFIG = {config!r}


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return {model_class}({config_class}(**CONFIG))


def _ids(batch_size: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch_size, SEQ_LEN), generator=gen)


def example_inputs(batch_size: int) -> dict[str, torch.Tensor]:
    return {{"input_ids": _ids(batch_size, torch.Generator().manual_seed(0))}}


def loss_fn(output: Any, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.logits.reshape(-1, VOCAB).float(), target.reshape(-1))


def batches(batch_size: int) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    while True:
        yield {{"input_ids": _ids(batch_size, gen)}}, _ids(batch_size, gen)
'''


def write_model_file(case: ModelCase, directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{case.name.replace('-', '_')}.py"
    write_atomic(path, MODEL_FILE.format(title=case.title, config_class=case.config_class,
                                         model_class=case.model_class, vocab=case.vocab,
                                         seq_len=case.seq_len, config=case.config))
    return path


def import_model_file(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"gpu_truth_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------------------------------------
# Measuring

def synchronizer(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def spread(times: list[float]) -> dict[str, float]:
    """Median, min, max and (max - min) / median of repeated times (seconds)."""
    median = statistics.median(times)
    return {"median_s": median, "min_s": min(times), "max_s": max(times),
            "spread": (max(times) - min(times)) / median if median else 0.0, "n": len(times)}


def autocast(device: torch.device, precision: str) -> ContextManager[Any]:
    if precision == "bf16-mixed":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return nullcontext()


def to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_device(v, device) for v in value)
    return value


def measure_model(module: ModuleType, batch_size: int, device: torch.device, precision: str,
                  repeats: int, warmup: int) -> dict[str, Any]:
    """Forward and forward + backward times of the whole model on `device` (synchronised,
    gradients set to None between steps, not timed), and the peak memory of a training step
    with AdamW once its states exist (CUDA only)."""
    sync = synchronizer(device)
    model = module.build_model().to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    inputs, target = next(iter(module.batches(batch_size)))
    inputs, target = to_device(inputs, device), to_device(target, device)

    def loss() -> torch.Tensor:
        with autocast(device, precision):
            out = model(**inputs)
        return module.loss_fn(out, target)

    def timed(fn: Callable[[], Any]) -> dict[str, float]:
        for _ in range(warmup):
            optimizer.zero_grad(set_to_none=True)
            fn()
        times = []
        for _ in range(repeats):
            optimizer.zero_grad(set_to_none=True)
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t0)
        return spread(times)

    forward = timed(lambda: loss().detach())  # autograd records, as in training
    step = timed(lambda: loss().backward())
    peak: int | None = None
    phases: dict[str, int] | None = None
    if device.type == "cuda":
        optimizer.step()  # the AdamW states exist from here on, as in a training run
        optimizer.zero_grad(set_to_none=True)
        sync()
        phases = {"parameters_and_states": torch.cuda.memory_allocated(device)}
        torch.cuda.reset_peak_memory_stats(device)
        out = loss()
        sync()
        # what the forward leaves alive (saved activations and the loss) and its own peak
        phases["after_forward"] = torch.cuda.memory_allocated(device)
        phases["forward_peak"] = torch.cuda.max_memory_allocated(device)
        out.backward()
        del out
        sync()
        phases["after_backward"] = torch.cuda.memory_allocated(device)  # + the gradients
        phases["backward_peak"] = torch.cuda.max_memory_allocated(device)
        optimizer.step()
        sync()
        peak = int(torch.cuda.max_memory_allocated(device))
        phases["step_peak"] = peak
    return {"forward": forward, "forward_backward": step, "peak_memory_bytes": peak,
            "memory_phases": phases,
            "parameter_bytes": sum(t.numel() * t.element_size() for t in model.parameters())}


# ------------------------------------------------------------------------------------------------
# Predicting

def price(result: CaptureResult, device: DeviceSpec, precision: str,
          saved: dict[str, SavedActivations]) -> tuple[CostTable, str]:
    """partc's analytic CostTable at `precision` (attention saved as the device's kernels keep
    it), and a note on how it was priced. `saved`: saved activations by device kind, measured
    once per capture (a forward of the model at two batch sizes each)."""
    if device.kind not in saved:
        saved[device.kind] = saved_activations(result.capture, target_kind=device.kind)
    table = plan_costs(result, device, precision=precision,  # type: ignore[arg-type]
                       saved=saved[device.kind])
    return table, f"priced at {precision}"


def predict(result: CaptureResult, device: DeviceSpec, precision: str,
            batch_size: int, saved: dict[str, SavedActivations]) -> dict[str, Any]:
    table, note = price(result, device, precision, saved)
    forward = table.total_forward_s(batch_size)
    backward = table.total_backward_s(batch_size)
    nodes = [n.name for n in result.graph.nodes]
    # gradients freed between steps, as launch does on one replica and measure_model does
    memory = stage_memory(table, nodes, microbatch_size=batch_size, num_microbatches=1,
                          stage_index=0, num_stages=1, gradients_resident=False,
                          config=TrainingConfig(precision=precision))  # type: ignore[arg-type]
    return {"forward_s": forward, "forward_backward_s": forward + backward,
            "peak_memory_bytes": memory.total, "memory": memory.to_dict(), "note": note}


def device_configs(args: argparse.Namespace, device: torch.device) -> list[DeviceSpec]:
    """Every --device-config (the first prices the stage plans), else the shipped config of this
    GPU (as `--cluster local` picks it, with the GPU's real memory), else the shipped cpu
    config."""
    if args.device_config:
        return [load_device(c) for c in args.device_config]
    if device.type == "cuda":
        from partc.hardware.local import local_cluster
        return [local_cluster().device]
    return [load_device("cpu")]


def config_labels(specs: list[DeviceSpec], sources: list[str]) -> list[str]:
    """One distinct label per device config: its name, and where two share a name, its source."""
    names = [s.name for s in specs]
    return [n if names.count(n) == 1 else f"{n} ({src})"
            for n, src in zip(names, sources, strict=True)]


def cluster_file(spec: DeviceSpec, stages: int, directory: Path) -> Path:
    """A one-node cluster of `stages` devices of `spec` (inline), linked like the shipped
    cluster of that device, for `partc compile --stages`."""
    link: dict[str, Any] = {"bandwidth": 25e9, "latency_s": 10e-6}
    backend = "nccl" if spec.kind == "cuda" else "gloo"
    for name in list_clusters():
        cluster = load_cluster(name)
        if cluster.device.name == spec.name or (cluster.device.kind == spec.kind
                                                and spec.kind == "cpu"):
            link = cluster.intra_node.to_dict()
            break
    path = directory / f"truth-{stages}.yaml"
    directory.mkdir(parents=True, exist_ok=True)
    write_atomic(path, yaml.safe_dump({
        "name": f"truth-{stages}", "device": spec.to_dict(), "devices_per_node": stages,
        "num_nodes": 1, "backend": backend, "intra_node": link}, sort_keys=False))
    return path


def time_stages(plan_dir: Path, module: ModuleType, device: torch.device, repeats: int,
                warmup: int) -> list[dict[str, Any]]:
    """Forward and backward time of every stage of a compiled plan on `device`, each stage file
    wrapped as launch runs it (partc.run.stage_runner.StageRunner: the plan's precision, its
    boundary dtypes, contiguous sends): stage k runs on stage k-1's outputs at the plan's
    micro-batch size; its backward gets ones as the gradient of each output."""
    import torch.utils._pytree as pytree

    from partc.emit.stage_code import load_stage
    from partc.emit.stage_graph import flatten_inputs
    from partc.frontend.model_file import normalize_inputs
    from partc.plans.plan import load_plan
    from partc.run.stage_runner import StageRunner

    sync = synchronizer(device)
    plan = load_plan(plan_dir)
    stages = [StageRunner.for_stage(plan, load_stage(plan.stage_bytes(s), map_location=device)
                                    .train(), s.index, device)
              for s in plan.stages]
    inputs, _target = next(iter(module.batches(plan.microbatch_size)))
    # any form a model file's batches() may yield (a tensor, a tuple, a dict, a pair)
    args_kwargs = to_device(normalize_inputs(inputs, "batches()"), device)
    flat = flatten_inputs(args_kwargs, pytree.treespec_loads(plan.model.input_spec)) \
        if plan.model.input_spec else pytree.tree_leaves(args_kwargs)
    current = [t.to(device) for t in flat]
    rows = []
    for st, stage in zip(plan.stages, stages, strict=True):
        taken = [t.detach().requires_grad_(t.is_floating_point()) for t in current]

        def forward(stage: Any = stage, taken: list[torch.Tensor] = taken) -> Any:
            return stage(*taken)

        def backward_once() -> float:
            outs = forward()
            pairs = [(o, torch.ones_like(o)) for o in outs
                     if isinstance(o, torch.Tensor) and o.requires_grad]
            sync()
            t0 = time.perf_counter()
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
            sync()
            return time.perf_counter() - t0

        fwd_times, bwd_times = [], []
        warm = max(warmup, 3)  # TorchScript's profiling executor optimises on early calls
        for i in range(warm + repeats):
            sync()
            t0 = time.perf_counter()
            outs = forward()
            sync()
            if i >= warm:
                fwd_times.append(time.perf_counter() - t0)
            bwd = backward_once()
            if i >= warm:
                bwd_times.append(bwd)
        rows.append({"stage": st.index, "predicted_forward_s": st.forward_s,
                     "predicted_backward_s": st.backward_s, "forward": spread(fwd_times),
                     "backward": spread(bwd_times), "microbatch_size": plan.microbatch_size,
                     "precision": plan.training.config.precision})
        current = [o.detach() for o in outs]
    return rows


FORMS = ("eager", "exported", "stage")
TOP_KERNELS = 25  # rows of each form's profiler table kept in its file


def runtime_forms(plan_dir: Path, module: ModuleType, device: torch.device, repeats: int,
                  warmup: int, out: Path) -> list[dict[str, Any]]:
    """The one-stage plan's model, whole, in the three forms a launch's time passes through, at
    the plan's micro-batch size, timed alike (forward; forward + backward with ones as the
    outputs' gradients; on CUDA the peak memory above the weights) and profiled once each:

    - eager: the model file's model as it is (what the whole-model rows measure);
    - exported: torch.export's raw program of it (`ExportedProgram.module()`: an attention mask
      HF leaves out eagerly is materialised here; compile's capture then drops it where it is
      constant and trivial or causal, partc.frontend.attention_masks, so this form shows what
      the mask costs);
    - stage: the plan's stage file as launch runs it (StageRunner: TorchScript, autocast,
      boundary dtypes), without the pipelining runtime around it.

    Where two forms differ, the profiler tables (DIR/forms-<plan>-<form>.txt: operators and
    kernels by their own time) say in which operators; the report keeps each form's top 12."""
    import torch.utils._pytree as pytree

    from partc.cost.torch_profiler import device_profile
    from partc.emit.stage_code import load_stage
    from partc.emit.stage_graph import flatten_inputs
    from partc.frontend.model_file import normalize_inputs
    from partc.plans.plan import load_plan
    from partc.run.stage_runner import StageRunner
    from partc.run.step_trace import operator_table

    sync = synchronizer(device)
    plan = load_plan(plan_dir)
    assert len(plan.stages) == 1, "runtime_forms times a one-stage plan"
    precision = plan.training.config.precision
    inputs, _target = next(iter(module.batches(plan.microbatch_size)))
    args, kwargs = to_device(normalize_inputs(inputs, "batches()"), device)
    flat = flatten_inputs((args, kwargs), pytree.treespec_loads(plan.model.input_spec)) \
        if plan.model.input_spec else pytree.tree_leaves((args, kwargs))

    def floating(outputs: Any) -> list[torch.Tensor]:
        return [o for o in pytree.tree_leaves(outputs)
                if isinstance(o, torch.Tensor) and o.is_floating_point() and o.requires_grad]

    model = module.build_model().to(device).train()
    exported = torch.export.export(model, tuple(args), kwargs).module()
    stage = StageRunner.for_stage(plan, load_stage(plan.stage_bytes(plan.stages[0]),
                                                   map_location=device).train(), 0, device)
    weights = [*model.parameters(), *exported.parameters(), *stage.parameters()]

    def eager() -> list[torch.Tensor]:
        with autocast(device, precision):
            return floating(model(*args, **kwargs))

    def exported_form() -> list[torch.Tensor]:
        with autocast(device, precision):
            return floating(exported(*args, **kwargs))

    forms: dict[str, Callable[[], list[torch.Tensor]]] = {
        "eager": eager, "exported": exported_form, "stage": lambda: floating(stage(*flat))}
    rows = []
    for name, form in forms.items():
        row: dict[str, Any] = {"form": name, "microbatch_size": plan.microbatch_size,
                               "precision": precision}

        def step(form: Callable[[], list[torch.Tensor]] = form) -> None:
            outs = form()
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
            for w in weights:
                w.grad = None

        try:
            fwd: list[float] = []
            both: list[float] = []
            with torch.jit.optimized_execution(False):  # as launch runs stage files
                for i in range(warmup + repeats):
                    for fn, times in ((form, fwd), (step, both)):
                        sync()
                        t0 = time.perf_counter()
                        fn()
                        sync()
                        if i >= warmup:
                            times.append(time.perf_counter() - t0)
                row["forward"], row["forward_backward"] = spread(fwd), spread(both)
                if device.type == "cuda":
                    base = torch.cuda.memory_allocated(device)
                    torch.cuda.reset_peak_memory_stats(device)
                    step()
                    sync()
                    row["peak_above_weights_bytes"] = \
                        int(torch.cuda.max_memory_allocated(device)) - base
                with device_profile(device, shapes=True) as prof:
                    step()
            key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
            events = sorted(prof.key_averages(), key=lambda e: -float(getattr(e, key)))
            row["top"] = [{"name": e.key, "self_ms": float(getattr(e, key)) / 1e3,
                           "calls": e.count} for e in events[:12]]
            table = out / f"forms-{plan_dir.name}-{name}.txt"
            write_atomic(table, operator_table(prof, device, rows=TOP_KERNELS) + "\n")
            row["table"] = str(table)
        except Exception as exc:  # noqa: BLE001 - one form failing must not hide the others
            row["error"] = summarize_exception(exc)
        rows.append(row)
    return rows


def compile_stages(model_path: Path, cluster: Path, stages: int, batch_size: int,
                   precision: str, out: Path) -> Path:
    plan_dir = out / "plans" / f"{model_path.stem}-{precision}-{stages}"
    partc_command("compile", str(model_path), "--cluster", str(cluster), "--stages",
                  str(stages), "--replicas", "1", "-b", str(batch_size), "--precision",
                  precision, "-o", str(plan_dir))
    return plan_dir


def partc_command(*args: str) -> None:
    """Run `python -m partc ARGS` here; RuntimeError with its last error line when it fails."""
    proc = subprocess.run([sys.executable, "-m", "partc", *args], capture_output=True,
                          text=True, cwd=ROOT)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise RuntimeError(f"partc {args[0]} failed (exit {proc.returncode}): {tail}")


def launch_once(model_path: Path, spec: DeviceSpec, precision: str, batch_size: int,
                steps: int, costs: str, out: Path,
                forms: tuple[ModuleType, torch.device, int, int] | None = None
                ) -> dict[str, Any]:
    """One end-to-end run: `partc compile` of the whole model as one stage on one device, priced
    analytically from `spec` (costs "analytic") or on this machine's device as compile's
    default does for `--cluster local` (costs "measured": a profile measured here), `partc
    launch` of it for `steps` steps with --metrics and --trace, and the run's median step, stage
    times, peak memory and top kernels beside the plan's predictions. With `forms` (the model
    file's module, the device, repeats, warm-up), the plan's model is first timed in its three
    runtime forms (`runtime_forms`)."""
    from partc.plans.plan import load_plan
    from partc.plans.run_metrics import RunMetrics

    cluster = str(cluster_file(spec, 1, out / "clusters")) if costs == "analytic" else "local"
    plan_dir = out / "plans" / f"{model_path.stem}-{precision}-launch-{costs}"
    metrics = out / f"launch-{model_path.stem}-{precision}-{costs}.jsonl"
    trace = out / f"trace-{model_path.stem}-{precision}-{costs}"
    metrics.unlink(missing_ok=True)
    partc_command("compile", str(model_path), "--cluster", cluster, "--costs", costs,
                  "--stages", "1", "--replicas", "1", "--microbatches", "1", "-b",
                  str(batch_size), "--precision", precision, "-o", str(plan_dir))
    forms_rows = None
    if forms is not None:
        module, device, repeats, warmup = forms
        forms_rows = runtime_forms(plan_dir, module, device, repeats, warmup, out)
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the launch runs in a process of its own
    partc_command("launch", str(plan_dir / "plan.yaml"), "--steps", str(steps),
                  "--metrics", str(metrics), "--trace", str(trace))
    plan = load_plan(plan_dir)
    run = RunMetrics.load(metrics)
    stage, measured = plan.stages[0], run.stage_summaries()[0]
    return {"model": model_path.stem, "precision": precision, "batch_size": batch_size,
            "costs": costs, "device_config": plan.cluster.device.name,
            "steps": steps, "timed_steps": len(run.timed_steps()),
            "predicted": {"iteration_s": plan.predicted.iteration_s,
                          "forward_s": stage.forward_s, "backward_s": stage.backward_s,
                          "optimizer_s": plan.predicted.optimizer_s[0],
                          "peak_memory_bytes": plan.predicted.peak_memory_bytes[0]},
            "measured": {"iteration_s": run.median_step_s(),
                         "iteration": spread([s.step_s for s in run.timed_steps()]),
                         "forward_s": measured.forward_s, "backward_s": measured.backward_s,
                         "optimizer_s": measured.optimizer_s,
                         "peak_memory_bytes": measured.peak_memory_bytes,
                         "memory_method": run.memory_method},
            "trace": str(trace / "rank0.txt"), "top": trace_top(trace / "rank0.txt"),
            "forms": forms_rows}


def trace_top(table: Path, rows: int = 12) -> list[str]:
    """The first `rows` operator lines of a `partc launch --trace` table (its header and the
    column titles skipped)."""
    if not table.is_file():
        return []
    lines = [ln.rstrip() for ln in table.read_text().splitlines()]
    body = [ln for ln in lines[lines.index(next(ln for ln in lines if ln.startswith("-"))):]
            if ln and not ln.startswith("-") and "Self" not in ln
            and not ln.startswith(("Self CPU time total", "Self CUDA time total"))]
    return body[:rows]


# ------------------------------------------------------------------------------------------------
# Report

def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:.3g}"


def _gib(b: int | None) -> str:
    return "-" if b is None else f"{b / 2**30:.2f}"


def _err(predicted: float | None, measured: float | None) -> str:
    if predicted is None or not measured:
        return "-"
    return f"{(predicted - measured) / measured:+.0%}"


def config_table(report: dict[str, Any]) -> list[str]:
    """fwd+bwd as each device config predicts it, when the run priced with more than one."""
    labels = list(report.get("device_configs", {}))
    if len(labels) < 2:
        return []
    lines = ["", "fwd+bwd (ms) as each device config predicts it; err vs the measured median:", "",
             "| model | precision | batch | measured | "
             + " | ".join(f"{label} | err" for label in labels) + " |",
             "|---|---|---:|---:|" + "---:|---:|" * len(labels)]
    for row in report["results"]:
        if "predicted_by" not in row or "measured" not in row:
            continue
        measured = row["measured"]["forward_backward"]["median_s"]
        cells = [f"{_ms(row['predicted_by'][label]['forward_backward_s'])} | "
                 f"{_err(row['predicted_by'][label]['forward_backward_s'], measured)}"
                 for label in labels]
        lines.append(f"| {row['model']} | {row['precision']} | {row['batch_size']} "
                     f"| {_ms(measured)} | " + " | ".join(cells) + " |")
    return lines


def memory_table(report: dict[str, Any]) -> list[str]:
    """The measured memory of a training step by phase beside the predicted terms (GiB)."""
    rows = [r for r in report["results"]
            if r.get("measured", {}).get("memory_phases") and "predicted" in r]
    if not rows:
        return []
    lines = ["", "Memory by phase (GiB). Measured: parameters and AdamW states before the step; "
             "what the forward leaves alive above them (its saved tensors); what the backward "
             "leaves (the gradients); the peaks of forward, backward and the optimizer step. "
             "Predicted: the terms of `stage_memory`.", "",
             "| model | precision | params+states meas / pred | saved by fwd meas / pred "
             "| grads meas / pred | fwd peak | bwd peak | step peak | predicted peak "
             "(workspace) |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        ph, mem = row["measured"]["memory_phases"], row["predicted"]["memory"]
        base = ph["parameters_and_states"]
        lines.append(
            f"| {row['model']} | {row['precision']} "
            f"| {_gib(base)} / {_gib(mem['parameters'] + mem['optimizer_state'])} "
            f"| {_gib(ph['after_forward'] - base)} / "
            f"{_gib(mem['activations'] + mem['communication'])} "
            f"| {_gib(ph['after_backward'] - base)} / {_gib(mem['gradients'])} "
            f"| {_gib(ph['forward_peak'])} | {_gib(ph['backward_peak'])} "
            f"| {_gib(ph['step_peak'])} | {_gib(mem['total'])} ({_gib(mem['workspace'])}) |")
    return lines


def markdown(report: dict[str, Any]) -> str:
    lines = [
        "# GPU truth: partc's predictions vs measurements",
        "",
        f"device: {report['device']} ({report['device_name']}); priced with device config "
        f"`{report['device_config']['name']}` ({report['device_config']['source']})",
        f"torch {report['torch']}, transformers {report['transformers']}, "
        f"{report['repeats']} repeats after {report['warmup']} warm-up",
        "",
        "Times in ms (median, [min, max]); error = (predicted - measured) / measured.",
        "",
        "| model | precision | batch | fwd measured | fwd predicted | err | fwd+bwd measured "
        "| fwd+bwd predicted | err | peak GiB measured | peak GiB predicted | err |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in report["results"]:
        if "error" in row:
            lines.append(f"| {row['model']} | {row['precision']} | {row.get('batch_size', '-')} "
                         f"| failed: {row['error']} |||||||||")
            continue
        m, p = row["measured"], row["predicted"]
        f, s = m["forward"], m["forward_backward"]
        lines.append(
            f"| {row['model']} | {row['precision']} | {row['batch_size']} "
            f"| {_ms(f['median_s'])} [{_ms(f['min_s'])}, {_ms(f['max_s'])}] "
            f"| {_ms(p['forward_s'])} | {_err(p['forward_s'], f['median_s'])} "
            f"| {_ms(s['median_s'])} [{_ms(s['min_s'])}, {_ms(s['max_s'])}] "
            f"| {_ms(p['forward_backward_s'])} | {_err(p['forward_backward_s'], s['median_s'])} "
            f"| {_gib(m['peak_memory_bytes'])} | {_gib(p['peak_memory_bytes'])} "
            f"| {_err(p['peak_memory_bytes'], m['peak_memory_bytes'])} |")
    lines += config_table(report) + memory_table(report)
    notes = sorted({row["predicted"]["note"] for row in report["results"] if "predicted" in row})
    lines += ["", "Notes:", *(f"- {n}" for n in notes),
              "- measured peak memory: torch.cuda.max_memory_allocated over forward, backward and "
              "an AdamW step once its states exist (no CUDA context, no allocator slack); "
              "predicted: partc.solve.memory.stage_memory of the whole model as one stage, one "
              "micro-batch, AdamW.",
              "- bf16-mixed is measured with torch.autocast(bfloat16) over fp32 weights; partc "
              "prices bf16 copies of the weights plus fp32 masters."]
    staged = [row for row in report["results"] if row.get("stages")]
    for row in staged:
        lines += ["", f"## {row['model']} ({row['precision']}): stages of `partc compile "
                  f"--stages {report['stages']}` (stage files run as launch runs them, "
                  f"micro-batch {row['stages'][0]['microbatch_size']})", "",
                  "| stage | fwd measured | fwd predicted | err | bwd measured | bwd predicted "
                  "| err |", "|---:|---:|---:|---:|---:|---:|---:|"]
        for st in row["stages"]:
            f, b = st["forward"], st["backward"]
            lines.append(f"| {st['stage']} | {_ms(f['median_s'])} | "
                         f"{_ms(st['predicted_forward_s'])} "
                         f"| {_err(st['predicted_forward_s'], f['median_s'])} "
                         f"| {_ms(b['median_s'])} | {_ms(st['predicted_backward_s'])} "
                         f"| {_err(st['predicted_backward_s'], b['median_s'])} |")
    for launch in report.get("launch", []):
        if "error" in launch:
            lines.append(f"\nEnd-to-end launch ({launch['costs']} costs): failed: "
                         f"{launch['error']}")
            continue
        p, m = launch["predicted"], launch["measured"]
        it = m["iteration"]
        lines += ["", f"## End to end: `partc launch` of {launch['model']} ({launch['precision']}, "
                  f"batch {launch['batch_size']}, one stage on one device, {launch['costs']} "
                  f"costs from `{launch['device_config']}`, {launch['steps']} steps, median of "
                  f"the {launch['timed_steps']} timed)", "",
                  "| | measured | predicted | err |", "|---|---:|---:|---:|",
                  f"| iteration ms | {_ms(it['median_s'])} [{_ms(it['min_s'])}, "
                  f"{_ms(it['max_s'])}] | {_ms(p['iteration_s'])} "
                  f"| {_err(p['iteration_s'], it['median_s'])} |"]
        for key, label in (("forward_s", "forward ms"), ("backward_s", "backward ms"),
                           ("optimizer_s", "optimizer step ms")):
            lines.append(f"| {label} | {_ms(m[key])} | {_ms(p[key])} "
                         f"| {_err(p[key], m[key])} |")
        lines.append(f"| peak memory GiB ({m['memory_method']}) | {_gib(m['peak_memory_bytes'])} "
                     f"| {_gib(p['peak_memory_bytes'])} "
                     f"| {_err(p['peak_memory_bytes'], m['peak_memory_bytes'])} |")
        lines += forms_table(launch.get("forms") or [])
        if launch.get("top"):
            lines += ["", f"Top operators of the launch's traced step, rank 0 "
                      f"(`partc launch --trace`, whole table in {launch['trace']}):", "", "```",
                      *launch["top"], "```"]
    for row in report["results"]:
        if row.get("stages_error"):
            lines.append(f"\n{row['model']} ({row['precision']}) stages: {row['stages_error']}")
    return "\n".join(lines) + "\n"


def forms_table(forms: list[dict[str, Any]]) -> list[str]:
    """The model in its three runtime forms (`runtime_forms`), each with its top kernels."""
    if not forms:
        return []
    lines = ["", f"The same model in the forms a launch passes through (micro-batch "
             f"{forms[0]['microbatch_size']}, {forms[0]['precision']}; `runtime_forms`):", "",
             "| form | fwd ms | fwd+bwd ms | peak above weights GiB | top by own time (ms) |",
             "|---|---:|---:|---:|---|"]
    for row in forms:
        if "error" in row:
            lines.append(f"| {row['form']} | failed: {row['error']} ||||")
            continue
        top = "; ".join(f"{t['name'][:50]} {t['self_ms']:.2f}" for t in row["top"][:4])
        lines.append(f"| {row['form']} | {_ms(row['forward']['median_s'])} "
                     f"| {_ms(row['forward_backward']['median_s'])} "
                     f"| {_gib(row.get('peak_above_weights_bytes'))} | {top} |")
    return lines


def config_label(report: dict[str, Any], name: str) -> str | None:
    """The label the report priced with the config named `name` under: the one passed by that
    name where a calibrated config shares it (`config_labels`), or None."""
    labels = [label for label, spec in report.get("device_configs", {}).items()
              if spec.get("name") == name]
    return labels[0] if len(labels) == 1 else \
        next((label for label in labels if label.endswith(f"({name})")), None)


def checked_against_line(reports: list[dict[str, Any]], name: str) -> str:
    """What these reports show of device config `name`'s predictions, worst first, as the
    config's `checked_against` text (DeviceSpec.checked_against): the whole-model fwd+bwd
    errors, the peak memory over the measured, and, where the report's stage plans and launch
    were priced with this config, their errors."""
    fwd_bwd: list[tuple[float, str]] = []
    memory: list[float] = []
    stages: list[float] = []
    launches: list[str] = []
    failed = 0
    seen: set[tuple[str, str, str]] = set()
    for report in reports:
        label = config_label(report, name)
        if label is None:
            raise SystemExit(f"a report was not priced with the device config {name!r} "
                             f"(it has {sorted(report.get('device_configs', {}))})")
        seen.add((report["device_name"], report["torch"], report.get("date", "undated")))
        # the first config priced the stage plans and the launch (report["device_config"])
        primary = report["device_configs"][label] == report["device_config"]
        for row in report["results"]:
            if "error" in row:
                failed += 1
                continue
            measured = row["measured"]["forward_backward"]["median_s"]
            predicted = row["predicted_by"][label]
            fwd_bwd.append((predicted["forward_backward_s"] / measured - 1,
                            f"{row['model']} {row['precision']}"))
            if row["measured"]["peak_memory_bytes"]:
                memory.append(predicted["peak_memory_bytes"] / row["measured"]["peak_memory_bytes"])
            if primary:
                stages += [st[f"predicted_{k}_s"] / st[k]["median_s"] - 1
                           for st in row.get("stages") or [] for k in ("forward", "backward")]
        for launch in report.get("launch") or []:
            if primary and "error" not in launch:
                ratio = launch["measured"]["iteration"]["median_s"] / \
                    launch["predicted"]["iteration_s"]
                launches.append(f"a launched one-stage {launch['model']} {launch['precision']} "
                                f"plan ran {ratio:.2f}x its predicted iteration")
    if not fwd_bwd:
        raise SystemExit("no measured row to summarise")
    where = "; ".join(f"{device}, torch {torch_}, {date}" for device, torch_, date in sorted(seen))
    worst = max(fwd_bwd, key=lambda e: abs(e[0]))
    parts = [f"whole-model fwd+bwd {min(e for e, _ in fwd_bwd):+.0%}.."
             f"{max(e for e, _ in fwd_bwd):+.0%} over {len(fwd_bwd)} model x precision rows "
             f"(worst {worst[1]} {worst[0]:+.0%})"]
    if memory:
        parts.append(f"peak memory {min(memory):.2f}-{max(memory):.2f}x the measured")
    if stages:
        parts.append(f"pinned plans' stages {min(stages):+.0%}..{max(stages):+.0%}")
    parts += launches
    if failed:
        parts.append(f"{failed} row(s) failed to run")
    return f"{where}: " + ", ".join(parts) + " (bench/gpu_truth.py)"


def save(report: dict[str, Any], out: Path) -> str:
    """Write the report so far (after each row: a run stopped midway keeps what it measured)."""
    write_atomic(out / "gpu_truth.json", json.dumps(report, indent=1, sort_keys=True) + "\n")
    text = markdown(report)
    write_atomic(out / "gpu_truth.md", text)
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="folder for the report")
    parser.add_argument("--checked-against", nargs="+", type=Path, metavar="JSON",
                        help="instead of measuring: print what these gpu_truth.json reports "
                             "show of --config-name's predictions, as that device config's "
                             "checked_against line")
    parser.add_argument("--config-name", default="h100-80gb",
                        help="the datasheet device config --checked-against summarises")
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N, or cpu (smoke tests)")
    parser.add_argument("--device-config", action="append", default=None,
                        help="device config name or YAML path to price with; repeat it to "
                             "price the same measurements with several (the first prices the "
                             "stage plans; default: the shipped config of this GPU, or cpu)")
    parser.add_argument("--quick", action="store_true", help="tiny models (a smoke test)")
    parser.add_argument("--models", default=None,
                        help="comma-separated subset of the model names (bert-large, "
                             "gpt2-medium; bert, gpt2 with --quick)")
    parser.add_argument("--precisions", default=",".join(PRECISIONS))
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=None,
                        help="override every model's batch size")
    parser.add_argument("--capture-batch", type=int, default=2,
                        help="batch size partc captures at (costs scale to any batch)")
    parser.add_argument("--stages", type=int, default=4,
                        help="compile a pinned K-stage plan and time its stages (0: skip)")
    parser.add_argument("--launch", default="first:bf16-mixed",
                        help="MODEL:PRECISION to compile as one stage and `partc launch` "
                             "end to end ('first': the first model; 'none': skip)")
    parser.add_argument("--launch-steps", type=int, default=12)
    parser.add_argument("--forms", action=argparse.BooleanOptionalAction, default=True,
                        help="before the first launch, time and profile its model in the three "
                             "forms it passes through: eager, exported, stage file")
    parser.add_argument("--launch-costs", default="analytic",
                        help="comma-separated: 'analytic' (priced from the first device "
                             "config), 'measured' (`--cluster local`: profiled on this device, "
                             "compile's default here); one launch each")
    args = parser.parse_args(argv)
    if args.checked_against:
        reports = [json.loads(path.read_text()) for path in args.checked_against]
        print(f"checked_against: {json.dumps(checked_against_line(reports, args.config_name))}")
        return 0
    if args.out is None:
        parser.error("--out is required (or --checked-against JSON...)")
    started = time.perf_counter()

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("CUDA is not available (use --device cpu --quick for a smoke test)")
    precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    bad = [p for p in precisions if p not in PRECISIONS]
    if bad:
        parser.error(f"unknown precision {bad[0]!r}; choose from {', '.join(PRECISIONS)}")
    cases = model_cases(args.quick)
    if args.models:
        wanted = {m.strip() for m in args.models.split(",")}
        cases = [c for c in cases if c.name in wanted]
        if not cases:
            parser.error(f"no model among {sorted(wanted)}")
    launch_case: ModelCase | None = None
    launch_name, _, launch_precision = args.launch.partition(":")
    launch_precision = launch_precision or "fp32"
    if launch_name != "none":
        launch_case = cases[0] if launch_name == "first" else \
            next((c for c in cases if c.name == launch_name), None)
        if launch_case is None or launch_precision not in PRECISIONS:
            parser.error(f"--launch {args.launch!r}: MODEL:PRECISION with a model among "
                         f"{[c.name for c in cases]} and a precision among {PRECISIONS}")
    launch_costs = [c.strip() for c in args.launch_costs.split(",") if c.strip()]
    if any(c not in ("analytic", "measured") for c in launch_costs):
        parser.error("--launch-costs: a comma-separated list of analytic and measured")
    specs = device_configs(args, device)
    spec = specs[0]
    labels = config_labels(specs, args.device_config or ["shipped"])
    args.out.mkdir(parents=True, exist_ok=True)
    cluster = cluster_file(spec, args.stages, args.out / "clusters") if args.stages > 0 else None

    import transformers
    report: dict[str, Any] = {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda"
        else platform.processor() or platform.machine(),
        "device_config": spec.to_dict(),
        "device_configs": {label: sp.to_dict() for label, sp in zip(labels, specs, strict=True)},
        "torch": torch.__version__,
        "transformers": transformers.__version__, "repeats": args.repeats,
        "warmup": args.warmup, "stages": args.stages, "quick": args.quick,
        "date": time.strftime("%Y-%m-%d", time.gmtime()), "results": []}
    for case in cases:
        batch = args.batch_size or case.batch_size
        path = write_model_file(case, args.out / "models")
        module = import_model_file(path)
        t0 = time.perf_counter()
        result = capture_graph(path, args.capture_batch, onnx=False)
        saved: dict[str, SavedActivations] = {}
        print(f"{case.name}: captured {len(result.graph.nodes)} operators in "
              f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)
        for precision in precisions:
            row: dict[str, Any] = {"model": case.name, "title": case.title,
                                   "precision": precision, "batch_size": batch}
            try:
                row["predicted_by"] = {label: predict(result, sp, precision, batch, saved)
                                       for label, sp in zip(labels, specs, strict=True)}
                row["predicted"] = row["predicted_by"][labels[0]]
                row["measured"] = measure_model(module, batch, device, precision,
                                                args.repeats, args.warmup)
            except (RuntimeError, torch.cuda.OutOfMemoryError) as exc:  # keep the other rows
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            if cluster is not None and "error" not in row:
                try:
                    plan_dir = compile_stages(path, cluster, args.stages, batch, precision,
                                              args.out)
                    row["plan"] = str(plan_dir)
                    row["stages"] = time_stages(plan_dir, module, device, args.repeats,
                                                args.warmup)
                except Exception as exc:  # noqa: BLE001 - optional part: report, do not stop
                    row["stages_error"] = summarize_exception(exc)
            report["results"].append(row)
            save(report, args.out)
            print(f"{case.name} {precision}: done at {time.perf_counter() - started:.0f} s",
                  file=sys.stderr)

    report["launch"] = []
    for i, costs in enumerate(launch_costs if launch_case is not None else []):
        assert launch_case is not None
        path = write_model_file(launch_case, args.out / "models")
        forms = (import_model_file(path), device, args.repeats, args.warmup) \
            if args.forms and i == 0 else None
        try:
            report["launch"].append(launch_once(
                path, spec, launch_precision, args.batch_size or launch_case.batch_size,
                args.launch_steps, costs, args.out, forms=forms))
        except Exception as exc:  # noqa: BLE001 - optional part: report, do not stop
            report["launch"].append({"costs": costs,
                                     "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
        save(report, args.out)
        print(f"launch ({costs} costs): done at {time.perf_counter() - started:.0f} s",
              file=sys.stderr)

    text = save(report, args.out)
    print(text)
    print(f"wrote {args.out / 'gpu_truth.md'} and {args.out / 'gpu_truth.json'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
