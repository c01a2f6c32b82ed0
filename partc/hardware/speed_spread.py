"""How a device's speed moves from one training step to the next: the speed spread `partc
calibrate` measures on the CPU and writes as the device's `speed_spread` (DeviceSpec).

Measured on this project's 2-core VM (docs/benchmarks.md, "Measured plan quality on this
machine"): each core runs the same kernel in a fast or a 1.3-2.9x slower mode, switching on its
own every few seconds, so a pipeline whose stages run on several cores waits, step by step, for
whichever is slow. A profile times one core for about a second per operator and cannot see it.

The measurement: one process pinned to each core this process may run on, all busy at once (as
a launch's ranks are), each timing a stage-sized matrix product (`KERNEL`) over the same
wall-clock windows of `WINDOW_S`, about a training step's length, one dtype after the other.
Each window's median call time is one sample of that core's speed. The samples of all cores,
over their mean, are the factors; sorted and cut into `MODES` groups of equal count, each group
is a (probability, mean factor) mode. Their weighted factor is 1: the profile's time is taken
as the mean one, and the simulator prices the spread's extra, the slowest unit of every step
(partc.solve.stragglers). Cores' spreads are pooled, each assumed to draw on its own.
"""
from __future__ import annotations

import json
import math
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from partc.errors import PartcError
from partc.hardware.local import pinnable_cpus, set_affinity, spawn_measurement
from partc.hardware.units import format_quantity, parse_quantity

KERNEL = (512, 512, 128)  # (M, K, N): a transformer MLP's product at a small micro-batch
WINDOW_S = 0.25  # a window: about a step of the plans this machine trains
QUICK_WINDOW_S = 0.05  # smoke runs (calibrate --seconds < 5)
MODES = 4  # groups of equal count the factors are cut into
MIN_WINDOWS = 4  # per core and dtype
DTYPES = ("float32", "bfloat16")
START_AFTER_S = 0.2  # the windows start this long after the last process is ready
READY_TIMEOUT_S = 60.0

Modes = tuple[tuple[float, float], ...]


class SpeedSpreadError(PartcError):
    """The speed spread cannot be measured here (a worker failed, no CPU to pin to)."""


@dataclass(frozen=True)
class SpeedSpread:
    """What `measure_speed_spread` found: per dtype, the modes and every core's window times."""

    modes: dict[str, Modes]
    window_s: float
    times_s: dict[str, tuple[tuple[float, ...], ...]]  # dtype -> per core, per window

    def reference_s(self) -> dict[str, float]:
        """Per dtype, the mean window time (4 digits, as a config writes it: "677.2us"): the
        time the modes' factors are of, which a device config records as `speed_reference_s`
        (DeviceSpec)."""
        return {dtype: parse_quantity(format_quantity(math.fsum(flat) / len(flat), "s", 4), "s")
                for dtype, per_core in sorted(self.times_s.items())
                if (flat := [t for core in per_core for t in core])}

    def measurements(self) -> dict[str, float]:
        """The raw numbers behind the modes, for the device config's comments."""
        found: dict[str, float] = {}
        for dtype, per_core in self.times_s.items():
            flat = [t for core in per_core for t in core]
            found[f"spread_{dtype}_windows"] = float(len(flat))
            found[f"spread_{dtype}_cores"] = float(len(per_core))
            found[f"spread_{dtype}_fastest_s"] = min(flat)
            found[f"spread_{dtype}_median_s"] = statistics.median(flat)
            found[f"spread_{dtype}_slowest_s"] = max(flat)
        return found


