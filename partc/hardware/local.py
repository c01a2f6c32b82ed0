"""This machine as a cluster (`--cluster local`, the default of `partc compile`), and the facts
about it other passes need (physical cores, RAM, CPU model)."""
from __future__ import annotations

import contextlib
import functools
import json
import os
import socket
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

from partc.errors import PartcError
from partc.hardware.configs import (
    ConfigError,
    config_dir,
    list_clusters,
    list_devices,
    load_cluster,
    load_device,
)
from partc.hardware.specs import ClusterSpec, DeviceSpec

if TYPE_CHECKING:
    import torch

LOCAL_CLUSTER = "local"


def local_cluster() -> ClusterSpec:
    """This machine as a cluster (what `--cluster local`, the default, means).

    With CUDA GPUs: one device per GPU, the device config whose name matches the GPU's (e.g. an
    "NVIDIA H100 80GB HBM3" is h100-80gb) with the GPU's real memory, NCCL, and the intra-node
    link of a shipped cluster config of that device. Without: the CPU as one gloo process per
    physical core, priced with the calibrated cpu device (configs/devices/cpu.yaml), each device
    getting an equal share of the RAM, and the loopback link measured in configs/clusters/cpu.yaml.
    """
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return _local_gpus(torch.cuda.device_count(), torch.cuda.get_device_properties(0))
    cores = physical_cores()
    base = load_cluster("cpu")
    device = replace(base.device, memory_bytes=ram_bytes() // cores,
                     description=f"{cpu_model()}: 1 of {cores} physical core(s), "
                                 f"{ram_bytes() / 2**30:.1f} GiB RAM shared equally")
    return replace(base, name=LOCAL_CLUSTER, device=device, devices_per_node=cores, num_nodes=1,
                   description=f"this machine: {cores} gloo process(es), one per physical core",
                   source="detected: /proc/cpuinfo, /proc/meminfo; "
                          "costs of configs/devices/cpu.yaml")


