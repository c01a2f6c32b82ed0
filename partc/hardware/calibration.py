"""Calibration: measure this machine's CPU or one of its CUDA GPUs as a partc device, and the link
between two such devices, and write them as a device and a cluster config (`partc calibrate`,
bench/calibrate_cpu.py; docs/hardware.md#calibrating-a-machine).

`measure_cpu` / `measure_cuda` time the operators the cost model prices (matrix peaks per dtype,
conv and attention, memory streams, per-operator overheads of the forward and of the backward)
and turn the timings into a `DeviceSpec`; `measure_gloo_link` / `measure_nccl_link` time two
processes talking. `device_yaml` / `cluster_yaml` render the result with every raw measurement as
a comment, and `calibrate` does it all and writes `DIR/devices/NAME.yaml` and
`DIR/clusters/NAME.yaml`, which `partc compile --cluster DIR/clusters/NAME.yaml` reads.
"""
from __future__ import annotations

import functools
import json
import math
import os
import re
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence, Union

from partc.errors import PartcError
from partc.files import write_atomic
from partc.hardware.configs import ConfigError, list_clusters, load_cluster, load_device
from partc.hardware.local import (
    batch_schedule_gloo_io,
    cpu_model,
    cpu_vector_bytes,
    free_port,
    physical_cores,
    pin_to_core,
    ram_bytes,
    run_processes,
    threads_beyond_cores,
)
from partc.hardware.specs import OP_CLASSES, ClusterSpec, DeviceSpec, LinkSpec
from partc.hardware.speed_spread import KERNEL as SPREAD_KERNEL
from partc.hardware.speed_spread import (
    QUICK_WINDOW_S,
    WINDOW_S,
    SpeedSpreadError,
    measure_speed_spread,
)
from partc.hardware.units import format_quantity, parse_quantity
from partc.hardware.wake_credit import WakeCredit, WakeCreditError, measure_wake_credit

if TYPE_CHECKING:
    import torch

# Op classes whose efficiency cannot be measured as a FLOP rate (the OpGraph counts no FLOPs for
# them: the bytes term decides), and "other": the documented defaults (docs/hardware.md).
DEFAULT_EFFICIENCY = {"norm": 0.5, "elementwise": 0.5, "reduction": 0.5, "gather": 0.5,
                      "copy": 0.5, "other": 0.3}
BANDWIDTH_CLASSES = ("elementwise", "norm", "reduction", "gather", "copy")
LINK_BYTES = 64 << 20  # the message that measures a link's bandwidth
# gloo exchanges of 1 B and of LINK_BYTES a calibration means (`measure_gloo_link`)
GLOO_SMALL_REPS, GLOO_BIG_REPS = 1500, 60
# of calibrate's `seconds`, what the speed spread measures per dtype (every core at once)
SPREAD_SHARE = 0.4
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class CalibrationError(PartcError):
    """`partc calibrate` cannot run as asked: a bad --device, a missing GPU, an unwritable -o."""


@dataclass(frozen=True)
class CpuCalibration:
    """What `measure_cpu` found: the DeviceSpec and the raw measurements behind each number."""

    spec: DeviceSpec
    cpu_model: str
    physical_cores: int
    ram_bytes: int
    threads: int
    measurements: dict[str, float] = field(default_factory=dict)  # name -> value, base units


@dataclass(frozen=True)
class CudaCalibration:
    """What `measure_cuda` found: the DeviceSpec of one GPU and the raw measurements."""

    spec: DeviceSpec
    gpu_name: str
    device_index: int
    device_count: int  # GPUs visible: the calibrated cluster is one node of them
    capability: tuple[int, int]
    measurements: dict[str, float] = field(default_factory=dict)  # name -> value, base units


@dataclass(frozen=True)
class LinkCalibration:
    """A link between two devices of one node: measured (gloo, NCCL) or taken from a shipped
    config (`measured` False); `source` says which, for the cluster file's `source:`."""

    link: LinkSpec
    measured: bool
    source: str
    measurements: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class RuntimeCalibration:
    """What the pipelining runtime costs per stage pass, measured a layer above this one
    (partc.run.overhead): the device's `microbatch_overhead_s`, `p2p_post_cpu_s` and
    `cold_pass_s` (None: not measured) and the raw numbers behind them, for the device file's
    comments."""

    microbatch_overhead_s: float
    cold_pass_s: float | None = None
    p2p_post_cpu_s: float | None = None
    measurements: dict[str, float] = field(default_factory=dict)
    # an optimizer step's extra time from evicted caches (the device's `step_cold_s`)
    step_cold_s: float | None = None


DeviceCalibration = Union[CpuCalibration, CudaCalibration]


@dataclass(frozen=True)
class CalibrationResult:
    """What `calibrate` measured and wrote."""

    device: DeviceCalibration
    link: LinkCalibration
    cluster: ClusterSpec  # read back from cluster_path (its device from device_path)
    device_path: Path
    cluster_path: Path
    wall_s: float
    # CPU time other processes used meanwhile, in cores (nan where /proc/stat is unavailable):
    # they compete for cores and memory bandwidth, so every number comes out low above ~0.1.
    other_processes_cores: float
    # the OS scheduler's credit for a process woken from a gloo wait (CPU calibrations with the
    # link measured; the cluster's wake_credit_s), None where it was not measured, and why not
    # where it was tried and failed (`wake_note`)
    wake: WakeCredit | None = None
    wake_note: str = ""
    # why the CPU's speed spread (the device's speed_spread) was not measured, where it was tried
    spread_note: str = ""
    # `--devices N`: the same node as N devices (cores shared when N exceeds them), each
    # (cluster read back, DIR/clusters/NAME-N.yaml)
    more_clusters: tuple[tuple[ClusterSpec, Path], ...] = ()


# --------------------------------------------------------------------------------------------
# Timing helpers (device-independent: `sync` waits for the device, a no-op on the CPU)

def _no_sync() -> None:
    return None


def _synchronizer(device: "torch.device") -> Callable[[], None]:
    if device.type == "cuda":
        import torch
        return lambda: torch.cuda.synchronize(device)
    return _no_sync


def _median_time(fn: Callable[[], Any], budget_s: float, min_reps: int = 3,
                 max_reps: int = 200, sync: Callable[[], None] = _no_sync) -> float:
    """Median wall time of fn() after one warm-up call, repeated until the budget is spent;
    `sync()` waits for queued device work before each start and after each call."""
    fn()
    sync()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < max_reps and (len(times) < min_reps
                                     or time.perf_counter() - start < budget_s):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _batched_time(fn: Callable[[], Any], budget_s: float, sync: Callable[[], None],
                  target_s: float = 5e-3, max_inner: int = 1000) -> float:
    """Time of one fn() on an asynchronous device: calls are repeated back to back until one
    timed chunk takes about `target_s`, so the launch and synchronisation latencies vanish."""
    one = _median_time(fn, 0.0, min_reps=2, max_reps=2, sync=sync)
    inner = max(1, min(max_inner, int(target_s / max(one, 1e-9))))

    def chunk() -> None:
        for _ in range(inner):
            fn()
    return _median_time(chunk, budget_s, sync=sync) / inner


def _counted_flops(fn: Callable[[], Any]) -> int:
    """FLOPs of fn() as partc's OpGraph counts them (torch's flop counter + partc's formulas)."""
    from partc.frontend.flop_count import flop_counter_mode
    with flop_counter_mode() as counter:
        fn()
    return int(counter.get_total_flops())


def _snap(value: float, unit: str, digits: int = 4) -> float:
    """`value` rounded to what its YAML text (`digits` significant digits with a unit prefix)
    reads back as, so that a rendered spec loads to an equal one."""
    return parse_quantity(format_quantity(value, unit, digits), unit)


def measure_op_overheads(device: "torch.device", budget_s: float, loops: int = 2000,
                         chain: int = 1000) -> dict[str, float]:
    """Per-operator fixed costs on `device` (synchronised), in seconds:

    - `op_overhead_s`: eager forward of a 1-element add whose input requires grad (dispatch,
      autograd recording and kernel launch, as in training), over `loops` back-to-back calls;
    - `op_dispatch_no_grad_s`: the same without autograd (the device's `dispatch_overhead_s`:
      what an optimizer step's kernels pay);
    - `backward_op_overhead_s`: backward through a chain of `chain` 1-element multiplications
      (`torch.autograd.grad`), divided by `chain`: the engine's node plus the gradient kernel;
    - `backward_chain_s` and `backward_chain_ops`: that backward's median time and length.
    """
    import torch

    sync = _synchronizer(device)
    leaf = torch.ones(1, device=device, requires_grad=True)
    plain = torch.ones(1, device=device)

    def forward_ops(x: "torch.Tensor") -> Callable[[], None]:
        def run() -> None:
            for _ in range(loops):
                torch.add(x, x)
        return run

    forward = _median_time(forward_ops(leaf), 0.4 * budget_s, sync=sync) / loops
    dispatch = _median_time(forward_ops(plain), 0.2 * budget_s, sync=sync) / loops

    def backward_once() -> float:
        y = leaf
        for _ in range(chain):
            y = y * 1.0
        sync()
        t0 = time.perf_counter()
        torch.autograd.grad(y, leaf)
        sync()
        return time.perf_counter() - t0

    backward_once()  # warm-up
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 3 or (time.perf_counter() - start < 0.4 * budget_s and len(times) < 50):
        times.append(backward_once())
    chain_s = statistics.median(times)
    return {"op_overhead_s": forward, "op_dispatch_no_grad_s": dispatch,
            "backward_op_overhead_s": chain_s / chain, "backward_chain_s": chain_s,
            "backward_chain_ops": float(chain)}


