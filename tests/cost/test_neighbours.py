"""Busy neighbours: a CPU profile taken with the node's other devices training (real processes,
real measurement of a small model)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from conftest import EXAMPLES, captured

from partc.cost.measured import ProfileOptions
from partc.cost.neighbours import busy_neighbours
from partc.cost.plan_costs import measurement
from partc.cost.profile_cache import cached_profile


def _neighbour_pids() -> set[int]:
    found = set()
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes()
            except OSError:
                continue
            if b"partc.cost.neighbours" in cmdline:
                found.add(int(proc.name))
    return found


def test_neighbours_run_for_the_block_and_are_gone_after() -> None:
    before = _neighbour_pids()
    with busy_neighbours(2, EXAMPLES / "mlp.py", 4):
        assert len(_neighbour_pids() - before) == 2
    assert not _neighbour_pids() - before
    # a model that cannot be built eagerly (meta) still gets a generic busy loop
    with busy_neighbours(1, EXAMPLES / "gpt2_1p3b_meta.py", 2):
        assert len(_neighbour_pids() - before) == 1
    assert not _neighbour_pids() - before


def test_compile_measures_with_the_other_devices_of_the_node_busy(tmp_path: Path) -> None:
    options = measurement("cpu", 2, 64, "fp32", neighbours=1)
    assert options.neighbours == 1 and options.batch_sizes == (2, 16)
    assert measurement("cuda:0", 2, 64, "fp32", neighbours=7).neighbours == 0
    result = captured(EXAMPLES / "mlp.py")
    fast = ProfileOptions(runs=2, warmup=1, method="torch")
    alone, a = cached_profile(result, fast, cache_dir=tmp_path)
    busy, b = cached_profile(result, dataclasses.replace(fast, neighbours=1), cache_dir=tmp_path)
    assert a != b  # separate cache entries
    assert busy.source.calibration["busy_neighbours"] == 1
    assert "busy_neighbours" not in alone.source.calibration
