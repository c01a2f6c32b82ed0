"""What posting a gloo step's receives at its start (partc launch's early receives) changes:
the same plans launched alternately with them (the default) and without
(`PARTC_EARLY_RECEIVES=0`, torch's own posting), median ms per iteration of each launch.

Each round launches every plan once each way, in an order that flips every round, so machine
drift hits both alike. Prints per plan the rounds' medians, their median, the ratio
early / torch, and the prediction.

    .venv/bin/python bench/early_receives.py PLAN_DIR [PLAN_DIR ...] --rounds 5
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from partc.plans.plan import load_plan  # noqa: E402

PARTC = str(Path(sys.executable).parent / "partc")


def launch_ms(plan: Path, early: bool, steps: int, skip: int) -> float:
    """One launch; the median of its step times after the first `skip` steps, in ms."""
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "m.jsonl"
        env = dict(os.environ, PARTC_EARLY_RECEIVES="1" if early else "0",
                   OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        subprocess.run([PARTC, "launch", str(plan / "plan.yaml"), "--steps", str(steps),
                        "--metrics", str(metrics)], env=env, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        times = [json.loads(line)["step_s"] for line in metrics.read_text().splitlines()]
    return 1000 * statistics.median(times[skip:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("plans", type=Path, nargs="+", help="plan directories (gloo plans)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--skip", type=int, default=3, help="warm-up steps left out")
    args = parser.parse_args(argv)
    runs: dict[Path, dict[bool, list[float]]] = {p: {True: [], False: []} for p in args.plans}
    for r in range(args.rounds):
        for plan in args.plans:
            for early in ((True, False) if r % 2 == 0 else (False, True)):
                runs[plan][early].append(launch_ms(plan, early, args.steps, args.skip))
        print(f"round {r + 1}: " + "; ".join(
            f"{p.name} early {runs[p][True][-1]:.1f} torch {runs[p][False][-1]:.1f}"
            for p in args.plans), file=sys.stderr, flush=True)
    print(f"{args.rounds} rounds, {args.steps} steps per launch (median of steps "
          f"{args.skip + 1}-{args.steps}), ms per iteration")
    print("| plan | shape | predicted | early receives: median (rounds) | torch's posting: median "
          "(rounds) | early / torch | early / predicted |")
    print("|---|---|---:|---|---|---:|---:|")
    for plan in args.plans:
        p = load_plan(plan / "plan.yaml")
        shape = p.training.shape
        with_early = statistics.median(runs[plan][True])
        with_torch = statistics.median(runs[plan][False])
        predicted = 1000 * p.predicted.iteration_s
        print(f"| {plan.name} | {shape.stages}x{shape.replicas} M{shape.num_microbatches} "
              f"{shape.schedule} | {predicted:.1f} | {with_early:.1f} "
              f"({', '.join(f'{t:.1f}' for t in runs[plan][True])}) | {with_torch:.1f} "
              f"({', '.join(f'{t:.1f}' for t in runs[plan][False])}) | "
              f"{with_early / with_torch:.3f} | {with_early / predicted:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