def measuring_device(device: torch.device, processes: int = 1) -> DeviceSpec | None:
    """The device config of this machine's torch device `device` (as
    partc.cost.measured.parse_device checked it), with the memory one of `processes` processes
    measuring on it has (a CPU's RAM shared equally; a GPU's own); None for a GPU no device
    config matches."""
    if device.type == "cuda":
        import torch

        props = torch.cuda.get_device_properties(device.index or 0)
        try:
            spec = _local_gpus(1, props).device
        except ConfigError:
            return None
        return replace(spec, memory_bytes=int(props.total_memory) // max(processes, 1))
    return replace(local_cluster().device, memory_bytes=ram_bytes() // max(processes, 1))


def measurable_device(cluster: ClusterSpec) -> str | None:
    """The torch device ("cpu", "cuda:0") on which this machine can measure `cluster`'s device,
    or None when the cluster is not this machine. `local` is this machine by definition; a CPU
    cluster of one node is too (a CPU config describes gloo processes on the host that runs
    them, and this host is the only one partc can measure); a GPU cluster is when it is `local`
    (its device config was matched to this machine's GPU)."""
    if cluster.name == LOCAL_CLUSTER:
        return "cuda:0" if cluster.device.kind == "cuda" else "cpu"
    if cluster.device.kind == "cpu" and cluster.num_nodes == 1:
        return "cpu"
    return None


@dataclass(frozen=True)
class ForeignCalibration:
    """A cluster that is this machine, priced with a device config calibrated on another one:
    its per-operator, runtime, optimizer and link costs are that machine's, which a measured
    profile does not replace (docs/hardware.md#the-cpu-device: the runtime's overhead per stage
    pass read 57 us on one VM and 111 us on another)."""

    config: str  # the device config's name
    calibrated_on: str  # the machine its numbers were measured on
    this_machine: str

    def message(self) -> str:
        """One line for a warning, with the way out."""
        return (f"the {self.config} device config was calibrated on {self.calibrated_on}, and "
                f"this machine is {self.this_machine}: its overheads, optimizer and link costs "
                f"are that machine's (hint: run `partc calibrate -o DIR` here and compile with "
                f"--cluster DIR/clusters/{self.config}.yaml)")


def foreign_calibration(cluster: ClusterSpec) -> ForeignCalibration | None:
    """When `cluster` is this machine (`measurable_device`) and its device config says it was
    calibrated on another machine (`DeviceSpec.calibrated_on`: a CPU model, or a GPU name), what
    tells them apart; None otherwise, and for configs that name no machine (datasheets)."""
    device = measurable_device(cluster)
    calibrated_on = cluster.device.calibrated_on
    if device is None or not calibrated_on:
        return None
    if device == "cpu":
        here = cpu_model()
    else:
        import torch

        here = str(torch.cuda.get_device_name(torch.device(device)))
    if " ".join(calibrated_on.split()) == " ".join(here.split()):
        return None
    return ForeignCalibration(config=cluster.device.name, calibrated_on=calibrated_on,
                              this_machine=here)


def _local_gpus(count: int, props: Any) -> ClusterSpec:
    gpu = str(props.name)
    memory = int(props.total_memory)
    best: DeviceSpec | None = None
    for name in list_devices():
        spec = load_device(name)
        family = name.split("-")[0].upper()  # a100-80gb -> A100
        if spec.kind == "cuda" and family in gpu.upper().replace(" ", "") and \
                (best is None or abs(spec.memory_bytes - memory) < abs(best.memory_bytes - memory)):
            best = spec
    if best is None:
        raise ConfigError(f"no device config matches this machine's GPU ({gpu})",
                          hint=f"pass --cluster with a cluster config (configs/clusters/), or add "
                               f"a device to {config_dir() / 'devices'}")
    link = next((c.intra_node for c in (load_cluster(n) for n in list_clusters())
                 if c.device.name == best.name), None)
    if link is None:
        raise ConfigError(f"no cluster config describes the links between {best.name} devices",
                          hint="pass --cluster with a cluster config")
    device = replace(best, memory_bytes=memory, description=f"{gpu} (config {best.name})")
    return ClusterSpec(name=LOCAL_CLUSTER, device=device, devices_per_node=count, num_nodes=1,
                       intra_node=link, inter_node=link, backend="nccl",
                       description=f"this machine: {count} x {gpu}",
                       source=f"detected by torch.cuda; costs of configs/devices/{best.name}.yaml")


def resolve_cluster(name_or_path: str | Path) -> ClusterSpec:
    """`local` (this machine, see local_cluster) or a cluster config name or path."""
    if str(name_or_path) == LOCAL_CLUSTER:
        return local_cluster()
    return load_cluster(name_or_path)



def cpu_model() -> str:
    """This machine's CPU model name from /proc/cpuinfo (or platform.processor())."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return " ".join(line.split(":", 1)[1].split())
    except OSError:
        pass
    import platform
    return platform.processor() or platform.machine() or "unknown CPU"


def cpu_vector_bytes() -> int:
    """The SIMD register width (bytes) torch's CPU kernels use on this machine, from the
    capability ATen dispatches to: 64 AVX-512, 32 AVX2 (or SVE-256), else 16 (SSE, NEON, VSX)."""
    import torch

    capability = torch.backends.cpu.get_cpu_capability().upper()
    if capability.startswith("AVX512"):
        return 64
    if capability in ("AVX2", "SVE256"):
        return 32
    return 16


def physical_cores() -> int:
    """Physical cores available to this process (hyper-threads of one core count once)."""
    return len(core_cpus()) or os.cpu_count() or 1


def threads_beyond_cores(threads: int) -> tuple[str, str] | None:
    """(message, hint) when one CPU device of `threads` cores is more than this machine has
    (it would be measured oversubscribed), else None: `partc profile` and `partc calibrate`
    refuse it alike."""
    cores = physical_cores()
    if threads <= cores:
        return None
    return (f"--threads {threads} is more than this machine's {cores} physical cores",
            f"one device is --threads cores: use at most {cores}")


def core_cpus() -> list[frozenset[int]]:
    """The logical CPUs of each physical core this process may run on (its affinity), in CPU
    order: one set per core, its hyper-threads together. Without /proc/cpuinfo every allowed
    logical CPU counts as a core."""
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    cores: dict[tuple[str, str], set[int]] = {}
    try:
        block: dict[str, str] = {}
        for line in Path("/proc/cpuinfo").read_text().splitlines() + [""]:
            if ":" in line:
                k, v = line.split(":", 1)
                block[k.strip()] = v.strip()
            elif block:
                cpu = int(block.get("processor", "-1"))
                if cpu >= 0 and (allowed is None or cpu in allowed):
                    key = (block.get("physical id", "0"), block.get("core id", str(cpu)))
                    cores.setdefault(key, set()).add(cpu)
                block = {}
    except (OSError, ValueError):
        cores = {}
    if not cores and allowed:
        return [frozenset({cpu}) for cpu in sorted(allowed)]
    return sorted((frozenset(c) for c in cores.values()), key=min)


def pin_to_core(index: int, count: int = 1) -> frozenset[int] | None:
    """Bind this process (every thread it has, and those it starts later) to `count` physical
    cores, the index-th block of them modulo the cores it may run on: a partc CPU device is a
    fixed set of cores, and a process the scheduler moves between cores loses its caches and
    lands beside another device's work (measured on a 2-core VM: a 2-stage gloo pipeline trains
    1.3x faster pinned). Returns the CPUs bound to, or None where affinity cannot be set (not
    Linux, or forbidden)."""
    cores = core_cpus() if hasattr(os, "sched_setaffinity") else []
    if not cores:
        return None
    count = max(1, min(count, len(cores)))
    blocks = max(1, len(cores) // count)
    start = (index % blocks) * count
    cpus = frozenset().union(*cores[start:start + count])
    return cpus if set_affinity(cpus) else None


@contextlib.contextmanager
def pinned_to_core(index: int, count: int = 1) -> Iterator[frozenset[int] | None]:
    """`pin_to_core(index, count)` for the duration of the block, the previous affinity restored
    after (a measurement inside a longer-lived process)."""
    before = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    try:
        yield pin_to_core(index, count)
    finally:
        if before is not None:
            set_affinity(frozenset(before))


def pinnable_cpus(what: str, error: type[PartcError]) -> list[int]:
    """One logical CPU of each physical core this process may run on (`core_cpus`), for a
    measurement that pins a process to each; raises `error` (one line, with a hint) where the
    system does not let partc set CPU affinity. `what` names the measurement."""
    cpus = [min(core) for core in core_cpus()] if hasattr(os, "sched_setaffinity") else []
    if not cpus:
        raise error(f"measuring {what} needs processes pinned to CPUs, and this system does not "
                    "let partc set CPU affinity",
                    hint="run partc calibrate on Linux, outside a container that forbids "
                         "sched_setaffinity")
    return cpus


def set_affinity(cpus: frozenset[int]) -> bool:
    """Every thread of this process onto `cpus` (sched_setaffinity(0) moves the calling thread
    only; threads started later inherit it)."""
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    done = False
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
            done = True
        except OSError:  # a thread that ended meanwhile, or a container that forbids it
            continue
    return done


# The process that starts a partc helper process (a busy neighbour, a launch worker) names
# itself here in the child's environment, so that a child whose parent died before it looked
# (while it imported torch) still knows whom it belonged to.
PARENT_PID_ENV = "PARTC_PARENT_PID"


def process_state(pid: int) -> tuple[str, int] | None:
    """(state letter, parent pid) of a process from /proc/PID/stat; None when it is gone or
    there is no /proc."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return fields[0].decode(), int(fields[1])
    except (OSError, IndexError, ValueError):
        return None


def _alive(pid: int) -> bool:
    """Whether `pid` runs: exists, and is not a zombie (a process killed and not yet reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: alive
        return True
    state = process_state(pid)
    return state is None or state[0] != "Z"  # without /proc: what kill said


def end_with_parent(poll_s: float = 0.5, parent: int | None = None) -> None:
    """End this process (SIGTERM to itself) once the process that started it is gone.

    A helper process partc starts (a busy neighbour looping until it is killed, a launch worker
    training to its last step) would otherwise outlive a parent killed by SIGKILL (the OOM
    killer, `kill -9`, a job timeout), which gets no chance to stop it: the orphan goes on
    computing on a core nobody accounts for. A daemon thread compares the parent's pid every
    `poll_s`. The parent is `PARTC_PARENT_PID` from the environment where that is this process's
    parent or no longer alive (it died while this process started), else the parent now (a
    variable inherited from an ancestor, or a process torchrun started). A `parent` given is
    watched instead, whether or not it is this process's parent (a launch worker forked by the
    launcher's forkserver watches the launcher)."""
    import signal
    import threading
    import time

    ours = parent is None  # this process's parent: its reparenting counts as its end too
    if parent is None:
        parent = os.getppid()
        named = os.environ.get(PARENT_PID_ENV, "")
        if named.isdigit() and (int(named) == parent or not _alive(int(named))):
            parent = int(named)
    watched = parent

    def watch() -> None:
        while (not ours or os.getppid() == watched) and _alive(watched):
            time.sleep(poll_s)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="partc-end-with-parent", daemon=True).start()


