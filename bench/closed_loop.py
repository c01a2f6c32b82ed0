"""The closed loop, launched: does a plan compiled from a launch's metrics (`partc compile
--calibrate-from RUN.jsonl`) predict what it then measures, where the default compile's plan did
not?

For each example model and process count (the cases of bench/plan_measured.py: `cpu` with 2
stages, `cpu-4` with 4 stages of 1 replica; the same global batches, fp32 or `--precision`):

    partc compile examples/X.py -b B --cluster C --stages S -o A          # default: cpsat
    partc launch A/plan.yaml --steps N --metrics A-r.jsonl                 # R times ("before")
    partc compile examples/X.py ... --calibrate-from A-1.jsonl ... -o B    # all R of them
    then R rounds, each launching A and B once, alternating which goes first ("after")

Reported per case: A's prediction against its launches before and after the calibration, B's
prediction (and shape, which the re-plan may change) against its launches, and B's measured
throughput over A's within each round. A and B launched in the same rounds meet the same machine,
so their ratios to their own predictions compare the two cost sources in the same minutes: a
calibration that only moved the machine's speed of one minute into the costs shows as B's ratio
wandering as A's does; one that caught a stable gap between profile and launch (what
bench/plan_measured.py reports as stage work over the machine's drift) brings B's ratio to 1
while A's stays off.

The calibration pools the R launches' timed steps (`--calibrate-from` repeated; per stage the
median over all of them); `--calibrate-runs last` takes the last launch alone, as this script did
before partc could pool runs, which puts that one launch's noise into B's costs. With 8 or more
timed steps pooled B also prices the launches' speed spread (each stage's per-step work over its
median, partc.plans.recalibrate): B's prediction is then an expectation, of the mean step, and
is reported against B's mean steps beside the medians (and B's median steps against its time
at the priced speed, the median stage work).

    OMP_NUM_THREADS=1 .venv/bin/python bench/closed_loop.py [--models bert,gpt2]
        [--processes 2,4] [--repeats 3] [--steps 12] [--precision fp32] [--calibrate DIR]
        [--calibrate-runs all|last] [--json rows.json] [--keep DIR]
"""
from __future__ import annotations

import argparse
import contextlib
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plan_measured import (  # noqa: E402  (a sibling script, not a package)
    BATCH,
    CASES,
    MODELS,
    Plan,
    calibrated_clusters,
    compile_plan,
    launch,
    shape_text,
)

from partc.options import PRECISIONS  # noqa: E402
from partc.plans.recalibrate import calibrated_from  # noqa: E402


def compile_calibrated(a: Plan, runs: list[Path], out: Path, precision: str) -> Plan:
    """B: A's compile again (same cluster, pinned stages, precision, strategy), its costs
    corrected by `runs`, metrics files of launches of A."""
    b = compile_plan(a.model, a.processes, a.strategy, out, precision=precision,
                     extra=[x for run in runs for x in ("--calibrate-from", str(run))])
    if b.error:
        b.error = f"calibrated {b.error}"
    return b


def calibration_record(plan: Plan) -> dict[str, Any] | None:
    """What B's profile says it was corrected from (the runs, the speed spread, the optimizer
    factor: partc.plans.recalibrate's record), or None where it has none."""
    if plan.profile_path is None or not plan.profile_path.is_file():
        return None
    d = yaml.safe_load(plan.profile_path.read_text())
    calibration = d.get("calibration") if isinstance(d, dict) else None
    return calibrated_from(calibration) if isinstance(calibration, dict) else None


def launch_keeping(plan: Plan, steps: int, keep: Path) -> bool:
    """Launch once (plan_measured.launch records the step time); keep the run's metrics file."""
    launch(plan, steps)
    if plan.error is not None:
        return False
    shutil.copyfile(plan.directory / "metrics.jsonl", keep)
    return True


def mean_ratio(row: dict[str, Any]) -> str:
    """B's mean steps over its prediction where that is an expectation over a speed spread."""
    if row.get("b_priced_speed_s") is None:
        return "-"
    return ratio(row["b_mean_s"], row["b_predicted_s"])


