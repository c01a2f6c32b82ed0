"""The machine's speed while a CPU profile times its whole-model totals: one reference matmul,
timed in every round of those totals (partc.cost.torch_profiler.time_interleaved).

A CPU profile's totals set every stage's time, and they are timed in about a second per size.
On a shared VM that second falls in whatever speed the cores run in just then: this project's
VM runs the same kernel in a fast or a 1.2-2x slower mode, switching every few seconds and
sometimes staying slow for a minute (docs/benchmarks.md, "The machine's speed while profiling";
run BU's BERT x4 was profiled 1.43x slower than it later ran). The probe is the speed spread's
own kernel (partc.hardware.speed_spread.KERNEL), timed on the same core between the totals'
runs and under the same clock, so its median is the machine's speed in the moments the totals
were taken. `partc calibrate` records the same kernel's mean time over its spread windows as
the device config's `speed_reference_s`; partc.cost.speed_correction scales a profile by the
part of the two's ratio beyond the probe's own noise, so that a profile taken in a slow minute
prices about the machine's mean speed, the speed the spread's factors are of.

Measured here (2026-12-08, 487 rounds over 90 s of a 4-layer transformer encoder's fwd+bwd and
this probe): over 2-second windows, log(model time) against log(probe time) has slope 1.08
and dividing by the probe halves the model time's spread (standard deviation 9.2% -> 4.2%).
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any, Callable

from partc.hardware.speed_spread import KERNEL
from partc.options import Precision, matmul_dtype_of

PROBE_CALLS = 5  # timed matmul calls per round (~3.5 ms here): their median is its sample
PROBE = "speed_probe"  # the profile calibration's key


@dataclass(frozen=True)
class SpeedProbeResult:
    """What a probe measured: the median over rounds of each round's median call time."""

    dtype: str  # torch dtype name: the precision's matmul dtype
    median_s: float
    rounds: int
    kernel: tuple[int, int, int] = KERNEL

    def to_dict(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "kernel": list(self.kernel),
                "median_s": float(f"{self.median_s:.6g}"), "rounds": self.rounds}


def probe_from(record: object) -> SpeedProbeResult | None:
    """A profile calibration's `speed_probe` record read back, or None where it is missing or is
    not one (another kernel, a non-positive time): such a profile is priced as measured."""
    if not isinstance(record, dict):
        return None
    dtype, median, rounds, kernel = (record.get(k) for k in ("dtype", "median_s", "rounds",
                                                             "kernel"))
    if (not isinstance(dtype, str) or isinstance(median, bool)
            or not isinstance(median, (int, float)) or not math.isfinite(median) or median <= 0
            or not isinstance(rounds, int) or rounds < 1
            or not isinstance(kernel, list) or tuple(kernel) != KERNEL):
        return None
    return SpeedProbeResult(dtype=dtype, median_s=float(median), rounds=rounds)


class SpeedProbe:
    """Call once per round of a profile's totals; `result()` after the rounds. Times with
    `clock` (the totals' own: CPU time where a neighbour shares the core)."""

    def __init__(self, precision: Precision, clock: Callable[[], float]) -> None:
        import torch  # here: the record's readers (partc diff) need no torch

        self.dtype = matmul_dtype_of(precision)
        m, k, n = KERNEL
        generator = torch.Generator().manual_seed(0)
        dtype = getattr(torch, self.dtype)
        self._a = torch.randn(m, k, generator=generator).to(dtype)
        self._b = torch.randn(k, n, generator=generator).to(dtype)
        self._clock = clock
        self._rounds: list[float] = []
        self._mm = torch.mm
        for _ in range(PROBE_CALLS):  # warm: oneDNN picks and compiles its kernel
            self._mm(self._a, self._b)

    def __call__(self) -> None:
        # one call untimed: a round starts after a cold pass (the cache flushed), and the first
        # call reads its operands from memory (measured here: 919 us against a window's 695;
        # the next five's median 723 without it, 675 with it, the window's median 675)
        self._mm(self._a, self._b)
        calls = []
        for _ in range(PROBE_CALLS):
            t0 = self._clock()
            self._mm(self._a, self._b)
            calls.append(self._clock() - t0)
        self._rounds.append(statistics.median(calls))

    def result(self) -> SpeedProbeResult | None:
        """The rounds' median, or None before any round (or where every call read 0: a clock
        too coarse for the kernel)."""
        if not self._rounds or not statistics.median(self._rounds) > 0:
            return None
        return SpeedProbeResult(dtype=self.dtype, median_s=statistics.median(self._rounds),
                                rounds=len(self._rounds))
