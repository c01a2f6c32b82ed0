"""Does a core run a pass slower right after it idled, or while the other core computes?

Two probes of what a pipeline rank meets that a profile does not: a profile times a program back
to back on one core while the others idle; a launched rank blocks in receives between passes (its
vCPU halts) and shares the machine with the other ranks.

- `wake`: after a sleep of each `--gaps` ms, `--calls` back-to-back forward + backward calls of a
  three-layer MLP (width `--width`, batch `--batch`, one thread, pinned to core 0); each call's
  median over `--trials` trials, over the recovered calls' (the later half). Gaps are interleaved
  trial by trial, so the machine's drift over seconds falls on every gap alike. The extra time
  of a wake: the first half's excess over the recovered call.
- `corun`: the same call back to back in `--windows` windows of 2 s, with a second process on the
  other core running the same loop (SIGCONT) or stopped (SIGSTOP) in alternate windows.

    OMP_NUM_THREADS=1 .venv/bin/python bench/core_wake.py [--probe wake,corun] [--gaps 0,1,3,10,30]
        [--batch 512] [--width 256] [--calls 8] [--trials 100] [--windows 12] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from typing import Any, Callable

WINDOW_S = 2.0


def _call(batch: int, width: int) -> Callable[[], None]:
    """One forward + backward of a three-layer ReLU MLP on one thread."""
    import torch
    import torch.nn as nn

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(3)])
    x = torch.randn(batch, width)

    def call() -> None:
        model.zero_grad(set_to_none=True)
        model(x).sum().backward()

    for _ in range(30):
        call()
    return call


def wake(call: Callable[[], None], gaps_ms: list[float], calls: int,
         trials: int) -> list[dict[str, Any]]:
    """Per gap: each call's median after a sleep of the gap, over the recovered call's."""
    times: dict[float, list[list[float]]] = {g: [[] for _ in range(calls)] for g in gaps_ms}
    for _ in range(trials):
        for gap in gaps_ms:  # interleaved: drift over seconds falls on every gap alike
            time.sleep(gap / 1e3)
            for k in range(calls):
                t = time.perf_counter()
                call()
                times[gap][k].append(time.perf_counter() - t)
    rows = []
    for gap in gaps_ms:
        medians = [statistics.median(ts) for ts in times[gap]]
        recovered = statistics.median(medians[calls // 2:])
        rows.append({"gap_ms": gap, "recovered_call_s": recovered,
                     "call_over_recovered": [m / recovered for m in medians],
                     "extra_s": sum(m - recovered for m in medians[:calls // 2])})
    return rows


def corun(call: Callable[[], None], cpus: list[int], args: argparse.Namespace) -> dict[str, Any]:
    """Alternate windows with the partner on the other core (`cpus[1]`) running or stopped."""
    if len(cpus) < 2:
        raise SystemExit("core_wake: --probe corun needs two cores")
    partner = subprocess.Popen([sys.executable, __file__, "--partner", str(cpus[1]),
                                "--batch", str(args.batch), "--width", str(args.width)])
    windows: dict[str, list[float]] = {"running": [], "stopped": []}
    try:
        time.sleep(8.0)  # its torch import and warm-up, on its own core
        for w in range(args.windows):
            state = "running" if w % 2 == 0 else "stopped"
            partner.send_signal(signal.SIGCONT if state == "running" else signal.SIGSTOP)
            time.sleep(0.2)
            ts, end = [], time.perf_counter() + WINDOW_S
            while time.perf_counter() < end:
                t = time.perf_counter()
                call()
                ts.append(time.perf_counter() - t)
            windows[state].append(statistics.median(ts))
    finally:
        partner.send_signal(signal.SIGCONT)
        partner.kill()
        partner.wait()
    return {"windows_s": windows,
            "running_over_stopped": statistics.median(windows["running"])
            / statistics.median(windows["stopped"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--probe", default="wake,corun")
    parser.add_argument("--gaps", default="0,1,3,10,30", help="sleeps before a trial's calls, ms")
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--calls", type=int, default=8)
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--windows", type=int, default=12)
    parser.add_argument("--json", default=None)
    parser.add_argument("--partner", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.partner is not None:  # the co-runner: pinned first, then warmed up, then forever
        os.sched_setaffinity(0, {args.partner})
        call = _call(args.batch, args.width)
        while True:
            call()
    cpus = sorted(os.sched_getaffinity(0))  # before this process is pinned to the first
    os.sched_setaffinity(0, {cpus[0]})
    call = _call(args.batch, args.width)
    probes = args.probe.split(",")
    result: dict[str, Any] = {"batch": args.batch, "width": args.width,
                              "utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())}
    print(f"MLP 3 x {args.width}, batch {args.batch}, forward + backward, one thread, core 0")
    if "wake" in probes:
        result["wake"] = wake(call, [float(g) for g in args.gaps.split(",")], args.calls,
                              args.trials)
        print("| sleep before (ms) | recovered call (ms) | call k over recovered, k = 1.. | "
              "extra of the wake (ms) |\n|---|---|---|---|")
        for row in result["wake"]:
            ratios = " ".join(f"{r:.3f}" for r in row["call_over_recovered"])
            print(f"| {row['gap_ms']:g} | {row['recovered_call_s'] * 1e3:.3f} | {ratios} | "
                  f"{row['extra_s'] * 1e3:+.3f} |")
    if "corun" in probes:
        result["corun"] = corun(call, cpus, args)
        w = result["corun"]["windows_s"]
        for state in ("running", "stopped"):
            print(f"other core {state}: " + " ".join(f"{t * 1e3:.3f}" for t in w[state]) + " ms")
        print(f"running over stopped (medians): {result['corun']['running_over_stopped']:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