def modes_of(times: Sequence[float], groups: int = MODES, reference: float | None = None
             ) -> Modes:
    """The (probability, factor) modes of window times: factors of `reference` (default: their
    mean, so that the weighted factor is 1 to rounding), sorted, cut into `groups` runs of
    (nearly) equal count, each the run's share (4 digits) and mean factor (3 digits; equal
    factors merged)."""
    if not times or any(not (t > 0 and math.isfinite(t)) for t in times):
        raise ValueError("window times must be positive and finite")
    if reference is not None and not (reference > 0 and math.isfinite(reference)):
        raise ValueError("the reference time must be positive and finite")
    mean = math.fsum(times) / len(times) if reference is None else reference
    factors = sorted(t / mean for t in times)
    n = len(factors)
    groups = max(1, min(groups, n))
    merged: dict[float, int] = {}
    for g in range(groups):
        part = factors[g * n // groups:(g + 1) * n // groups]
        factor = round(math.fsum(part) / len(part), 3)
        merged[factor] = merged.get(factor, 0) + len(part)
    ordered = sorted(merged.items())
    # shares to 4 digits, the last one taking the rounding: they sum to 1 as written in YAML
    shares = [round(count / n, 4) for _, count in ordered[:-1]]
    shares.append(round(1 - math.fsum(shares), 4))
    return tuple((p, factor) for p, (factor, _) in zip(shares, ordered, strict=True))


def measure_speed_spread(seconds: float, dtypes: Sequence[str] = DTYPES,
                         window_s: float = WINDOW_S) -> SpeedSpread:
    """Measure every core's speed spread for about `seconds` per dtype (module docstring)."""
    cpus = pinnable_cpus("the speed spread", SpeedSpreadError)
    windows = max(MIN_WINDOWS, round(seconds / window_s))
    per_dtype: dict[str, list[list[float]]] = spawn_measurement(
        _worker, (tuple(cpus), tuple(dtypes), windows, window_s), len(cpus), "speed spread",
        SpeedSpreadError, "partc-spread-")
    times = {d: tuple(tuple(core) for core in per_dtype[d]) for d in dtypes}
    return SpeedSpread(modes={d: modes_of([t for core in times[d] for t in core])
                              for d in dtypes},
                       window_s=window_s, times_s=times)


def _worker(index: int, cpus: tuple[int, ...], dtypes: tuple[str, ...], windows: int,
            window_s: float, out: str) -> None:
    import torch

    torch.set_num_threads(1)
    if not set_affinity(frozenset({cpus[index]})):
        raise RuntimeError(f"worker {index} cannot pin itself to CPU {cpus[index]}")
    m, k, n = KERNEL
    operands = {d: (torch.randn(m, k, dtype=getattr(torch, d)),
                    torch.randn(k, n, dtype=getattr(torch, d))) for d in dtypes}
    for a, b in operands.values():  # warm: oneDNN picks and compiles its kernels
        for _ in range(5):
            torch.mm(a, b)
    start = _agreed_start(index, len(cpus), out)
    found: dict[str, list[float]] = {}
    for position, dtype in enumerate(dtypes):
        a, b = operands[dtype]
        medians = []
        for w in range(windows):
            begin = start + (position * windows + w) * window_s
            end = begin + window_s
            while (now := time.time()) < begin:
                time.sleep(min(begin - now, 0.01))
            calls = []
            while time.time() < end:
                t0 = time.perf_counter()
                torch.mm(a, b)
                calls.append(time.perf_counter() - t0)
            if calls:  # a window this process reached late counts as missing, not as slow
                medians.append(statistics.median(calls))
        found[dtype] = medians
    _publish(Path(f"{out}.{index}"), json.dumps(found))
    if index == 0:  # the others write theirs as they finish the same windows
        parts = [_wait_for(Path(f"{out}.{i}")) for i in range(len(cpus))]
        merged = {d: [part[d] for part in parts] for d in dtypes}
        _publish(Path(out), json.dumps(merged))


def _agreed_start(index: int, count: int, out: str) -> float:
    """A wall-clock start every worker computes alike: each writes when it is ready, and the
    windows start just after the last one is."""
    _publish(Path(f"{out}.ready.{index}"), repr(time.time()))
    ready = [float(_wait_for(Path(f"{out}.ready.{i}"), text=True)) for i in range(count)]
    return max(ready) + START_AFTER_S


def _publish(path: Path, text: str) -> None:
    """Write `text` so that a reader polling `path` sees all of it or nothing."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)


def _wait_for(path: Path, text: bool = False) -> Any:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        try:
            content = path.read_text()
            if content:
                return content if text else json.loads(content)
        except FileNotFoundError:
            pass  # not written yet
        if time.monotonic() > deadline:
            raise RuntimeError(f"a speed-spread worker did not report ({path.name})")
        time.sleep(0.01)
