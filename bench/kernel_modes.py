"""Is this machine fast or slow right now, per precision? The same matmul, window by window.

On the shared VM this project measures on (docs/benchmarks.md), one kernel's time is bimodal and
flips within seconds, whatever this machine's other core does: a 512x512 @ 512x128 bfloat16
matmul (oneDNN's AMX kernel) ran 71-81 us or 146-208 us in alternate 2-second windows, float32
(AVX-512) 385-420 us or 540-660 us. bf16 loses more (2.0-2.9x against 1.4-2.0x), so a bf16 plan
priced in a fast minute and launched in a slow one misses its prediction by more than an fp32
plan does, and neither is an error of the cost model. Run this beside a measured run to say
which mode the machine was in.

It runs, on one core, `--windows` rounds of: bf16 for `--seconds`, then fp32 for `--seconds`,
each the median (p10..p90) of back-to-back calls; `--partner` keeps the other core busy with the
same bf16 (or fp32) loop in a second process, or `--partner stopped` starts it and SIGSTOPs it
around each window (is the other core's AMX work what slows ours?). A window's mode: `slow` when
its median is above 1.3x the fastest window's of that precision in this run, so a run spent
wholly in the slow mode reads all `fast`: compare the medians with another run's (2026-11-29
07:56 every bf16 window read 187-188 us, 07:54 77-81 us).

`--idle sleep,spin` adds bf16 windows whose calls come in 10 ms bursts with 3 ms gaps, slept
(the core idles, as a pipeline rank blocked in a receive: does an idling vCPU come back in the
slow mode more often?) or spun (the core stays busy).

`--every-core` times every core at once instead, one process pinned to each, the windows
aligned on the wall clock: the mode is each core's own (2026-11-29 10:06, 60 one-second fp32
windows: core 0 slow in 41, core 1 in 26, both in 15), and a pipeline whose stages run on
different cores is slowed whenever any of them is, so a run on several cores needs every
core's mode, not core 0's.

Usage: python bench/kernel_modes.py [--windows 6] [--seconds 2] [--partner none|bf16|fp32|stopped]
           [--idle sleep,spin] [--every-core] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PRECISIONS = ("bf16", "fp32")
SLOW = 1.3  # a window's median above this multiple of the fastest window's is the slow mode
SHAPE = ((512, 512), (512, 128))  # a transformer MLP's GEMM at 16 x 32 tokens, width 128/512


IDLE = ("none", "sleep", "spin")
BURST_S, GAP_S = 0.010, 0.003  # a pipeline rank's compute between waits, and a bubble's wait


def _window(precision: str, seconds: float, idle: str = "none") -> list[float]:
    """Calls of the matmul for `seconds`; each call's time (s). `idle`: back to back (`none`),
    or bursts of BURST_S separated by GAP_S of sleeping (`sleep`: the core idles, as a rank
    blocked in a receive) or of spinning (`spin`: the core stays busy doing nothing)."""
    import torch

    a, b = _operands(precision)
    for _ in range(20):
        torch.mm(a, b)
    times = []
    end = time.perf_counter() + seconds
    burst_end = time.perf_counter() + BURST_S
    while time.perf_counter() < end:
        t = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - t)
        if idle != "none" and time.perf_counter() >= burst_end:
            if idle == "sleep":
                time.sleep(GAP_S)
            else:
                until = time.perf_counter() + GAP_S
                while time.perf_counter() < until:
                    pass
            burst_end = time.perf_counter() + BURST_S
    return times


def _loop(precision: str) -> None:
    """The partner: the same matmul forever, untimed (killed by the parent)."""
    import torch

    a, b = _operands(precision)
    while True:
        torch.mm(a, b)


def _operands(precision: str) -> tuple[Any, Any]:
    """The matmul's two operands in `precision`."""
    import torch

    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    return torch.randn(*SHAPE[0], dtype=dtype), torch.randn(*SHAPE[1], dtype=dtype)


