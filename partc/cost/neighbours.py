"""Busy neighbours: measure a CPU device the way training uses it, with the other devices of its
host busy.

A partc CPU device is one gloo process per core, and in a pipeline's steady state every process
computes at once. They share the last-level cache, the memory bandwidth and, on SMT hosts or
when a cluster puts more processes than cores on a node, the cores themselves. A profile taken
on an idle machine misses that: on this 2-core VM one busy neighbour slows BERT's forward +
backward 1.09x, three (4 processes on 2 cores) 2.2x. `busy_neighbours(n, model, batch)` runs n
processes that train the same model (its eager forward and backward at the same batch size: the
neighbours a pipeline stage has are other stages of it) for as long as the measurement inside it
lasts; a model built on the meta device, or one that fails to run eagerly, is replaced by a
generic train-like loop (`generic_step`: a GEMM under the profile's precision, then a stream
over a tensor larger than the caches).

Processes are pinned as launch pins its workers (partc.hardware.local.pin_to_core): the
measuring process on core 0, neighbour i on core i + 1, modulo the cores.

Each neighbour is forked from this process's forkserver (which imported torch once), named
`partc-neighbour` (`ps -e`, /proc/PID/comm): it tells its parent once its first step ran and
loops until killed, or until the process that started it is gone (`end_with_parent`: a compile
killed by SIGKILL leaves no neighbour computing). Whatever the model or a library prints (a
model's own prints, ONEDNN_VERBOSE) goes to /dev/null; "ready" comes through a pipe of its own.
"""
from __future__ import annotations

import contextlib
import os
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Callable, Iterator

from partc.errors import PartcError
from partc.hardware.local import core_cpus, end_with_parent, name_process, set_affinity
from partc.options import PRECISIONS, Precision, check_choice
from partc.progress import Progress


def shares_core(count: int) -> bool:
    """Whether `busy_neighbours(count)` puts a neighbour on the measuring process's own core:
    more processes than this process's cores, as when a cluster's devices oversubscribe them."""
    cores = core_cpus()
    return bool(cores) and count >= len(cores)


# What the forkserver the neighbours are forked from imports once (their model file, user code,
# is imported by each neighbour)
_PRELOAD = ("torch", "partc.cost.neighbours")
# A neighbour's name in `ps -e` and /proc/PID/comm (its command line is the forkserver's)
PROCESS_NAME = "partc-neighbour"


@contextlib.contextmanager
def busy_neighbours(count: int, model: str | Path | None = None,
                    batch_size: int = 2, precision: Precision = "fp32",
                    progress: Progress | None = None) -> Iterator[None]:
    """Keep `count` single-threaded neighbour processes busy training `model` (or a generic loop)
    for the duration of the block, under `precision` as the pipeline's other stages run it; they
    are killed on exit, whatever ends the block (an error, Ctrl-C). They are forked from this
    process's forkserver (partc.hardware.forkserver), which imports torch once: a spawned
    neighbour imported it itself, 1.3-1.6 s of CPU each here. Their start (each builds the model
    and runs a first step) is a `progress` step."""
    check_choice("precision", precision, PRECISIONS, PartcError)
    procs: list[BaseProcess] = []
    cores = core_cpus()  # this process's, before anything pins it: children inherit a pinning
    try:
        if count:
            with (progress or Progress()).step(f"starting {count} busy neighbour(s): the node's "
                                               "other devices, training the model"):
                _start(procs, count, cores, model, batch_size, precision)
        yield
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.join()


