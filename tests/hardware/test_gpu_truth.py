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
         "--device", "cpu", "--quick", "--models", "gpt2", "--repeats", "2", "--warmup", "1"],
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
    table = (tmp_path / "gpu_truth.md").read_text()
    assert "| gpt2 | fp32 | 2 |" in table and "stages of `partc compile --stages 4`" in table
