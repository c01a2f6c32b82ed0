"""Page faults of a GPipe-ordered step, with glibc's default allocator and with freed memory kept.

A GPipe stage runs every micro-batch's forward, then every backward: its activations pile up and
are freed in one sweep at the step's end. glibc hands a freed block above the mmap threshold (at
most 32 MiB) or a free heap top above the trim threshold back to the OS, and the next step
page-faults and zero-fills those pages again. 1F1B frees and re-allocates one micro-batch's worth
at a time and mostly reuses the same blocks; an operator timed in a loop (the profiler) always
does. partc.hardware.local.keep_freed_memory (entered through
partc.cost.torch_profiler.cpu_settings by launch, the profiler and reference training) sets
M_MMAP_MAX 0 and M_TRIM_THRESHOLD -1 so memory stays with the process.

This times one example model's whole training step on one core, its micro-batches in GPipe's
order (all forwards, then all backwards) and interleaved (forward, backward, as 1F1B's steady
state), in a fresh process per allocator setting (mallopt cannot be undone), the settings
alternating round by round so that a drift of the machine lands on both. Per setting and order:
the median step time, its spread, and the minor page faults per step.

Usage: python bench/freed_memory.py [--model bert] [--microbatch 8] [--microbatches 4]
           [--steps 20] [--rounds 3] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SETTINGS = ("default", "kept")
ORDERS = ("gpipe", "interleaved")
WARMUP = 3


def worker(model: str, microbatch: int, microbatches: int, steps: int, setting: str) -> None:
    """One process: time `steps` steps in both orders (alternating), print JSON."""
    import torch

    from partc.frontend.model_file import load_model_file
    from partc.hardware.local import keep_freed_memory, pin_to_core

    if setting == "kept" and not keep_freed_memory():
        raise SystemExit("this C library is not glibc: nothing to compare")
    pin_to_core(0)
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    loaded = load_model_file(ROOT / "examples" / f"{model}.py")
    module = loaded.build_model()
    assert loaded.batches is not None and loaded.loss_fn is not None
    loss_fn = loaded.loss_fn
    data = iter(loaded.batches(microbatch))
    batches = [next(data) for _ in range(microbatches)]

    def loss(batch: Any) -> torch.Tensor:
        inputs, target = batch
        out = module(**inputs) if isinstance(inputs, dict) else module(*inputs)
        return loss_fn(out, target)

    def gpipe() -> None:
        losses = [loss(b) for b in batches]
        for value in losses:
            value.backward()

    def interleaved() -> None:
        for b in batches:
            loss(b).backward()

    times: dict[str, list[float]] = {o: [] for o in ORDERS}
    faults: dict[str, list[int]] = {o: [] for o in ORDERS}
    for step in range(WARMUP + steps):
        for order, run in (("gpipe", gpipe), ("interleaved", interleaved)):
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            start = time.perf_counter()
            run()
            elapsed = time.perf_counter() - start
            module.zero_grad(set_to_none=True)
            if step >= WARMUP:
                times[order].append(elapsed)
                faults[order].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(json.dumps({"times": times, "faults": faults}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bert")
    parser.add_argument("--microbatch", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--worker", choices=SETTINGS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.model, args.microbatch, args.microbatches, args.steps, args.worker)
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    results: dict[str, dict[str, dict[str, list[float]]]] = {
        s: {"times": {o: [] for o in ORDERS}, "faults": {o: [] for o in ORDERS}}
        for s in SETTINGS}
    for _ in range(args.rounds):
        for setting in SETTINGS:
            proc = subprocess.run([sys.executable, __file__, "--worker", setting, "--model",
                                   args.model, "--microbatch", str(args.microbatch),
                                   "--microbatches", str(args.microbatches), "--steps",
                                   str(args.steps)], capture_output=True, text=True, env=env,
                                  check=True)
            got = json.loads(proc.stdout.strip().splitlines()[-1])
            for key in ("times", "faults"):
                for order in ORDERS:
                    results[setting][key][order].extend(got[key][order])
    print(f"{args.model}, {args.microbatches} micro-batches of {args.microbatch}, one core, "
          f"{args.rounds} rounds x {args.steps} steps per setting; load "
          f"{os.getloadavg()[0]:.2f}")
    print(f"{'allocator':<10} {'order':<12} {'median ms':>10} {'p10..p90 ms':>16} "
          f"{'faults/step':>12}")
    summary: dict[str, Any] = {}
    for setting in SETTINGS:
        for order in ORDERS:
            t = sorted(results[setting]["times"][order])
            med = statistics.median(t)
            p10, p90 = t[len(t) // 10], t[(len(t) * 9) // 10]
            f = statistics.median(results[setting]["faults"][order])
            summary[f"{setting}/{order}"] = {"median_s": med, "p10_s": p10, "p90_s": p90,
                                             "faults_per_step": f}
            print(f"{setting:<10} {order:<12} {med * 1e3:>10.2f} "
                  f"{p10 * 1e3:>7.2f}..{p90 * 1e3:<7.2f} {f:>12.0f}")
    for setting in SETTINGS:
        ratio = (summary[f"{setting}/gpipe"]["median_s"]
                 / summary[f"{setting}/interleaved"]["median_s"])
        print(f"{setting}: gpipe / interleaved = {ratio:.3f}")
    if args.json:
        args.json.write_text(json.dumps({"config": vars(args) | {"json": str(args.json)},
                                         "summary": summary, "raw": results}, indent=1,
                                        sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
