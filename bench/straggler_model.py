"""What independent per-device slow modes do to two plans' predicted ratio: a model, not a
measurement.

    .venv/bin/python bench/straggler_model.py CPSAT_PLAN BASELINE_PLAN [--modes 0.3:1.4,0.5:1.5]

On this VM each core runs the same kernel in a fast or a slow mode (1.3-1.5x, fp32), on its own,
for seconds at a time (docs/benchmarks.md, "Measured plan quality": bench/kernel_modes.py
--every-core). A pipeline step waits for its slowest stage, so a cut whose stages are balanced
loses more to such noise than one whose step is bound by one stage anyway. This script takes
each plan's per-stage forward + backward times (plan.yaml's `stages[].predicted`) and its
micro-batch count M, prices a 1F1B step as sum(t) + (M - 1) max(t) (fill/drain plus the steady
state; no transfers, no optimizer), and averages it over every combination of per-stage modes,
each stage slow with probability p and then f times slower, independently. It prints the
noise-free ratio of the two steps (cpsat's over the baseline's), the expected ratio under each
(p, f), and their quotient: the deviation of the measured advantage from the predicted one that
the noise alone would cause (bench/strategy_pairs.py measures that deviation).
"""
from __future__ import annotations

import argparse
import itertools
import math
from pathlib import Path

import yaml


def stage_times(plan: Path) -> tuple[list[float], int]:
    """(forward + backward seconds per micro-batch of each stage, micro-batches) of a plan."""
    path = plan / "plan.yaml" if plan.is_dir() else plan
    data = yaml.safe_load(path.read_text())
    times = [float(s["predicted"]["forward_s"]) + float(s["predicted"]["backward_s"])
             for s in data["stages"]]
    return times, int(data["training"]["num_microbatches"])


def step(times: list[float], microbatches: int, scale: tuple[float, ...]) -> float:
    """A 1F1B step's compute: fill and drain through every stage, then the slowest stage's
    steady state."""
    scaled = [t * s for t, s in zip(times, scale, strict=True)]
    return sum(scaled) + (microbatches - 1) * max(scaled)


def expected_step(times: list[float], microbatches: int, p: float, f: float) -> float:
    """`step` averaged over each stage independently slow (f times) with probability p."""
    total = 0.0
    for modes in itertools.product((False, True), repeat=len(times)):
        weight = math.prod(p if slow else 1 - p for slow in modes)
        total += weight * step(times, microbatches, tuple(f if slow else 1.0 for slow in modes))
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cpsat", type=Path)
    parser.add_argument("baseline", type=Path)
    parser.add_argument("--modes", default="0.2:1.3,0.3:1.4,0.5:1.5",
                        help="p:f pairs: a stage's chance of its slow mode and its slowdown")
    args = parser.parse_args()
    (ct, cm), (bt, bm) = stage_times(args.cpsat), stage_times(args.baseline)
    nominal = step(ct, cm, (1.0,) * len(ct)) / step(bt, bm, (1.0,) * len(bt))
    print(f"cpsat stages {[round(t * 1e3, 2) for t in ct]} ms, M {cm}; baseline "
          f"{[round(t * 1e3, 2) for t in bt]} ms, M {bm}")
    print(f"noise-free (predicted) cpsat/baseline step: {nominal:.3f}")
    for pair in args.modes.split(","):
        p, f = (float(v) for v in pair.split(":"))
        noisy = expected_step(ct, cm, p, f) / expected_step(bt, bm, p, f)
        print(f"p {p:.2f} f {f:.2f}: expected ratio {noisy:.3f}, deviation {noisy / nominal:.3f}; "
              f"cpsat's own step {expected_step(ct, cm, p, f) / step(ct, cm, (1.0,) * len(ct)):.3f}"
              "x its noise-free price")


if __name__ == "__main__":
    main()