def measure_bandwidth(device: "torch.device", numel: int, budget_s: float,
                      overhead_s: float = 0.0) -> dict[str, float]:
    """Memory bandwidths on `device` over float32 tensors of `numel` elements (bytes read +
    written per second): `stream_copy_B_s`, `stream_add_B_s` (the peak is the faster) and one
    operator per bandwidth-bound class, `<class>_B_s` (elementwise mul, layer_norm, row sum,
    index_select, transposed copy). Outputs are preallocated where torch allows (`out=`): on the
    CPU a fresh tensor over glibc's mmap threshold (32 MiB) is page-faulted in on every call, which
    would measure the allocator rather than the operator. `overhead_s` is subtracted per call."""
    import torch

    sync = _synchronizer(device)
    timer: Callable[[Callable[[], Any], float], float]
    if device.type == "cpu":
        def timer(fn: Callable[[], Any], budget: float) -> float:
            return _median_time(fn, budget)
    else:
        def timer(fn: Callable[[], Any], budget: float) -> float:
            return _batched_time(fn, budget, sync)

    src = torch.randn(numel, device=device)
    dst = torch.empty(numel, device=device)
    other = torch.randn(numel, device=device)
    nbytes = numel * 4

    def stream(fn: Callable[[], Any], moved: int, share: float) -> float:
        return moved / max(timer(fn, share * budget_s) - overhead_s, 1e-9)

    found = {"stream_copy_B_s": stream(lambda: dst.copy_(src), 2 * nbytes, 0.2),
             "stream_add_B_s": stream(lambda: torch.add(src, other, out=dst), 3 * nbytes, 0.2)}
    hidden = 1024
    rows = numel // hidden
    x2, y2 = src.view(rows, hidden), dst.view(rows, hidden)
    ln_w = torch.ones(hidden, device=device)
    ln_b = torch.zeros(hidden, device=device)
    ln_stats = torch.empty(rows, 1, device=device), torch.empty(rows, 1, device=device)
    row_sums = torch.empty(rows, device=device)
    index = torch.randint(0, rows, (rows,), device=device)
    square, transposed = src.view(-1, 4096), dst.view(4096, -1)
    aten = torch.ops.aten

    def norm() -> Any:
        if device.type == "cpu":
            return aten.native_layer_norm.out(x2, [hidden], ln_w, ln_b, 1e-5, out0=y2,
                                              out1=ln_stats[0], out2=ln_stats[1])
        # The caching allocator makes a fresh output cheap on a GPU.
        return torch.nn.functional.layer_norm(x2, [hidden], ln_w, ln_b)

    found["elementwise_B_s"] = stream(lambda: torch.mul(src, other, out=dst), 3 * nbytes, 0.12)
    found["norm_B_s"] = stream(norm, 2 * nbytes, 0.12)
    found["reduction_B_s"] = stream(lambda: torch.sum(x2, dim=1, out=row_sums),
                                    nbytes + rows * 4, 0.12)
    found["gather_B_s"] = stream(lambda: torch.index_select(x2, 0, index, out=y2),
                                 2 * nbytes + rows * 8, 0.12)
    found["copy_B_s"] = stream(lambda: transposed.copy_(square.t()), 2 * nbytes, 0.12)
    return found


# Working sets of the cache sweep (bytes): three float32 tensors of a third each (an add).
CACHE_SWEEP_BYTES = tuple(3 * (1 << k) for k in range(20, 28))  # 3 MiB .. 384 MiB
QUICK_CACHE_SWEEP_BYTES = tuple(3 * (1 << k) for k in range(18, 23))  # 768 KiB .. 12 MiB


def measure_cache(budget_s: float, overhead_s: float = 0.0, quick: bool = False
                  ) -> dict[str, float]:
    """An add over float32 tensors at each working set of the sweep (`cache_add_<bytes>_B_s`,
    bytes read + written per second, `overhead_s` subtracted per call), on the CPU: repeated
    passes over a working set the cache holds run well above the DRAM rate (measured on an
    Intel Xeon VM: 27-29 GB/s up to 48 MiB, 14.5 GB/s from 192 MiB)."""
    import torch

    sizes = QUICK_CACHE_SWEEP_BYTES if quick else CACHE_SWEEP_BYTES
    found: dict[str, float] = {}
    for ws in sizes:
        numel = ws // 12
        a, b, out = torch.randn(numel), torch.randn(numel), torch.empty(numel)
        t = _median_time(functools.partial(torch.add, a, b, out=out), budget_s / len(sizes))
        found[f"cache_add_{ws}_B_s"] = ws / max(t - overhead_s, 1e-9)
    return found


def _cache_terms(found: dict[str, float], dram: float) -> tuple[int, float]:
    """(cache_bytes, cache_bandwidth) from `measure_cache`'s sweep and the DRAM stream rate
    `dram`: the bandwidth is the median over the working sets that run at 1.5x `dram` or more,
    and the cache the largest of them below the first that does not; (0, 0) where none does
    (no cache worth a term)."""
    sweep = sorted((int(k.split("_")[2]), v) for k, v in found.items()
                   if k.startswith("cache_add_"))
    fast = []
    for ws, rate in sweep:
        if rate < 1.5 * dram:
            break
        fast.append((ws, rate))
    if not fast:
        return 0, 0.0
    return fast[-1][0], statistics.median(r for _, r in fast)


def _bandwidth_terms(found: dict[str, float]) -> tuple[float, float]:
    """(memory_bandwidth, bandwidth_efficiency) from `measure_bandwidth`'s numbers."""
    peak = max(found["stream_copy_B_s"], found["stream_add_B_s"])
    eff = statistics.median(found[f"{c}_B_s"] / peak for c in BANDWIDTH_CLASSES)
    return peak, min(1.0, max(eff, 1e-3))


# --------------------------------------------------------------------------------------------
# CPU

