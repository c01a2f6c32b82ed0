"""What the benchmarks measure of one partc command run in a fresh process: exit code, wall time,
peak RSS and the step times of its progress lines; a command's last line and a benchmark's end
(total time, raw rows as JSON). Shared by the bench/ scripts."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Runs one command and prints its peak RSS last on stderr: a fresh wrapper per run, so
# RUSAGE_CHILDREN is that command's own peak, not the largest of every run so far.
_WRAPPER = ("import resource, subprocess, sys; rc = subprocess.call(sys.argv[1:]); "
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); "
            "sys.exit(rc)")
_STEP_LINE = re.compile(r"^\s*ok (.*) \((\d+(?:\.\d+)?) s\)\s*$")


@dataclass
class Measured:
    returncode: int
    wall_s: float
    rss_mib: float
    stdout: str
    stderr: str  # the command's own stderr (the wrapper's RSS line removed)

    def steps(self) -> list[tuple[str, float]]:
        """(label, seconds) of every finished progress step ("  ok <label> (<s> s)")."""
        out = []
        for line in self.stderr.splitlines():
            match = _STEP_LINE.match(line)
            if match:
                out.append((match.group(1), float(match.group(2))))
        return out


def run_measured(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> Measured:
    """Run `args` under the RSS wrapper and measure it."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _WRAPPER, *args], cwd=cwd, capture_output=True,
                          text=True, env=env)
    wall = time.perf_counter() - start
    lines = proc.stderr.rstrip("\n").split("\n")
    return Measured(returncode=proc.returncode, wall_s=wall, rss_mib=int(lines[-1]) / 1024,
                    stdout=proc.stdout, stderr="\n".join(lines[:-1]))


def last_line(text: str) -> str:
    """The last non-blank line of a command's output (its one-line error, for partc)."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else "(no output)"


def finish(start: float, path: Path | None, payload: dict[str, Any]) -> None:
    """Print a benchmark's total time; write its raw rows (with the total) to `path` as JSON."""
    total = time.perf_counter() - start
    print(f"\ntotal {total / 60:.1f} min")
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({**payload, "total_s": total}, indent=1, sort_keys=True,
                                   default=str))
