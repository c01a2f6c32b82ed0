"""The CPU peak-memory measurement the memory model is checked against, on a toy step.

torch.profiler (profile_memory=True) reports no free for a block allocated before the profiler
started (torch warns "Memory block of unknown size was allocated before the profiling started,
profiler results will not include the deallocation event"). A measurement "bytes live at step
start + the profiler's peak above that" must therefore take its snapshot after anything the step
frees of what existed before it: otherwise the freed tensors stay counted and their replacements
are counted again. `partc launch --metrics` on CPU took it before `zero_grad(set_to_none=True)`
and so counted every gradient twice (docs/memory-model.md, "Checking `partc launch --metrics` on
CPU"); these tests pin the profiler behaviour and the correct order.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
_ROOT = str(Path(__file__).resolve().parents[2])

import torch  # noqa: E402

from partc.cost.activations import storage_bytes  # noqa: E402
from partc.run.reference import peak_above_start  # noqa: E402

_N = 1 << 16  # elements of each toy tensor (256 KiB in fp32)


def _profiled(fn):  # type: ignore[no-untyped-def]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True) as prof:
        fn()
    return peak_above_start(prof)


def _in_fresh_process(measurement: str) -> list[int]:
    """`measurement` (a function of this file) run in a process with no earlier profiler
    session, each its own: a
    block that one saw allocated, freed after it, stays in the CPU allocator's size table, so
    a later tensor at the same address has its free reported (1 in 20 repeats in one process;
    both tests below failed so, once each, in `make test` workers)."""
    found = subprocess.run([sys.executable, __file__, measurement], capture_output=True, text=True,
                           timeout=120, env={**os.environ, "PYTHONPATH": _ROOT})
    assert found.returncode == 0, found.stderr[-2000:]
    return [int(v) for v in found.stdout.split()[-2:]]


def _unseen_free() -> tuple[int, int]:
    held = [torch.ones(_N)]

    def step() -> None:
        held.pop()  # frees the pre-existing block: the profiler does not see it
        held.append(torch.ones(_N))  # the replacement: seen

    return 0, int(_profiled(step))


def test_profiler_reports_no_free_of_a_block_allocated_before_it() -> None:
    assert _in_fresh_process("_unseen_free")[1] == 4 * _N


def test_snapshot_after_the_frees_gives_the_true_peak() -> None:
    """A toy training step with gradients freed by zero_grad(set_to_none=True) and made again by
    the backward: the true peak is weights + gradients + the backward's temporaries (measured
    in a fresh process, `_in_fresh_process`)."""
    over, after = _in_fresh_process("_snapshots")
    grads = weights = 4 * _N
    assert over - after == grads
    assert after >= weights + grads + 4 * _N  # x and the fresh gradient: no double counting
    assert after < weights + grads + 4 * _N + 3 * 4 * _N  # and only a few temporaries on top


def _snapshots() -> tuple[int, int]:
    """(peak with the snapshot before zero_grad, peak with it after), for the test above."""
    w = torch.nn.Parameter(torch.ones(_N))
    x = torch.ones(_N)
    (w * x).sum().backward()  # last step's gradient exists at step start

    def zero_grad() -> None:
        w.grad = None

    def step() -> None:
        (w * x).sum().backward()

    # snapshot before zero_grad (what the launch measurement did): the gradient counts twice
    before = storage_bytes([w, w.grad, x])

    def zero_then_step() -> None:
        zero_grad()
        step()

    over = before + _profiled(zero_then_step)
    # snapshot after zero_grad: counted once
    zero_grad()
    after = storage_bytes([w, x]) + _profiled(step)
    return over, after


def test_storage_bytes_counts_each_storage_once_on_meta_too() -> None:
    """Views share a storage; distinct storages count apart even on meta, where every data
    pointer is 0 (a meta model's batch was counted as its largest tensor alone)."""
    for device in ("cpu", "meta"):
        a = torch.empty(4, 4, device=device)
        b = torch.empty(8, device=device)
        assert storage_bytes([a, a[1:], b, b.view(2, 4), None]) == 4 * (16 + 8), device


if __name__ == "__main__":
    print(*{"_unseen_free": _unseen_free, "_snapshots": _snapshots}[sys.argv[1]]())
