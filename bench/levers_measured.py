"""Memory levers, launched on this machine: what each lever costs in time and saves in memory,
measured, against what partc predicts.

For each example model, four plans of the same pipeline shape (2 stages x 2 replicas on the
`cpu-4` cluster: 4 gloo processes on this 2-core machine, the shape pinned, the micro-batch count
pinned to the plain plan's), compiled with the default (measured) costs:

    partc compile examples/X.py -b B --cluster cpu-4 --stages 2 --replicas 2 --microbatches M
                  --no-checkpointing --sharding none        -> plain
                  --checkpointing    --sharding none        -> checkpointing (every stage)
                  --no-checkpointing --sharding optimizer   -> sharded (ZeRO-1, every stage)
                  --no-checkpointing --sharding gradients   -> sharded-gradients (ZeRO-2)
    OMP_NUM_THREADS=1 partc launch PLAN --steps N --metrics FILE

Each plan is launched `--repeats` times, the plans in turn (the repeat loop outermost, so drift
hits them alike). Reported per plan: the predicted and measured step time (median of rank 0's
step over the steps after two warm-up steps, without the one the CPU memory profiler watched;
medians over repeats with their spread), each stage's predicted and measured peak memory, and the
losses of every step, which must equal the plain plan's (the same seed: the levers change how
training runs, not what it computes). Per lever: its time cost, measured (lever plan's step /
plain plan's step, per repeat, median) against predicted (the same ratio of plan.yaml's
iterations), and the memory it saves per stage, measured against predicted.

    .venv/bin/python bench/levers_measured.py [--models transformer,gpt2,bert] [--repeats 3]
        [--steps 12] [--json bench/results/levers_measured.json]

About 16 minutes with the defaults.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml
from process_stats import finish, last_line

from partc.plans.run_metrics import MEMORY_NONE, RunMetrics

ROOT = Path(__file__).resolve().parent.parent
PARTC = str(Path(sys.executable).parent / "partc")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
MODELS = ["transformer", "gpt2", "bert"]
BATCH = {"transformer": 64, "gpt2": 32, "bert": 32}
PLANS = {"plain": ["--no-checkpointing", "--sharding", "none"],
         "checkpointing": ["--checkpointing", "--sharding", "none"],
         "sharded": ["--no-checkpointing", "--sharding", "optimizer"],
         "sharded-gradients": ["--no-checkpointing", "--sharding", "gradients"]}
LEVERS = [name for name in PLANS if name != "plain"]
WARMUP = 2
LOSS_RTOL = 1e-5



def compile_plan(model: str, name: str, out: Path, microbatches: int | None) -> dict[str, Any]:
    pinned = ["--stages", "2", "--replicas", "2"]
    if microbatches:
        pinned += ["--microbatches", str(microbatches)]
    proc = subprocess.run([PARTC, "compile", f"examples/{model}.py", "-b", str(BATCH[model]),
                           "--cluster", "cpu-4", *pinned, *PLANS[name], "-o", str(out)],
                          cwd=ROOT, env=ENV, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"compile {model} {name} failed: {last_line(proc.stderr)}")
    doc = yaml.safe_load((out / "plan.yaml").read_text())
    ranks = [s["rank"] for s in doc["stages"]]
    return {"dir": out, "model": model, "plan": name,
            "microbatches": doc["training"]["num_microbatches"],
            "predicted_s": float(doc["predicted"]["iteration_s"]),
            "predicted_peaks": [int(doc["predicted"]["memory"][r]["total"]) for r in ranks],
            "levers": [(s["activation_checkpointing"], s["sharding"]) for s in doc["stages"]],
            "steps_s": [], "peaks": [], "losses": []}


def launch(plan: dict[str, Any], steps: int) -> None:
    metrics = plan["dir"] / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    proc = subprocess.run([PARTC, "launch", str(plan["dir"] / "plan.yaml"), "--steps",
                           str(steps), "--metrics", str(metrics)],
                          cwd=ROOT, env=ENV, capture_output=True, text=True)
    if proc.returncode != 0 or not metrics.exists():
        raise SystemExit(f"launch {plan['model']} {plan['plan']} failed: "
                         f"{last_line(proc.stderr)}")
    run = RunMetrics.load(metrics)
    timed = [st for st in run.steps[WARMUP:] if st.memory_method == MEMORY_NONE]
    plan["steps_s"].append(statistics.median(st.step_s for st in timed))
    watched = [st for st in run.steps if st.memory_method != MEMORY_NONE]
    plan["peaks"].append([int(sm.peak_memory_bytes or 0) for sm in watched[-1].stages])
    plan["losses"].append([st.loss for st in run.steps])


def spread(values: list[float], scale: float = 1.0, fmt: str = "{:.1f}") -> str:
    med = statistics.median(values) * scale
    return (fmt.format(med) + " (" + fmt.format(min(values) * scale) + "-"
            + fmt.format(max(values) * scale) + ")")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    models = args.models.split(",")
    start = time.perf_counter()
    print(f"load average at start: {os.getloadavg()[0]:.1f}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        plans: dict[str, dict[str, dict[str, Any]]] = {}
        for model in models:
            plain = compile_plan(model, "plain", Path(tmp) / f"{model}-plain", None)
            plans[model] = {"plain": plain}
            for name in LEVERS:
                plans[model][name] = compile_plan(model, name, Path(tmp) / f"{model}-{name}",
                                                  plain["microbatches"])
        order = [p for model in models for p in plans[model].values()]
        for repeat in range(args.repeats):
            rotated = order[repeat % len(order):] + order[:repeat % len(order)]
            for plan in rotated:
                launch(plan, args.steps)
            print(f"repeat {repeat + 1} done ({(time.perf_counter() - start) / 60:.1f} min)",
                  flush=True)
    rows: list[dict[str, Any]] = []
    print("\n| model | plan | levers per stage | predicted ms/iter | measured ms/iter | "
          "measured/predicted | losses = plain's |")
    print("|---|---|---|---|---|---|---|")
    for model in models:
        plain = plans[model]["plain"]
        for name, p in plans[model].items():
            same = all(abs(a - b) <= LOSS_RTOL * abs(b) for run in p["losses"]
                       for a, b in zip(run, plain["losses"][0], strict=True))
            levers = ", ".join("+".join((["ckpt"] if c else []) + ([f"shard-{s}"]
                                                                   if s != "none" else []))
                               or "-" for c, s in p["levers"])
            measured = statistics.median(p["steps_s"])
            print(f"| {model} | {name} | {levers} | {p['predicted_s'] * 1e3:.1f} | "
                  f"{spread(p['steps_s'], 1e3)} | {measured / p['predicted_s']:.2f}x | "
                  f"{'yes' if same else 'NO'} |")
            rows.append({k: (str(v) if isinstance(v, Path) else v) for k, v in p.items()}
                        | {"losses_equal_plain": same})
    print("\n| model | lever | time cost measured (lever/plain, per repeat) | predicted | "
          "measured/predicted cost |")
    print("|---|---|---|---|---|")
    for model in models:
        plain = plans[model]["plain"]
        for name in LEVERS:
            p = plans[model][name]
            ratios = [a / b for a, b in zip(p["steps_s"], plain["steps_s"], strict=True)]
            predicted = p["predicted_s"] / plain["predicted_s"]
            print(f"| {model} | {name} | {spread(ratios, fmt='{:.3f}')}x | {predicted:.3f}x | "
                  f"{statistics.median(ratios) / predicted:.2f} |")
    print("\n| model | plan | stage | measured peak MiB (median) | predicted MiB | "
          "predicted/measured | saved vs plain, measured MiB | saved, predicted MiB |")
    print("|---|---|---|---|---|---|---|---|")
    for model in models:
        plain = plans[model]["plain"]
        plain_peaks = [statistics.median(r[k] for r in plain["peaks"])
                       for k in range(len(plain["predicted_peaks"]))]
        for name, p in plans[model].items():
            for k, predicted in enumerate(p["predicted_peaks"]):
                measured = statistics.median(r[k] for r in p["peaks"])
                print(f"| {model} | {name} | {k} | {measured / 2**20:.1f} | "
                      f"{predicted / 2**20:.1f} | {predicted / measured:.3f} | "
                      f"{(plain_peaks[k] - measured) / 2**20:.1f} | "
                      f"{(plain['predicted_peaks'][k] - predicted) / 2**20:.1f} |")
    finish(start, args.json, {"rows": rows})


if __name__ == "__main__":
    main()
