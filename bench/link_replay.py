"""Which link model explains launched runs better: each run's schedule replayed with its own
measured stage times (`partc.plans.report.replay_measured`, as `partc show --metrics`) under the
plan's intra-node link and under another one, against the run's measured step.

    python bench/link_replay.py --bandwidth 3.97GB/s --latency 86.8us \\
        PLAN_DIR:METRICS.jsonl [PLAN_DIR:METRICS.jsonl ...]

Each transfer's link time in the plan (`StageTiming.send_*_s`: its tensors' latencies plus
bytes over the bandwidth) is re-priced with the other link: latencies scaled by the ratio of
the latencies, the rest by the ratio of the bandwidths. Prints measured / replayed under both.
Used for docs/benchmarks.md#a-gloo-link-timed-one-way-tried-and-reverted-2026-11-28.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import partc.plans.report as report  # noqa: E402
from partc.hardware.units import parse_quantity  # noqa: E402
from partc.plans.plan import load_plan  # noqa: E402
from partc.plans.run_metrics import RunMetrics  # noqa: E402
from partc.solve.simulator import PipelineSpec, StageTiming  # noqa: E402


def relinked(spec: PipelineSpec, latency: float, bandwidth: float) -> PipelineSpec:
    """`spec` with every transfer's latency scaled by `latency` and the rest by `bandwidth`."""
    def stage(s: StageTiming) -> StageTiming:
        return replace(
            s, send_forward_latency_s=s.send_forward_latency_s * latency,
            send_forward_s=s.send_forward_latency_s * latency
            + (s.send_forward_s - s.send_forward_latency_s) * bandwidth,
            send_backward_latency_s=s.send_backward_latency_s * latency,
            send_backward_s=s.send_backward_latency_s * latency
            + (s.send_backward_s - s.send_backward_latency_s) * bandwidth)
    return replace(spec, stages=tuple(stage(s) for s in spec.stages))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--bandwidth", required=True, help="the other link's, e.g. 3.97GB/s")
    parser.add_argument("--latency", required=True, help="the other link's, e.g. 86.8us")
    parser.add_argument("runs", nargs="+", help="PLAN_DIR:METRICS.jsonl")
    args = parser.parse_args(argv)
    bandwidth = float(parse_quantity(args.bandwidth, "B/s"))
    latency = float(parse_quantity(args.latency, "s"))
    simulate = report.simulate
    print(f"| plan | measured ms | replay, plan's link | replay, {args.bandwidth} {args.latency} |")
    print("|---|---|---|---|")
    for run in args.runs:
        plan_dir, _, metrics_file = run.rpartition(":")
        plan, metrics = load_plan(plan_dir), RunMetrics.load(metrics_file)
        link = plan.cluster.intra_node
        measured = metrics.median_step_s()
        own = report.replay_measured(plan, metrics)

        def other(spec: PipelineSpec, *a: Any, scales: tuple[float, float] = (
                latency / link.latency_s, link.bandwidth / bandwidth), **k: Any) -> Any:
            return simulate(relinked(spec, *scales), *a, **k)
        report.simulate = other  # replay_measured's simulator, for this one call
        try:
            alt = report.replay_measured(plan, metrics)
        finally:
            report.simulate = simulate
        if own is None or alt is None:
            print(f"| {plan_dir} | {measured * 1e3:.1f} | (no CPU times) | |")
            continue
        print(f"| {plan_dir} | {measured * 1e3:.1f} | {measured / own.iteration_s:.3f} "
              f"| {measured / alt.iteration_s:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
