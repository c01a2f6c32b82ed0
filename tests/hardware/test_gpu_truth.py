"""bench/gpu_truth.py runs end to end on the CPU with tiny models (a smoke test of the script any
CUDA machine runs for the real numbers)."""
from __future__ import annotations

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