def measure_cpu(threads: int = 1, seconds: float = 20.0) -> CpuCalibration:
    """Measure this machine's CPU as a partc device of `threads` cores (see calibrate_cpu)."""
    import torch
    import torch.nn.functional as F

    if threads < 1 or seconds <= 0:
        raise ValueError("threads must be >= 1 and seconds > 0")
    quick = seconds < 5  # smoke runs: small sizes so that every step stays in budget
    unit = seconds / 20.0  # the full run's budget shares below add up to about 20 units
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    cpu = torch.device("cpu")
    found: dict[str, float] = {}
    try:
        # -- matmul: the measured peak is the best shape; efficiency is the median over
        # squares and transformer-like linear shapes (forward and weight gradient).
        def mm_rate(m: int, k: int, n: int, dtype: torch.dtype, budget: float) -> float:
            a = torch.randn(m, k, dtype=dtype)
            b = torch.randn(k, n, dtype=dtype)
            return 2.0 * m * k * n / _median_time(lambda: torch.mm(a, b), budget)

        sizes = [(256, 256, 256), (512, 512, 512), (512, 256, 1024)] if quick else [
            (512, 512, 512), (1024, 1024, 1024), (2048, 2048, 2048),
            (2048, 768, 3072), (768, 2048, 3072)]
        rates = [mm_rate(m, k, n, torch.float32, 1.0 * unit) for m, k, n in sizes]
        for (m, k, n), r in zip(sizes, rates, strict=True):
            found[f"matmul_float32_{m}x{k}x{n}_flop_s"] = r
        peak32 = max(rates)  # raised below if conv or attention beat it
        peaks: dict[str, float] = {}

        # Other dtypes: a small probe first. A dtype slower than 1/20 of float32 (no native
        # kernels, e.g. float16 without AVX512-FP16) keeps the probe's rate rather than being
        # timed at large sizes for long; leaving it out would price it at the float32 peak.
        probe = 256 if quick else 512
        big = 512 if quick else 2048
        for name, dtype in (("bfloat16", torch.bfloat16), ("float16", torch.float16),
                            ("float64", torch.float64)):
            first = mm_rate(probe, probe, probe, dtype, 0.3 * unit)
            found[f"matmul_{name}_{probe}_flop_s"] = first
            peaks[name] = first
            if first >= peak32 / 20:
                second = mm_rate(big, big, big, dtype, 1.0 * unit)
                found[f"matmul_{name}_{big}_flop_s"] = second
                peaks[name] = max(first, second)

        # -- conv and attention, forward + backward as in training, FLOPs counted the way the
        # OpGraph counts them.
        n, c, hw = (2, 32, 16) if quick else (8, 64, 56)
        x = torch.randn(n, c, hw, hw, requires_grad=True)
        w = torch.randn(c, c, 3, 3, requires_grad=True)

        def conv_step() -> None:
            y = F.conv2d(x, w, padding=1)
            torch.autograd.grad(y, (x, w), torch.ones_like(y))

        conv_rate = _counted_flops(conv_step) / _median_time(conv_step, 2.0 * unit)
        found["conv2d_fwd_bwd_flop_s"] = conv_rate

        b, h, seq, d = (1, 4, 128, 64) if quick else (2, 8, 512, 64)
        q, k_, v = (torch.randn(b, h, seq, d, requires_grad=True) for _ in range(3))

        def attention_step() -> None:
            o = F.scaled_dot_product_attention(q, k_, v)
            torch.autograd.grad(o, (q, k_, v), torch.ones_like(o))

        attn_rate = _counted_flops(attention_step) / _median_time(attention_step, 2.0 * unit)
        found["sdpa_fwd_bwd_flop_s"] = attn_rate
        peak32 = max(peak32, conv_rate, attn_rate)
        peaks["float32"] = peak32
        matmul_eff = statistics.median(rates) / peak32

        # -- per-operator overheads: forward with autograd recording, backward per chain node.
        found.update(measure_op_overheads(cpu, 1.0 * unit, loops=200 if quick else 2000,
                                          chain=200 if quick else 1000))

        # -- memory bandwidth: streams over tensors far larger than the caches. The bare
        # dispatch time (no autograd: these run without grad) is subtracted per call.
        numel = (4 << 20) if quick else (32 << 20)  # 16 MiB / 128 MiB of float32 per tensor
        found.update(measure_bandwidth(cpu, numel, 5.0 * unit,
                                       overhead_s=found["op_dispatch_no_grad_s"]))
        peak_bw, bandwidth_eff = _bandwidth_terms(found)
        # -- the cache: the same add over working sets from a few MiB up, for the passes an
        # optimizer step makes over one parameter's tensors at a time
        found.update(measure_cache(1.5 * unit, overhead_s=found["op_dispatch_no_grad_s"],
                                   quick=quick))
        cache_bytes, cache_bw = _cache_terms(found, found["stream_add_B_s"])
    finally:
        torch.set_num_threads(previous_threads)

    cores = physical_cores()
    ram = ram_bytes()
    devices = max(1, cores // threads)
    model = cpu_model()
    efficiency = {
        "matmul": round(min(1.0, matmul_eff), 3),
        "conv": round(min(1.0, conv_rate / peak32), 3),
        "attention": round(min(1.0, attn_rate / peak32), 3),
        **DEFAULT_EFFICIENCY,
    }
    spec = _measured_spec(
        found, name="cpu", kind="cpu", memory_bytes=ram // devices, peaks=peaks,
        bandwidth=peak_bw, bandwidth_eff=bandwidth_eff, efficiency=efficiency,
        description=(f"This machine's CPU ({model}, {cores} physical cores, "
                     f"{ram / 2**30:.1f} GiB RAM) as {devices} device(s) of {threads} core(s) "
                     f"each, eager PyTorch with {threads} thread(s) per device"),
        source=f"calibrated by bench/calibrate_cpu.py on {model}",
        cache=(cache_bytes, cache_bw),
    )
    spec = replace(spec, calibrated_on=model, vector_bytes=cpu_vector_bytes())
    return CpuCalibration(spec=spec, cpu_model=model, physical_cores=cores, ram_bytes=ram,
                          threads=threads, measurements=found)


def calibrate_cpu(threads: int = 1, seconds: float = 20.0) -> DeviceSpec:
    """A DeviceSpec of this machine's CPU, measured: one device = `threads` cores.

    Peak FLOP/s per dtype is the best dense matrix operator measured (float32, bfloat16, float16,
    float64; a dtype 20x slower than float32 is only probed at one small size). Matmul, conv and
    attention efficiencies are their achieved fractions of the float32 peak (conv and attention
    forward + backward). Memory bandwidth is the best large-tensor stream (bytes read + written
    per second), bandwidth_efficiency the median fraction of it that norm, elementwise,
    reduction, gather and copy operators reach. The per-operator overheads are the eager time of
    a 1-element add recorded by autograd and the backward time per node of a chain of 1-element
    multiplications; memory is RAM * threads / cores.
    Takes about `seconds` (plus warm-up); `seconds` < 5 uses small sizes (a smoke test).
    """
    return measure_cpu(threads, seconds).spec


# --------------------------------------------------------------------------------------------
# CUDA

# GEMM shapes (M, K, N) like a transformer layer's at 8k tokens: squares, the MLP's up and down
# projections, and a weight gradient (K = tokens).
CUDA_GEMM_SHAPES = ((4096, 4096, 4096), (8192, 1024, 4096), (8192, 4096, 1024),
                    (1024, 8192, 4096))
QUICK_GEMM_SHAPES = ((256, 256, 256), (512, 128, 512))


def parse_calibration_device(text: str) -> str:
    """`cpu`, `cuda` or `cuda:N` (normalised: `cuda` -> `cuda:0`); anything else is a
    CalibrationError. Whether the GPU exists is checked by `measure_cuda`."""
    value = text.strip().lower()
    if value == "cpu":
        return "cpu"
    if value == "cuda":
        return "cuda:0"
    m = re.fullmatch(r"cuda:(\d+)", value)
    if m:
        return f"cuda:{int(m.group(1))}"
    raise CalibrationError(f"bad --device {text!r}", "use cpu, cuda or cuda:N (e.g. cuda:1)")


def _cuda_device(device: str) -> tuple["torch.device", Any, int]:
    """(torch.device, its properties, visible GPU count); CalibrationError when it is missing."""
    import torch

    device = parse_calibration_device(device)
    dev = torch.device(device)
    if dev.type != "cuda":
        raise CalibrationError(f"--device {device!r} is not a CUDA device",
                               "use cuda or cuda:N, or calibrate the CPU with --device cpu")
    if not torch.cuda.is_available():
        build = "this torch has no CUDA support" if torch.version.cuda is None else \
            "torch sees no CUDA GPU"
        raise CalibrationError(f"cannot calibrate {device}: {build}",
                               "run on a machine with an NVIDIA GPU and a CUDA build of torch, "
                               "check CUDA_VISIBLE_DEVICES, or use --device cpu")
    count = torch.cuda.device_count()
    index = dev.index or 0
    if index >= count:
        raise CalibrationError(f"cannot calibrate {device}: only {count} CUDA device(s) visible",
                               f"use cuda:0 .. cuda:{count - 1}")
    return torch.device("cuda", index), torch.cuda.get_device_properties(index), count


def cuda_dtypes(capability: tuple[int, int]) -> list[str]:
    """The `peak_flops` keys a GPU of this compute capability runs natively: tf32 and bfloat16
    from Ampere (8.0) on."""
    dtypes = ["float32", "float16", "float64"]
    if capability >= (8, 0):
        dtypes[1:1] = ["tf32", "bfloat16"]
    return dtypes


def compute_dtype(dtypes: Sequence[str]) -> str:
    """The dtype a GPU's conv and attention are measured (and mixed-precision training runs)
    in: bfloat16 where measured, else float16, else float32."""
    return next((d for d in ("bfloat16", "float16") if d in dtypes), "float32")


def _matmul_dtypes(found: dict[str, float]) -> list[str]:
    """The dtypes `found` has GEMM rates of (keys `matmul_<dtype>_<M>x<K>x<N>_flop_s`)."""
    dtypes = []
    for key in found:
        m = re.fullmatch(r"matmul_([a-z0-9]+)_\d+x\d+x\d+_flop_s", key)
        if m and m.group(1) not in dtypes:
            dtypes.append(m.group(1))
    return dtypes


def measure_accelerator(device: "torch.device", seconds: float, dtypes: Sequence[str],
                        quick: bool = False) -> dict[str, float]:
    """The raw measurements `measure_cuda` turns into a DeviceSpec, on any torch device (the CPU
    runs it in tests): GEMM FLOP/s per dtype and shape (`matmul_<dtype>_<M>x<K>x<N>_flop_s`;
    tf32 is float32 with TF32 matmuls allowed), forward + backward conv2d and attention FLOP/s in
    the compute dtype (bfloat16 where listed, else float16 or float32), the memory bandwidths
    (`measure_bandwidth`) and the per-operator overheads (`measure_op_overheads`)."""
    import torch
    import torch.nn.functional as F

    sync = _synchronizer(device)
    unit = seconds / 20.0
    found: dict[str, float] = {}
    shapes = QUICK_GEMM_SHAPES if quick else CUDA_GEMM_SHAPES
    matmul = torch.backends.cuda.matmul
    previous_tf32 = matmul.allow_tf32
    torch.manual_seed(0)
    try:
        def mm_rate(m: int, k: int, n: int, dtype: torch.dtype, budget: float) -> float:
            a = torch.randn(m, k, device=device, dtype=dtype)
            b = torch.randn(k, n, device=device, dtype=dtype)
            out = torch.empty(m, n, device=device, dtype=dtype)
            return 2.0 * m * k * n / _batched_time(lambda: torch.mm(a, b, out=out), budget, sync)

        fp32_best = 0.0
        for name in dtypes:
            dtype = {"float32": torch.float32, "tf32": torch.float32, "float64": torch.float64,
                     "bfloat16": torch.bfloat16, "float16": torch.float16}[name]
            matmul.allow_tf32 = name == "tf32"
            todo = list(shapes)
            if name == "float64" and fp32_best:
                # Consumer GPUs run float64 at 1/32-1/64 of float32: one shape is enough there.
                m, k, n = todo[0]
                first = mm_rate(m, k, n, dtype, 0.5 * unit)
                found[f"matmul_{name}_{m}x{k}x{n}_flop_s"] = first
                todo = todo[1:] if first >= fp32_best / 20 else []
            for m, k, n in todo:
                rate = mm_rate(m, k, n, dtype, 0.5 * unit)
                found[f"matmul_{name}_{m}x{k}x{n}_flop_s"] = rate
                if name == "float32":
                    fp32_best = max(fp32_best, rate)
        matmul.allow_tf32 = False

        cdtype = getattr(torch, compute_dtype(dtypes))
        n_, c, hw = (2, 16, 16) if quick else (32, 128, 56)
        x = torch.randn(n_, c, hw, hw, device=device, dtype=cdtype, requires_grad=True)
        w = torch.randn(c, c, 3, 3, device=device, dtype=cdtype, requires_grad=True)

        def conv_step() -> None:
            y = F.conv2d(x, w, padding=1)
            torch.autograd.grad(y, (x, w), torch.ones_like(y))

        found["conv2d_fwd_bwd_flop_s"] = (_counted_flops(conv_step)
                                          / _median_time(conv_step, 1.5 * unit, sync=sync))
        b, h, seq, d = (1, 2, 128, 32) if quick else (4, 16, 2048, 64)
        q, k_, v = (torch.randn(b, h, seq, d, device=device, dtype=cdtype, requires_grad=True)
                    for _ in range(3))

        def attention_step() -> None:
            o = F.scaled_dot_product_attention(q, k_, v, is_causal=True)
            torch.autograd.grad(o, (q, k_, v), torch.ones_like(o))

        found["sdpa_fwd_bwd_flop_s"] = (_counted_flops(attention_step)
                                        / _median_time(attention_step, 1.5 * unit, sync=sync))

        found.update(measure_op_overheads(device, 1.0 * unit, loops=200 if quick else 2000,
                                          chain=200 if quick else 1000))
        numel = (1 << 20) if quick else (64 << 20)  # 4 MiB / 256 MiB of float32 per tensor
        found.update(measure_bandwidth(device, numel, 3.0 * unit))
    finally:
        matmul.allow_tf32 = previous_tf32
    return found


def cuda_device_spec(found: dict[str, float], *, name: str, total_memory: int,
                     description: str = "", source: str = "") -> DeviceSpec:
    """A DeviceSpec from `measure_accelerator`'s numbers: each dtype's peak is its best GEMM
    (the compute dtype's also its conv or attention rate when higher); matmul efficiency is the
    median of the compute dtype's GEMM shapes / its peak, conv and attention their rates / that
    peak; the bandwidth-bound classes keep the documented defaults."""
    rates: dict[str, list[float]] = {}
    for key, value in found.items():
        m = re.fullmatch(r"matmul_([a-z0-9]+)_\d+x\d+x\d+_flop_s", key)
        if m:
            rates.setdefault(m.group(1), []).append(value)
    if "float32" not in rates:
        raise ValueError("no float32 GEMM measured")
    compute = compute_dtype(list(rates))
    peaks = {dtype: max(values) for dtype, values in rates.items()}
    conv, attention = found["conv2d_fwd_bwd_flop_s"], found["sdpa_fwd_bwd_flop_s"]
    peaks[compute] = max(peaks.get(compute, 0.0), conv, attention)
    peak = peaks[compute]
    efficiency = {
        "matmul": round(min(1.0, statistics.median(rates.get(compute, rates["float32"])) / peak),
                        3),
        "conv": round(min(1.0, max(conv / peak, 1e-3)), 3),
        "attention": round(min(1.0, max(attention / peak, 1e-3)), 3),
        **DEFAULT_EFFICIENCY,
    }
    bandwidth, bandwidth_eff = _bandwidth_terms(found)
    return _measured_spec(found, name=name, kind="cuda", memory_bytes=int(total_memory),
                          peaks=peaks, bandwidth=bandwidth, bandwidth_eff=bandwidth_eff,
                          efficiency=efficiency, description=description, source=source)


def _measured_spec(found: dict[str, float], *, name: str, kind: str, memory_bytes: int,
                   peaks: dict[str, float], bandwidth: float, bandwidth_eff: float,
                   efficiency: dict[str, float], description: str, source: str,
                   cache: tuple[int, float] = (0, 0.0)) -> DeviceSpec:
    """A DeviceSpec from measured numbers, rounded so that its YAML text reads back equal."""
    return DeviceSpec(
        cache_bytes=cache[0], cache_bandwidth=_snap(cache[1], "B/s") if cache[1] else 0.0,
        name=name, kind=kind, memory_bytes=memory_bytes,
        peak_flops={k: _snap(peaks[k], "FLOP/s") for k in sorted(peaks)},
        memory_bandwidth=_snap(bandwidth, "B/s"), efficiency=efficiency,
        bandwidth_efficiency=round(bandwidth_eff, 3),
        op_overhead_s=_snap(found["op_overhead_s"], "s", 3),
        backward_op_overhead_s=_snap(found["backward_op_overhead_s"], "s", 3),
        dispatch_overhead_s=_snap(found["op_dispatch_no_grad_s"], "s", 3),
        description=description, source=source)


def gpu_slug(gpu_name: str) -> str:
    """A config name from a GPU's name: "NVIDIA H100 80GB HBM3" -> "nvidia-h100-80gb-hbm3"."""
    return re.sub(r"[^a-z0-9]+", "-", gpu_name.lower()).strip("-") or "cuda"


def measure_cuda(device: str = "cuda", seconds: float = 20.0,
                 name: str | None = None) -> CudaCalibration:
    """Measure one CUDA GPU as a partc device (see measure_accelerator and cuda_device_spec):
    GEMM peaks per dtype it supports, bf16 attention and conv forward + backward, HBM bandwidth,
    per-operator overheads (synchronised), memory = the driver's total. `seconds` < 5 uses small
    sizes (a smoke test). CalibrationError when the device does not exist."""
    import torch

    if seconds <= 0:
        raise ValueError("seconds must be > 0")
    dev, props, count = _cuda_device(device)
    capability = (int(props.major), int(props.minor))
    gpu = str(props.name)
    with torch.cuda.device(dev):
        found = measure_accelerator(dev, seconds, cuda_dtypes(capability), quick=seconds < 5)
    total = int(props.total_memory)
    found["total_memory_bytes"] = float(total)
    spec = cuda_device_spec(
        found, name=name or gpu_slug(gpu), total_memory=total,
        description=(f"{gpu} (compute capability {capability[0]}.{capability[1]}, "
                     f"{total / 2**30:.1f} GiB), eager PyTorch {torch.__version__}"),
        source=f"calibrated by partc calibrate on {gpu}")
    spec = replace(spec, calibrated_on=gpu)
    return CudaCalibration(spec=spec, gpu_name=gpu, device_index=dev.index or 0,
                           device_count=count, capability=capability, measurements=found)


# --------------------------------------------------------------------------------------------
# Links

def link_from_pingpong(found: dict[str, float], nbytes: int) -> tuple[LinkSpec, str]:
    """A link from `_pingpong`'s one-way times of a tiny message (the latency) and an `nbytes`
    one, and a few words on which times it took.

    Its averages (`latency_s`, `big_s`) where they separate the two terms: the tiny message
    takes at most half the big one's time, as on any link at the sizes calibrate sends (gloo
    on loopback: 0.07 ms against 3 ms for 8 MiB). On a loaded machine a few stalled tiny
    exchanges can lift their mean to the big one's, and the difference, the bytes' time, to
    nothing (a CI run wrote 8.39 EB/s); then the medians (`latency_median_s`,
    `big_median_s`), which stalls move less; and where even those do not separate, the big
    message's median time taken as all bytes: the lowest bandwidth the times allow."""
    candidates = [("latency_s", "big_s", "")]
    if "latency_median_s" in found and "big_median_s" in found:
        candidates.append(("latency_median_s", "big_median_s",
                           "medians: the means of 1 B exchanges reached the big message's"))
    for small_key, big_key, how in candidates:
        latency, big = found[small_key], found[big_key]
        if 0 < latency <= big / 2:
            return _link(nbytes / (big - latency), latency), how
    small_key, big_key, _ = candidates[-1]
    latency, big = found[small_key], max(found[big_key], 1e-9)
    return (_link(nbytes / big, min(latency, big)),
            "the big message's time as all bytes: a 1 B exchange took as long as it did "
            "(a loaded machine)")


def _link(bandwidth: float, latency_s: float) -> LinkSpec:
    return LinkSpec(bandwidth=_snap(bandwidth, "B/s", 3), latency_s=_snap(latency_s, "s", 3))


def _pingpong_worker(rank: int, backend: str, port: int, threads: int, out: str,
                     small_reps: int, big_reps: int, nbytes: int, allreduce: bool) -> None:
    """One of two processes timing a tiny and an `nbytes` message one way (and, with
    `allreduce`, all-reduces), rank 0 writing the times to `out` as JSON.

    NCCL: half a ping-pong, medians. gloo: as a pipeline uses it, each process pinned to its
    own core as launch pins its workers, both sending to each other at once (torch's schedules
    post a send and a receive together), and the mean: on a small VM about one exchange in ten
    stalls ~4 ms whatever its size (measured on this repository's 2-core machine: 1 B 0.07 ms
    median, 0.51 ms mean), and a step of many transfers pays the mean, not the median."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    else:
        pin_to_core(rank)
    sync = _synchronizer(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    batch_schedule_gloo_io()  # as launch runs gloo
    peer = 1 - rank

    average = statistics.median if backend == "nccl" else statistics.mean

    def timed(step: Callable[[], None], reps: int) -> tuple[float, float]:
        """(the average, the median) of `reps` timed calls of `step`."""
        times = []
        for i in range(reps + 1):  # the first round warms up the connection
            dist.barrier()
            sync()
            t0 = time.perf_counter()
            step()
            sync()
            if i:
                times.append(time.perf_counter() - t0)
        return average(times), statistics.median(times)

    def one_way_s(tensor: torch.Tensor, reps: int) -> tuple[float, float]:
        """NCCL: half a ping-pong, rank 0 sends, rank 1 sends it back. gloo: an exchange, each
        process sending its tensor to the other while receiving the other's."""
        if backend != "nccl":
            received = torch.empty_like(tensor)

            def exchange() -> None:
                for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, tensor, peer),
                                                    dist.P2POp(dist.irecv, received, peer)]):
                    work.wait()
            return timed(exchange, reps)

        def step() -> None:
            if rank == 0:
                dist.send(tensor, peer)
                dist.recv(tensor, peer)
            else:
                dist.recv(tensor, peer)
                dist.send(tensor, peer)
        average_s, median_s = timed(step, reps)
        return average_s / 2, median_s / 2

    result: dict[str, float] = {}
    for key, numel, reps in (("latency", 1, small_reps), ("big", nbytes, big_reps)):
        tensor = torch.zeros(numel, dtype=torch.uint8, device=device)
        result[f"{key}_s"], result[f"{key}_median_s"] = one_way_s(tensor, reps)
    if allreduce:
        small = torch.zeros(1, device=device)
        big = torch.zeros(nbytes // 4, device=device)
        result["allreduce_small_s"] = timed(lambda: dist.all_reduce(small), small_reps)[0]
        result["allreduce_big_s"] = timed(lambda: dist.all_reduce(big), big_reps)[0]
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def _pingpong(backend: str, threads: int, small_reps: int, big_reps: int, nbytes: int,
              allreduce: bool) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "link.json")
        run_processes(_pingpong_worker, (backend, free_port(), threads, out, small_reps,
                                         big_reps, nbytes, allreduce), 2)
        found: dict[str, float] = json.loads(Path(out).read_text())
    return found


