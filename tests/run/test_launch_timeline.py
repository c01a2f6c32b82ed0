"""bench/launch_timeline.py end to end on a small plan: the hook times every pass of every rank
from outside partc, and the script lines the ranks' timelines up against the replay."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PARTC = str(Path(sys.executable).parent / "partc")


@pytest.mark.slow
def test_launch_timeline_times_every_pass_of_a_two_stage_plan(tmp_path: Path) -> None:
    plan = tmp_path / "plan"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([PARTC, "compile", str(ROOT / "examples" / "mlp.py"), "-b", "64",
                    "--cluster", "cpu", "--stages", "2", "--microbatches", "4",
                    "--schedule", "1f1b", "--costs", "analytic", "-o", str(plan)],
                   check=True, capture_output=True, env=env, timeout=300)
    out = tmp_path / "timeline.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "launch_timeline.py"), str(plan),
                           "--steps", "5", "--json", str(out)],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    # steps 3 and 4 timed: each a positive span, a tail and a gather on rank 0
    assert len(report["span_s"]) == len(report["tail_s"]) == len(report["gather_s"]) == 2
    assert all(s > 0 for s in report["span_s"]) and report["replayed_s"] > 0
    assert all(0 <= g <= t for g, t in zip(report["gather_s"], report["tail_s"], strict=True))
    # 2 stages x 4 micro-batches: stage 1's forwards wait for stage 0's, stage 0's backwards
    # for stage 1's, 4 hops each per step; a lag is never below -1 ms (clock skew would show)
    assert len(report["lag_F_s"]) == len(report["lag_B_s"]) == 8
    assert min(report["lag_F_s"] + report["lag_B_s"]) > -1e-3
    assert "rank 1 (step starts at" in proc.stdout and "hop lag, forward inputs" in proc.stdout
