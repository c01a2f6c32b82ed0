"""Where a launched step's time goes, pass by pass, beside the schedule the simulator replays.

`partc show --metrics` says by how much a run missed its replay (the schedule re-simulated with
the run's own stage times); this says where. It launches a plan with a per-pass timeline hook in
every worker (bench/timeline_hook/sitecustomize.py, from outside partc: every stage forward and
backward with its CPU time, every p2p post and wait, the tied-gradient sum, the step), then, for
the timed steps after warm-up, measures:

- hop lag: how long a stage's forward (backward) of a micro-batch started after the later of its
  input's producer finishing (the previous stage's forward, the next stage's backward) and its
  own rank's previous pass ending: the time the bytes took to arrive, which the simulator
  prices as the link's latency plus its copy, shared with the cores' other work;
- tail: from rank 0's last pass to the step's end (the tied-gradient sum, the optimizer step
  and launch's per-step metrics gather, which the prediction does not have), and the gather
  alone (rank 0's time in it: posting the step's rows and waiting for the last step's, which
  have arrived while the step ran unless some rank lags);
- the step's period (the first rank's step end to step end: the run's throughput) and span (first
  rank's start to the last rank's end) against the replayed iteration.

It prints one step's per-rank timeline beside the replay's events, then the lags' medians over
the timed steps, by pass kind. One stage per rank and one replica (GPipe or 1F1B plans).

    OMP_NUM_THREADS=1 .venv/bin/python bench/launch_timeline.py PLAN_DIR [--steps 14]
        [--show-step K] [--json out.json] [--keep DIR] [--gloo-io batch|other]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from partc.hardware.speed_spread import modes_of  # noqa: E402
from partc.plans.plan import Plan, load_plan  # noqa: E402
from partc.plans.report import replay_measured  # noqa: E402
from partc.plans.run_metrics import RunMetrics, StepMetrics  # noqa: E402
from partc.solve.simulator import PipelineSpec, Simulation, simulate  # noqa: E402
from partc.solve.stragglers import expected_iteration_s  # noqa: E402

PARTC = str(Path(sys.executable).parent / "partc")
HOOK = ROOT / "bench" / "timeline_hook"
WARMUP = 3  # steps left out: the first builds the schedule, the next warm the allocator


@dataclass(frozen=True)
class Pass:
    kind: str  # "F" or "B"
    microbatch: int
    start_s: float
    end_s: float
    cpu_s: float


@dataclass(frozen=True)
class RankStep:
    start_s: float
    end_s: float  # after the metrics gather's post
    passes: tuple[Pass, ...]
    tied: tuple[float, float] | None
    gather_s: float  # the per-step metrics gather: its post, and the wait for the last step's
    rows: tuple[tuple[str, float, float, Any], ...]  # every event of the step, for the listing


def replay_spec(plan: Plan, run: RunMetrics, steps: tuple[StepMetrics, ...]
                ) -> tuple[PipelineSpec, list[float]]:
    """The plan's schedule with the stages' work of `steps` (medians over them, as
    partc.plans.report.replay_measured takes over all timed steps), and each stage's forward +
    backward work so taken."""
    spec, posts = plan.pipeline_spec(), plan.p2p_posts_priced()
    work = [w.compute_s(spec.shares_cores, posts[w.index]) for w in run.stage_summaries(steps)]
    if any(w is None for w in work):
        raise SystemExit("launch_timeline: the run has no CPU times to replay")
    done = [w for w in work if w is not None]
    optimizer = [0.0] * spec.num_ranks
    for summary, (_, _, step) in zip(run.stage_summaries(steps), done, strict=True):
        optimizer[summary.pipeline_rank] += step
    spec = replace(spec, stages=tuple(replace(t, forward_s=f, backward_s=b)
                                      for t, (f, b, _) in zip(spec.stages, done, strict=True)),
                   optimizer_s=tuple(optimizer))
    return spec, [f + b for f, b, _ in done]


def step_variation(plan: Plan, run: RunMetrics) -> tuple[float, float, float]:
    """Where the replay's gap goes: (the replay of the stages' median work, the mean of every
    timed step replayed with its own stages' work, the replay's expectation over the speed
    modes of those steps' work over the medians, as compile --calibrate-from prices them with
    one core per unit)."""
    steps = run.timed_steps()
    median_spec, median_work = replay_spec(plan, run, steps)
    per_step, samples = [], []
    for step in steps:
        spec, work = replay_spec(plan, run, (step,))
        per_step.append(simulate(spec).iteration_s)
        samples += [w / m for w, m in zip(work, median_work, strict=True) if m > 0]
    units = [tuple(plan.cluster.core_of(d) for d in plan.training.shape.rank_devices(r))
             for r in range(median_spec.num_ranks)]
    expected = expected_iteration_s(median_spec, units, modes_of(samples, reference=1.0))
    return simulate(median_spec).iteration_s, statistics.mean(per_step), expected


def launch(plan_dir: Path, steps: int, out: Path, gloo_io: str = "batch") -> Path:
    """Launch the plan with the hook; returns its metrics file. `gloo_io` "other": gloo's socket
    loops stay at the default scheduling policy instead of launch's SCHED_BATCH (an
    experiment)."""
    metrics = out / "metrics.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "PARTC_TIMELINE_DIR": str(out), "PARTC_TIMELINE_GLOO_IO": gloo_io,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(HOOK),
                                                        os.environ.get("PYTHONPATH")]))}
    subprocess.run([PARTC, "launch", str(plan_dir), "--steps", str(steps), "--metrics",
                    str(metrics)], check=True, env=env, stdout=subprocess.DEVNULL)
    return metrics


def rank_steps(path: Path) -> dict[int, RankStep]:
    """A rank's timeline file, cut into its steps."""
    steps: dict[int, RankStep] = {}
    current: list[tuple[str, float, float, Any]] = []
    start = 0.0
    rows = [row for line in path.read_text().splitlines() if line for row in json.loads(line)]
    for kind, begin, end, detail in rows:
        if kind == "step":
            current, start = [], begin
        elif kind == "step_end":
            passes = tuple(Pass(k, int(d[0]), b, e, float(d[1])) for k, b, e, d in current
                           if k in ("F", "B"))
            tied = next(((b, e) for k, b, e, _ in current if k == "tied"), None)
            gather = sum(e - b for k, b, e, _ in current if k == "gather")
            steps[int(detail)] = RankStep(start, end, passes, tied, gather, tuple(current))
        else:
            current.append((kind, begin, end, detail))
    return steps


