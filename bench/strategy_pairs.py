"""Why cpsat's launched plans lose to a baseline: every cpsat-vs-baseline pair of every recorded
measured run (bench/results/plan_measured*.json, written by bench/plan_measured.py), pooled.

    .venv/bin/python bench/strategy_pairs.py [FILES...]

For each run, case (model, processes) and baseline whose plan differs from cpsat's, one pair:

- predicted advantage: cpsat's predicted iteration over the baseline's (below 1: cpsat faster);
- measured advantage: the same with the measured steps (medians over the run's repeats);
- deviation: measured over predicted advantage (above 1: cpsat gained less than predicted);
- stage-work overrun: cpsat's stages' launched work over their price, over the baseline's
  (`stage_work_ratio`, the median over repeats): above 1, cpsat's cut ran further over its price.

It prints the pooled distribution of the deviation, how often cpsat measured below 0.98x a
baseline's throughput by predicted advantage, and how much of the deviation the stage work
explains (its correlation with the overrun, and the overrun in lost and in won pairs). Rows
repeated across files (a run copied under two names) count once.
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
LOST = 1 / 0.98  # cpsat's step over the baseline's above this: below 0.98x its throughput


@dataclass(frozen=True)
class Pair:
    """One cpsat-vs-baseline comparison of one measured run."""

    run: str
    model: str
    processes: int
    baseline: str
    predicted: float
    measured: float
    overrun: float

    @property
    def deviation(self) -> float:
        return self.measured / self.predicted


def _usable(row: dict[str, Any]) -> bool:
    return (not row.get("error") and not row.get("same_plan_as")
            and bool(row.get("stage_work_ratio")) and bool(row.get("measured_step_s"))
            and bool(row.get("predicted_iteration_s")))


def pairs_of(files: list[Path]) -> list[Pair]:
    """The cpsat-vs-baseline pairs of `files`, each measured row counted once."""
    seen: set[tuple[Any, ...]] = set()
    found: list[Pair] = []
    for path in files:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        rows = data.get("rows") if isinstance(data, dict) else None
        if not rows:
            continue
        cases: dict[tuple[str, int], dict[str, dict[str, Any]]] = {}
        for row in rows:
            if not _usable(row):
                continue
            key = (row["model"], row["processes"], row["strategy"],
                   tuple(row.get("measured_steps_s") or ()))
            if key in seen:
                continue
            seen.add(key)
            cases.setdefault((row["model"], row["processes"]), {})[row["strategy"]] = row
        for (model, processes), by_strategy in sorted(cases.items()):
            cpsat = by_strategy.get("cpsat")
            if cpsat is None:
                continue
            for baseline, row in sorted(by_strategy.items()):
                if baseline == "cpsat":
                    continue
                found.append(Pair(
                    run=path.stem, model=model, processes=processes, baseline=baseline,
                    predicted=cpsat["predicted_iteration_s"] / row["predicted_iteration_s"],
                    measured=cpsat["measured_step_s"] / row["measured_step_s"],
                    overrun=(statistics.median(cpsat["stage_work_ratio"])
                             / statistics.median(row["stage_work_ratio"]))))
    return found


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _correlation(xs: list[float], ys: list[float]) -> float:
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    cov = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    return cov / math.sqrt(sum((x - mx) ** 2 for x in xs) * sum((y - my) ** 2 for y in ys))


def report(found: list[Pair]) -> str:
    """The markdown summary of `found`."""
    runs = len({p.run for p in found})
    deviation = [p.deviation for p in found]
    lost = [p for p in found if p.measured > LOST]
    won = [p for p in found if p.measured <= LOST]
    log_deviation = [math.log(d) for d in deviation]
    log_overrun = [math.log(p.overrun) for p in found]
    lines = [f"{len(found)} cpsat-vs-baseline pairs from {runs} result files", "",
             f"- deviation (measured over predicted advantage): median "
             f"{statistics.median(deviation):.3f}, p10 {_quantile(deviation, 0.1):.3f}, "
             f"p90 {_quantile(deviation, 0.9):.3f}",
             f"- stage-work overrun (cpsat's over the baseline's): median "
             f"{statistics.median(p.overrun for p in found):.3f}"]
    if lost and won:
        lines.append(f"  (in the {len(lost)} pairs cpsat lost: "
                     f"{statistics.median(p.overrun for p in lost):.3f}; in the others "
                     f"{statistics.median(p.overrun for p in won):.3f})")
    lines += [f"- correlation of log deviation with log overrun: "
              f"{_correlation(log_overrun, log_deviation):.2f}", "",
              "| predicted advantage | pairs | cpsat below 0.98x the baseline |",
              "|---|---|---|"]
    for low, high in ((0.0, 0.90), (0.90, 0.95), (0.95, 0.98), (0.98, math.inf)):
        band = [p for p in found if low <= p.predicted < high]
        if band:
            losses = sum(p.measured > LOST for p in band)
            label = f"{low:.2f}-{high:.2f}" if high < math.inf else f">= {low:.2f}"
            lines.append(f"| {label} | {len(band)} | {losses} ({losses / len(band):.0%}) |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", type=Path)
    args = parser.parse_args()
    files = args.files or [Path(f) for f in sorted(glob.glob(str(RESULTS /
                                                                  "plan_measured*.json")))]
    found = pairs_of(files)
    if not found:
        raise SystemExit("no cpsat-vs-baseline pairs with stage work in these files")
    print(report(found))


if __name__ == "__main__":
    main()
