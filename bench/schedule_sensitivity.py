"""Is a schedule's loss the schedule, or its stages' costs? Plans of one cut under different
schedules (cpsat's GPipe and a baseline's 1F1B, say), each simulated with its predicted stage
times scaled by every launch's measured per-stage work ratios (`bench/plan_measured.py`'s
`per_stage_work_ratio`, medians over its repeats), and by one ratio for every stage.

    python bench/schedule_sensitivity.py --json bench/results/plan_measured_X.json \\
        --model mlp --processes 4 STRATEGY=PLAN_DIR [STRATEGY=PLAN_DIR ...]

PLAN_DIR: the strategy's plan compiled as the benchmark compiled it (same cluster, cache and
flags), so that its predicted iteration matches the JSON's. Prints one row per plan: priced,
every stage at the median ratio of all, and under each launch's per-stage ratios. Where a plan
wins at one launch's ratios and loses at another's, the ranking turns on which stages run
slower, not on the schedule model alone.
Used for docs/benchmarks.md#run-bg-bf16-mixed-and-fp32-on-an-avx-512-boot-2026-12-04-evening.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from partc.plans.plan import load_plan  # noqa: E402
from partc.solve.simulator import PipelineSpec, simulate  # noqa: E402


def scaled(spec: PipelineSpec, ratios: list[float]) -> PipelineSpec:
    """`spec` with stage i's forward and backward times times `ratios[i]`."""
    return replace(spec, stages=tuple(
        replace(t, forward_s=t.forward_s * r, backward_s=t.backward_s * r)
        for t, r in zip(spec.stages, ratios, strict=True)))


def launch_ratios(rows: list[dict], model: str, processes: int) -> dict[str, list[float]]:
    """strategy -> per-stage median work ratio over its repeats, for the case's launched plans
    (a strategy whose plan was another's is left out)."""
    out: dict[str, list[float]] = {}
    for r in rows:
        if (r["model"], r["processes"]) != (model, processes) or r.get("same_plan_as") \
                or not r.get("per_stage_work_ratio"):
            continue
        out[r["strategy"]] = [statistics.median(s) for s in
                              zip(*r["per_stage_work_ratio"], strict=True)]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, required=True, help="bench/plan_measured.py rows")
    parser.add_argument("--model", required=True)
    parser.add_argument("--processes", type=int, required=True)
    parser.add_argument("plans", nargs="+", metavar="STRATEGY=PLAN_DIR")
    args = parser.parse_args(argv)
    rows = json.loads(args.json.read_text())["rows"]
    ratios = launch_ratios(rows, args.model, args.processes)
    measured = {r["strategy"]: statistics.median(r["measured_steps_s"]) for r in rows
                if (r["model"], r["processes"]) == (args.model, args.processes)
                and r["measured_steps_s"]}
    plans = dict(p.split("=", 1) for p in args.plans)
    every = statistics.median(x for v in ratios.values() for x in v)
    heads = [f"at {s}'s ratios" for s in ratios]
    print("per-stage work ratios (measured/predicted, medians): "
          + "; ".join(f"{s} {' '.join(f'{x:.3f}' for x in v)}" for s, v in ratios.items()))
    print(f"\n| plan | schedule | measured ms | priced ms | every stage x{every:.3f} | "
          + " | ".join(heads) + " |")
    print("|---|---|---|---|---|" + "---|" * len(heads))
    for strategy, directory in plans.items():
        spec = load_plan(Path(directory)).pipeline_spec()
        cells = [simulate(spec).iteration_s,
                 simulate(scaled(spec, [every] * len(spec.stages))).iteration_s]
        cells += [simulate(scaled(spec, v)).iteration_s if len(v) == len(spec.stages)
                  else float("nan") for v in ratios.values()]
        got = f"{measured[strategy] * 1e3:.1f}" if strategy in measured else "-"
        print(f"| {strategy} | {spec.schedule} | {got} | "
              + " | ".join(f"{c * 1e3:.2f}" for c in cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