def measure_gloo_link(threads: int = 1, small_reps: int = GLOO_SMALL_REPS,
                      big_reps: int = GLOO_BIG_REPS,
                      nbytes: int = LINK_BYTES) -> LinkCalibration:
    """Point-to-point gloo link between two processes of this machine (TCP over loopback), as
    a pipeline uses it (`_pingpong_worker`): latency = the mean exchange of 1 B, bandwidth =
    `nbytes` / (its mean exchange - latency). Means of many: about one 1 B exchange in a
    hundred waits a 4 ms scheduler tick and one 64 MiB exchange in twenty runs 3-4x the others
    (measured on this repository's 2-core VM), so 500 and 20 exchanges moved the latency by
    40 us and the bandwidth by 15-30% between back-to-back calibrations."""
    found = _pingpong("gloo", threads, small_reps, big_reps, nbytes, allreduce=False)
    found["message_bytes"] = float(nbytes)
    link, taken = link_from_pingpong(found, nbytes)
    how = ("measured by partc calibrate: gloo between two local processes (TCP over loopback), "
           f"each pinned to a core, sending to each other at once, on {cpu_model()}; latency = "
           f"the mean exchange of 1 B, bandwidth = {nbytes >> 20} MiB / (its mean exchange - "
           "latency)" + (f"; taken from {taken}" if taken else ""))
    return LinkCalibration(link=link, measured=True, source=how, measurements=found)


