"""Does a profile's speed probe (partc.cost.speed_probe) follow the model's own speed, and does it
read what `partc calibrate`'s windows read? The measurements behind partc.cost.speed_correction.

1. `follow`: one process pinned to core 0 runs, for `--seconds`, rounds of the probe (one
   untimed call, the median of five timed, as a profile's round does) and one fwd+bwd of a
   4-layer `nn.TransformerEncoder` (d 256, 4 heads, batch 8 x 64); core 1 runs the same matmul
   meanwhile. Over windows of `--window` rounds: the correlation of the probe's and the model's
   window medians, the slope of log(model) on log(probe) (1: the model slows as the probe
   does), and the model's spread (standard deviation of the windows' logs) before and after
   dividing by the probe.
2. `bias`: back-to-back 0.25 s windows of the matmul (the calibration's method) against probe
   rounds after a cache flush and a training step of a 4-layer MLP, alternating in one process:
   the medians of both.

Usage: OMP_NUM_THREADS=1 python bench/speed_probe.py [--seconds 90] [--window 10] [--rounds 20]
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from partc.cost.speed_probe import PROBE_CALLS  # noqa: E402
from partc.cost.torch_profiler import flush_cpu_caches  # noqa: E402
from partc.hardware.speed_spread import KERNEL  # noqa: E402

M, K, N = KERNEL
PARTNER = ("import os, torch\nos.sched_setaffinity(0, {1}); torch.set_num_threads(1)\n"
           f"a, b = torch.randn({M}, {K}), torch.randn({K}, {N})\nwhile True: torch.mm(a, b)")


def probe_round(a: torch.Tensor, b: torch.Tensor) -> float:
    """One round as partc.cost.speed_probe.SpeedProbe times it."""
    torch.mm(a, b)
    calls = []
    for _ in range(PROBE_CALLS):
        t0 = time.perf_counter()
        torch.mm(a, b)
        calls.append(time.perf_counter() - t0)
    return statistics.median(calls)


def follow(seconds: float, window: int) -> None:
    a, b = torch.randn(M, K), torch.randn(K, N)
    model = torch.nn.TransformerEncoder(
        torch.nn.TransformerEncoderLayer(256, 4, 1024, batch_first=True), 4)
    x = torch.randn(8, 64, 256)
    partner = subprocess.Popen([sys.executable, "-c", PARTNER])
    try:
        for _ in range(3):
            probe_round(a, b)
            model(x).sum().backward()
        rows = []
        end = time.time() + seconds
        while time.time() < end:
            p = probe_round(a, b)
            t0 = time.perf_counter()
            model(x).sum().backward()
            rows.append((p, time.perf_counter() - t0))
    finally:
        partner.kill()
        partner.wait()
    chunks = [rows[i:i + window] for i in range(0, len(rows) - window + 1, window)]
    probe = [math.log(statistics.median(r[0] for r in c)) for c in chunks]
    model_t = [math.log(statistics.median(r[1] for r in c)) for c in chunks]
    slope = statistics.linear_regression(probe, model_t).slope
    corr = statistics.correlation(probe, model_t)
    divided = [m - p for m, p in zip(model_t, probe, strict=True)]
    print(f"follow: {len(rows)} rounds in {seconds:g} s, {len(chunks)} windows of {window}: "
          f"correlation {corr:.2f}, slope of log(model) on log(probe) {slope:.2f}, model "
          f"spread {statistics.pstdev(model_t):.1%} -> {statistics.pstdev(divided):.1%} "
          f"divided by the probe")


def bias(rounds: int) -> None:
    a, b = torch.randn(M, K), torch.randn(K, N)
    mlp = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(4)])
    x = torch.randn(64, 512)
    windows, probes = [], []
    for _ in range(rounds):
        calls = []
        end = time.time() + 0.25
        while time.time() < end:
            t0 = time.perf_counter()
            torch.mm(a, b)
            calls.append(time.perf_counter() - t0)
        windows.append(statistics.median(calls))
        for _ in range(15):
            flush_cpu_caches()
            mlp(x).sum().backward()
            probes.append(probe_round(a, b))
    w, p = statistics.median(windows), statistics.median(probes)
    print(f"bias: calibration-style windows {w * 1e6:.1f} us, probe rounds {p * 1e6:.1f} us "
          f"({p / w:.3f}x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=90.0)
    parser.add_argument("--window", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.sched_setaffinity(0, {0})
    print(f"machine: {os.uname().machine}, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())} UTC")
    follow(args.seconds, args.window)
    bias(args.rounds)


if __name__ == "__main__":
    main()
