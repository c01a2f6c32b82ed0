"""`partc profile` for every model compile accepts: meta models with buffers computed at build
time, the onnxruntime/torch timing choice, and precision (real torch, onnxruntime, HF models)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from conftest import EXAMPLES, TEST_MODELS, captured
from partc_process import run_partc

from partc.cost.measured import ProfileOptions, measure_costs, profile_model
from partc.cost.ort_profiler import ProfileError, choose_provider
from partc.cost.table import CostTable, Curve, ProfileFileError
from partc.cost.torch_profiler import precision_autocast
from partc.progress import Progress

FAST = ProfileOptions(runs=3, warmup=1, totals_budget_s=0.2)  # (totals: 0.2 s, not 1 s)
CPU = torch.device("cpu")


class Notes(Progress):
    """Progress that keeps the warnings it is given (what the CLI prints to stderr)."""

    def __init__(self) -> None:
        self.warnings: list[str] = []

    def warn(self, message: str) -> None:
        self.warnings.append(message)


# ---- meta models whose buffers are computed at build time ---------------------------------------

def _program_code(result) -> list[str]:  # type: ignore[no-untyped-def]
    """The captured program's generated code and every sub-graph's (export may keep a no-grad
    region as one)."""
    gm = result.capture.exported.graph_module
    return [m.code for m in [gm, *gm.modules()] if isinstance(m, torch.fx.GraphModule)]


def test_meta_llama_with_rope_buffers_is_profiled() -> None:
    # HF Llama computes RoPE's inv_freq in __init__ and uses it inside a no-grad region, which
    # export keeps as a sub-graph naming the meta device
    result = captured(TEST_MODELS / "tiny_llama_meta.py")
    before = _program_code(result)
    assert result.graph.on_meta and result.onnx is not None and result.onnx.status == "ok"
    table = measure_costs(result, CPU, FAST, Progress())
    assert table.methods().get("onnxruntime", 0) > 50
    assert table.total_forward_s(4) > 0 and table.total_backward_s(4) > 0
    assert table.total_saved_bytes(4) > table.total_saved_bytes(2) > 0
    # profiling left the captured programs as they were: the batch-4 program still exports to
    # ONNX (it names the meta device), so onnxruntime timed both sizes
    measured = table.source.calibration["measured"]
    assert measured["2"]["ort_forward_s"] and measured["4"]["ort_forward_s"]
    # ... and the program's code, sub-graphs included, is what the capture made
    assert _program_code(result) == before


# ---- onnxruntime or torch ---------------------------------------------------------------------

def test_provider_choice_falls_back_to_torch_only_for_auto() -> None:
    cpu_only = ["AzureExecutionProvider", "CPUExecutionProvider"]
    both = ["CUDAExecutionProvider", "CPUExecutionProvider"]
    assert choose_provider("auto", "cpu", cpu_only).provider == "CPUExecutionProvider"
    assert choose_provider("auto", "cuda", both).provider == "CUDAExecutionProvider"
    assert choose_provider("onnxruntime", "cuda", both).fallback == ""
    torch_choice = choose_provider("torch", "cuda", both)
    assert torch_choice.provider is None and torch_choice.fallback == ""

    fallback = choose_provider("auto", "cuda", cpu_only)
    assert fallback.provider is None and "no CUDAExecutionProvider" in fallback.fallback
    with pytest.raises(ProfileError, match="no CUDAExecutionProvider") as info:
        choose_provider("onnxruntime", "cuda", cpu_only)
    assert "onnxruntime-gpu" in info.value.hint and "--method" in info.value.hint

    bf16 = choose_provider("auto", "cpu", cpu_only, "bf16-mixed")
    assert bf16.provider is None and "autocast" in bf16.fallback
    with pytest.raises(ProfileError, match="bf16-mixed") as info:
        choose_provider("onnxruntime", "cpu", cpu_only, "bf16-mixed")
    assert "--method" in info.value.hint


# ---- precision --------------------------------------------------------------------------------

def test_precision_autocast_is_launch_s_bf16() -> None:
    layer = torch.nn.Linear(8, 8)
    x = torch.randn(2, 8)
    with precision_autocast("bf16-mixed", "cpu"):
        assert layer(x).dtype == torch.bfloat16
    with precision_autocast("fp32", "cpu"):
        assert layer(x).dtype == torch.float32


@pytest.fixture(scope="module")
def mlp_fp32_and_bf16() -> tuple[CostTable, CostTable, list[str]]:
    result = captured(EXAMPLES / "mlp.py")
    fp32 = measure_costs(result, CPU, FAST, Progress())
    notes = Notes()
    bf16 = measure_costs(result, CPU, ProfileOptions(runs=3, warmup=1, precision="bf16-mixed"),
                         notes)
    return fp32, bf16, notes.warnings


def test_bf16_profile_measures_under_autocast(
        mlp_fp32_and_bf16: tuple[CostTable, CostTable, list[str]]) -> None:
    fp32, bf16, warnings = mlp_fp32_and_bf16
    assert fp32.source.precision == "fp32" and bf16.source.precision == "bf16-mixed"
    assert fp32.total_forward_s(4) != bf16.total_forward_s(4)
    # onnxruntime cannot autocast: torch timed every node, and the profile says why
    assert "onnxruntime" not in bf16.methods() and bf16.source.provider == ""
    assert "autocast" in bf16.source.calibration["fallback"]
    assert "fallback" not in fp32.source.calibration
    assert len(warnings) == 1 and "autocast" in warnings[0]
    # saved bytes under the same autocast: the first linear keeps its input in bf16 (half the
    # bytes per sample); linears whose input needs a gradient keep the bf16 copy of their
    # weight, a cost that does not grow with the batch
    first = next(n.name for n in fp32.graph.nodes if n.kind == "linear")

    def per_sample(c: Curve) -> float:
        return (c.at(4) - c.at(2)) / 2

    assert per_sample(bf16.cost(first).saved) == pytest.approx(
        per_sample(fp32.cost(first).saved) / 2)
    fixed = {t.source.precision: sum(c.saved.at(0) for c in t.nodes.values())
             for t in (fp32, bf16)}
    assert fixed["fp32"] < 1 and fixed["bf16-mixed"] >= 4 * (256 * 256 * 2)  # 4 hidden layers


def test_profile_precision_round_trips_and_is_checked(
        mlp_fp32_and_bf16: tuple[CostTable, CostTable, list[str]], tmp_path: Path) -> None:
    fp32, bf16, _ = mlp_fp32_and_bf16
    path = bf16.save(tmp_path / "bf16.yaml")
    assert yaml.safe_load(path.read_text())["precision"] == "bf16-mixed"
    assert CostTable.load(path, bf16.graph).source == bf16.source
    assert CostTable.load(path, bf16.graph, precision="bf16-mixed").source.precision == \
        "bf16-mixed"
    with pytest.raises(ProfileFileError, match="precision bf16-mixed, not fp32") as info:
        CostTable.load(path, bf16.graph, precision="fp32")
    assert "profile again with --precision fp32" in info.value.hint

    # a profile written before the precision key existed is an fp32 one
    old = tmp_path / "old.yaml"
    text = fp32.save(tmp_path / "fp32.yaml").read_text()
    old.write_text("".join(ln for ln in text.splitlines(keepends=True)
                           if not ln.startswith("precision:")))
    assert "precision" not in yaml.safe_load(old.read_text())
    assert CostTable.load(old, fp32.graph, precision="fp32").source.precision == "fp32"
    with pytest.raises(ProfileFileError, match="precision fp32, not bf16-mixed") as info:
        CostTable.load(old, fp32.graph, precision="bf16-mixed")
    assert info.value.hint == "profile again with --precision bf16-mixed"


def test_unknown_precision_is_a_user_error() -> None:
    with pytest.raises(ProfileError, match="unknown precision") as info:
        profile_model(EXAMPLES / "mlp.py", 2, ProfileOptions(precision="fp8"))  # type: ignore[arg-type]
    assert "bf16-mixed" in info.value.hint


def _partc(*args: str) -> subprocess.CompletedProcess[str]:
    return run_partc(*args)


def test_cli_profile_precision(tmp_path: Path) -> None:
    out = tmp_path / "bf16.yaml"
    proc = _partc("profile", str(EXAMPLES / "mlp.py"), "--precision", "bf16-mixed",
                  "--runs", "2", "--warmup", "1", "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "bf16-mixed" in proc.stdout.splitlines()[0]
    assert proc.stderr.count("onnxruntime cannot autocast") == 1
    assert yaml.safe_load(out.read_text())["precision"] == "bf16-mixed"
    # an explicit onnxruntime that cannot be honoured: one line with a hint, nothing measured
    proc = _partc("profile", str(EXAMPLES / "mlp.py"), "--precision", "bf16-mixed",
                  "--method", "onnxruntime", "-o", str(tmp_path / "x.yaml"))
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("partc: error: onnxruntime cannot time bf16-mixed") and "(hint: " in last
    assert "Traceback" not in proc.stderr and not (tmp_path / "x.yaml").exists()


def test_scalars_bf16_cannot_hold_are_saturated_for_bf16_mixed(tmp_path: Path) -> None:
    """float32's most negative value baked into a masked_fill: saturated to bfloat16's for a
    bf16-mixed program (what the model computes eagerly under autocast), left for fp32; a
    bf16-mixed plan of it is measured, compiled and trained (torch refused the float32 value
    on the bfloat16 scores)."""
    from partc.cost.precision_scalars import saturate_scalars
    from partc.frontend.capture import capture_graph

    model = TEST_MODELS / "fp32_sentinel.py"
    program = capture_graph(model, 2).capture.exported

    def fills(module: torch.fx.GraphModule) -> list[float]:
        return [n.args[2] for n in module.graph.nodes
                if n.target is torch.ops.aten.masked_fill.Scalar]

    fp32 = program.module()
    assert saturate_scalars(fp32, "fp32") == 0 and fills(fp32) == [torch.finfo(torch.float32).min]
    bf16 = program.module()
    assert saturate_scalars(bf16, "bf16-mixed") == 1
    assert fills(bf16) == [torch.finfo(torch.bfloat16).min]
    x = torch.randn(2, 8, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16(x).float().sum().backward()
    partc = str(Path(sys.executable).parent / "partc")
    out = tmp_path / "p"
    proc = subprocess.run([partc, "compile", str(model), "-b", "4", "--stages", "2", "--cluster",
                           "cpu", "--precision", "bf16-mixed", "-o", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    proc = subprocess.run([partc, "launch", str(out), "--steps", "1"], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