def measure_nccl_link(small_reps: int = 200, big_reps: int = 20,
                      nbytes: int = LINK_BYTES) -> LinkCalibration:
    """The link between GPUs 0 and 1 over NCCL (two processes, run_processes): the
    LinkSpec is send/recv's (latency = half the median round trip of 1 B, bandwidth = `nbytes` /
    (half its round trip - latency)); a 2-GPU all-reduce of 4 B and of `nbytes` is recorded too,
    with the per-direction bandwidth the ring formula implies (`allreduce_ring_B_s`)."""
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        raise CalibrationError("measuring an NCCL link needs two visible CUDA GPUs",
                               "set CUDA_VISIBLE_DEVICES to two GPUs of one node")
    found = _pingpong("nccl", 1, small_reps, big_reps, nbytes, allreduce=True)
    found["message_bytes"] = float(nbytes)
    # Ring all-reduce over 2 devices: t = n / B + 2 L (ClusterSpec.allreduce_s).
    ar_latency = found["allreduce_small_s"] / 2
    found["allreduce_ring_B_s"] = nbytes / max(found["allreduce_big_s"] - 2 * ar_latency,
                                               found["allreduce_big_s"] / 2)
    link, taken = link_from_pingpong(found, nbytes)
    how = (f"measured by partc calibrate: NCCL send/recv between cuda:0 and cuda:1 "
           f"({torch.cuda.get_device_name(0)}); latency = half the median round trip of 1 B, "
           f"bandwidth = {nbytes >> 20} MiB / (half its median round trip - latency)"
           + (f"; taken from {taken}" if taken else ""))
    return LinkCalibration(link=link, measured=True, source=how, measurements=found)


def shipped_cuda_link(gpu_name: str, total_memory: int) -> LinkCalibration:
    """The intra-node link of the shipped cluster config whose GPU matches `gpu_name` (closest
    memory), else of the first shipped NCCL cluster: a stand-in where no link can be measured."""
    best: tuple[float, str, LinkSpec] | None = None
    fallback: tuple[str, LinkSpec] | None = None
    for cluster_name in list_clusters():
        try:
            cluster = load_cluster(cluster_name)
        except PartcError:
            continue
        if cluster.backend != "nccl":
            continue
        fallback = fallback or (cluster_name, cluster.intra_node)
        family = cluster.device.name.split("-")[0].upper()
        if family and family in gpu_name.upper().replace(" ", ""):
            gap = abs(cluster.device.memory_bytes - total_memory)
            if best is None or gap < best[0]:
                best = (gap, cluster_name, cluster.intra_node)
    if best is not None:
        name, link = best[1], best[2]
    elif fallback is not None:
        name, link = fallback
    else:
        name, link = "none", LinkSpec(bandwidth=25e9, latency_s=10e-6)
    return LinkCalibration(
        link=link, measured=False,
        source=(f"not measured (one GPU visible): the intra-node link of the shipped cluster "
                f"config '{name}'"), measurements={})


# --------------------------------------------------------------------------------------------
# YAML

def _q(value: float, unit: str) -> str:
    return format_quantity(value, unit, digits=4)


def _quantity_text(value: float, unit: str) -> str:
    """The YAML text of a spec quantity: with a unit prefix when that reads back exactly, else
    the plain number (repr reads back exactly)."""
    for digits in (4, 3, 6):
        text = format_quantity(value, unit, digits)
        if parse_quantity(text, unit) == value:
            return text
    return repr(float(value))


def _measurement_text(key: str, value: float) -> str:
    if key.endswith("B_s"):
        return _q(value, "B/s")
    if key.endswith("_s"):
        return _q(value, "s")
    return f"{value:.0f}" if float(value).is_integer() else f"{value:g}"


def _quote(text: str) -> str:
    return json.dumps(text)  # a JSON string is a valid YAML double-quoted scalar


def _matmul_comments(m: dict[str, float]) -> list[str]:
    lines = []
    for key, value in m.items():
        found = re.fullmatch(r"matmul_(.+)_flop_s", key)
        if found:
            lines.append(f"#   {found.group(1)}: {_q(value, 'FLOP/s')}")
    return lines


def _overhead_comments(m: dict[str, float]) -> tuple[list[str], list[str]]:
    forward = [
        "# Eager forward of torch.add on 1-element tensors that require grad (autograd records",
        f"# a node, as in training): {_q(m['op_overhead_s'], 's')} per operator "
        f"({_q(m['op_dispatch_no_grad_s'], 's')} without autograd).",
    ]
    backward = [
        f"# Backward through a chain of {m['backward_chain_ops']:.0f} 1-element multiplications "
        f"(torch.autograd.grad): {_q(m['backward_chain_s'], 's')},",
        f"# / {m['backward_chain_ops']:.0f} = {_q(m['backward_op_overhead_s'], 's')} per "
        "operator (engine node + kernel launch).",
    ]
    return forward, backward


def _device_lines(spec: DeviceSpec, comments: dict[str, list[str]]) -> list[str]:
    """The keys of `spec` as YAML, each preceded by its comment lines."""
    def block(key: str, *lines: str) -> list[str]:
        return [*comments.get(key, []), *lines]

    lines = [f"name: {spec.name}", f"kind: {spec.kind}",
             f"description: {_quote(spec.description)}", f"source: {_quote(spec.source)}"]
    if spec.calibrated_on:
        # the machine these numbers are of: compile warns when it prices another with them
        lines.append(f"calibrated_on: {_quote(spec.calibrated_on)}")
    lines += block("memory_bytes", f"memory_bytes: {spec.memory_bytes}")
    lines += block("peak_flops", "peak_flops:",
                   *(f"  {k}: {_quantity_text(v, 'FLOP/s')}" for k, v in spec.peak_flops.items()))
    if spec.allow_tf32 or "tf32" in spec.peak_flops:
        lines += block("allow_tf32", f"allow_tf32: {str(spec.allow_tf32).lower()}")
    lines += block("memory_bandwidth",
                   f"memory_bandwidth: {_quantity_text(spec.memory_bandwidth, 'B/s')}")
    lines += block("bandwidth_efficiency",
                   f"bandwidth_efficiency: {_quantity_text(spec.bandwidth_efficiency, '')}")
    lines += block("efficiency", "efficiency:",
                   *(f"  {c}: {_quantity_text(spec.efficiency[c], '')}" for c in OP_CLASSES))
    lines += block("op_overhead_s", f"op_overhead_s: {_quantity_text(spec.op_overhead_s, 's')}")
    if spec.backward_op_overhead_s is not None:
        lines += block("backward_op_overhead_s", "backward_op_overhead_s: "
                       f"{_quantity_text(spec.backward_op_overhead_s, 's')}")
    if spec.dispatch_overhead_s is not None:
        lines += block("dispatch_overhead_s", "dispatch_overhead_s: "
                       f"{_quantity_text(spec.dispatch_overhead_s, 's')}")
    if spec.microbatch_overhead_s:
        lines += block("microbatch_overhead_s", "microbatch_overhead_s: "
                       f"{_quantity_text(spec.microbatch_overhead_s, 's')}")
    if spec.p2p_post_cpu_s:
        lines += block("p2p_post_cpu_s",
                       f"p2p_post_cpu_s: {_quantity_text(spec.p2p_post_cpu_s, 's')}")
    if spec.cold_pass_s:
        lines += block("cold_pass_s", f"cold_pass_s: {_quantity_text(spec.cold_pass_s, 's')}")
    if spec.cache_bytes:
        lines += block("cache_bytes", f"cache_bytes: {spec.cache_bytes}",
                       f"cache_bandwidth: {_quantity_text(spec.cache_bandwidth, 'B/s')}")
    if spec.step_cold_s:
        lines += block("step_cold_s",
                       "# An AdamW step over a group within the cache, after a flush of the "
                       "last-level cache, over",
                       "# the same step warm (partc.run.overhead.measure_cold_step): a rank's "
                       "optimizer step starts cold.",
                       f"step_cold_s: {_quantity_text(spec.step_cold_s, 's')}")
    if spec.vector_bytes:
        # what its kernels block tensors by (the memory model's CPU convolution scratch)
        lines += block("vector_bytes", "# SIMD register width torch's CPU kernels use here",
                       f"vector_bytes: {spec.vector_bytes}")
    if spec.speed_spread:
        lines += block("speed_spread", "speed_spread:",
                       *(f"  {d}: [{', '.join(f'[{p:.6g}, {f:.6g}]' for p, f in modes)}]"
                         for d, modes in sorted(spec.speed_spread.items())))
    if spec.speed_reference_s:
        lines += block("speed_reference_s", "speed_reference_s:",
                       *(f"  {d}: {_quantity_text(t, 's')}"
                         for d, t in sorted(spec.speed_reference_s.items())))
    return lines