@contextmanager
def _partner(kind: str) -> Iterator[int | None]:
    """A second process on the other core running the bf16 (`bf16`, `stopped`) or fp32 loop;
    yields its pid (None for `none`)."""
    if kind == "none":
        yield None
        return
    precision = "fp32" if kind == "fp32" else "bf16"
    cpus = sorted(os.sched_getaffinity(0))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, __file__, "--loop", precision], env=env)
    try:
        if len(cpus) > 1:
            os.sched_setaffinity(proc.pid, {cpus[1]})
        time.sleep(3.0)  # its torch import and warm-up
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


def _core_windows(core: int, start: float, windows: int, seconds: float) -> list[dict[str, Any]]:
    """One `--every-core` child: pinned to logical CPU `core`, from wall time `start` on, a bf16
    then an fp32 window of `seconds` each, `windows` times, each window starting on the wall
    clock's schedule so that every core's window w covers the same seconds."""
    os.sched_setaffinity(0, {core})
    rows = []
    for w in range(windows):
        for k, precision in enumerate(PRECISIONS):
            begin = start + (w * len(PRECISIONS) + k) * seconds
            while time.time() < begin:
                time.sleep(min(0.01, max(0.0, begin - time.time())))
            # the call that runs past the window's end is the last: a window's calls cover it
            at = time.strftime("%H:%M:%S", time.gmtime())
            times = _window(precision, max(0.0, begin + seconds - time.time() - 0.05))
            rows.append({"window": w, "precision": precision, "idle": "none", "utc": at,
                         "core": core, **_quantiles(times)})
    return rows


def _every_core(windows: int, seconds: float) -> list[dict[str, Any]]:
    """`_core_windows` on every core this process may run on, at once (one child per core)."""
    cpus = sorted(os.sched_getaffinity(0))
    start = time.time() + 5.0  # each child's torch import
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, __file__, "--core-child", str(c), str(start),
                               str(windows), str(seconds)], stdout=subprocess.PIPE, env=env,
                              text=True) for c in cpus]
    rows: list[dict[str, Any]] = []
    for proc in procs:
        out, _ = proc.communicate()
        if proc.returncode != 0:
            raise SystemExit(f"the probe on a core failed (exit {proc.returncode})")
        rows.extend(json.loads(out))
    return rows


def _report_every_core(rows: list[dict[str, Any]], seconds: float) -> None:
    """Per window, every core's median and mode; per precision, how often each core and any
    core was slow."""
    cores = sorted({r["core"] for r in rows})
    fastest = {p: min(r["median_us"] for r in rows if r["precision"] == p) for p in PRECISIONS}
    for r in rows:
        r["mode"] = "slow" if r["median_us"] > SLOW * fastest[r["precision"]] else "fast"
    print(f"every core at once ({len(cores)}), {seconds:g} s windows; median us per core, "
          "* = slow")
    print("window  utc       precision  " + "  ".join(f"core {c:<3d}" for c in cores))
    at = {(r["window"], r["precision"], r["core"]): r for r in rows}
    for w in sorted({r["window"] for r in rows}):
        for p in PRECISIONS:
            mine = [at[(w, p, c)] for c in cores]
            print(f"{w:6d}  {mine[0]['utc']}  {p:9s}  " + "  ".join(
                f"{r['median_us']:7.0f}{'*' if r['mode'] == 'slow' else ' '}" for r in mine))
    for p in PRECISIONS:
        per_window: dict[int, list[bool]] = {}
        for r in rows:
            if r["precision"] == p:
                per_window.setdefault(r["window"], []).append(r["mode"] == "slow")
        slow = [r["core"] for r in rows if r["precision"] == p and r["mode"] == "slow"]
        each = ", ".join(f"core {c} {slow.count(c)}" for c in cores)
        print(f"{p}: slow windows of {len(per_window)}: {each}; any core "
              f"{sum(any(v) for v in per_window.values())}, every core "
              f"{sum(all(v) for v in per_window.values())} (against the fastest, "
              f"{fastest[p]:.0f} us)")