_PR_SET_NAME = 15  # prctl's option (linux/prctl.h)


def name_process(name: str) -> None:
    """Set this process's name as `ps -e`, `top` and /proc/PID/comm show it (Linux, at most 15
    bytes); nothing elsewhere. A process forked from a server (a launch worker) would otherwise
    carry the server's name."""
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return
    prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)


_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
_M_MMAP_MAX = -4


@functools.cache
def keep_freed_memory() -> bool:
    """Have glibc's malloc keep the memory this process frees, for the rest of the process,
    instead of handing it back to the OS: no allocation is served by its own mmap (M_MMAP_MAX
    0) and the heap's free top is never trimmed (M_TRIM_THRESHOLD -1). This is what CUDA's
    caching allocator does for a GPU, and what a training step's steady state wants: it frees
    and re-allocates the same sizes every micro-batch. Returns whether it applied (False where
    the C library is not glibc); once per process (cached: `platform.libc_ver` reads the
    interpreter's binary, and every measurement enters `cpu_settings`).

    Why: by default a free of a block at the heap's top beyond the trim threshold, or of a
    block above the mmap threshold (dynamic, at most 32 MiB), goes back to the OS, and the next
    allocation of that memory page-faults and zero-fills every 4 KiB page again. A schedule that
    holds many micro-batches' activations (GPipe) frees them in one sweep at the step's end and
    pays that again each step; one that reuses memory at once (1F1B) does not, and an operator
    timed in a loop never does. Measured on an Intel Xeon VM (glibc 2.36), the BERT example's
    4 forwards then 4 backwards at micro-batch 8 in one process: 3,036 minor faults and 2.4%
    more time than interleaved forward/backward by default, 3 faults and the same time (0.5%
    less) with freed memory kept; launched as a 2-stage pipeline, the same cut measured 5%
    slower under GPipe than 1F1B where the profile priced them equal.

    The cost: the process's resident memory stays at its high-water mark (as a GPU's reserved
    memory does), which is what partc's memory model prices a step to reach anyway."""
    import ctypes
    import platform

    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, -1))


