"""How far ahead a process woken from a gloo wait runs of a core-mate that kept computing: the
wake credit the simulator gives a rank that shares its core (`ClusterSpec.wake_credit_s`,
partc.solve.shared_cores).

Linux's fair scheduler shares a core fairly over time, not at each instant: a process that
slept is placed behind the one that kept running and runs ahead of it until it has caught up.
A pipeline rank sleeps in a receive while a core-mate computes, and its input's arrival wakes
it, so how much it runs ahead decides which of the two finishes first. That depends on the
kernel and on how the process is woken (measured on a 2-core VM, Linux 6.18: 0 when woken by a
timer, about 5 ms when woken by a gloo receive), so it is measured the way launch's workers meet
it: three processes, a hog computing without pause and a sleeper pinned to one CPU, and a
sender elsewhere that sends the sleeper a small message every `period_s`. Each time the sleeper
receives, it computes `compute_s` of CPU time and records the wall time that took. Run ahead
by W and then sharing the CPU equally, C seconds of work take W + 2 (C - W): W = 2 C - wall,
clamped to 0..C, and the median over the repeats is the credit. A credit that reaches C is
measured again with twice the work.
"""
from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from partc.errors import PartcError
from partc.hardware.local import (
    batch_schedule_gloo_io,
    free_port,
    pinnable_cpus,
    set_affinity,
    spawn_measurement,
)

COMPUTE_S = 0.03  # CPU seconds the sleeper computes per wake: over the credits seen (5 ms)
PERIOD_S = 0.08  # between the sender's messages: the sleeper's 2 C of wall time and a wait
REPEATS = 15
WARMUP = 2  # wakes not timed: the first allocates gloo's buffers and warms the kernels
MAX_COMPUTE_S = 0.25  # the most work a re-measurement doubles up to


class WakeCreditError(PartcError):
    """The wake credit cannot be measured here (a worker failed, no CPU to pin to)."""


@dataclass(frozen=True)
class WakeCredit:
    """What `measure_wake_credit` found (seconds)."""

    wake_credit_s: float  # the median credit
    compute_s: float  # the sleeper's work per wake in the measurement that was kept
    credits_s: tuple[float, ...] = field(default=())  # per timed wake

    def measurements(self) -> dict[str, float]:
        """The raw numbers, for the cluster config's comments."""
        return {"wake_credit_compute_s": self.compute_s,
                "wake_credit_min_s": min(self.credits_s, default=0.0),
                "wake_credit_max_s": max(self.credits_s, default=0.0)}


def measure_wake_credit(repeats: int = REPEATS) -> WakeCredit:
    """Measure this machine's wake credit (the module docstring); takes a few seconds."""
    compute = COMPUTE_S
    while True:
        credits = _measure(compute, max(PERIOD_S, 2.7 * compute), repeats)
        credit = statistics.median(credits)
        if credit < 0.8 * compute or 2 * compute > MAX_COMPUTE_S:
            return WakeCredit(wake_credit_s=credit, compute_s=compute, credits_s=tuple(credits))
        compute *= 2


def _measure(compute_s: float, period_s: float, repeats: int) -> list[float]:
    cpus = pinnable_cpus("the wake credit", WakeCreditError)
    # the hog and the sleeper on one logical CPU (an SMT sibling would run them side by side),
    # the sender on another core where there is one
    shared, sender = cpus[0], cpus[1 % len(cpus)]
    timed: list[list[float]] = spawn_measurement(
        _worker, (free_port(), shared, sender, compute_s, period_s, repeats), 3, "wake credit",
        WakeCreditError, "partc-wake-")
    return [min(max(2 * cpu - wall, 0.0), cpu) for wall, cpu in timed]


def _work(seconds: float, x: Any) -> Any:
    """`seconds` of this thread's CPU time in small matrix products (the kind of work a stage
    does), returning the last product."""
    import torch

    start = time.thread_time()
    while time.thread_time() - start < seconds:
        x = torch.mm(x, x)
        x = x / x.norm()
    return x


def _worker(index: int, port: int, shared: int, sender: int, compute_s: float, period_s: float,
            repeats: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    x = torch.randn(128, 128)
    wakes = WARMUP + repeats
    # unpinned, the hog and the sleeper could run side by side and the credit would read as
    # the whole of the work: refuse instead
    if not set_affinity(frozenset({shared if index < 2 else sender})):
        raise RuntimeError(f"worker {index} cannot pin itself to a CPU")
    if index == 0:  # the hog: computes on the shared CPU until the others are done
        done = Path(out + ".done")
        deadline = time.perf_counter() + 60.0
        while not done.exists() and time.perf_counter() < deadline:
            x = _work(0.005, x)
        return
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=index - 1, world_size=2)
    batch_schedule_gloo_io()  # as launch's workers run gloo's socket loops
    message = torch.zeros(1024)
    timed = []
    try:
        for _ in range(wakes):
            if index == 2:
                time.sleep(period_s)
                dist.send(message, 0)
                continue
            dist.recv(message, 1)
            wall, cpu = time.perf_counter(), time.thread_time()
            x = _work(compute_s, x)
            timed.append([time.perf_counter() - wall, time.thread_time() - cpu])
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if index == 1:
        Path(out).write_text(json.dumps(timed[WARMUP:]))
        Path(out + ".done").write_text("")