def _quantiles(times: list[float]) -> dict[str, float]:
    """p10, median and p90 of `times`, in microseconds."""
    s = sorted(times)
    n = len(s)
    return {"p10_us": s[n // 10] * 1e6, "median_us": s[n // 2] * 1e6,
            "p90_us": s[9 * n // 10] * 1e6, "calls": float(n)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=6)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--partner", choices=("none", "bf16", "fp32", "stopped"),
                        default="none")
    parser.add_argument("--idle", default="none",
                        help=f"comma list of {', '.join(IDLE)}: besides back-to-back calls, "
                        f"bursts of {BURST_S * 1e3:g} ms with {GAP_S * 1e3:g} ms gaps slept "
                        "(a rank blocked in a receive) or spun, bf16 only")
    parser.add_argument("--every-core", action="store_true",
                        help="time every core at once, one process on each (not with "
                        "--partner or --idle)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--loop", choices=PRECISIONS, help=argparse.SUPPRESS)
    parser.add_argument("--core-child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    if args.loop:
        _loop(args.loop)
        return
    if args.core_child:
        core, start, windows, seconds = args.core_child
        print(json.dumps(_core_windows(int(core), float(start), int(windows), float(seconds))))
        return
    if args.every_core:
        if args.partner != "none" or args.idle != "none":
            parser.error("--every-core keeps every core busy itself: no --partner or --idle")
        every = _every_core(args.windows, args.seconds)
        _report_every_core(every, args.seconds)
        if args.json:
            args.json.write_text(json.dumps(every, indent=1, sort_keys=True) + "\n")
        return
    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpus[0]})
    idles = [i for i in args.idle.split(",") if i]
    if any(i not in IDLE for i in idles):
        parser.error(f"--idle takes {', '.join(IDLE)}")
    # (precision, idle) per window: both precisions back to back, then bf16 with each gap kind
    variants = [(p, "none") for p in PRECISIONS] + [("bf16", i) for i in idles if i != "none"]
    rows: list[dict[str, Any]] = []
    with _partner(args.partner) as pid:
        for w in range(args.windows):
            for precision, idle in variants:
                if pid is not None and args.partner == "stopped":
                    os.kill(pid, signal.SIGSTOP)
                at = time.strftime("%H:%M:%S", time.gmtime())
                times = _window(precision, args.seconds, idle)
                if pid is not None and args.partner == "stopped":
                    os.kill(pid, signal.SIGCONT)
                rows.append({"window": w, "precision": precision, "idle": idle, "utc": at,
                             **_quantiles(times)})
    fastest = {p: min(r["median_us"] for r in rows if r["precision"] == p) for p in PRECISIONS}
    print(f"{torch.__version__}, one core, {args.seconds:g} s windows, partner {args.partner}; "
          f"{SHAPE[0][0]}x{SHAPE[0][1]} @ {SHAPE[1][0]}x{SHAPE[1][1]} matmul")
    print("window  utc       precision  idle   median us   p10..p90 us   mode")
    for r in rows:
        r["mode"] = "slow" if r["median_us"] > SLOW * fastest[r["precision"]] else "fast"
        print(f"{r['window']:6d}  {r['utc']}  {r['precision']:9s}  {r['idle']:5s}  "
              f"{r['median_us']:9.0f}  {r['p10_us']:5.0f}..{r['p90_us']:<6.0f}  {r['mode']}")
    for p, idle in variants:
        mine = [r for r in rows if r["precision"] == p and r["idle"] == idle]
        slow = [r["median_us"] for r in mine if r["mode"] == "slow"]
        tail = (f", slow windows {min(slow) / fastest[p]:.2f}-{max(slow) / fastest[p]:.2f}x the "
                "fastest") if slow else ""
        print(f"{p} idle {idle}: {len(slow)} of {len(mine)} windows slow{tail} (against this "
              "run's fastest,"
              f" {fastest[p]:.0f} us)")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
