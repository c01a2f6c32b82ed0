"""`partc launch --trace DIR`: one training step per rank under torch.profiler, written for people.

A plan's prediction and a run's `--metrics` say how long each stage took; when they disagree, the
question is which operators, and on CUDA which kernels, took the time (an attention that fell back
to its math path, a copy nobody expected, a host that cannot keep the device busy). The traced
step writes, per rank:

- `rank<R>.json`: the step's Chrome trace (open it in Perfetto or chrome://tracing), with input
  shapes: every operator on the host and every kernel on the device, on one time line;
- `rank<R>.txt`: the operators and kernels ranked by their own time (device time on CUDA, host time
  on CPU), with the step, the rank's stages and the device in its first lines.

The traced step is the one the CPU memory probe watches (partc.run.runtime: the third of the run,
when the optimizer state exists and DDP has rebuilt its buckets, else the last), so a run is slowed
by a profiler on one step at most; that step is marked `traced` in the metrics file and left out of
the time summaries. Both files are written atomically: an interrupted run leaves the old ones or
none.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from partc.errors import LaunchError
from partc.files import probe_writable, write_atomic
from partc.plans.plan import PLAN_FILE

if TYPE_CHECKING:  # the launcher checks --trace before any process imports torch
    import torch

TRACE_ROWS = 40  # operators in the table: enough to show every kind of kernel a stage runs


def trace_paths(directory: Path, rank: int) -> tuple[Path, Path]:
    """The Chrome trace and the operator table of `rank` in `directory`."""
    return directory / f"rank{rank}.json", directory / f"rank{rank}.txt"


def prepare_trace_directory(directory: Path) -> None:
    """Create `directory` (and its parents) and check it can take the trace files; LaunchError
    with a hint otherwise. A plan directory is refused: the files would sit among what was
    reviewed."""
    if directory.exists() and not directory.is_dir():
        raise LaunchError(f"--trace {directory} is a file",
                          hint="pass a directory (it is created if missing)")
    if (directory / PLAN_FILE).exists():
        raise LaunchError(f"--trace {directory} is a plan directory",
                          hint="write traces outside plan directories; only partc compile "
                               "writes there")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe_writable(directory)
    except OSError as exc:
        raise LaunchError(f"cannot write --trace {directory}: {exc.strerror or exc}",
                          hint="pass a writable directory") from None


def operator_table(prof: torch.profiler.profile, device: torch.device,
                   rows: int = TRACE_ROWS) -> str:
    """The profiled operators and kernels ranked by their own time: device time on CUDA (the
    kernels' names say which attention or matmul implementation ran), host time on CPU."""
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    table: str = prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=90)
    return table


def write_step_trace(prof: torch.profiler.profile, directory: Path, rank: int, step: int,
                     stages: Sequence[int], device: torch.device, plan_path: str) -> None:
    """Write `rank<R>.json` and `rank<R>.txt` for the profiled `step` (1-based) of this rank;
    LaunchError (one line) if the disk refuses them."""
    import torch

    json_path, table_path = trace_paths(directory, rank)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    header = (f"partc launch --trace: {plan_path}, step {step}, rank {rank}, "
              f"stage(s) {', '.join(map(str, stages))}, device {device} ({name}), "
              f"torch {torch.__version__}\n"
              f"ranked by {'device' if device.type == 'cuda' else 'host'} self time; "
              f"the whole step is in {json_path.name}\n\n")
    try:
        # torch writes the trace to a path; it goes to a private temporary name first
        tmp = directory / f".{json_path.name}.{os.getpid()}.tmp"
        try:
            prof.export_chrome_trace(str(tmp))
            write_atomic(json_path, tmp.read_bytes())
        finally:
            tmp.unlink(missing_ok=True)
        write_atomic(table_path, header + operator_table(prof, device) + "\n")
    except OSError as exc:
        raise LaunchError(f"cannot write the trace of step {step} to {directory}: "
                          f"{exc.strerror or exc}",
                          hint="free disk space or pass another --trace directory") from None
