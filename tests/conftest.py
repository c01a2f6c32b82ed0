"""Shared fixtures: each example is captured once per test session (real torch.export + ONNX)."""
from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Callable

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
# Compiles on this machine measure costs by default, cached per model: one cache for the whole
# session (CLI subprocesses inherit it), never the user's ~/.cache.
if "PARTC_CACHE_DIR" not in os.environ:
    import tempfile

    os.environ["PARTC_CACHE_DIR"] = tempfile.mkdtemp(prefix="partc-test-profiles-")
warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=DeprecationWarning)

from partc.frontend.capture import CaptureResult, capture_graph  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
TEST_MODELS = Path(__file__).resolve().parent / "models"

_cache: dict[tuple[str, int], CaptureResult] = {}


def captured(path: Path, batch_size: int = 2) -> CaptureResult:
    key = (str(path), batch_size)
    if key not in _cache:
        _cache[key] = capture_graph(path, batch_size)
    return _cache[key]


@pytest.fixture(scope="session")
def capture_example() -> Callable[..., CaptureResult]:
    """capture_example('bert', batch_size=2) -> CaptureResult (cached per session)."""
    def get(name: str, batch_size: int = 2) -> CaptureResult:
        return captured(EXAMPLES / f"{name}.py", batch_size)
    return get


def losses_of(metrics: Path) -> list[float]:
    """The loss of each step of a `partc launch --metrics` file; a step run twice (after a
    restart or a resume) counts with its last value."""
    import json

    by_step: dict[int, float] = {}
    for line in metrics.read_text().splitlines():
        row = json.loads(line)
        by_step[row["step"]] = row["loss"]
    return [by_step[s] for s in sorted(by_step)]


def named_descendants(ancestor: int, prefix: str) -> list[tuple[str, int]]:
    """(name, pid) of the live processes below `ancestor` whose name (/proc/PID/comm) starts
    with `prefix`: processes partc forks from a forkserver (launch's ranks, busy neighbours) are
    its grandchildren and carry the server's command line, so they are found by name."""
    from pathlib import Path as _Path

    parents: dict[int, int] = {}
    named: list[tuple[str, int]] = []  # every match, those of concurrent tests' processes too
    for entry in _Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            name = (entry / "comm").read_text().strip()
        except (OSError, IndexError):
            continue
        if fields[0] == "Z":
            continue
        parents[int(entry.name)] = int(fields[1])
        if name.startswith(prefix):
            named.append((name, int(entry.name)))

    def descends(pid: int) -> bool:
        while pid > 1:
            pid = parents.get(pid, 0)
            if pid == ancestor:
                return True
        return False

    return [(name, pid) for name, pid in named if descends(pid)]


def launched_ranks(launcher: int) -> dict[int, int]:
    """{rank: pid} of the live training processes a `partc launch` process started: its
    descendants named `partc-rank<N>` (forked from its forkserver; not zombies)."""
    return {int(name[10:]): pid for name, pid in named_descendants(launcher, "partc-rank")
            if name[10:].isdigit()}
