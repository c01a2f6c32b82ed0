"""Compile benchmark: wall time, per-step time and peak RSS of `partc compile`, end to end.

Each case runs `partc compile` in a fresh process (imports included, as a user runs it) and reads
the process's peak RSS (`getrusage(RUSAGE_CHILDREN)` in a wrapper process), the per-step times
from the plan's timings.yaml, and the stage files' total size. Cases: the small examples pinned to
2 and 4 stages on the `cpu-4` cluster, and the meta-device BERT-large and GPT-2 1.3B for
8 x A100-80GB with 8 stages (compiled without materialising their weights). `--repeats N` runs
each case N times and reports the median wall time.

    .venv/bin/python bench/compile.py [--quick] [--repeats 3]
"""
from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml
from process_stats import run_measured

ROOT = Path(__file__).resolve().parent.parent
PARTC = str(Path(sys.executable).parent / "partc")

CASES = [  # (model file, batch, stages, cluster)
    ("examples/mlp.py", 16, 2, "cpu-4"),
    ("examples/bert.py", 16, 2, "cpu-4"),
    ("examples/bert.py", 16, 4, "cpu-4"),
    ("examples/gpt2.py", 16, 4, "cpu-4"),
    ("examples/resnet.py", 16, 4, "cpu-4"),
    ("examples/bert_large_meta.py", 256, 8, "8xa100-80gb"),
    ("examples/gpt2_1p3b_meta.py", 512, 8, "8xa100-80gb"),
]
QUICK = CASES[:2] + CASES[-1:]



def run_case(model: str, batch: int, stages: int, cluster: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "plan"
        run = run_measured([PARTC, "compile", model, "-b", str(batch), "--stages", str(stages),
                            "--cluster", cluster, "-o", str(out)], cwd=ROOT)
        if run.returncode != 0:
            raise SystemExit(f"compile failed: {model}\n{run.stderr[-2000:]}")
        timings = yaml.safe_load((out / "timings.yaml").read_text())
        plan = yaml.safe_load((out / "plan.yaml").read_text())
        size = sum(p.stat().st_size for p in out.glob("stage_*.pt"))
    return {"wall_s": run.wall_s, "rss_mib": run.rss_mib, "size_mb": size / 1e6,
            "params": plan["model"]["parameters"], "weights": plan["model"]["weights"],
            **timings}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="three cases only")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    cases = QUICK if args.quick else CASES
    print(f"machine: {platform.processor() or platform.machine()}, "
          f"python {platform.python_version()}")
    print("| model | cluster | stages | params | weights in files | wall s (median) | capture s "
          "| costs s | solve s | emit s | peak RSS MiB | stage files MB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for model, batch, stages, cluster in cases:
        runs = [run_case(model, batch, stages, cluster) for _ in range(args.repeats)]
        mid = sorted(runs, key=lambda r: r["wall_s"])[len(runs) // 2]
        print(f"| {Path(model).stem} (b {batch}) | {cluster} | {stages} "
              f"| {mid['params'] / 1e6:.1f}M "
              f"| {'yes' if mid['weights'] == 'stage-files' else 'no (meta)'} "
              f"| {statistics.median(r['wall_s'] for r in runs):.1f} | {mid['capture_s']:.1f} "
              f"| {mid['costs_s']:.1f} | {mid['solve_s']:.1f} | {mid['emit_s']:.1f} "
              f"| {max(r['rss_mib'] for r in runs):.0f} | {mid['size_mb']:.2f} |",
              flush=True)


if __name__ == "__main__":
    main()
