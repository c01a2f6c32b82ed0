"""Calibrate this machine's CPU as a partc device and cluster.

Writes configs/devices/cpu.yaml (partc.hardware.calibration.measure_cpu: matmul/conv/attention FLOP/s, memory
bandwidth, per-operator overhead, memory per device) and configs/clusters/cpu.yaml (one node of
`cores / threads` such devices; the intra-node link is measured here: gloo send/recv between two
local processes, 1 B ping-pong for latency and 64 MiB for bandwidth). Takes about 30 s. Other
processes lower every number (cores and memory bandwidth are shared): the script reports how
much CPU they used meanwhile and warns above 10% of a core; rerun on an idle machine then.

Usage: python bench/calibrate_cpu.py [--threads 1] [--seconds 20] [--out configs] [--no-gloo]
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from partc.hardware.calibration import CpuCalibration, measure_cpu
from partc.hardware.configs import load_cluster, load_device
from partc.hardware.specs import OP_CLASSES, LinkSpec
from partc.hardware.units import format_quantity

COMMAND = "python bench/calibrate_cpu.py"
BIG_BYTES = 64 << 20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gloo_worker(rank: int, port: int, threads: int, out: str, small_reps: int,
                 big_reps: int) -> None:
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    peer = 1 - rank

    def one_way_s(tensor: torch.Tensor, reps: int) -> float:
        """Median of half a ping-pong: rank 0 sends, rank 1 sends it back."""
        times = []
        for i in range(reps + 1):  # the first round trip warms up the connection
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(tensor, peer)
                dist.recv(tensor, peer)
            else:
                dist.recv(tensor, peer)
                dist.send(tensor, peer)
            if i:
                times.append((time.perf_counter() - t0) / 2)
        return statistics.median(times)

    latency = one_way_s(torch.zeros(1, dtype=torch.uint8), small_reps)
    big = one_way_s(torch.zeros(BIG_BYTES, dtype=torch.uint8), big_reps)
    if rank == 0:
        Path(out).write_text(json.dumps({"latency_s": latency, "big_s": big}))
    dist.destroy_process_group()


def measure_gloo_link(threads: int = 1, small_reps: int = 500, big_reps: int = 20) -> LinkSpec:
    """Point-to-point gloo link between two processes of this machine (TCP over loopback)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "gloo.json")
        mp.spawn(_gloo_worker, args=(_free_port(), threads, out, small_reps, big_reps),
                 nprocs=2, join=True)
        result = json.loads(Path(out).read_text())
    latency = result["latency_s"]
    bandwidth = BIG_BYTES / (result["big_s"] - latency)
    return LinkSpec(bandwidth=float(f"{bandwidth:.3g}"), latency_s=float(f"{latency:.3g}"))


def _q(value: float, unit: str) -> str:
    return format_quantity(value, unit, digits=4)


def _quote(text: str) -> str:
    return json.dumps(text)  # a JSON string is a valid YAML double-quoted scalar


def device_yaml(cal: CpuCalibration, seconds: float) -> str:
    spec, m = cal.spec, cal.measurements
    matmuls = [(k.removeprefix("matmul_").removesuffix("_flop_s"), v) for k, v in m.items()
               if k.startswith("matmul_")]
    lines = [
        f"# Written by `{COMMAND} --threads {cal.threads} --seconds {seconds:g}`; rerun it to",
        "# recalibrate rather than editing by hand. One device = "
        f"{cal.threads} core(s) of this machine running",
        "# eager PyTorch; numbers are medians of repeats (docs/hardware.md#the-cpu-device).",
        f"name: {spec.name}",
        f"kind: {spec.kind}",
        f"description: {_quote(spec.description)}",
        f"source: {_quote(spec.source)}",
        f"# MemTotal {cal.ram_bytes / 2**30:.2f} GiB / {cal.physical_cores} cores * "
        f"{cal.threads} thread(s) = {spec.memory_bytes / 2**30:.2f} GiB",
        f"memory_bytes: {spec.memory_bytes}",
        "# Best dense matrix operator per dtype. Matmuls (dtype_MxKxN, or dtype_N for squares):",
        *(f"#   {name}: {_q(v, 'FLOP/s')}" for name, v in matmuls),
        f"#   float32 conv2d 3x3 forward + backward: {_q(m['conv2d_fwd_bwd_flop_s'], 'FLOP/s')}",
        f"#   float32 scaled_dot_product_attention forward + backward: "
        f"{_q(m['sdpa_fwd_bwd_flop_s'], 'FLOP/s')}",
        "peak_flops:",
        *(f"  {k}: {_q(v, 'FLOP/s')}" for k, v in spec.peak_flops.items()),
        "# Best of a copy and an add over 128 MiB tensors, bytes read + written per second:",
        f"#   copy {_q(m['stream_copy_B_s'], 'B/s')}, add {_q(m['stream_add_B_s'], 'B/s')}",
        f"memory_bandwidth: {_q(spec.memory_bandwidth, 'B/s')}",
        "# Median fraction of memory_bandwidth over one operator per bandwidth-bound class:",
        *(f"#   {c}: {_q(m[f'{c}_B_s'], 'B/s')}" for c in
          ("elementwise", "norm", "reduction", "gather", "copy")),
        f"bandwidth_efficiency: {spec.bandwidth_efficiency}",
        "# matmul: median of the float32 matmul shapes / peak; conv and attention: their rates",
        "# above / peak. The other classes count no FLOPs in the OpGraph (bandwidth-bound), so",
        "# theirs are the documented defaults.",
        "efficiency:",
        *(f"  {c}: {spec.efficiency[c]}" for c in OP_CLASSES),
        "# Eager time of torch.add on 1-element tensors.",
        f"op_overhead_s: {_q(spec.op_overhead_s, 's')}",
    ]
    return "\n".join(lines) + "\n"


