"""Check benchmark: wall time and peak RSS of `partc check` on a current plan, end to end.

Each case compiles a plan once, then runs `partc check PLAN` in a fresh process `--repeats` times
(imports included, as CI runs it) and reports the median wall time, the peak RSS and the check's
own step times (from its progress lines: capture, costs, solve). The headline case is BERT-base
(bench/models/bert_base.py: real weights, 110M parameters, sequence 128) planned in 4 stages for
8 x A100-80GB; the issue's target is < 30 s on this CPU machine. The 1.3B GPT-2 on meta shows the
check of a model that is never materialised.

    .venv/bin/python bench/check.py [--repeats 3]
"""
from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from process_stats import Measured, run_measured

ROOT = Path(__file__).resolve().parent.parent
PARTC = str(Path(sys.executable).parent / "partc")

CASES = [  # (model file, batch, stages, cluster)
    ("bench/models/bert_base.py", 256, 4, "8xa100-80gb"),
    ("examples/bert.py", 16, 4, "cpu-4"),
    ("examples/gpt2_1p3b_meta.py", 512, 8, "8xa100-80gb"),
]



def _steps(run: Measured) -> dict[str, float]:
    """Seconds per phase from the progress lines."""
    out = {"capture": 0.0, "costs": 0.0, "solve": 0.0}
    for what, secs in run.steps():
        if what.startswith(("loading", "building", "capturing")):
            out["capture"] += secs
        elif what.startswith("pricing"):
            out["costs"] += secs
        elif what.startswith(("coarsen", "cpsat", "chain-dp", "uniform", "params")):
            out["solve"] += secs
    return out


def run_case(model: str, batch: int, stages: int, cluster: str, repeats: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "plan"
        proc = subprocess.run([PARTC, "compile", model, "-b", str(batch), "--stages", str(stages),
                               "--cluster", cluster, "-o", str(out)], cwd=ROOT,
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"compile failed: {model}\n{proc.stderr[-2000:]}")
        runs = []
        for _ in range(repeats):
            run = run_measured([PARTC, "check", str(out)], cwd=ROOT)
            if run.returncode != 0:
                raise SystemExit(f"check did not pass: {model}\n{run.stdout}{run.stderr[-2000:]}")
            runs.append({"wall_s": run.wall_s, "rss_mib": run.rss_mib, **_steps(run)})
    mid = sorted(runs, key=lambda r: r["wall_s"])[len(runs) // 2]
    return {**mid, "wall_s": statistics.median(r["wall_s"] for r in runs),
            "rss_mib": max(r["rss_mib"] for r in runs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"machine: {platform.processor() or platform.machine()}, "
          f"python {platform.python_version()}")
    print("| model | cluster | stages | check wall s (median) | capture s | costs s | solve s "
          "| peak RSS MiB |")
    print("|---|---|---|---|---|---|---|---|")
    for model, batch, stages, cluster in CASES:
        r = run_case(model, batch, stages, cluster, args.repeats)
        print(f"| {Path(model).stem} (b {batch}) | {cluster} | {stages} | {r['wall_s']:.1f} "
              f"| {r['capture']:.1f} | {r['costs']:.1f} | {r['solve']:.1f} | {r['rss_mib']:.0f} |",
              flush=True)


if __name__ == "__main__":
    main()
