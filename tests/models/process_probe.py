"""A small MLP that records how the processes running it compute, in $PARTC_PROBE_DIR:
- batches() records, once, which CPUs the process drawing them may run on (rank<RANK>.txt):
  launch's first and last stages draw the data, so a 2-stage launch shows where both of its
  workers were pinned;
- loss_fn() appends whether denormal floats are flushed to zero (denormals.txt, a line per call)
  and whether the C allocator keeps a freed 48 MiB block (allocator.txt, "kept" or "returned"):
  the profiler, launch's last stage and single-process training all run it, and must all compute
  the same way (partc.cost.torch_profiler.cpu_settings);
- under launch, loss_fn() also appends the scheduling policy of each of the process's gloo socket
  loop threads (gloo_io.txt, "batch" or "other"; partc.hardware.local.batch_schedule_gloo_io)."""
from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                         nn.Linear(16, 4))


def example_inputs(batch_size: int) -> tuple[torch.Tensor]:
    return (torch.randn(batch_size, 8),)


def batches(batch_size: int) -> Iterator[tuple[tuple[torch.Tensor], torch.Tensor]]:
    out = os.environ.get("PARTC_PROBE_DIR")
    if out and "RANK" in os.environ:
        cpus = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
        Path(out, f"rank{os.environ['RANK']}.txt").write_text(cpus)
    gen = torch.Generator().manual_seed(0)
    while True:
        yield (torch.randn(batch_size, 8, generator=gen),), torch.randint(0, 4, (batch_size,),
                                                                          generator=gen)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def _allocator_keeps_freed_memory() -> bool:
    """Whether glibc served a 48 MiB tensor from its heap (not its own mmap, which glibc's
    default does above 32 MiB at most) and kept the heap's size after the tensor was freed."""
    mallinfo2 = ctypes.CDLL(None).mallinfo2
    mallinfo2.restype = _MallInfo2
    before = mallinfo2()
    block = torch.empty(48 << 20, dtype=torch.uint8)
    block.fill_(1)
    held = mallinfo2()
    del block
    after = mallinfo2()
    return held.hblkhd - before.hblkhd < 48 << 20 and after.arena >= held.arena


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    out = os.environ.get("PARTC_PROBE_DIR")
    if out:
        # a denormal operand reads as zero where denormals are flushed
        flushed = bool((torch.full((), 1e-40) * 2 == 0).item())
        with Path(out, "denormals.txt").open("a") as f:
            f.write("flushed\n" if flushed else "kept\n")
        with Path(out, "allocator.txt").open("a") as f:
            f.write("kept\n" if _allocator_keeps_freed_memory() else "returned\n")
        if "RANK" in os.environ:
            from partc.hardware.local import GLOO_IO_THREAD
            with Path(out, "gloo_io.txt").open("a") as f:
                for tid in os.listdir("/proc/self/task"):
                    if Path(f"/proc/self/task/{tid}/comm").read_text().strip() == GLOO_IO_THREAD:
                        batch = os.sched_getscheduler(int(tid)) == os.SCHED_BATCH
                        f.write("batch\n" if batch else "other\n")
    return F.cross_entropy(output, target)
