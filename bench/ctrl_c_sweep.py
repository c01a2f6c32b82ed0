"""Ctrl-C a `partc launch` at fixed delays after its start and report how each ended.

    .venv/bin/python bench/ctrl_c_sweep.py PLAN --delays 0.1,0.5,1.0,2.0 --repeats 6

Each try starts `partc launch PLAN --steps 400` in a session of its own (as a terminal's
foreground job), sends SIGINT to its whole process group DELAY seconds later, and prints the exit
status, whether a traceback was printed and the last line of stderr; a summary counts the
outcomes per delay. The contract (docs/trust.md): exit 130 with one line, every time. Where the
launch trains to its last step (exit 0), the Ctrl-C was lost.
"""
from __future__ import annotations

import argparse
import collections
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

PARTC = str(Path(sys.executable).parent / "partc")


def one_try(plan: str, delay: float, steps: int) -> tuple[str, bool, str]:
    """(exit status, whether a traceback was printed, stderr's last line) of one interrupted
    launch."""
    proc = subprocess.Popen([PARTC, "launch", plan, "--steps", str(steps)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    time.sleep(delay)
    os.killpg(proc.pid, signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=120)
        status = str(proc.returncode)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        status = "timeout"
    lines = [line for line in err.splitlines() if line.strip()]
    return status, "Traceback" in err + out, lines[-1][:120] if lines else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("plan")
    parser.add_argument("--delays", default="0.1,0.2,0.5,1.0,1.5,2.0,3.0")
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--steps", type=int, default=400)
    args = parser.parse_args()
    outcomes: dict[float, collections.Counter[str]] = {}
    for delay in (float(d) for d in args.delays.split(",")):
        outcomes[delay] = collections.Counter()
        for _ in range(args.repeats):
            status, traceback, last = one_try(args.plan, delay, args.steps)
            print(f"delay {delay:.2f} s: exit {status}, traceback {traceback}: {last}",
                  flush=True)
            clean = status == "130" and not traceback
            outcomes[delay]["one line, exit 130" if clean else
                            f"exit {status}" + (" with a traceback" if traceback else "")] += 1
    print("\n| delay | outcomes |\n|---|---|")
    for delay, counts in outcomes.items():
        print(f"| {delay:.2f} s | " + ", ".join(f"{n} {what}" for what, n in
                                                 sorted(counts.items())) + " |")


if __name__ == "__main__":
    main()