Lags = dict[str, list[tuple[float, float | None]]]  # per pass kind: (lag, core-mate's elapsed)


def hop_lags(plan: Plan, by_rank: dict[int, RankStep]) -> Lags:
    """Each pass's wait for its input beyond its producer's end and its own rank's last pass (its
    ready time), with how long a core-mate had been in the pass it was computing at that ready
    time (None: no core-mate was computing; where ranks share cores, the scheduler decides
    whether the woken rank takes the core from a core-mate mid-pass)."""
    S = plan.num_stages
    rank_of = [plan.stages[k].devices[0] for k in range(S)]
    core = [plan.cluster.core_of(d) for d in rank_of]
    found: dict[tuple[int, str, int], Pass] = {}
    previous: dict[tuple[int, str, int], float] = {}
    for k in range(S):
        last = by_rank[rank_of[k]].start_s
        for p in by_rank[rank_of[k]].passes:
            found[(k, p.kind, p.microbatch)] = p
            previous[(k, p.kind, p.microbatch)] = last
            last = p.end_s
    lags: Lags = {"F": [], "B": []}
    for (k, kind, mb), p in found.items():
        producer = found.get((k - 1, "F", mb)) if kind == "F" else found.get((k + 1, "B", mb))
        if producer is None:  # the first stage's forwards, the last stage's backwards
            continue
        ready = max(producer.end_s, previous[(k, kind, mb)])
        mates = [q for (j, _, _), q in found.items()
                 if j != k and core[j] == core[k] and q.start_s <= ready < q.end_s]
        elapsed = max((ready - q.start_s for q in mates), default=None)
        lags[kind].append((p.start_s - ready, elapsed))
    return lags


