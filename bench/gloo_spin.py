"""gloo's socket loop spinning on a pinned process, with and without SCHED_BATCH.

gloo's TCP event loop try-locks a pair when its socket is ready and, when a thread of the process
holds the lock, goes back to a level-triggered epoll_wait that reports the socket again at once.
Woken by arriving bytes it preempts the lock holder, which launch has pinned to the same core,
and spins until the scheduler's tick ends its slice. partc.hardware.local.batch_schedule_gloo_io
runs the loop threads SCHED_BATCH (no wakeup preemption). This measures both ways, each process
pinned as launch pins its workers (pin_to_core(rank)):

- exchange: 2 processes, one per core, both sending 1 B to each other at once and waiting (how a
  pipeline's schedule exchanges, and what `partc calibrate` measures as the link's latency);
- gather: 4 processes, 2 per core; ranks 1 and 2 reach a gather of 320 B to rank 0 at once,
  ranks 0 and 3 after 10 ms of computing (launch's end-of-step metrics gather and tied-weight
  all-reduces meet like this); the root's time in the gather;
- wake (idle / busy): rank 1 (its own core) sends 1 B every 4 ms to rank 0, which waits in recv
  on a core it shares with a third process, asleep or computing (matrix multiplies) all the
  while, as a pipeline rank waits for its input while its core-mate computes (4 stages on 2
  cores); the time from the send to rank 0's recv returning.

Usage: python bench/gloo_spin.py [--reps 400] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from partc.hardware.local import free_port  # noqa: E402

MODES = ("plain", "batch")


def _worker(rank: int, world: int, port: int, mode: str, test: str, reps: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from partc.hardware.local import batch_schedule_gloo_io, pin_to_core

    torch.set_num_threads(1)
    pin_to_core(rank)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    if mode == "batch":
        batch_schedule_gloo_io()
    times = []
    if test == "exchange":
        peer = 1 - rank
        send, recv = torch.zeros(1, dtype=torch.uint8), torch.zeros(1, dtype=torch.uint8)
        for i in range(reps + 20):
            dist.barrier()
            t0 = time.perf_counter()
            ops = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, peer),
                                          dist.P2POp(dist.irecv, recv, peer)])
            for op in ops:
                op.wait()
            if i >= 20:
                times.append(time.perf_counter() - t0)
    elif test.startswith("wake"):
        stamp = torch.zeros(1, dtype=torch.float64)
        for i in range(reps + 10):
            if rank == 1:
                time.sleep(0.004)
                stamp[0] = time.perf_counter()  # CLOCK_MONOTONIC: one clock for the host
                dist.send(stamp, 0)
            else:
                dist.recv(stamp, 1)
                if i >= 10:
                    times.append(time.perf_counter() - float(stamp[0]))
    else:
        row = torch.zeros(40, dtype=torch.float64)
        rows = [torch.zeros_like(row) for _ in range(world)] if rank == 0 else None
        for i in range(reps + 10):
            dist.barrier()
            if rank in (0, 3):
                t = time.perf_counter()
                while time.perf_counter() - t < 0.010:
                    pass
            t0 = time.perf_counter()
            dist.gather(row, gather_list=rows, dst=0)
            if i >= 10:
                times.append(time.perf_counter() - t0)
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    dist.destroy_process_group()


def _core_mate(stop: Any, busy: bool) -> None:
    """Rank 0's core-mate in the wake tests: pinned to its core, computing until told to stop
    (busy) or asleep."""
    import torch

    from partc.hardware.local import pin_to_core

    torch.set_num_threads(1)
    pin_to_core(0)
    a = torch.randn(256, 256)
    while busy and not stop.is_set():
        a @ a
    stop.wait()


def measure(test: str, mode: str, reps: int) -> list[float]:
    """Rank 0's seconds per operation, one run of `test` in `mode`."""
    import multiprocessing

    import torch.multiprocessing as mp

    world = 4 if test == "gather" else 2
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    mate = ctx.Process(target=_core_mate, args=(stop, test == "wake-busy")) \
        if test.startswith("wake") else None
    if mate is not None:
        mate.start()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "times.json")
            mp.spawn(_worker, args=(world, free_port(), mode, test, reps, out), nprocs=world,
                     join=True)
            times: list[float] = json.loads(Path(out).read_text())
    finally:
        stop.set()
        if mate is not None:
            mate.join()
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=400)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    found: dict[str, dict[str, dict[str, float]]] = {}
    print("| test | gloo loop | median ms | mean ms | p90 ms | max ms |")
    print("|---|---|---|---|---|---|")
    for test in ("exchange", "gather", "wake-idle", "wake-busy"):
        for mode in MODES:
            times = sorted(measure(test, mode, args.reps))
            row = {"median_ms": statistics.median(times) * 1e3,
                   "mean_ms": statistics.mean(times) * 1e3,
                   "p90_ms": times[int(0.9 * (len(times) - 1))] * 1e3,
                   "max_ms": times[-1] * 1e3}
            found.setdefault(test, {})[mode] = row
            print(f"| {test} | {mode} | " + " | ".join(f"{v:.3f}" for v in row.values()) + " |",
                  flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(found, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