GLOO_IO_THREAD = "gloo_tcp_loop"
"""The name gloo's TCP transport gives each process group's socket event-loop thread."""


def batch_schedule_gloo_io() -> int:
    """Run this process's gloo socket event loops (`GLOO_IO_THREAD`) under SCHED_BATCH; returns
    how many threads now run so. Call it once the process groups exist (each has its own loop)
    and again is harmless.

    Why: gloo's event loop handles a ready socket by try-locking its pair and, when a thread of
    the process holds that lock (posting a send or receive), returns to a level-triggered
    epoll_wait that reports the socket again at once: it spins. Woken by arriving bytes, the loop
    thread preempts the lock holder, which is pinned to the same core (launch's workers,
    partc.hardware.local.pin_to_core), and spins until the scheduler's tick ends its slice.
    Measured on a 2-core VM, 4 gloo processes 2 per core (Linux 6.18): a gather whose root runs
    into it took 4-6 ms instead of 0.4, and a 4-stage launch spent 5 ms per step on rank 0's
    spinning loop (bench/gloo_spin.py). A SCHED_BATCH thread does not preempt on wakeup, so the
    holder releases the lock first; it keeps its fair share of the core for copying bytes."""
    if not hasattr(os, "SCHED_BATCH"):
        return 0
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return 0
    moved = 0
    for tid in tids:
        try:
            if Path(f"/proc/self/task/{tid}/comm").read_text().strip() != GLOO_IO_THREAD:
                continue
            if os.sched_getscheduler(int(tid)) != os.SCHED_BATCH:
                os.sched_setscheduler(int(tid), os.SCHED_BATCH, os.sched_param(0))
            moved += 1
        except OSError:  # a thread that ended meanwhile, or a system that forbids it
            continue
    return moved


# What the forkserver of measurement processes imports once (torch.distributed.pipelining: the
# runtime's overhead is measured on launch's own classes).
MEASUREMENT_PRELOAD = ("torch", "torch.distributed", "torch.distributed.pipelining")


def run_processes(worker: Callable[..., None], args: tuple[Any, ...], nprocs: int) -> None:
    """Run `worker(index, *args)` in `nprocs` fresh processes and wait for them (a worker's
    exception is raised here, as torch.multiprocessing.spawn raises it). They are forked from
    multiprocessing's forkserver, which imports torch (and the worker's module) once for every
    measurement of this process: a spawned interpreter imports them again, 2-3.5 s of CPU per
    process here. Forked from a server that ran nothing, they start as clean as spawned ones
    (no CUDA context, no OpenMP pool)."""
    import torch.multiprocessing as mp

    from partc.hardware.forkserver import start_forkserver

    start_forkserver([*MEASUREMENT_PRELOAD, worker.__module__])
    mp.start_processes(worker, args=args, nprocs=nprocs, join=True, start_method="forkserver")


def spawn_measurement(worker: Callable[..., None], args: tuple[Any, ...], nprocs: int,
                      what: str, error: type[PartcError], prefix: str) -> Any:
    """Run `worker(index, *args, out)` in `nprocs` processes (`run_processes`) and return the
    JSON one of them wrote to the file `out` (in a temporary folder); a worker's failure raises
    `error` as one line naming `what` (a calibration measurement's contract)."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        out = os.path.join(tmp, "result.json")
        try:
            run_processes(worker, (*args, out), nprocs)
        except Exception as exc:  # a worker's failure: one line
            raise error(f"the {what} measurement failed: {str(exc).strip().splitlines()[-1]}",
                        hint="rerun partc calibrate with --debug") from exc
        return json.loads(Path(out).read_text())


def free_port() -> int:
    """A TCP port on 127.0.0.1 free right now (for a local process group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ram_bytes() -> int:
    """Physical RAM (MemTotal of /proc/meminfo)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise OSError("MemTotal not found in /proc/meminfo")