def cluster_yaml(cal: CpuCalibration, link: LinkSpec | None, how: str) -> str:
    devices = max(1, cal.physical_cores // cal.threads)
    bandwidth = _q(link.bandwidth, "B/s") if link else "1GB/s"
    latency = _q(link.latency_s, "s") if link else "100us"
    description = f"This machine: {devices} device(s) of {cal.threads} core(s), gloo over loopback"
    return "\n".join([
        f"# Written by `{COMMAND}`: this machine as one node of {devices} CPU device(s) talking",
        "# gloo. There is one node, so no inter_node link (docs/hardware.md#the-cpu-device).",
        "name: cpu",
        f"description: {_quote(description)}",
        f"source: {_quote(how)}",
        "device: cpu",
        f"devices_per_node: {devices}",
        "num_nodes: 1",
        "backend: gloo",
        "intra_node:",
        f"  bandwidth: {bandwidth}",
        f"  latency_s: {latency}",
    ]) + "\n"


def _busy_cpu_s() -> float:
    """CPU seconds all processes of this machine have used since boot (from /proc/stat)."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    import resource
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1, help="cores (threads) per device")
    parser.add_argument("--seconds", type=float, default=20.0,
                        help="time budget of the device measurements")
    parser.add_argument("--out", type=Path, default=ROOT / "configs",
                        help="configs folder to write devices/cpu.yaml and clusters/cpu.yaml into")
    parser.add_argument("--no-gloo", action="store_true",
                        help="skip the gloo measurement (the link is then a placeholder)")
    args = parser.parse_args(argv)

    busy0, own0 = _busy_cpu_s(), _own_cpu_s()
    t0 = time.perf_counter()
    cal = measure_cpu(args.threads, args.seconds)
    t1 = time.perf_counter()
    link = None if args.no_gloo else measure_gloo_link(args.threads)
    t2 = time.perf_counter()
    # CPU time other processes took meanwhile: they compete for cores and memory bandwidth.
    others = max(0.0, (_busy_cpu_s() - busy0) - (_own_cpu_s() - own0)) / (t2 - t0)
    if others > 0.1:
        print(f"warning: other processes used {others:.0%} of a core during the calibration; "
              "its numbers are low, rerun on an idle machine", file=sys.stderr)
    how = ("measured by bench/calibrate_cpu.py: gloo send/recv between two local processes "
           f"(TCP over loopback) on {cal.cpu_model}; latency = half the median round trip of "
           "1 B, bandwidth = 64 MiB / (half its median round trip - latency)") if link else \
        "placeholder: bench/calibrate_cpu.py ran with --no-gloo"

    device_path = args.out / "devices" / "cpu.yaml"
    cluster_path = args.out / "clusters" / "cpu.yaml"
    device_path.parent.mkdir(parents=True, exist_ok=True)
    cluster_path.parent.mkdir(parents=True, exist_ok=True)
    device_path.write_text(device_yaml(cal, args.seconds))
    cluster_path.write_text(cluster_yaml(cal, link, how))
    # Read both back through the loader: what was written must be a valid config.
    spec = load_device(device_path)
    cluster = load_cluster(cluster_path)

    print(f"device  {device_path}  ({t1 - t0:.1f} s)")
    for key, value in spec.to_dict().items():
        print(f"  {key}: {value}")
    print(f"cluster {cluster_path}  ({t2 - t1:.1f} s)")
    print(f"  devices: {cluster.num_devices}, intra_node: "
          f"{_q(cluster.intra_node.bandwidth, 'B/s')}, {_q(cluster.intra_node.latency_s, 's')}")
    print(f"other processes' CPU use meanwhile: {others:.0%} of a core")
    return 0


if __name__ == "__main__":
    sys.exit(main())