def device_yaml(cal: DeviceCalibration, command: str = "partc calibrate") -> str:
    """The device config of a calibration, every raw measurement as a comment beside the key it
    decided; `load_device` reads it back to a spec equal to `cal.spec`. `command` is named in the
    header as the way to rewrite the file."""
    spec, m = cal.spec, cal.measurements
    forward, backward = _overhead_comments(m)
    bandwidth_classes = [f"#   {c}: {_q(m[f'{c}_B_s'], 'B/s')}" for c in BANDWIDTH_CLASSES]
    streams = f"#   copy {_q(m['stream_copy_B_s'], 'B/s')}, add {_q(m['stream_add_B_s'], 'B/s')}"
    if isinstance(cal, CpuCalibration):
        header = [
            f"# Written by `{command}`; rerun it to recalibrate rather than editing by hand.",
            f"# One device = {cal.threads} core(s) of this machine running eager PyTorch; "
            "numbers are",
            "# medians of repeats (docs/hardware.md#the-cpu-device).",
        ]
        comments = {
            "memory_bytes": [f"# MemTotal {cal.ram_bytes / 2**30:.2f} GiB / {cal.physical_cores} "
                             f"cores * {cal.threads} thread(s) = "
                             f"{spec.memory_bytes / 2**30:.2f} GiB"],
            "peak_flops": [
                "# Best dense matrix operator per dtype. Matmuls (dtype_MxKxN, or dtype_N for "
                "squares):", *_matmul_comments(m),
                f"#   float32 conv2d 3x3 forward + backward: "
                f"{_q(m['conv2d_fwd_bwd_flop_s'], 'FLOP/s')}",
                f"#   float32 scaled_dot_product_attention forward + backward: "
                f"{_q(m['sdpa_fwd_bwd_flop_s'], 'FLOP/s')}"],
            "memory_bandwidth": ["# Best of a copy and an add over large float32 tensors, bytes "
                                 "read + written per second:", streams],
            "efficiency": [
                "# matmul: median of the float32 matmul shapes / peak; conv and attention: their "
                "rates", "# above / peak. The other classes count no FLOPs in the OpGraph "
                "(bandwidth-bound), so", "# theirs are the documented defaults."],
        }
    else:
        compute = compute_dtype(_matmul_dtypes(m))
        header = [
            f"# Written by `{command}`; rerun it to recalibrate rather than editing by hand.",
            f"# One device = one {cal.gpu_name} (cuda:{cal.device_index}) running eager "
            "PyTorch; numbers are medians",
            "# of synchronised repeats (docs/hardware.md#calibrating-a-machine).",
        ]
        comments = {
            "memory_bytes": ["# torch.cuda.get_device_properties().total_memory (the CUDA "
                             "context and NCCL buffers", "# are not subtracted: the planner's "
                             "memory margin covers them)"],
            "peak_flops": [
                "# Best GEMM per dtype (dtype_MxKxN; tf32 = float32 with TF32 matmuls allowed):",
                *_matmul_comments(m),
                f"#   {compute} conv2d 3x3 forward + backward: "
                f"{_q(m['conv2d_fwd_bwd_flop_s'], 'FLOP/s')}",
                f"#   {compute} scaled_dot_product_attention (causal) forward + backward: "
                f"{_q(m['sdpa_fwd_bwd_flop_s'], 'FLOP/s')}"],
            "allow_tf32": ["# Set true when training enables TF32 (float32 matmuls then run at "
                           "the tf32 peak)."],
            "memory_bandwidth": ["# Best of a copy and an add over large float32 tensors, bytes "
                                 "read + written per second:", streams],
            "efficiency": [
                f"# matmul: median of the {compute} GEMM shapes / the {compute} peak; conv and "
                "attention:", f"# their {compute} rates above / that peak. The other classes "
                "count no FLOPs in the OpGraph", "# (bandwidth-bound), so theirs are the "
                "documented defaults."],
        }
    comments["bandwidth_efficiency"] = [
        "# Median fraction of memory_bandwidth over one operator per bandwidth-bound class:",
        *bandwidth_classes]
    comments["op_overhead_s"] = forward
    comments["backward_op_overhead_s"] = backward
    comments["dispatch_overhead_s"] = [
        "# The same add without autograd: what each kernel of an optimizer step pays (no_grad)."]
    sweep = sorted((int(k.split("_")[2]), v) for k, v in m.items() if k.startswith("cache_add_"))
    if sweep:
        comments["cache_bytes"] = [
            "# An add over float32 tensors per working set (bytes read + written per second):",
            *(f"#   {ws / 2**20:g} MiB: {_q(rate, 'B/s')}" for ws, rate in sweep),
            "# The cache: the largest working set at 1.5x the DRAM add rate or more, and the "
            "median rate of",
            "# those: what an optimizer step's passes over one parameter's tensors run at."]
    if "pipeline_forward_overhead_s" in m:
        comments["microbatch_overhead_s"] = [
            "# The pipelining runtime's time per stage forward and backward beyond the stage's "
            "operators",
            "# (a two-stage pipeline of launch's own classes on two processes, partc.run.overhead):"
            f" forward {_q(m['pipeline_forward_overhead_s'], 's')},",
            f"# backward {_q(m['pipeline_backward_overhead_s'], 's')}; between the passes, the "
            "computing thread's CPU per",
            "# pass (schedule loop, step setup; the p2p posts and waits apart, below): "
            f"{_q(m.get('pipeline_between_passes_cpu_s', 0.0), 's')}.",
            "# The solver adds the mean of the first two plus the third to every stage's passes."]
    if "pipeline_p2p_post_cpu_s" in m:
        comments["p2p_post_cpu_s"] = [
            "# The computing thread's CPU in the same pipeline's p2p posts and waits, per transfer "
            "end (each",
            "# pass there receives or sends one tensor of "
            f"{int(m.get('pipeline_boundary_bytes', 0))} B: gloo's post and wait, not the "
            "bytes' copy,",
            "# which the link prices). The solver adds it to a stage's pass once per tensor the "
            "pass receives",
            "# from or sends to another stage (a middle stage's: two)."]
    if "cold_forward_s" in m:
        comments["cold_pass_s"] = [
            "# A stage pass from caches another process's work evicted, beyond the same pass warm "
            "(the",
            "# runtime's stage runner on the same small stage, the last-level cache flushed before "
            "each pass,",
            f"# partc.run.overhead): forward {_q(m['cold_forward_s'], 's')}, backward "
            f"{_q(m['cold_backward_s'], 's')}. The solver adds their mean to",
            "# both passes of every stage whose process shares its core with another."]
    spread = [d for d in spec.speed_spread if f"spread_{d}_windows" in m]
    if spread:
        mm = "x".join(str(x) for x in SPREAD_KERNEL)
        comments["speed_spread"] = [
            "# How the speed moves from step to step: one process pinned to each core, all "
            f"timing a {mm}",
            "# matmul in the same step-long windows; each window's median call, over the mean "
            "of all, cut into",
            "# equal groups: [probability, factor] (partc.hardware.speed_spread). The simulator "
            "prices a step",
            "# as the expectation over every core's own draw (partc.solve.stragglers).",
            *(f"#   {d}: {int(m[f'spread_{d}_windows'])} windows on "
              f"{int(m[f'spread_{d}_cores'])} core(s), fastest "
              f"{_q(m[f'spread_{d}_fastest_s'], 's')}, median {_q(m[f'spread_{d}_median_s'], 's')}"
              f", slowest {_q(m[f'spread_{d}_slowest_s'], 's')}" for d in spread)]
    if spec.speed_reference_s:
        comments["speed_reference_s"] = [
            "# The mean of those windows: one call's time at the speed the factors are of. A "
            "profile of this",
            "# machine times the same matmul beside its whole-model totals; one that read it "
            "more than 10% off",
            "# this is scaled by the excess, so a profile taken in a slow minute prices about "
            "the mean speed",
            "# (partc.cost.speed_correction)."]
    return "\n".join([*header, *_device_lines(spec, comments)]) + "\n"


