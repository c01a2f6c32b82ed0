"""A cache of measured profiles, so compile measures a model on this machine once.

An entry is one profile file (`CostTable.save`) keyed by everything that changes what a
measurement gives: the OpGraph content hash (the model; it does not depend on the capture batch
size), the device label (the device model, not just "cpu"), the precision, the CPU threads and
busy neighbours, the
profiled micro-batch sizes and the timing method. A missing entry is measured and written
atomically (`partc.files.write_atomic`, through `CostTable.save`), so concurrent compiles see a
whole file or none, and under a lock of that entry (`.<entry>.lock`, flock), so two compiles
needing the same entry at once measure it once: the second waits and reads it (two
measurements at once would also each time the other as load); an entry that cannot be read
or that does not match its key (a corrupt or hand-edited file) is measured again and replaced,
never trusted. An entry at some of the sizes
asked for is extended (`extend_profile`): the other sizes measured, its own whole-model totals
timed again in the same rounds.

Where: `$PARTC_CACHE_DIR`, else `$XDG_CACHE_HOME/partc/profiles`, else `~/.cache/partc/profiles`.
"""
from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import os
import re
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterator

from partc.cost.measured import (
    MEASUREMENT_REVISION,
    ProfileOptions,
    check_options,
    cpu_clocked,
    device_label,
    extend_profile,
    intra_op_threads,
    measure_costs,
    parse_device,
    timing_choice,
)
from partc.cost.ort_profiler import ProfileError
from partc.cost.table import PROFILE_VERSION, CostTable, ProfileFileError
from partc.cost.torch_profiler import CPU_CLOCK_NAME
from partc.files import probe_writable
from partc.frontend.capture import CaptureResult
from partc.graph.opgraph import OpGraph
from partc.progress import Progress


def profile_cache_dir() -> Path:
    """The directory cached profiles live in (module docstring); not created here."""
    explicit = os.environ.get("PARTC_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "partc" / "profiles"


def _slug(text: str) -> str:
    """Filesystem-safe: letters, digits, '.', '_' and '-' only, never empty or hidden."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip(".-")[:48] or "x"


def _entry_name(graph_hash: str, device: str, precision: str, threads: int,
                batch_sizes: tuple[int, ...], timing: str, neighbours: int = 0,
                cpu_time: bool = False) -> str:
    """An entry's file name: readable parts, then a digest of the whole key (the readable parts
    are shortened and slugged, so they alone could collide)."""
    # the format version too: a new one measures more or differently (entries of an older partc
    # are never found, rather than found and refused)
    full = "\n".join([graph_hash, device, precision, str(threads),
                      ",".join(str(b) for b in batch_sizes), timing, f"n{neighbours}",
                      f"v{PROFILE_VERSION}", f"r{MEASUREMENT_REVISION}",
                      *(["cpu-time"] if cpu_time else [])])
    digest = hashlib.sha256(full.encode()).hexdigest()[:16]
    parts = [graph_hash.removeprefix("sha256:")[:12], device, precision,
             f"t{threads}n{neighbours}{'c' if cpu_time else ''}",
             "b" + "-".join(str(b) for b in batch_sizes), timing, digest]
    return "_".join(_slug(p) for p in parts) + ".yaml"


def _complete(table: CostTable, graph: OpGraph) -> bool:
    """Every node priced with finite numbers: what `measure_costs` writes. A file cut short or
    edited by hand still parses, and a node it lacks would silently cost nothing."""
    if set(table.nodes) != {n.name for n in graph.nodes}:
        return False
    return all(curve.is_finite() for c in [*table.nodes.values(), table.loss]
               for curve in (c.forward, c.backward, c.saved))


def _largest_subset(directory: Path, graph: OpGraph, precision: str, sizes: tuple[int, ...],
                    matches: Callable[[CostTable], bool]) -> CostTable | None:
    """The cached entry of the same model, device and conditions (`matches`) whose sizes are
    the most of `sizes` (a proper subset), or None."""
    prefix = _slug(graph.content_hash().removeprefix("sha256:")[:12]) + "_"
    best: CostTable | None = None
    for candidate in sorted(directory.glob(glob.escape(prefix) + "*.yaml")):
        try:
            table = CostTable.load(candidate, graph, precision=precision)
        except ProfileFileError:
            continue
        have = set(table.source.batch_sizes)
        if have < set(sizes) and matches(table) and (
                best is None or len(have) > len(best.source.batch_sizes)):
            best = table
    return best


@contextlib.contextmanager
def _entry_lock(path: Path, progress: Progress) -> Iterator[None]:
    """Hold an exclusive lock of the cache entry `path` (flock of a hidden file beside it; the
    kernel drops it when its holder exits, killed or not). Where no lock file can be made (a
    read-only cache) the entry is looked up and measured without one."""
    lock = path.with_name(f".{path.stem}.lock")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            with progress.step("waiting for another partc measuring this profile"):
                fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _unwritable(path: Path, exc: OSError) -> ProfileError:
    return ProfileError(f"cannot write the profile cache {path}: {exc.strerror or exc}",
                        hint="set PARTC_CACHE_DIR to a writable directory")


def _check_writable(directory: Path, path: Path) -> None:
    """ProfileError unless a file can be made in `directory` (created if missing): the cache
    entry `path` will be written there."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe_writable(directory)
    except OSError as exc:
        raise _unwritable(path, exc) from exc