def _start(procs: list[BaseProcess], count: int, cores: list[frozenset[int]],
           model: str | Path | None, batch_size: int, precision: Precision) -> None:
    """Start the neighbours into `procs` (the caller kills them) and wait until each is busy."""
    import multiprocessing

    from partc.hardware.forkserver import start_forkserver

    start_forkserver(_PRELOAD)
    context = multiprocessing.get_context("forkserver")
    readies = []
    for index in range(count):
        # neighbour i is the node's device i + 1: on core i + 1 (modulo the cores), as
        # launch pins its local ranks, the measuring process being device 0
        cpus = tuple(sorted(cores[(index + 1) % len(cores)])) if cores else ()
        ready, told = context.Pipe(duplex=False)
        proc = context.Process(target=_neighbour, daemon=False, args=(
            cpus, None if model is None else str(model), batch_size, precision, os.getpid(),
            told))
        proc.start()
        told.close()  # the neighbour's end: a neighbour that dies closes the last copy
        procs.append(proc)
        readies.append(ready)
    for ready in readies:
        try:
            ready.recv()
        except EOFError:
            raise PartcError("a busy-neighbour process for profiling did not start",
                             hint="profile without neighbours (--neighbours 0)") from None
        finally:
            ready.close()


def _neighbour(cpus: tuple[int, ...], model: str | None, batch_size: int, precision: Precision,
               parent: int, told: Connection) -> None:
    """A forked neighbour: pinned to `cpus` (none: unpinned), it tells `told` once its first
    step ran and loops until killed, or until `parent` is gone (`end_with_parent`: a compile
    killed by SIGKILL leaves no neighbour computing). Whatever the model or a library prints
    (a model's own prints, ONEDNN_VERBOSE) goes to /dev/null."""
    name_process(PROCESS_NAME)
    end_with_parent(parent=parent)
    if cpus:
        set_affinity(frozenset(cpus))
    devnull = os.open(os.devnull, os.O_WRONLY)
    for fd in (1, 2):
        os.dup2(devnull, fd)
    os.close(devnull)

    def ready() -> None:
        told.send(True)
        told.close()

    try:
        _loop(model, batch_size, precision, ready)
    except KeyboardInterrupt:  # a terminal's Ctrl-C reaches the whole group: end quietly
        pass


def _model_step(model: str, batch_size: int,
                precision: Precision) -> Callable[[], None] | None:
    """One eager training step of the model file's model under `precision` (bf16-mixed: bf16
    autocast, as launch runs a stage), or None when it cannot run here."""
    import torch

    from partc.cost.torch_profiler import precision_autocast
    from partc.frontend.model_file import load_model_file

    try:
        spec = load_model_file(model)
        module = spec.build().train()
        if any(t.is_meta for t in module.parameters()):
            return None
        args, kwargs = spec.inputs(batch_size)

        def step() -> None:
            with precision_autocast(precision, "cpu"):
                out = module(*args, **kwargs)
            leaves = [t for t in torch.utils._pytree.tree_leaves(out)
                      if isinstance(t, torch.Tensor) and t.requires_grad]
            torch.autograd.backward(leaves, [torch.ones_like(t) for t in leaves])
            module.zero_grad(set_to_none=True)

        step()
        return step
    except Exception:  # any failure: the generic loop still loads the machine
        return None


def generic_step(precision: Precision) -> Callable[[], object]:
    """The train-like loop's step for a model that cannot run here (a meta-device one): a GEMM
    under `precision`'s autocast, as the model's matmuls run (bf16-mixed: the bf16 kernels, on
    this hardware AMX tiles, rather than fp32 ones), then a stream over a tensor larger than the
    caches, as activations are. Returns the step; each call returns the GEMM's result."""
    import torch

    from partc.cost.torch_profiler import precision_autocast

    a = torch.randn(384, 384)
    b = torch.randn(384, 384)
    src = torch.randn(8 << 20)  # 32 MiB
    dst = torch.empty_like(src)

    def step() -> torch.Tensor:
        with precision_autocast(precision, "cpu"):
            product = torch.mm(a, b)
        dst.copy_(src)
        torch.add(src, dst, out=dst)
        return product

    return step


def _loop(model: str | None, batch_size: int, precision: Precision,
          ready: Callable[[], None]) -> None:
    import torch

    from partc.cost.torch_profiler import cpu_settings

    torch.set_num_threads(1)
    with cpu_settings(torch.device("cpu")):  # as the measured process and launch compute
        model_step = _model_step(model, batch_size, precision) if model is not None else None
        step: Callable[[], object] = model_step if model_step is not None \
            else generic_step(precision)
        step()
        ready()
        while True:
            step()
