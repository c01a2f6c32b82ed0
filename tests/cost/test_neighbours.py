"""Busy neighbours: a CPU profile taken with the node's other devices training (real processes,
real measurement of a small model)."""
from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import pytest
from conftest import EXAMPLES, captured, named_descendants

from partc.cost.measured import ProfileOptions
from partc.cost.neighbours import PROCESS_NAME, busy_neighbours, generic_step
from partc.cost.plan_costs import measurement
from partc.cost.profile_cache import cached_profile


def _neighbour_pids() -> set[int]:
    """This process's neighbours (other tests may be measuring in parallel workers)."""
    return {pid for _, pid in named_descendants(os.getpid(), PROCESS_NAME)}


def test_neighbours_run_for_the_block_and_are_gone_after() -> None:
    before = _neighbour_pids()
    with busy_neighbours(2, EXAMPLES / "mlp.py", 4):
        assert len(_neighbour_pids() - before) == 2
    assert not _neighbour_pids() - before
    # a model that cannot be built eagerly (meta) still gets a generic busy loop
    with busy_neighbours(1, EXAMPLES / "gpt2_1p3b_meta.py", 2):
        assert len(_neighbour_pids() - before) == 1
    assert not _neighbour_pids() - before


def test_the_generic_loop_computes_in_the_profiles_precision() -> None:
    # a bf16 profile of a meta model: its neighbours load the core with the bf16 kernels the
    # pipeline's other stages run, not fp32 ones
    import torch

    assert generic_step("fp32")().dtype == torch.float32
    assert generic_step("bf16-mixed")().dtype == torch.bfloat16
    before = _neighbour_pids()  # the child takes the precision (fp32: the test above)
    with busy_neighbours(1, EXAMPLES / "gpt2_1p3b_meta.py", 2, "bf16-mixed"):
        assert len(_neighbour_pids() - before) == 1
    assert not _neighbour_pids() - before


_TALKATIVE = """
import torch
import torch.nn as nn


class Talkative(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        print("x" * 8192)  # a model that prints: 64 KiB fill a pipe in 8 steps
        return self.linear(x)


def build_model() -> nn.Module:
    return Talkative()


def example_inputs(batch_size: int) -> tuple[torch.Tensor]:
    return (torch.randn(batch_size, 64),)
"""


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_neighbour_whose_model_or_libraries_print_stays_busy(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a neighbour prints (the model's prints, oneDNN's verbose log) must neither be taken
    for its "ready" nor fill the pipe the parent stops reading after it, which blocked the
    neighbour: the profile then measured beside an idle core, saying it had a busy one."""
    model = tmp_path / "talkative.py"
    model.write_text(_TALKATIVE)
    monkeypatch.setenv("ONEDNN_VERBOSE", "1")
    before = _neighbour_pids()
    with busy_neighbours(1, model, 2):
        (pid,) = _neighbour_pids() - before
        time.sleep(1.0)  # well past the steps that would have filled a pipe
        start = _cpu_seconds(pid)
        time.sleep(1.0)
        busy = _cpu_seconds(pid) - start
    # a blocked neighbour gains nothing; a running one most of a core (the test workers of
    # a loaded machine share the cores, hence the low bar)
    assert busy > 0.2, f"the neighbour ran {busy:.2f} s of the last second"


def test_compile_measures_with_the_other_devices_of_the_node_busy(tmp_path: Path) -> None:
    options = measurement("cpu", 2, 64, "fp32", neighbours=1)
    assert options is not None and options.neighbours == 1 and options.batch_sizes == (2, 16)
    on_gpu = measurement("cuda:0", 2, 64, "fp32", neighbours=7)
    assert on_gpu is not None and on_gpu.neighbours == 0
    result = captured(EXAMPLES / "mlp.py")
    fast = ProfileOptions(runs=2, warmup=1, method="torch", totals_budget_s=0.2)
    alone, a = cached_profile(result, fast, cache_dir=tmp_path)
    busy, b = cached_profile(result, dataclasses.replace(fast, neighbours=1), cache_dir=tmp_path)
    assert a != b  # separate cache entries
    assert busy.source.calibration["busy_neighbours"] == 1
    assert "busy_neighbours" not in alone.source.calibration


def test_a_neighbour_on_the_measuring_core_times_the_work_by_cpu_time(tmp_path: Path) -> None:
    """Devices that oversubscribe the cores (cpu-4: 4 processes on 2): compile keeps all the
    node's other devices busy, so one shares the measuring process's core, and the profile times
    each node by the thread's CPU time (the wall clock would hold the neighbour's turns, which the
    simulator shares out itself). A separate cache entry, recorded in the calibration."""
    import torch

    from partc.cost.measured import cpu_clocked
    from partc.cost.plan_costs import solve_costs
    from partc.hardware.configs import load_cluster
    from partc.hardware.local import core_cpus

    cores = len(core_cpus())
    cpu = torch.device("cpu")
    fast = ProfileOptions(runs=2, warmup=1, method="torch", totals_budget_s=0.2)
    assert not cpu_clocked(fast, cpu)
    assert not cpu_clocked(dataclasses.replace(fast, neighbours=cores - 1), cpu)
    assert cpu_clocked(dataclasses.replace(fast, neighbours=cores), cpu)
    assert not cpu_clocked(dataclasses.replace(fast, neighbours=cores), torch.device("meta"))
    result = captured(EXAMPLES / "mlp.py")
    other, a = cached_profile(result, dataclasses.replace(fast, neighbours=cores - 1),
                              cache_dir=tmp_path)
    shared, b = cached_profile(result, dataclasses.replace(fast, neighbours=cores),
                               cache_dir=tmp_path)
    assert a != b and "clock" not in other.source.calibration
    assert shared.source.calibration["clock"] == "thread_time"
    assert all(c.forward.at(2) > 0 for c in shared.nodes.values() if c.forward.at(2))
    # and a second call reads the entry back rather than measuring again
    again, c = cached_profile(result, dataclasses.replace(fast, neighbours=cores),
                              cache_dir=tmp_path)
    assert c == b and again.source.calibration == shared.source.calibration
    # compile measures with the node's other devices busy: on cpu-4 (4 devices), 3 (from the
    # session's cache, where the compiles of other tests on cpu-4 measure the same entry)
    table, path = solve_costs(result, load_cluster("cpu-4"), 8, costs="measured")
    assert path is not None and table.source.calibration["busy_neighbours"] == 3
    three = dataclasses.replace(fast, neighbours=3)
    assert (table.source.calibration.get("clock") == "thread_time") == cpu_clocked(three, cpu)
