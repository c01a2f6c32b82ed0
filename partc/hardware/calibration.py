"""Calibration: measure this machine's CPU so that `configs/devices/cpu.yaml` describes it, which
makes the analytic cost model testable against real timings here (bench/calibrate_cpu.py writes
the file)."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from partc.hardware.local import cpu_model, physical_cores, ram_bytes
from partc.hardware.specs import DeviceSpec


@dataclass(frozen=True)
class CpuCalibration:
    """What `measure_cpu` found: the DeviceSpec and the raw measurements behind each number."""

    spec: DeviceSpec
    cpu_model: str
    physical_cores: int
    ram_bytes: int
    threads: int
    measurements: dict[str, float] = field(default_factory=dict)  # name -> value, base units


def _median_time(fn: Callable[[], Any], budget_s: float, min_reps: int = 3,
                 max_reps: int = 200) -> float:
    """Median wall time of fn() after one warm-up call, repeated until the budget is spent."""
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < max_reps and (len(times) < min_reps
                                     or time.perf_counter() - start < budget_s):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _counted_flops(fn: Callable[[], Any]) -> int:
    """FLOPs of fn() as partc's OpGraph counts them (torch's flop counter + partc's formulas)."""
    from partc.frontend.flop_count import flop_counter_mode
    with flop_counter_mode() as counter:
        fn()
    return int(counter.get_total_flops())


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

        # -- per-operator overhead: eager dispatch of an op whose work is nothing.
        one = torch.ones(1)
        loops = 200 if quick else 2000

        def tiny_ops() -> None:
            for _ in range(loops):
                torch.add(one, one)

        overhead = _median_time(tiny_ops, 0.5 * unit) / loops
        found["op_overhead_s"] = overhead

        # -- memory bandwidth: streams over tensors far larger than the caches, counting bytes
        # read + written. The fastest is the peak; one typical operator per bandwidth-bound class
        # sets bandwidth_efficiency (the median of their fractions of the peak). Outputs are
        # preallocated (out=): a fresh tensor over glibc's mmap threshold (32 MiB) is page-faulted
        # in on every call, which would measure the allocator rather than the operator.
        numel = (4 << 20) if quick else (32 << 20)  # 16 MiB / 128 MiB of float32 per tensor
        src = torch.randn(numel)
        dst = torch.empty(numel)
        other = torch.randn(numel)
        nbytes = numel * 4

        def stream(fn: Callable[[], Any], moved: int, budget: float) -> float:
            return moved / max(_median_time(fn, budget) - overhead, 1e-9)

        copy_bw = stream(lambda: dst.copy_(src), 2 * nbytes, 1.0 * unit)
        add_bw = stream(lambda: torch.add(src, other, out=dst), 3 * nbytes, 1.0 * unit)
        found["stream_copy_B_s"] = copy_bw
        found["stream_add_B_s"] = add_bw
        peak_bw = max(copy_bw, add_bw)

        hidden = 1024
        rows = numel // hidden
        x2, y2 = src.view(rows, hidden), dst.view(rows, hidden)
        ln_w, ln_b = torch.ones(hidden), torch.zeros(hidden)
        ln_stats = torch.empty(rows, 1), torch.empty(rows, 1)
        row_sums = torch.empty(rows)
        index = torch.randint(0, rows, (rows,))
        square, transposed = src.view(-1, 4096), dst.view(4096, -1)
        aten = torch.ops.aten
        class_bw = {
            "elementwise": stream(lambda: torch.mul(src, other, out=dst), 3 * nbytes, 0.6 * unit),
            "norm": stream(lambda: aten.native_layer_norm.out(
                x2, [hidden], ln_w, ln_b, 1e-5, out0=y2, out1=ln_stats[0], out2=ln_stats[1]),
                2 * nbytes, 0.6 * unit),
            "reduction": stream(lambda: torch.sum(x2, dim=1, out=row_sums), nbytes + rows * 4,
                                0.6 * unit),
            "gather": stream(lambda: torch.index_select(x2, 0, index, out=y2),
                             2 * nbytes + rows * 8, 0.6 * unit),
            "copy": stream(lambda: transposed.copy_(square.t()), 2 * nbytes, 0.6 * unit),
        }
        for name, bw in class_bw.items():
            found[f"{name}_B_s"] = bw
        bandwidth_eff = min(1.0, statistics.median(bw / peak_bw for bw in class_bw.values()))
    finally:
        torch.set_num_threads(previous_threads)

    cores = physical_cores()
    ram = ram_bytes()
    devices = max(1, cores // threads)
    model = cpu_model()
    # Bandwidth-bound classes count no FLOPs in the OpGraph (torch's flop counter prices only
    # matrix ops), so their FLOP efficiency cannot be measured; 0.5 is the documented default.
    efficiency = {
        "matmul": round(min(1.0, matmul_eff), 3),
        "conv": round(min(1.0, conv_rate / peak32), 3),
        "attention": round(min(1.0, attn_rate / peak32), 3),
        "norm": 0.5, "elementwise": 0.5, "reduction": 0.5, "gather": 0.5, "copy": 0.5,
        "other": 0.3,
    }
    spec = DeviceSpec(
        name="cpu",
        kind="cpu",
        memory_bytes=ram // devices,
        peak_flops={k: float(f"{peaks[k]:.4g}") for k in sorted(peaks)},
        memory_bandwidth=float(f"{peak_bw:.4g}"),
        efficiency=efficiency,
        bandwidth_efficiency=round(bandwidth_eff, 3),
        op_overhead_s=float(f"{overhead:.3g}"),
        description=(f"This machine's CPU ({model}, {cores} physical cores, "
                     f"{ram / 2**30:.1f} GiB RAM) as {devices} device(s) of {threads} core(s) "
                     f"each, eager PyTorch with {threads} thread(s) per device"),
        source=f"calibrated by bench/calibrate_cpu.py on {model}",
    )
    return CpuCalibration(spec=spec, cpu_model=model, physical_cores=cores, ram_bytes=ram,
                          threads=threads, measurements=found)


def calibrate_cpu(threads: int = 1, seconds: float = 20.0) -> DeviceSpec:
    """A DeviceSpec of this machine's CPU, measured: one device = `threads` cores.

    Peak FLOP/s per dtype is the best dense matrix operator measured (float32, bfloat16, float16,
    float64; a dtype 20x slower than float32 is only probed at one small size). Matmul, conv and
    attention efficiencies are their achieved fractions of the float32 peak (conv and attention
    forward + backward). Memory bandwidth is the best large-tensor stream (bytes read + written
    per second), bandwidth_efficiency the median fraction of it that norm, elementwise,
    reduction, gather and copy operators reach. The per-operator overhead is the eager time of a
    1-element add; memory is RAM * threads / cores.
    Takes about `seconds` (plus warm-up); `seconds` < 5 uses small sizes (a smoke test).
    """
    return measure_cpu(threads, seconds).spec