def _device_count_problem(cores: int, threads: int, n: int) -> tuple[str, str] | None:
    """(message, hint) where a CPU node of `cores` cores calibrated at `threads` threads cannot
    be `n` devices: fewer than one per `threads` cores (launch would give each more threads than
    the device was timed at), or more at more than one thread each; None where it can."""
    own = max(1, cores // threads)
    if n < own:
        return (f"--devices {n} is fewer than this machine's {own} device(s) of {threads} "
                f"core(s)", f"give each device more cores with --threads {max(1, cores // n)}")
    if n > own and threads != 1:
        return (f"--devices {n} shares {cores} cores among more processes, which needs "
                f"--threads 1 (got {threads})", "calibrate with --threads 1")
    return None


def cluster_yaml(cal: DeviceCalibration, link: LinkCalibration, name: str | None = None,
                 command: str = "partc calibrate", wake: WakeCredit | None = None,
                 devices: int | None = None) -> str:
    """The cluster config of a calibration: one node of this machine's devices (`cores / threads`
    CPU devices over gloo, or every visible GPU over NCCL), its device named `cal.spec.name`
    (found in the `devices/` folder beside the cluster file's folder) and `link` as the
    intra-node link, its raw measurements as comments; `wake` the scheduler's wake credit.

    `devices` (CPU only, at least the default count): the node as that many gloo processes;
    more than it has cores (with one thread each) time-share them (`cores_per_node`: launch pins
    process i to core i % cores and the simulator shares each core, crediting a woken process
    `wake`), and each gets an equal share of the RAM (`device_memory_bytes`)."""
    name = name or cal.spec.name
    extra: list[str] = []
    shared = False
    if isinstance(cal, CpuCalibration):
        own = max(1, cal.physical_cores // cal.threads)
        devices = own if devices is None else devices
        problem = _device_count_problem(cal.physical_cores, cal.threads, devices)
        if problem is not None:  # check_devices refuses it before anything is measured
            raise ValueError(problem[0])
        backend = "gloo"
        shared = devices > own
        over = f" (oversubscribed on {cal.physical_cores} cores)" if shared else ""
        description = (f"This machine: {devices} device(s) of {cal.threads} core(s){over}, gloo "
                       "over loopback")
        if devices != own:
            extra += ["# RAM shared out among the devices (MemTotal / devices)",
                      f"device_memory_bytes: {cal.ram_bytes // devices}"]
        if shared or cal.threads > 1:
            # shared: launch pins process i to core i % cores, the simulator shares each core;
            # threads > 1: each process gets cores / devices threads (threads_per_device), as
            # launch gives it and the device was calibrated at
            extra += ["# The node's physical cores, which its processes share out",
                      f"cores_per_node: {cal.physical_cores}"]
    elif devices is not None:
        raise ValueError("devices is for CPU calibrations")
    else:
        devices, backend = cal.device_count, "nccl"
        description = f"This machine: {devices} x {cal.gpu_name}, NCCL"
    notes = [f"#   {k}: {_measurement_text(k, v)}" for k, v in link.measurements.items()]
    average = "means" if backend == "gloo" else "medians"  # as _pingpong_worker takes them
    how = [f"# Measured ({average} of repeats):", *notes] if link.measured else \
        [f"# NOT MEASURED ({link.source}).",
         "# Rerun where it can be measured (two GPUs visible; without --no-gloo on a CPU)."]
    return "\n".join([
        f"# Written by `{command}`: this machine as one node of {devices} {cal.spec.kind} "
        f"device(s) talking {backend}.",
        "# There is one node, so no inter_node link (docs/hardware.md#calibrating-a-machine).",
        f"name: {name}",
        f"description: {_quote(description)}",
        f"source: {_quote(link.source)}",
        f"device: {cal.spec.name}",
        f"devices_per_node: {devices}",
        *extra,
        "num_nodes: 1",
        f"backend: {backend}",
        *how,
        "intra_node:",
        f"  bandwidth: {_quantity_text(link.link.bandwidth, 'B/s')}",
        f"  latency_s: {_quantity_text(link.link.latency_s, 's')}",
        *([] if wake is None else _wake_lines(wake, shared)),
    ]) + "\n"


def _wake_lines(wake: WakeCredit, shared: bool) -> list[str]:
    m = wake.measurements()
    used = ("This node's processes share its cores, so the simulator uses it." if shared else
            "This node's cores are not shared, so only a cluster of more devices uses it "
            "(partc calibrate --devices N).")
    return [
        "# Where a cluster of this node runs more processes than it has cores: the CPU time a",
        "# process woken by a gloo receive runs ahead of a core-mate that kept computing before",
        "# they share the core (partc.hardware.wake_credit; median of "
        f"{len(wake.credits_s)} wakes, each computing {_q(m['wake_credit_compute_s'], 's')},",
        f"# {_q(m['wake_credit_min_s'], 's')}..{_q(m['wake_credit_max_s'], 's')}).",
        f"# {used}",
        f"wake_credit_s: {_quantity_text(_snap(wake.wake_credit_s, 's', 3), 's')}",
    ]


# --------------------------------------------------------------------------------------------
# The command

def _busy_cpu_s() -> float:
    """CPU seconds all processes of this machine have used since boot (from /proc/stat)."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    """CPU seconds of this process and of every process it started for a measurement: its
    reaped children, and the forkserver (and resource tracker) with the workers they forked and
    reaped, which are not this process's children and would otherwise count as other
    processes' use (an idle machine read 92-96% of a core)."""
    import resource

    from partc.hardware.forkserver import helper_pids

    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime
    tick = os.sysconf("SC_CLK_TCK")
    for pid in helper_pids():
        try:
            # after the command's parenthesised name: utime, stime, cutime, cstime are fields
            # 14-17 of /proc/PID/stat, the 12th-15th after it
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += sum(int(x) for x in fields[11:15]) / tick
        except (OSError, ValueError, IndexError):  # gone meanwhile: reaped into RUSAGE_CHILDREN
            continue
    return total


def _cpu_clock() -> tuple[float, float]:
    try:
        return _busy_cpu_s(), _own_cpu_s()
    except (OSError, ValueError, ImportError):
        return math.nan, math.nan


def check_name(name: str) -> str:
    """A config name (a file stem): letters, digits, '.', '_', '-'; else a CalibrationError."""
    if not _NAME.match(name) or name.endswith((".yaml", ".yml")):
        raise CalibrationError(f"bad --name {name!r}: it becomes a file name",
                               "use letters, digits, '.', '_' and '-', e.g. my-gpu")
    return name


def output_paths(out_dir: str | Path, name: str) -> tuple[Path, Path]:
    """(DIR/devices/NAME.yaml, DIR/clusters/NAME.yaml), their folders created; a
    CalibrationError when DIR cannot be written (checked before anything is measured)."""
    out = Path(out_dir)
    paths = out / "devices" / f"{name}.yaml", out / "clusters" / f"{name}.yaml"
    for path in paths:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CalibrationError(f"cannot write to {path.parent}: {exc.strerror or exc}",
                                   "pass -o a folder you can write to") from None
        if not os.access(path.parent, os.W_OK | os.X_OK):
            raise CalibrationError(f"cannot write to {path.parent}: permission denied",
                                   "pass -o a folder you can write to")
    return paths


def check_devices(kind: str, threads: int, devices: Sequence[int]) -> tuple[int, ...]:
    """`--devices` counts of a calibration, sorted and without the node's own count (its
    default cluster): each a CPU node as that many processes of `threads` cores, at least one
    per `threads` cores, and more than that (cores shared) only at one thread each; else a
    CalibrationError."""
    if not devices:
        return ()
    if kind != "cpu":
        raise CalibrationError(f"--devices is for --device cpu, not {kind}",
                               "a GPU cluster has one process per visible GPU")
    cores = physical_cores()
    for n in devices:
        problem = _device_count_problem(cores, threads, n)
        if problem is not None:
            raise CalibrationError(*problem)
    return tuple(sorted(set(devices) - {max(1, cores // threads)}))


def check_calibration_inputs(out_dir: str | Path, device: str = "cpu", *,
                             name: str | None = None, threads: int = 1,
                             seconds: float = 20.0,
                             devices: Sequence[int] = ()
                             ) -> tuple[str, str, Path, Path, tuple[int, ...]]:
    """(device kind, config name, device config path, cluster config path, the `--devices`
    counts that get a cluster of their own: `check_devices`) of a calibration, after refusing
    what would fail it later (a bad device, name, --threads, --seconds or --devices, a missing
    GPU, an unwritable `out_dir`: its folders are created here, `output_paths`), so nothing is
    measured for a run that cannot write its result."""
    kind = parse_calibration_device(device)
    if threads < 1:
        raise CalibrationError(f"--threads must be >= 1, got {threads}", "e.g. --threads 1")
    # a device of more cores than the machine has: its rates would be measured oversubscribed
    # and its memory (RAM * threads / cores) more than the RAM
    beyond = threads_beyond_cores(threads) if kind == "cpu" else None
    if beyond is not None:
        raise CalibrationError(*beyond)
    if not seconds > 0:
        raise CalibrationError(f"--seconds must be > 0, got {seconds}", "e.g. --seconds 20")
    more = check_devices(kind, threads, devices)
    if kind != "cpu":
        _cuda_device(kind)  # fail before writing anything
    if name is None:
        if kind == "cpu":
            name = "cpu"
        else:
            import torch
            name = gpu_slug(torch.cuda.get_device_name(torch.device(kind)))
    name = check_name(name)
    for n in more:
        check_name(f"{name}-{n}")
    return (kind, name, *output_paths(out_dir, name), more)


def calibrate(out_dir: str | Path, device: str = "cpu", *, name: str | None = None,
              threads: int = 1, seconds: float = 20.0, measure_link: bool = True,
              command: str | None = None,
              runtime: RuntimeCalibration | None = None,
              devices: Sequence[int] = ()) -> CalibrationResult:
    """Measure `device` (`cpu`, `cuda`, `cuda:N`) and write `out_dir/devices/NAME.yaml` and
    `out_dir/clusters/NAME.yaml` atomically; both are read back through the config loader.
    `devices` (CPU): for each count N other than the node's own, also
    `out_dir/clusters/NAME-N.yaml`, the node as N processes (`cluster_yaml`).

    NAME defaults to `cpu`, or the GPU's name made a file name (`nvidia-h100-80gb-hbm3`). On the
    CPU one device is `threads` cores and the link is gloo between two local processes; on a GPU
    the cluster is one node of every visible GPU, its link NCCL between GPUs 0 and 1 (with one GPU:
    the shipped configs' link for that GPU, marked not measured); on the CPU also the
    scheduler's wake credit (partc.hardware.wake_credit). `measure_link=False` skips the
    link and wake credit measurements (the CPU link is then a placeholder). `runtime` is the
    pipelining runtime's measured cost per stage pass (partc.run.overhead, a layer above this
    one), written as the device's `microbatch_overhead_s` and `cold_pass_s`. Raises
    CalibrationError (a PartcError) for a bad device or name, a
    missing GPU or an unwritable `out_dir`.
    """
    kind, name, device_path, cluster_path, more = check_calibration_inputs(
        out_dir, device, name=name, threads=threads, seconds=seconds, devices=devices)
    command = command or (f"partc calibrate --device {device} --threads {threads} "
                          f"--seconds {seconds:g} --name {name}"
                          + "".join(f" --devices {n}" for n in more) + f" -o {out_dir}")

    busy0, own0 = _cpu_clock()
    t0 = time.perf_counter()
    cal: DeviceCalibration
    link: LinkCalibration
    wake: WakeCredit | None = None
    wake_note = spread_note = ""
    quick = seconds < 5
    if kind == "cpu":
        cpu_cal = measure_cpu(threads, seconds)
        tool = command.split(" --")[0].removeprefix("python ")
        cal = replace(cpu_cal, spec=replace(cpu_cal.spec, name=name, source=(
            f"calibrated by {tool} on {cpu_cal.cpu_model}")))
        if measure_link:
            link = measure_gloo_link(threads, small_reps=50 if quick else GLOO_SMALL_REPS,
                                     big_reps=3 if quick else GLOO_BIG_REPS,
                                     nbytes=(8 << 20) if quick else LINK_BYTES)
            try:
                wake = measure_wake_credit()
            except WakeCreditError as exc:  # the rest of the calibration still holds
                wake_note = exc.one_line()
            try:
                spread = measure_speed_spread(
                    SPREAD_SHARE * seconds, window_s=QUICK_WINDOW_S if quick else WINDOW_S)
                cal = replace(cal, spec=replace(cal.spec, speed_spread=spread.modes,
                                                speed_reference_s=spread.reference_s()),
                              measurements={**cal.measurements, **spread.measurements()})
            except SpeedSpreadError as exc:  # priced without a spread, as before
                spread_note = exc.one_line()
        else:
            link = LinkCalibration(link=LinkSpec(bandwidth=1e9, latency_s=100e-6), measured=False,
                                   source="placeholder: the link was not measured")
    else:
        cal = measure_cuda(kind, seconds, name)
        if measure_link and cal.device_count >= 2:
            link = measure_nccl_link(small_reps=50 if quick else 200,
                                     big_reps=3 if quick else 20)
        else:
            link = shipped_cuda_link(cal.gpu_name, cal.spec.memory_bytes)
    if runtime is not None:
        cold, posts, step_cold = runtime.cold_pass_s, runtime.p2p_post_cpu_s, runtime.step_cold_s
        cal = replace(cal, spec=replace(
            cal.spec, microbatch_overhead_s=_snap(runtime.microbatch_overhead_s, "s", 3),
            cold_pass_s=cal.spec.cold_pass_s if cold is None else _snap(cold, "s", 3),
            p2p_post_cpu_s=cal.spec.p2p_post_cpu_s if posts is None else _snap(posts, "s", 3),
            step_cold_s=cal.spec.step_cold_s if step_cold is None else _snap(step_cold, "s", 3)),
            measurements={**cal.measurements, **runtime.measurements})
    wall = time.perf_counter() - t0
    busy1, own1 = _cpu_clock()
    others = max(0.0, (busy1 - busy0) - (own1 - own0)) / wall if wall > 0 else math.nan

    more_paths = [cluster_path.with_name(f"{name}-{n}.yaml") for n in more]
    texts = {device_path: device_yaml(cal, command),
             cluster_path: cluster_yaml(cal, link, name, command, wake),
             **{path: cluster_yaml(cal, link, f"{name}-{n}", command, wake, devices=n)
                for n, path in zip(more, more_paths, strict=True)}}
    clusters = write_loadable_configs(texts, device_path, [cluster_path, *more_paths])
    return CalibrationResult(device=cal, link=link, cluster=clusters[0], device_path=device_path,
                             cluster_path=cluster_path, wall_s=wall,
                             other_processes_cores=others, wake=wake, wake_note=wake_note,
                             spread_note=spread_note,
                             more_clusters=tuple(zip(clusters[1:], more_paths, strict=True)))


def write_loadable_configs(texts: dict[Path, str], device_path: Path,
                            cluster_paths: list[Path]) -> list[ClusterSpec]:
    """Write `texts` (path -> YAML) only once every file reads back through the loader, and
    return the clusters of `cluster_paths` as loaded. They are staged in a hidden folder of the
    output directory (its own devices/ and clusters/, so a cluster finds its device there, and
    the same filesystem, so each move is a rename); a measurement no config can hold (a loaded
    machine's link time) ends in a CalibrationError with the previous configs untouched."""
    out = device_path.parent.parent
    try:
        staging = Path(tempfile.mkdtemp(prefix=".partc-calibrate-", dir=out))
    except OSError as exc:
        raise CalibrationError(f"cannot write {out}: {exc.strerror or exc}",
                               "pass -o a folder you can write to") from None
    try:
        staged = {path: staging / path.parent.name / path.name for path in texts}
        try:
            for path, text in texts.items():
                staged[path].parent.mkdir(exist_ok=True)
                write_atomic(staged[path], text)
        except OSError as exc:
            raise CalibrationError(f"cannot write {out}: {exc.strerror or exc}",
                                   "pass -o a folder you can write to") from None
        try:
            load_device(staged[device_path])
            clusters = [load_cluster(staged[path]) for path in cluster_paths]
        except ConfigError as exc:
            raise CalibrationError(
                f"the calibration measured values no config can hold "
                f"({exc.message.replace(str(staging), str(out))}); "
                "nothing was written", "run it again on an idle machine; if it repeats, "
                "report it with the command") from None
        for path in texts:
            os.replace(staged[path], path)
        return clusters
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def format_calibration(result: CalibrationResult) -> str:
    """A short report of `calibrate`'s result, for the terminal."""
    spec, link = result.device.spec, result.link.link
    peaks = ", ".join(f"{k} {_q(v, 'FLOP/s')}" for k, v in spec.peak_flops.items())
    backward = spec.backward_overhead_s()
    lines = [
        f"device  {result.device_path}",
        f"  {spec.description}",
        f"  peak: {peaks}",
        f"  efficiency: matmul {spec.efficiency['matmul']}, conv {spec.efficiency['conv']}, "
        f"attention {spec.efficiency['attention']}",
        f"  memory: {spec.memory_bytes / 2**30:.2f} GiB, bandwidth "
        f"{_q(spec.memory_bandwidth, 'B/s')} x {spec.bandwidth_efficiency}",
        f"  per operator: forward {_q(spec.op_overhead_s, 's')}, backward {_q(backward, 's')}",
        f"  pipelining runtime per stage pass: {_q(spec.microbatch_overhead_s, 's')}"
        + ("" if spec.microbatch_overhead_s else " (not measured: needs two processes or GPUs)"),
        *([f"  p2p posts and waits: {_q(spec.p2p_post_cpu_s, 's')} per tensor a pass "
           "receives or sends"] if spec.p2p_post_cpu_s else []),
        *([f"  a stage pass from evicted caches: {_q(spec.cold_pass_s, 's')} more"]
          if spec.cold_pass_s else []),
        *([f"  an optimizer step from evicted caches: {_q(spec.step_cold_s, 's')} more"]
          if spec.step_cold_s else []),
        f"cluster {result.cluster_path}",
        f"  {result.cluster.num_devices} device(s), {result.cluster.backend}, intra_node "
        f"{_q(link.bandwidth, 'B/s')}, {_q(link.latency_s, 's')}"
        + ("" if result.link.measured else " (not measured)"),
        *([] if result.wake is None else [
            f"  a process woken by a gloo receive runs {_q(result.cluster.wake_credit_s, 's')} "
            "ahead of a busy core-mate (where processes share cores)"]),
        *([f"  wake credit not measured: {result.wake_note}"] if result.wake_note else []),
        *(f"  speed spread, {dtype}: " + ", ".join(f"{p:.0%} at {f:.3f}x" for p, f in modes)
          + " of the mean (per core and step-long window)"
          + (f"; the mean: {_q(spec.speed_reference_s[dtype], 's')} per "
             f"{'x'.join(map(str, SPREAD_KERNEL))} matmul"
             if dtype in spec.speed_reference_s else "")
          for dtype, modes in spec.speed_spread.items()),
        *([f"  speed spread not measured: {result.spread_note}"] if result.spread_note else []),
        *(f"cluster {path}\n  {c.num_devices} device(s) on {c.busy_cores_per_node} core(s), "
          f"{c.device.memory_bytes / 2**30:.2f} GiB each" for c, path in result.more_clusters),
        f"took {result.wall_s:.1f} s",
    ]
    if not math.isnan(result.other_processes_cores):
        lines.append(f"other processes' CPU use meanwhile: {result.other_processes_cores:.0%} "
                     "of a core")
    return "\n".join(lines)