def ratio(steps: list[float], predicted: float | None) -> str:
    if not steps or not predicted:
        return "-"
    return (f"{statistics.median(steps) / predicted:.3f} "
            f"({min(steps) / predicted:.3f}-{max(steps) / predicted:.3f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS),
                        help=f"comma-separated subset of {','.join(MODELS)}")
    parser.add_argument("--processes", default="2,4", help="comma-separated subset of 2,4")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--precision", default="fp32", choices=PRECISIONS)
    parser.add_argument("--calibrate", type=Path, metavar="DIR",
                        help="run partc calibrate into DIR first and price every case with its "
                             "configs (as bench/plan_measured.py --calibrate)")
    parser.add_argument("--calibrate-runs", choices=("all", "last"), default="all",
                        help="calibrate B from all of A's launches before (pooled) or the last")
    parser.add_argument("--json", type=Path, help="write the raw rows here")
    parser.add_argument("--keep", type=Path, metavar="DIR",
                        help="keep the plans and every launch's metrics in DIR (a new folder), "
                             "so another calibration can be compared on the same runs")
    args = parser.parse_args()
    models = [m for m in args.models.split(",") if m]
    processes = [int(p) for p in args.processes.split(",") if p]
    unknown = [m for m in models if m not in BATCH] + [str(p) for p in processes if p not in CASES]
    if unknown or args.repeats < 1:
        raise SystemExit(f"unknown models/processes: {', '.join(unknown)}" if unknown
                         else "--repeats must be at least 1")
    if args.calibrate is not None:
        for n, cluster in calibrated_clusters(args.calibrate).items():
            CASES[n] = (cluster, CASES[n][1])
    print(f"config: {args.repeats} repeats x {args.steps} steps, precision {args.precision}, "
          f"B calibrated from {args.calibrate_runs} of A's launches before, "
          f"clusters {', '.join(f'{n}: {CASES[n][0]}' for n in processes)}\n", flush=True)

    began = time.perf_counter()
    rows: list[dict[str, Any]] = []
    if args.keep is not None:  # a new folder: runs of another invocation stay apart
        if args.keep.exists():
            raise SystemExit(f"closed_loop: --keep {args.keep} exists (give a new folder)")
        args.keep.mkdir(parents=True)
    with contextlib.ExitStack() as stack:
        tmp = args.keep if args.keep is not None else \
            Path(stack.enter_context(tempfile.TemporaryDirectory()))
        for model in models:
            for n in processes:
                rows.append(run_case(model, n, tmp, args))
    total_s = time.perf_counter() - began

    print("| model | processes | A (default) shape | A predicted ms | A measured/predicted, "
          "before | after | B (calibrated) shape | B predicted ms | B measured/predicted | "
          "B mean/expected | B median/at its priced speed | B/A throughput per round |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        if row["error"]:
            print(f"| {row['model']} | {row['processes']} | {row['error']} |||||||||||")
            continue
        speedups = [a / b for a, b in zip(row["a_after_s"], row["b_s"], strict=True)]
        print(f"| {row['model']} | {row['processes']} | {row['a_shape']} "
              f"| {row['a_predicted_s'] * 1e3:.1f} "
              f"| {ratio(row['a_before_s'], row['a_predicted_s'])} "
              f"| {ratio(row['a_after_s'], row['a_predicted_s'])} "
              f"| {row['b_shape']}{' (same plan)' if row['same_plan'] else ''} "
              f"| {row['b_predicted_s'] * 1e3:.1f} | {ratio(row['b_s'], row['b_predicted_s'])} "
              f"| {mean_ratio(row)} "
              f"| {ratio(row['b_s'], row.get('b_priced_speed_s'))} "
              f"| {statistics.median(speedups):.3f} ({min(speedups):.3f}-{max(speedups):.3f}) |")
    ok = [r for r in rows if not r["error"]]
    for label, key, pred, rows_of in (
            ("A after", "a_after_s", "a_predicted_s", ok),
            ("B", "b_s", "b_predicted_s", ok),
            ("B's mean steps over its expectation (spread priced)", "b_mean_s", "b_predicted_s",
             [r for r in ok if r.get("b_priced_speed_s") is not None])):
        got = [statistics.median(r[key]) / r[pred] for r in rows_of]
        if got:
            within = sum(abs(g - 1) <= 0.15 for g in got)
            print(f"\n{label}: {within} of {len(got)} within 15%, median "
                  f"{statistics.median(got):.3f} ({min(got):.3f}-{max(got):.3f})", end="")
    print(f"\n\n{len(rows)} cases in {total_s / 60:.1f} min")
    if args.json:
        import json
        paths = {"json": str(args.json), "keep": str(args.keep), "calibrate": str(args.calibrate)}
        args.json.write_text(json.dumps({"config": vars(args) | paths, "rows": rows,
                                         "total_s": total_s}, indent=1))


def run_case(model: str, n: int, tmp: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One case: compile A, launch it R times, compile B from those launches (or the last),
    then R rounds of A and B."""
    row: dict[str, Any] = {"model": model, "processes": n, "error": None}
    a = compile_plan(model, n, "cpsat", tmp / f"{model}-{n}-A", precision=args.precision)
    if a.error:
        return {**row, "error": a.error}
    runs = tmp / f"{model}-{n}-runs"
    runs.mkdir()
    kept: list[Path] = []
    for r in range(args.repeats):
        kept.append(runs / f"A-{r}.jsonl")
        if not launch_keeping(a, args.steps, kept[-1]):
            return {**row, "error": a.error}
        print(f"{model} x{n} A before {r + 1}/{args.repeats}: {a.steps_s[-1] * 1e3:.1f} ms/step",
              file=sys.stderr, flush=True)
    before = list(a.steps_s)
    runs_used = kept if args.calibrate_runs == "all" else kept[-1:]
    b = compile_calibrated(a, runs_used, tmp / f"{model}-{n}-B", args.precision)
    if b.error:
        return {**row, "error": b.error}
    print(f"{model} x{n} B: {shape_text(b.shape)}, predicted "
          f"{(b.predicted_iteration_s or 0) * 1e3:.1f} ms (A "
          f"{(a.predicted_iteration_s or 0) * 1e3:.1f})", file=sys.stderr, flush=True)
    a.steps_s.clear()
    for r in range(args.repeats):
        for plan in ((a, b) if r % 2 == 0 else (b, a)):
            keep = runs / f"{plan.directory.name}-after-{r}.jsonl"
            if not launch_keeping(plan, args.steps, keep):
                return {**row, "error": plan.error}
        print(f"{model} x{n} round {r + 1}/{args.repeats}: A {a.steps_s[-1] * 1e3:.1f}, "
              f"B {b.steps_s[-1] * 1e3:.1f} ms/step", file=sys.stderr, flush=True)
    return {**row, "a_shape": shape_text(a.shape), "b_shape": shape_text(b.shape),
            "same_plan": a.key == b.key,
            "a_predicted_s": a.predicted_iteration_s, "b_predicted_s": b.predicted_iteration_s,
            "a_before_s": before, "a_after_s": list(a.steps_s), "b_s": list(b.steps_s),
            "b_mean_s": list(b.mean_steps_s), "b_priced_speed_s": b.priced_speed_iteration_s,
            "calibrated_from": [str(p) for p in runs_used],
            "calibration": calibration_record(b)}


if __name__ == "__main__":
    main()
