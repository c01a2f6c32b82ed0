"""How much does this machine's speed move while nothing of ours runs, and what does one core's
memory traffic cost the other's?

A plan's prediction is priced from a profile and a calibration taken in some minutes, and its
launches run in others. On the shared VM this project measures on (docs/benchmarks.md), the same
plan's launches moved 10-35% between rounds minutes apart. This probe says how much of that the
machine itself moves, without a pipeline, a gloo socket or a second process of ours:

- `drift` (default): every `--every` seconds for `--seconds`, on one pinned core, three rates:
  DRAM bandwidth (a copy between two 128 MiB tensors), a 512x512 float32 matmul's FLOP/s, and a
  cache-resident copy (1 MiB). Printed per sample (JSON lines with `--jsonl`) and as quartiles.
- `--share`: the DRAM copy on core 0 alone, on core 1 alone, and on both at once (two processes
  started together behind a barrier), `--rounds` times: the bandwidth one core keeps while the
  other streams too. A CPU "device" config prices each core's bandwidth alone; two pipeline
  ranks streaming at once (an optimizer step beside a backward) share the memory bus.

Usage: python bench/machine_drift.py [--seconds 480] [--every 4] [--core 0] [--jsonl out.jsonl]
       python bench/machine_drift.py --share [--rounds 3]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from typing import Any

import torch

DRAM_NUMEL = 32 << 20  # float32: 128 MiB a tensor, far beyond any last-level cache
CACHE_NUMEL = 1 << 18  # 1 MiB: within L2 on the machines measured
MATMUL = 512


def _pin(core: int) -> None:
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)


def dram_copy_gbs(src: torch.Tensor, dst: torch.Tensor, repeats: int) -> float:
    """GB/s (bytes read + written) of `repeats` copies of `src` into `dst`."""
    start = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    return repeats * 2 * src.numel() * src.element_size() / (time.perf_counter() - start) / 1e9


def sample(tensors: dict[str, torch.Tensor]) -> dict[str, float]:
    """One sample of the three rates (about 0.4 s)."""
    dram = dram_copy_gbs(tensors["a"], tensors["b"], 5)
    start = time.perf_counter()
    for _ in range(20):
        torch.mm(tensors["x"], tensors["y"])
    gemm = 20 * 2 * MATMUL ** 3 / (time.perf_counter() - start) / 1e9
    cache = dram_copy_gbs(tensors["s"], tensors["t"], 2000)
    return {"dram_GBs": round(dram, 2), "gemm_GFs": round(gemm, 1), "cache_GBs": round(cache, 1)}


def drift(core: int, seconds: float, every: float, jsonl: str | None) -> None:
    _pin(core)
    a = torch.randn(DRAM_NUMEL)
    s = torch.randn(CACHE_NUMEL)
    tensors = {"a": a, "b": torch.empty_like(a), "x": torch.randn(MATMUL, MATMUL),
               "y": torch.randn(MATMUL, MATMUL), "s": s, "t": torch.empty_like(s)}
    sample(tensors)  # first touch of every tensor
    rows: list[dict[str, Any]] = []
    out = open(jsonl, "w") if jsonl else None
    end = time.time() + seconds
    try:
        while time.time() < end:
            row = {"t": round(time.time(), 1), **sample(tensors)}
            rows.append(row)
            line = json.dumps(row)
            print(line, flush=True)
            if out:
                out.write(line + "\n")
            time.sleep(every)
    finally:
        if out:
            out.close()
    print(f"\n{len(rows)} samples over {seconds:.0f} s on core {core} "
          "(min / q1 / median / q3 / max, max/min):")
    for key in ("dram_GBs", "gemm_GFs", "cache_GBs"):
        v = sorted(r[key] for r in rows)
        q = statistics.quantiles(v, n=4) if len(v) > 1 else [v[0]] * 3
        print(f"  {key:10} {v[0]:8.2f} {q[0]:8.2f} {q[1]:8.2f} {q[2]:8.2f} {v[-1]:8.2f}   "
              f"{v[-1] / v[0]:.2f}x")


def _streamer(core: int, barrier: Any, results: Any) -> None:
    _pin(core)
    a = torch.randn(DRAM_NUMEL)
    b = torch.empty_like(a)
    b.copy_(a)
    barrier.wait()
    results.put((core, dram_copy_gbs(a, b, 40)))


def share(rounds: int) -> None:
    ctx = mp.get_context("fork")
    table: dict[str, list[float]] = {"core 0 alone": [], "core 1 alone": [],
                                     "core 0, both": [], "core 1, both": []}
    for _ in range(rounds):
        for cores in ((0,), (1,), (0, 1)):
            barrier, results = ctx.Barrier(len(cores)), ctx.Queue()
            procs = [ctx.Process(target=_streamer, args=(c, barrier, results)) for c in cores]
            for p in procs:
                p.start()
            got = dict(results.get() for _ in cores)
            for p in procs:
                p.join()
            for core, gbs in got.items():
                table[f"core {core} alone" if len(cores) == 1 else f"core {core}, both"
                      ].append(gbs)
    print(f"DRAM copy GB/s per core, {rounds} rounds (median, min-max):")
    for name, v in table.items():
        print(f"  {name:13} {statistics.median(v):6.2f}  ({min(v):.2f}-{max(v):.2f})")
    alone = statistics.median(table["core 0 alone"] + table["core 1 alone"])
    both = statistics.median(table["core 0, both"] + table["core 1, both"])
    print(f"one core's bandwidth while the other streams too: {both / alone:.2f}x its own alone")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=480.0)
    ap.add_argument("--every", type=float, default=4.0)
    ap.add_argument("--core", type=int, default=0)
    ap.add_argument("--jsonl")
    ap.add_argument("--share", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if args.share:
        if os.cpu_count() is None or len(os.sched_getaffinity(0)) < 2:
            print("--share needs two cores", file=sys.stderr)
            return 2
        share(args.rounds)
    else:
        drift(args.core, args.seconds, args.every, args.jsonl)
    return 0


if __name__ == "__main__":
    sys.exit(main())
