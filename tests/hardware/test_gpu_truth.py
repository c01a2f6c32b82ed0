"""bench/gpu_truth.py runs end to end on the CPU with tiny models (a smoke test of the script any
CUDA machine runs for the real numbers)."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_gpu_truth_smoke_on_cpu(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_truth.py"), "--out", str(tmp_path),
         "--device", "cpu", "--quick", "--models", "gpt2", "--repeats", "2", "--warmup", "1",
         "--device-config", "cpu", "--device-config", "h100-80gb", "--launch-steps", "4"],
        capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_truth.json").read_text())
    rows = report["results"]
    assert [r["precision"] for r in rows] == ["fp32", "bf16-mixed"]
    for row in rows:
        assert "error" not in row, row["error"]
        assert row["measured"]["forward_backward"]["median_s"] > 0
        assert row["predicted"]["forward_backward_s"] > 0
        assert row["predicted"]["peak_memory_bytes"] > 0
        assert "stages_error" not in row, row["stages_error"]
        assert len(row["stages"]) == 4
        # the stage files run as launch runs them, under the plan's precision
        assert {st["precision"] for st in row["stages"]} == {row["precision"]}
        # one measurement priced by both device configs; the first is the headline
        assert set(row["predicted_by"]) == {"cpu", "h100-80gb"}
        assert row["predicted"] == row["predicted_by"]["cpu"]
        assert row["predicted_by"]["h100-80gb"]["forward_backward_s"] \
            != row["predicted"]["forward_backward_s"]
    # one end-to-end launch (bf16-mixed, priced from the first config), read from its metrics
    [launch] = report["launch"]
    assert "error" not in launch, launch["error"]
    assert (launch["precision"], launch["costs"], launch["device_config"]) \
        == ("bf16-mixed", "analytic", "cpu")
    assert launch["measured"]["iteration_s"] > 0 and launch["predicted"]["iteration_s"] > 0
    assert launch["measured"]["peak_memory_bytes"] > 0
    # its traced step's top operators, and its model timed and profiled in the three forms
    assert sum("aten::" in line for line in launch["top"]) >= 5, launch["top"]
    assert [f["form"] for f in launch["forms"]] == ["eager", "exported", "stage"]
    for form in launch["forms"]:
        assert "error" not in form, form["error"]
        assert form["forward_backward"]["median_s"] > form["forward"]["median_s"] > 0
        assert form["top"] and Path(form["table"]).read_text().count("aten::") >= 5
    table = (tmp_path / "gpu_truth.md").read_text()
    assert "| gpt2 | fp32 | 2 |" in table and "stages of `partc compile --stages 4`" in table
    assert "as each device config predicts it" in table
    assert "## End to end: `partc launch` of gpt2 (bf16-mixed" in table
    assert "The same model in the forms a launch passes through" in table
    assert "Top operators of the launch's traced step" in table
    # the shipped config's checked_against line from that report (what gpu_session.sh writes)
    line = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_truth.py"), "--checked-against",
         str(tmp_path / "gpu_truth.json"), "--config-name", "h100-80gb"],
        capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert line.returncode == 0, line.stderr[-2000:]
    assert line.stdout.startswith('checked_against: "') and "whole-model fwd+bwd " in line.stdout
    assert "over 2 model x precision rows" in line.stdout


def _report(name: str, calibrated: str) -> dict[str, object]:
    """A gpu_truth.json report's shape: two configs priced one BERT row; the calibrated one
    first, so it priced the stages and the launch."""
    first, second = {"name": calibrated, "calibrated_on": "NVIDIA H100"}, {"name": name}
    row = {"model": "bert-large", "precision": "bf16-mixed",
           "measured": {"forward_backward": {"median_s": 0.080}, "peak_memory_bytes": 100},
           "predicted_by": {calibrated: {"forward_backward_s": 0.064, "peak_memory_bytes": 102},
                            name: {"forward_backward_s": 0.088, "peak_memory_bytes": 104}},
           "stages": [{"forward": {"median_s": 0.010}, "predicted_forward_s": 0.004,
                       "backward": {"median_s": 0.020}, "predicted_backward_s": 0.021}]}
    failed = {"model": "gpt2-medium", "precision": "fp32", "error": "OutOfMemoryError: ..."}
    return {"device_name": "NVIDIA H100 80GB HBM3", "torch": "2.11.0", "date": "2026-12-07",
            "device_config": first, "device_configs": {calibrated: first, name: second},
            "results": [row, failed],
            "launch": [{"model": "bert_large", "precision": "bf16-mixed",
                        "measured": {"iteration": {"median_s": 0.182}},
                        "predicted": {"iteration_s": 0.076}}]}


def test_the_checked_against_line_says_what_the_reports_measured() -> None:
    spec = importlib.util.spec_from_file_location("gpu_truth", ROOT / "bench" / "gpu_truth.py")
    assert spec is not None and spec.loader is not None
    gpu_truth = importlib.util.module_from_spec(spec)
    sys.modules["gpu_truth"] = gpu_truth  # its dataclasses look their module up
    spec.loader.exec_module(gpu_truth)
    checked_against_line = gpu_truth.checked_against_line
    shipped = checked_against_line([_report("h100-80gb", "nvidia-h100")], "h100-80gb")
    assert shipped == ("NVIDIA H100 80GB HBM3, torch 2.11.0, 2026-12-07: whole-model fwd+bwd "
                       "+10%..+10% over 1 model x precision rows (worst bert-large bf16-mixed "
                       "+10%), peak memory 1.04-1.04x the measured, 1 row(s) failed to run "
                       "(bench/gpu_truth.py)")
    # the calibrated config priced the stage plan and the launch: their errors are its own
    calibrated = checked_against_line([_report("h100-80gb", "nvidia-h100")], "nvidia-h100")
    assert "-20%..-20%" in calibrated and "pinned plans' stages -60%..+5%" in calibrated
    assert "a launched one-stage bert_large bf16-mixed plan ran 2.39x its predicted" in calibrated
    with pytest.raises(SystemExit, match="not priced with the device config 'a100-80gb'"):
        checked_against_line([_report("h100-80gb", "nvidia-h100")], "a100-80gb")