def cached_profile(result: CaptureResult, options: ProfileOptions,
                   cache_dir: Path | None = None,
                   progress: Progress | None = None) -> tuple[CostTable, Path]:
    """The measured CostTable of a capture on `options.device` and the cache file holding it:
    read from the cache when an entry matches, else measured (`measure_costs`) and written."""
    progress = progress or Progress()
    check_options(options)
    device = parse_device(options.device)
    graph = result.graph
    sizes = tuple(sorted(set(options.batch_sizes or (graph.batch_size, 2 * graph.batch_size))))
    # what will time the forward: the provider when onnxruntime can run the export, else torch
    provider = timing_choice(options, device).provider
    exported = result.onnx is not None and result.onnx.status == "ok"
    clocked = cpu_clocked(options, device)
    timing = provider if provider is not None and exported and not clocked else "torch"
    label = device_label(device)
    threads = options.threads if device.type == "cpu" else 0
    directory = cache_dir if cache_dir is not None else profile_cache_dir()
    neighbours = options.neighbours if device.type == "cpu" else 0
    path = directory / _entry_name(graph.content_hash(), label, options.precision, threads,
                                   sizes, timing, neighbours, clocked)

    def matches(table: CostTable) -> bool:
        """Measured as asked, at any sizes (the key's other parts)."""
        src = table.source
        return (src.kind == "measured" and src.device == label and src.threads == threads
                and src.calibration.get("busy_neighbours", 0) == neighbours
                and (src.calibration.get("clock") == CPU_CLOCK_NAME) == clocked
                and src.precision == options.precision and (src.provider or "torch") == timing
                and src.calibration.get("revision") == MEASUREMENT_REVISION
                and _complete(table, graph))

    with _entry_lock(path, progress):
        if path.is_file():
            try:
                table = CostTable.load(path, graph, precision=options.precision)
            except ProfileFileError as exc:
                progress.warn(f"re-measuring: cached profile {path.name} is unreadable "
                              f"({exc.message})")
            else:
                if matches(table) and table.source.batch_sizes == sizes:
                    return table, path
                progress.warn(f"re-measuring: cached profile {path.name} does not match its key")
        # the entry will be written: a cache that cannot take it fails now, not after minutes
        # of measuring
        _check_writable(directory, path)
        # an entry at some of the sizes (a compile measuring one more micro-batch size than
        # before): measure only the others, the entry's totals timed again with theirs
        part = _largest_subset(directory, graph, options.precision, sizes, matches) \
            if directory.is_dir() else None
        with intra_op_threads(device, options.threads):
            if part is None:
                table = measure_costs(result, device, options, progress)
            else:
                table = extend_profile(part, result, device, replace(options, batch_sizes=sizes),
                                       progress)
        try:
            with progress.step(f"caching the profile in {path}"):
                table.save(path)
        except OSError as exc:  # the disk filled while measuring
            raise _unwritable(path, exc) from exc
        # the costs as the file holds them (rounded): what a plan's check will load from its copy
        return CostTable.load(path, graph, precision=options.precision), path