# how long a core-mate had been computing when a pass's input arrived, in bins (ms)
MATE_BINS = ((0.0, 2.0), (2.0, 5.0), (5.0, math.inf))


def lag_by_mate(values: list[tuple[float, float | None]]) -> str:
    """The hop lags' medians by what the receiving rank's core-mate was doing."""
    parts = []
    idle = [lag for lag, mate in values if mate is None]
    if idle:
        parts.append(f"mate idle {statistics.median(idle) * 1e3:.2f} ms (n {len(idle)})")
    for low, high in MATE_BINS:
        got = [lag for lag, mate in values if mate is not None and low <= mate * 1e3 < high]
        if got:
            span = f"{low:.0f}+" if high == math.inf else f"{low:.0f}-{high:.0f}"
            parts.append(f"mate {span} ms into a pass {statistics.median(got) * 1e3:.2f} ms "
                          f"(n {len(got)})")
    return "; ".join(parts)


def show_step(plan: Plan, by_rank: dict[int, RankStep], replay: Simulation) -> None:
    base = min(s.start_s for s in by_rank.values())
    for r in sorted(by_rank):
        step = by_rank[r]
        print(f"rank {r} (step starts at +{(step.start_s - base) * 1e3:.1f} ms): replayed | "
              "launched (ms from the first rank's start)")
        simulated = [f"{e.kind[0].upper()}{e.microbatch if e.microbatch >= 0 else ''} "
                     f"{e.start_s * 1e3:6.1f}-{e.end_s * 1e3:6.1f}"
                     for e in replay.events if e.rank == r]
        launched = []
        for kind, begin, end, detail in step.rows:
            span = f"{(begin - base) * 1e3:6.1f}-{(end - base) * 1e3:6.1f}"
            if kind in ("F", "B"):
                launched.append(f"{kind}{detail[0]} {span} (cpu {detail[1] * 1e3:.1f})")
            elif kind in ("tied", "gather") or end - begin > 5e-4:  # shorter waits: noise
                launched.append(f"  {kind} {span}")
        launched.append(f"  step end {(step.end_s - base) * 1e3:6.1f}")
        for i in range(max(len(simulated), len(launched))):
            left = simulated[i] if i < len(simulated) else ""
            right = launched[i] if i < len(launched) else ""
            print(f"  {left:26s} | {right}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("plan", type=Path)
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--show-step", type=int, default=None,
                        help="the step (0-based) whose timeline is printed; default the last")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--gloo-io", choices=("batch", "other"), default="batch",
                        help="gloo's socket loops under launch's SCHED_BATCH (default) or left "
                             "at the default policy (an experiment: what batching costs hops)")
    parser.add_argument("--keep", type=Path, default=None,
                        help="a folder to copy the run's metrics and per-rank timelines into")
    args = parser.parse_args()
    plan_path = args.plan / "plan.yaml" if args.plan.is_dir() else args.plan
    plan = load_plan(plan_path)
    if any(s.replicas != 1 for s in plan.stages) or len({s.rank for s in plan.stages}) != \
            plan.num_stages:
        raise SystemExit("launch_timeline: one stage per rank and one replica only")
    if args.steps <= WARMUP:
        raise SystemExit(f"launch_timeline: --steps must be over {WARMUP}")
    with tempfile.TemporaryDirectory(prefix="partc-timeline-") as tmp:
        out = Path(tmp)
        metrics = launch(plan_path, args.steps, out, args.gloo_io)
        run = RunMetrics.load(metrics)
        replay = replay_measured(plan, run)
        timelines = {r: rank_steps(out / f"rank{r}.jsonl") for r in range(plan.num_stages)}
        if args.keep is not None:
            args.keep.mkdir(parents=True, exist_ok=True)
            for name in ["metrics.jsonl"] + [f"rank{r}.jsonl" for r in range(plan.num_stages)]:
                shutil.copyfile(out / name, args.keep / name)
    if replay is None:
        raise SystemExit("launch_timeline: the run has no CPU times to replay")
    timed = range(WARMUP, args.steps)
    show = args.steps - 1 if args.show_step is None else args.show_step
    show_step(plan, {r: t[show] for r, t in timelines.items()}, replay)
    lags: Lags = {"F": [], "B": []}
    spans, periods, tails, gathers = [], [], [], []
    first_rank = plan.stages[0].devices[0]
    for i in timed:
        by_rank = {r: t[i] for r, t in timelines.items()}
        for kind, found in hop_lags(plan, by_rank).items():
            lags[kind] += found
        spans.append(max(s.end_s for s in by_rank.values()) -
                     min(s.start_s for s in by_rank.values()))
        first = by_rank[first_rank]
        # the step's period, what a run's throughput is: the first rank's step end to step end
        # (the span over-counts it where ranks without a tied sum start the next step early)
        periods.append(first.end_s - timelines[first_rank][i - 1].end_s)
        tails.append(first.end_s - max(p.end_s for p in first.passes))
        gathers.append(first.gather_s)
    shape = plan.training.shape
    print(f"\n{plan_path}: {plan.num_stages} stages, {shape.schedule}, "
          f"{shape.num_microbatches} micro-batches; steps {timed.start}..{timed.stop - 1}")
    print(f"step period (rank {first_rank}'s step end to step end) median "
          f"{statistics.median(periods) * 1e3:.1f} ms ({min(periods) * 1e3:.1f}-"
          f"{max(periods) * 1e3:.1f}); span (first rank's start to last rank's end) median "
          f"{statistics.median(spans) * 1e3:.1f} ms "
          f"({min(spans) * 1e3:.1f}-{max(spans) * 1e3:.1f}); replayed "
          f"{replay.iteration_s * 1e3:.1f} ms; rank 0's tail after its last pass (tied sum, "
          f"optimizer, metrics gather) median {statistics.median(tails) * 1e3:.1f} ms, the "
          f"gather {statistics.median(gathers) * 1e3:.1f} ms")
    of_medians, per_step_mean, expected = step_variation(plan, run)
    print(f"the stages' work varying from step to step: each timed step replayed with its own, "
          f"mean {per_step_mean * 1e3:.1f} ms (the medians' replay {of_medians * 1e3:.1f}); "
          f"the medians' replay over those steps' speed modes {expected * 1e3:.1f} ms; the run's "
          f"mean step {run.mean_step_s() * 1e3:.1f} ms")
    summary: dict[str, Any] = {"plan": str(plan_path), "schedule": shape.schedule,
                               "step_replays_mean_s": per_step_mean,
                               "expected_over_steps_s": expected,
                               "mean_step_s": run.mean_step_s(),
                               "span_s": spans, "period_s": periods,
                               "replayed_s": replay.iteration_s, "tail_s": tails,
                               "gather_s": gathers}
    for kind, pairs in lags.items():
        lag_values = [lag for lag, _ in pairs]
        if lag_values:
            late = sum(v > 1e-3 for v in lag_values)
            per_step = sum(lag_values) / len(timed)
            print(f"hop lag, {'forward' if kind == 'F' else 'backward'} inputs: median "
                  f"{statistics.median(lag_values) * 1e3:.2f} ms, mean "
                  f"{statistics.mean(lag_values) * 1e3:.2f}, max {max(lag_values) * 1e3:.2f}; "
                  f"{late} of {len(lag_values)} over 1 ms; per step {per_step * 1e3:.1f} ms")
            if plan.pipeline_spec().shares_cores:
                print(f"  by the receiving rank's core-mate: {lag_by_mate(pairs)}")
        summary[f"lag_{kind}_s"] = lag_values
        summary[f"lag_{kind}_mate_elapsed_s"] = [mate for _, mate in pairs]
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
