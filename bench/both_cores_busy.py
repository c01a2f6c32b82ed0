"""What slows a launched pass when both cores of a 2-core machine compute: the host, or the
launched processes' own traffic?

One model is compiled twice at the same micro-batch: a one-process plan (`--stages 1 --replicas
1`) and the default plan for twice the batch (one stage on two replicas: DDP's gradient
all-reduce between two pinned processes). Each round launches, in turn:

- A: the one-process plan pinned to core 0, the other core idle;
- B: two independent copies of the one-process plan at once, on core 0 and core 1 (both cores
  computing the same work, no traffic between them);
- S: the one-process plan on core 0 beside a pure-Python spin on core 1 (a busy core that touches
  almost no memory);
- C: the two-replica plan (both cores computing, with the all-reduce between them).

and prints the stage's forward and backward CPU per pass (the computing thread's clock, as launch
records it) over the plan's price, and the median step. B as slow as C: the host slows
both-cores-busy minutes; B like A and C slow: the replicas' own traffic does. Alternating the
conditions spreads the machine's slow minutes over all of them; run it on an otherwise idle
machine.

Usage: python bench/both_cores_busy.py [--model examples/transformer.py] [--micro-batch 32]
           [--cluster CLUSTER] [--rounds 6] [--steps 30] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from partc.plans.plan import load_plan  # noqa: E402
from partc.plans.run_metrics import RunMetrics  # noqa: E402

PARTC = str(Path(sys.executable).parent / "partc")
CONDITIONS = ("A", "B", "S", "C")


def _compile(model: str, batch: int, cluster: str, out: Path, *extra: str) -> None:
    subprocess.run([PARTC, "compile", model, "-b", str(batch), "--cluster", cluster,
                    "-o", str(out), *extra], check=True, capture_output=True, text=True)


def _launch(plan: Path, steps: int, metrics: Path, core: int | None) -> subprocess.Popen[bytes]:
    pin = ["taskset", "-c", str(core)] if core is not None else []
    return subprocess.Popen([*pin, PARTC, "launch", str(plan), "--steps", str(steps),
                             "--metrics", str(metrics)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _ratios(plan_dir: Path, metrics: Path) -> dict[str, float]:
    plan = load_plan(plan_dir)
    run = RunMetrics.load(metrics)
    stage, priced = run.stage_summaries()[0], plan.stages[0]
    assert stage.forward_cpu_s is not None and stage.backward_cpu_s is not None
    return {"forward_cpu": stage.forward_cpu_s / priced.forward_s,
            "backward_cpu": stage.backward_cpu_s / priced.backward_s,
            "step_ms": run.median_step_s() * 1e3}


def _wait(*procs: subprocess.Popen[bytes]) -> None:
    for proc in procs:
        if proc.wait() != 0:
            raise SystemExit(f"a launch failed (exit {proc.returncode}): {proc.args!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(ROOT / "examples" / "transformer.py"))
    parser.add_argument("--micro-batch", type=int, default=32)
    parser.add_argument("--cluster", default="cpu")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("needs two CPUs to run on")
    work = Path(tempfile.mkdtemp(prefix="partc-both-cores-"))
    try:
        one, copy, two = work / "one", work / "copy", work / "two"
        _compile(args.model, args.micro_batch, args.cluster, one, "--stages", "1",
                 "--replicas", "1")
        shutil.copytree(one, copy)  # its own directory: two launches write their own files
        _compile(args.model, 2 * args.micro_batch, args.cluster, two, "--stages", "1",
                 "--replicas", "2")
        rows: list[dict[str, object]] = []
        for r in range(1, args.rounds + 1):
            m = {c: work / f"{c}{r}.jsonl" for c in (*CONDITIONS, "B2")}
            _wait(_launch(one, args.steps, m["A"], 0))
            _wait(_launch(one, args.steps, m["B"], 0), _launch(copy, args.steps, m["B2"], 1))
            spin = subprocess.Popen(["taskset", "-c", "1", sys.executable, "-c",
                                     "while True: pass"])
            try:
                _wait(_launch(one, args.steps, m["S"], 0))
            finally:
                spin.kill()
                spin.wait()
            _wait(_launch(two, args.steps, m["C"], None))
            for label, plan_dir, metrics in [("A", one, m["A"]), ("B", one, m["B"]),
                                             ("B", copy, m["B2"]), ("S", one, m["S"]),
                                             ("C", two, m["C"])]:
                row = {"round": r, "condition": label, **_ratios(plan_dir, metrics)}
                rows.append(row)
                print(f"round {r} {label}  forward CPU {row['forward_cpu']:.2f}x  backward CPU "
                      f"{row['backward_cpu']:.2f}x  step {row['step_ms']:.1f} ms", flush=True)
        print("\nmedian (range) over rounds, CPU per pass over the plan's price:")
        for c in CONDITIONS:
            of = [row for row in rows if row["condition"] == c]
            parts = []
            for key in ("forward_cpu", "backward_cpu", "step_ms"):
                values = [float(row[key]) for row in of]  # type: ignore[arg-type]
                parts.append(f"{key} {statistics.median(values):.2f} "
                             f"({min(values):.2f}-{max(values):.2f})")
            print(f"  {c}: " + ", ".join(parts))
        if args.json:
            args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                             "rows": rows}, indent=1, sort_keys=True) + "\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
