"""`partc calibrate` and partc.hardware.calibration: the files it writes load and compile, the
YAML round-trips, the device-independent parts of the CUDA path run on the CPU, errors are one
line."""
from __future__ import annotations

import re
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import yaml
from partc_process import run_partc

from partc.errors import PartcError
from partc.hardware.calibration import (
    CalibrationError,
    CpuCalibration,
    CudaCalibration,
    LinkCalibration,
    _own_cpu_s,
    check_devices,
    check_name,
    cluster_yaml,
    cuda_device_spec,
    cuda_dtypes,
    device_yaml,
    gpu_slug,
    link_from_pingpong,
    measure_accelerator,
    measure_nccl_link,
    measure_op_overheads,
    output_paths,
    parse_calibration_device,
    shipped_cuda_link,
    write_loadable_configs,
)
from partc.hardware.configs import device_from_dict, load_cluster, load_device
from partc.hardware.local import cpu_model, cpu_vector_bytes, physical_cores
from partc.hardware.specs import DeviceSpec, LinkSpec, speed_modes_problem
from partc.hardware.speed_spread import SpeedSpread, measure_speed_spread, modes_of
from partc.hardware.units import parse_quantity
from partc.hardware.wake_credit import WakeCredit

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return run_partc(*args, timeout=timeout)


# -- synthetic calibrations (no measuring) -------------------------------------------------------

OVERHEADS = {"op_overhead_s": 1.234567e-6, "op_dispatch_no_grad_s": 0.9e-6,
             "backward_op_overhead_s": 3.3e-6, "backward_chain_s": 3.3e-3,
             "backward_chain_ops": 1000.0}
BANDWIDTHS = {"stream_copy_B_s": 21.3e9, "stream_add_B_s": 27.59e9, "elementwise_B_s": 26.6e9,
              "norm_B_s": 3.1e9, "reduction_B_s": 23.4e9, "gather_B_s": 16.7e9,
              "copy_B_s": 6.5e9}


def gpu_measurements() -> dict[str, float]:
    return {
        "matmul_float32_4096x4096x4096_flop_s": 51.23456e12,
        "matmul_float32_8192x1024x4096_flop_s": 49.1e12,
        "matmul_tf32_4096x4096x4096_flop_s": 371.1e12,
        "matmul_bfloat16_4096x4096x4096_flop_s": 702.3e12,
        "matmul_bfloat16_8192x1024x4096_flop_s": 655.5e12,
        "matmul_bfloat16_1024x8192x4096_flop_s": 601.9e12,
        "matmul_float16_4096x4096x4096_flop_s": 710.0e12,
        "matmul_float64_4096x4096x4096_flop_s": 51.0e12,
        "conv2d_fwd_bwd_flop_s": 300.7e12,
        "sdpa_fwd_bwd_flop_s": 350.1e12,
        **OVERHEADS,
        "stream_copy_B_s": 2.71e12, "stream_add_B_s": 2.93e12, "elementwise_B_s": 2.9e12,
        "norm_B_s": 2.2e12, "reduction_B_s": 2.6e12, "gather_B_s": 1.8e12, "copy_B_s": 1.4e12,
    }


def gpu_calibration(count: int = 1) -> CudaCalibration:
    found = gpu_measurements()
    spec = cuda_device_spec(found, name="my-h100", total_memory=85_045_870_592,
                            description="NVIDIA H100 80GB HBM3 (test)", source="synthetic")
    return CudaCalibration(spec=spec, gpu_name="NVIDIA H100 80GB HBM3", device_index=0,
                           device_count=count, capability=(9, 0), measurements=found)


def cpu_calibration() -> CpuCalibration:
    found = {"matmul_float32_512x512x512_flop_s": 103.81234e9,
             "matmul_bfloat16_512_flop_s": 222.7e9, "conv2d_fwd_bwd_flop_s": 100.8e9,
             "sdpa_fwd_bwd_flop_s": 75.9e9, **OVERHEADS, **BANDWIDTHS}
    shipped = load_device("cpu")
    spread = SpeedSpread(modes={"float32": modes_of([1.0, 1.1, 1.2, 2.0, 0.9, 1.0])},
                         window_s=0.25, times_s={"float32": ((1e-3, 1.1e-3, 1.2e-3),
                                                             (2e-3, 0.9e-3, 1e-3))})
    spec = replace(shipped, name="box", op_overhead_s=1.23e-6, backward_op_overhead_s=3.3e-6,
                   description='A "quoted" description: with colons', source="synthetic",
                   speed_spread=spread.modes, speed_reference_s=spread.reference_s())
    return CpuCalibration(spec=spec, cpu_model="Test CPU", physical_cores=4, ram_bytes=32 << 30,
                          threads=2, measurements={**found, **spread.measurements()})


# -- YAML ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("make", [cpu_calibration, gpu_calibration])
def test_device_yaml_round_trips_to_an_equal_spec(make) -> None:  # type: ignore[no-untyped-def]
    cal = make()
    text = device_yaml(cal, "partc calibrate -o here")
    assert text.startswith("# Written by `partc calibrate -o here`")
    loaded = device_from_dict(yaml.safe_load(text), "rendered")
    assert loaded == cal.spec
    # The raw numbers are in the comments, the overheads included.
    assert "1.235us per operator" in text and "Backward through a chain of 1000" in text
    # Measured values are snapped to their unit text; others are written as plain numbers.
    pretty = "backward_op_overhead_s: 3.3us\n" in text
    assert pretty or "backward_op_overhead_s: 3.3e-06\n" in text
    assert pretty == isinstance(cal, CudaCalibration)
    if isinstance(cal, CpuCalibration):  # the speed spread and the windows it came from
        assert "#   float32: 6 windows on 2 core(s), fastest 900us, median 1.05ms, slowest 2ms" \
            in text and loaded.speed_spread == cal.spec.speed_spread


def test_speed_modes_are_equal_groups_of_the_windows_over_their_mean() -> None:
    """partc.hardware.speed_spread.modes_of: sorted factors of the mean, cut into equal groups,
    each its share and mean factor; the weighted factor is 1 (the profile's time is the mean)."""
    modes = modes_of([1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 2.0, 2.0])  # a slow mode a quarter of the time
    assert modes == ((0.75, 0.8), (0.25, 1.6))  # equal factors merged
    assert speed_modes_problem(modes) is None
    spread = modes_of([float(t) for t in range(1, 101)])
    assert [p for p, _ in spread] == [0.25] * 4 and speed_modes_problem(spread) is None
    assert spread[0][1] < spread[-1][1]
    assert modes_of([3.0]) == ((1.0, 1.0),)
    with pytest.raises(ValueError, match="positive and finite"):
        modes_of([1.0, 0.0])


def test_cache_terms_are_the_plateau_above_the_memory_rate() -> None:
    """The cache: the working sets that stream at 1.5x the DRAM rate or more, up to the first
    that does not (measured on an Intel Xeon VM: 27 GB/s to 96 MiB, 14 GB/s from 192 MiB); none
    such, no term. The device file shows the sweep beside the keys and reads back equal."""
    from partc.hardware.calibration import _cache_terms

    mib = 1 << 20
    sweep = {3 * mib: 30.4e9, 6 * mib: 27.4e9, 12 * mib: 26.9e9, 48 * mib: 26.7e9,
             96 * mib: 24.5e9, 192 * mib: 14.2e9, 384 * mib: 13.9e9}
    found = {f"cache_add_{ws}_B_s": rate for ws, rate in sweep.items()}
    assert _cache_terms(found, 13.9e9) == (96 * mib, pytest.approx(26.9e9))
    assert _cache_terms(found, 25e9) == (0, 0.0)
    assert _cache_terms({}, 13.9e9) == (0, 0.0)
    cal = cpu_calibration()
    cal = replace(cal, spec=replace(cal.spec, cache_bytes=96 * mib, cache_bandwidth=26.9e9),
                  measurements={**cal.measurements, **found})
    text = device_yaml(cal)
    assert "#   96 MiB: 24.5GB/s" in text and "cache_bytes: 100663296\n" in text
    assert device_from_dict(yaml.safe_load(text), "rendered") == cal.spec
    with pytest.raises(ValueError, match="go together"):
        replace(cal.spec, cache_bandwidth=0.0)


def test_cuda_device_spec_from_measurements() -> None:
    spec = gpu_calibration().spec
    assert spec.kind == "cuda" and spec.memory_bytes == 85_045_870_592
    assert set(spec.peak_flops) == {"float32", "tf32", "bfloat16", "float16", "float64"}
    assert spec.peak_flops["bfloat16"] == pytest.approx(702.3e12)
    assert spec.peak_flops["float32"] == pytest.approx(51.23e12)  # 4 significant digits
    assert spec.efficiency["matmul"] == pytest.approx(655.5 / 702.3, abs=1e-3)
    assert spec.efficiency["attention"] == pytest.approx(350.1 / 702.3, abs=1e-3)
    assert spec.memory_bandwidth == pytest.approx(2.93e12)
    assert spec.op_overhead_s == pytest.approx(1.23e-6) and not spec.allow_tf32
    assert spec.backward_op_overhead_s == pytest.approx(3.3e-6)
    # an optimizer step's kernels pay the dispatch without autograd
    assert spec.dispatch_overhead_s == pytest.approx(0.9e-6)
    assert spec.no_grad_overhead_s() == spec.dispatch_overhead_s
    assert replace(spec, dispatch_overhead_s=None).no_grad_overhead_s() == spec.op_overhead_s
    assert spec.microbatch_overhead_s == 0.0  # left to the runtime's own calibration
    # Without bf16 (pre-Ampere) the compute dtype is float16.
    found = {k: v for k, v in gpu_measurements().items() if "bfloat16" not in k and "tf32" not in k}
    v100 = cuda_device_spec(found, name="v", total_memory=1 << 30)
    assert v100.efficiency["attention"] == pytest.approx(350.1 / 710.0, abs=1e-3)


def write_pair(root: Path, cal: CpuCalibration | CudaCalibration, link: LinkCalibration) -> Path:
    devices, clusters = output_paths(root, cal.spec.name)
    devices.write_text(device_yaml(cal))
    clusters.write_text(cluster_yaml(cal, link))
    return clusters


def test_cluster_yaml_loads_with_its_sibling_device(tmp_path: Path) -> None:
    cal = gpu_calibration(count=8)
    link = LinkCalibration(LinkSpec(bandwidth=370.5e9, latency_s=12.5e-6), measured=True,
                           source="measured", measurements={"latency_s": 12.5e-6,
                                                            "allreduce_ring_B_s": 300e9,
                                                            "message_bytes": 64 << 20})
    cluster = load_cluster(write_pair(tmp_path, cal, link))
    assert cluster.device == cal.spec and cluster.name == "my-h100"
    assert cluster.num_devices == 8 and cluster.backend == "nccl"
    assert cluster.intra_node == link.link
    text = (tmp_path / "clusters" / "my-h100.yaml").read_text()
    assert "allreduce_ring_B_s: 300GB/s" in text and "message_bytes: 67108864" in text

    one = gpu_calibration(count=1)
    stand_in = shipped_cuda_link(one.gpu_name, one.spec.memory_bytes)
    assert not stand_in.measured and "h100" in stand_in.source
    assert stand_in.link == load_cluster("4x8xh100-80gb").intra_node
    text = write_pair(tmp_path / "one", one, stand_in).read_text()
    assert "NOT MEASURED" in text
    assert load_cluster(tmp_path / "one" / "clusters" / "my-h100.yaml").num_devices == 1


def test_a_link_is_taken_from_times_that_separate_latency_from_bytes() -> None:
    """The means where the 1 B exchange takes at most half the big one; the medians where a
    loaded machine's stalls lifted the 1 B mean to the big one's (a CI run's means gave 8 MiB
    / 1e-12 s = 8.39 EB/s, a config no loader reads); the big median as all bytes where even
    the medians do not separate. Each is a link a cluster config holds."""
    mib8 = 8 << 20
    means = {"latency_s": 80e-6, "big_s": 3.28e-3, "latency_median_s": 60e-6,
             "big_median_s": 3.0e-3}
    link, taken = link_from_pingpong(means, mib8)
    assert taken == "" and link.latency_s == pytest.approx(80e-6)
    assert link.bandwidth == pytest.approx(mib8 / 3.2e-3, rel=5e-3)

    stalled = {**means, "latency_s": 3.4e-3}
    link, taken = link_from_pingpong(stalled, mib8)
    assert taken.startswith("medians") and link.latency_s == pytest.approx(60e-6)
    assert link.bandwidth == pytest.approx(mib8 / 2.94e-3, rel=5e-3)

    both = {**stalled, "latency_median_s": 2.9e-3}
    link, taken = link_from_pingpong(both, mib8)
    assert "all bytes" in taken and link.latency_s == pytest.approx(2.9e-3)
    assert link.bandwidth == pytest.approx(mib8 / 3.0e-3, rel=5e-3)
    # A worker of an older partc recorded no medians: its means, or the big mean as all bytes.
    link, taken = link_from_pingpong({"latency_s": 3.4e-3, "big_s": 3.28e-3}, mib8)
    assert "all bytes" in taken and link.bandwidth == pytest.approx(mib8 / 3.28e-3, rel=5e-3)
    assert link.latency_s <= 3.28e-3


def test_configs_the_loader_refuses_are_not_written(tmp_path: Path) -> None:
    """calibrate writes its configs only once each reads back: a measured value outside what
    a config holds ends in one CalibrationError naming the key, the previous configs stay as
    they were and no staging folder is left behind."""
    cal = gpu_calibration(count=8)
    device_path, cluster_path = output_paths(tmp_path, cal.spec.name)
    good = LinkCalibration(LinkSpec(bandwidth=370e9, latency_s=12e-6), measured=True,
                           source="measured")
    texts = {device_path: device_yaml(cal), cluster_path: cluster_yaml(cal, good)}
    (cluster,) = write_loadable_configs(texts, device_path, [cluster_path])
    assert cluster.intra_node == good.link and load_cluster(cluster_path) == cluster
    before = {p: p.read_bytes() for p in (device_path, cluster_path)}

    bad = replace(good, link=LinkSpec(bandwidth=8.39e18, latency_s=3e-3))
    texts = {device_path: device_yaml(replace(cal, spec=replace(cal.spec, description="new"))),
             cluster_path: cluster_yaml(cal, bad)}
    with pytest.raises(CalibrationError, match="intra_node.bandwidth") as err:
        write_loadable_configs(texts, device_path, [cluster_path])
    assert "nothing was written" in err.value.message and err.value.hint
    assert ".partc-calibrate" not in err.value.message
    assert {p: p.read_bytes() for p in (device_path, cluster_path)} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["clusters", "devices"]


def test_a_cpu_node_as_more_devices_shares_its_cores_and_ram(tmp_path: Path) -> None:
    """`--devices N`: the node as N gloo processes; past one per core they share the cores
    (cores_per_node, which launch pins by and the simulator shares), and the RAM N ways."""
    cal = replace(cpu_calibration(), threads=1)  # 4 cores: 4 devices of its own
    link = LinkCalibration(LinkSpec(bandwidth=2e9, latency_s=90e-6), measured=True,
                           source="measured", measurements={"latency_s": 90e-6})
    wake = WakeCredit(wake_credit_s=4.8e-3, compute_s=0.2, credits_s=(4.7e-3, 4.9e-3))
    devices, clusters = output_paths(tmp_path, cal.spec.name)
    devices.write_text(device_yaml(cal))
    clusters.write_text(cluster_yaml(cal, link, wake=wake))
    own = load_cluster(clusters)
    assert own.num_devices == 4 and own.cores_per_node is None and own.devices_per_core == 1
    assert own.device.memory_bytes == cal.spec.memory_bytes
    assert "only a cluster of more devices uses it" in clusters.read_text()

    shared = clusters.with_name("box-8.yaml")
    shared.write_text(cluster_yaml(cal, link, "box-8", wake=wake, devices=8))
    eight = load_cluster(shared)
    assert eight.name == "box-8" and eight.num_devices == 8 and eight.cores_per_node == 4
    assert eight.devices_per_core == 2 and eight.core_of(5) == (0, 1)
    assert eight.device.memory_bytes == (32 << 30) // 8  # RAM shared 8 ways
    assert eight.wake_credit_s == pytest.approx(4.8e-3) and eight.intra_node == link.link
    assert eight.device.name == own.device.name  # the same calibrated device
    text = shared.read_text()
    assert "oversubscribed on 4 cores" in text and "share its cores, so the simulator" in text
    # the node's own count is its default cluster; fewer, or sharing at 2 threads, is refused
    assert cluster_yaml(cal, link, wake=wake, devices=4) == clusters.read_text()
    with pytest.raises(ValueError):
        cluster_yaml(cal, link, devices=3)
    with pytest.raises(ValueError):
        cluster_yaml(replace(cal, threads=2), link, devices=4)  # 2 devices of 2 cores each
    with pytest.raises(ValueError, match="CPU"):
        cluster_yaml(gpu_calibration(count=2), link, devices=4)


def test_a_cpu_calibration_at_more_threads_gives_each_device_its_cores(tmp_path: Path) -> None:
    """A device of 2 cores: the cluster says so (cores_per_node), so the memory model's
    per-thread terms use the 2 threads launch gives each process and the device was timed at."""
    cal = cpu_calibration()  # 4 cores, 2 threads a device
    link = LinkCalibration(LinkSpec(bandwidth=2e9, latency_s=90e-6), measured=True,
                           source="measured", measurements={"latency_s": 90e-6})
    devices, clusters = output_paths(tmp_path, cal.spec.name)
    devices.write_text(device_yaml(cal))
    clusters.write_text(cluster_yaml(cal, link))
    cluster = load_cluster(clusters)
    assert cluster.num_devices == 2 and cluster.cores_per_node == 4
    assert cluster.threads_per_device == 2 and cluster.devices_per_core == 1
    assert {cluster.core_of(0), cluster.core_of(1)} == {(0, 0), (0, 1)}  # no core shared
    assert cluster.device.memory_bytes == cal.spec.memory_bytes


def test_devices_counts_are_checked_before_measuring() -> None:
    cores = physical_cores()
    assert check_devices("cpu", 1, ()) == ()
    assert check_devices("cpu", 1, (cores + 2, cores, cores + 2)) == (cores + 2,)
    with pytest.raises(CalibrationError, match="needs --threads 1"):
        check_devices("cpu", 2, (cores + 1,))
    with pytest.raises(CalibrationError, match="is for --device cpu"):
        check_devices("cuda:0", 1, (4,))
    if cores > 1:
        with pytest.raises(CalibrationError, match="fewer than this machine"):
            check_devices("cpu", 1, (cores - 1,))


def test_cluster_device_name_resolves_beside_the_cluster_first(tmp_path: Path) -> None:
    """A cluster file outside configs/ names a device: DIR/devices/<name>.yaml wins over the
    shipped one of that name; a name only shipped still resolves."""
    shipped = load_device("cpu")
    (tmp_path / "devices").mkdir()
    (tmp_path / "clusters").mkdir()
    mine = replace(shipped, memory_bytes=shipped.memory_bytes // 2, source="mine")
    (tmp_path / "devices" / "cpu.yaml").write_text(yaml.safe_dump(mine.to_dict()))
    link = {"bandwidth": "1GB/s", "latency_s": "100us"}
    for name, device in (("local", "cpu"), ("shipped", "a100-80gb")):
        backend = "gloo" if device == "cpu" else "nccl"
        (tmp_path / "clusters" / f"{name}.yaml").write_text(yaml.safe_dump(
            {"device": device, "devices_per_node": 2, "num_nodes": 1, "backend": backend,
             "intra_node": link}))
    assert load_cluster(tmp_path / "clusters" / "local.yaml").device == mine
    assert load_cluster(tmp_path / "clusters" / "shipped.yaml").device == load_device("a100-80gb")


# -- the CUDA path's device-independent parts, on the CPU ---------------------------------------

def test_measure_accelerator_runs_on_any_device() -> None:
    found = measure_accelerator(torch.device("cpu"), 0.5, ["float32", "bfloat16"], quick=True)
    assert any(k.startswith("matmul_bfloat16_") for k in found)
    spec = cuda_device_spec(found, name="fake-gpu", total_memory=1 << 30)
    assert isinstance(spec, DeviceSpec) and spec.peak_flops["float32"] > 0
    assert spec.op_overhead_s > 0 and spec.backward_overhead_s() >= 0
    assert device_from_dict(yaml.safe_load(device_yaml(CudaCalibration(
        spec=spec, gpu_name="fake", device_index=0, device_count=1, capability=(8, 0),
        measurements=found))), "rendered") == spec


def test_op_overheads_are_positive() -> None:
    found = measure_op_overheads(torch.device("cpu"), 0.2, loops=50, chain=50)
    assert found["op_overhead_s"] > 0 and found["backward_op_overhead_s"] > 0
    assert found["backward_chain_ops"] == 50
    assert found["backward_op_overhead_s"] == pytest.approx(found["backward_chain_s"] / 50)


def test_small_helpers() -> None:
    assert parse_calibration_device("cpu") == "cpu"
    assert parse_calibration_device("cuda") == "cuda:0"
    assert parse_calibration_device("CUDA:3") == "cuda:3"
    for bad in ("tpu", "cuda:x", "cuda:-1", ""):
        with pytest.raises(CalibrationError, match="bad --device"):
            parse_calibration_device(bad)
    assert cuda_dtypes((7, 0)) == ["float32", "float16", "float64"]
    assert cuda_dtypes((9, 0)) == ["float32", "tf32", "bfloat16", "float16", "float64"]
    assert gpu_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert check_name("my-box_2.x") == "my-box_2.x"
    for bad in ("../x", "a b", "x.yaml", "-x"):
        with pytest.raises(CalibrationError):
            check_name(bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_cuda_without_a_gpu_is_a_partc_error() -> None:
    from partc.hardware.calibration import measure_cuda
    with pytest.raises(PartcError, match="cannot calibrate cuda:0") as info:
        measure_cuda("cuda", 1.0)
    assert "--device cpu" in info.value.hint
    with pytest.raises(CalibrationError, match="two visible CUDA GPUs"):
        measure_nccl_link()


# -- the command ---------------------------------------------------------------------------------

def test_calibrate_command_writes_configs_that_compile(tmp_path: Path) -> None:
    out = tmp_path / "cal"
    many = physical_cores() * 2
    proc = run("calibrate", "--seconds", "1", "--devices", str(many), "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    device_path, cluster_path = out / "devices" / "cpu.yaml", out / "clusters" / "cpu.yaml"
    shared_path = out / "clusters" / f"cpu-{many}.yaml"
    assert f"wrote {device_path} and {cluster_path} (and {shared_path})" in proc.stderr
    shared = load_cluster(shared_path)
    assert shared.num_devices == many and shared.devices_per_core == 2
    assert f"--devices {many}" in shared_path.read_text()  # the command that wrote it
    spec = load_device(device_path)
    cluster = load_cluster(cluster_path)
    assert cluster.device == spec and "partc calibrate" in spec.source  # not the shipped cpu
    assert spec.op_overhead_s > 0
    assert spec.backward_op_overhead_s is not None and spec.backward_op_overhead_s >= 0
    assert cluster.backend == "gloo" and cluster.intra_node.bandwidth > 0
    # the pipelining runtime's own cost per pass, measured on two pinned gloo processes
    assert 0 < spec.microbatch_overhead_s < 0.01
    # and a pass's cold start from a flushed last-level cache: the fetch from DRAM is never free
    assert 0 < spec.cold_pass_s < 0.01
    # and the posts and waits of the tensor each pass receives or sends (gloo's calls, on the
    # computing thread)
    assert 0 < spec.p2p_post_cpu_s < 0.01
    # and an optimizer step's start from evicted caches (may read 0 on a quiet cache: never <0)
    assert 0 <= spec.step_cold_s < 0.01
    assert ("# the same step warm (partc.run.overhead.measure_cold_step)" in
            device_path.read_text()) == (spec.step_cold_s > 0)
    # the scheduler's credit for a process woken by a gloo receive, measured on one CPU: at
    # most the work each wake computed (partc.hardware.wake_credit)
    assert 0 <= cluster.wake_credit_s <= 0.25
    assert "# Where a cluster of this node runs more processes than it has cores" in \
        cluster_path.read_text()
    assert "ahead of a busy core-mate" in proc.stdout
    text = device_path.read_text()
    assert "# Eager forward of torch.add" in text and "# Backward through a chain" in text
    assert "# The pipelining runtime's time per stage forward and backward" in text
    assert "# A stage pass from caches another process's work evicted" in text
    assert "a stage pass from evicted caches" in proc.stdout
    assert "# The computing thread's CPU in the same pipeline's p2p posts and waits" in text
    assert "p2p posts and waits: " in proc.stdout
    # every core's speed from step-long window to window, per dtype: modes of mean factor 1
    assert set(spec.speed_spread) == {"float32", "bfloat16"}
    assert all(speed_modes_problem(modes) is None for modes in spec.speed_spread.values())
    assert "# How the speed moves from step to step" in text
    assert "speed spread, float32: " in proc.stdout
    # and the mean the factors are of, per dtype: the time a profile's speed probe is read
    # against (partc.cost.speed_correction), of the same matmul the probe times
    assert set(spec.speed_reference_s) == {"float32", "bfloat16"}
    assert all(0 < t < 0.1 for t in spec.speed_reference_s.values())
    assert "# The mean of those windows" in text and "per 512x512x128 matmul" in proc.stdout
    # inside the passes and, on a CPU, the process's CPU between them: both in the value; the
    # posts and waits apart from both
    flat = " ".join(line.lstrip("# ") for line in text.splitlines())
    inside, between = (parse_quantity(re.search(pattern, flat).group(1), "s")  # type: ignore
                       for pattern in (r"forward (\S+),", r"apart, below\): (\S+)\."))
    assert 0 < inside < spec.microbatch_overhead_s and 0 < between < spec.microbatch_overhead_s
    assert not list(out.rglob(".*.tmp"))  # atomic writes leave no temporary files

    # analytic: the roofline is what prices with the calibrated numbers (a measured profile
    # would time the model itself)
    plan = tmp_path / "plan"
    proc = run("compile", str(ROOT / "examples" / "mlp.py"), "--cluster", str(cluster_path),
               "-b", "8", "--costs", "analytic", "-o", str(plan))
    assert proc.returncode == 0, proc.stderr
    assert (plan / "plan.yaml").is_file()
    assert f"source: {spec.source}" in (plan / "plan.yaml").read_text()  # the calibrated device
    # two devices, each with its own spread: the plan's iteration is the expectation over it,
    # not below the schedule at the priced speed (to a hair: with gloo's rendezvous copies the
    # simulated step is not convex in the stage times, docs/simulator.md)
    predicted = yaml.safe_load((plan / "plan.yaml").read_text())["predicted"]
    at_price = predicted["speed_spread"]["iteration_at_priced_speed_s"]
    assert predicted["iteration_s"] >= 0.99 * at_price > 0
    assert predicted["speed_spread"]["modes"] == [list(m) for m in spec.speed_spread["float32"]]
    assert "at the priced speed" in proc.stderr + proc.stdout
    # calibrated here: compile prices this machine with it and says nothing of another machine
    assert spec.calibrated_on == cpu_model() and "was calibrated on" not in proc.stderr
    # the SIMD width this machine's kernels use (what a CPU convolution's scratch is blocked by)
    assert spec.vector_bytes == cpu_vector_bytes() and "vector_bytes: " in text

    # the same config said to be another machine's: the search warns, in one line, and goes on.
    # `partc solve` runs the search compile runs (partc.plans.priced_search, where the warning
    # is), so one CLI call covers both without a second capture and stage emit (~15 s); the
    # message itself is test_hardware's test_a_config_calibrated_on_another_machine_is_told_apart
    text = device_path.read_text().replace(f'calibrated_on: "{cpu_model()}"',
                                           'calibrated_on: "Imaginary CPU 9000"')
    assert "Imaginary CPU 9000" in text
    device_path.write_text(text)
    proc = run("solve", str(ROOT / "examples" / "mlp.py"), "--cluster", str(cluster_path),
               "-b", "8", "--costs", "analytic")
    assert proc.returncode == 0, proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if "was calibrated on" in line]
    assert warnings == [f"partc: warning: the cpu device config was calibrated on Imaginary "
                        f"CPU 9000, and this machine is {cpu_model()}: its overheads, optimizer "
                        f"and link costs are that machine's (hint: run `partc calibrate -o DIR` "
                        f"here and compile with --cluster DIR/clusters/cpu.yaml)"]


@pytest.mark.parametrize(("args", "message"), [
    (["--device", "tpu"], "partc: error: bad --device 'tpu' (hint: use cpu, cuda or cuda:N"),
    (["--name", "../up"], "partc: error: bad --name '../up'"),
    (["--threads", "2", "--devices", str(physical_cores() + 1)],
     f"partc: error: --devices {physical_cores() + 1} shares"),
    (["--device", "cuda", "--devices", "4"], "partc: error: --devices is for --device cpu"),
    # a device of more cores than the machine has: measured oversubscribed, and its memory
    # (RAM * threads / cores) was written as more than the machine's RAM
    (["--threads", str(physical_cores() + 1)],
     f"partc: error: --threads {physical_cores() + 1} is more than this machine's "
     f"{physical_cores()} physical cores"),
])
def test_calibrate_bad_options_are_one_line_errors(tmp_path: Path, args: list[str],
                                                   message: str) -> None:
    proc = run("calibrate", *args, "-o", str(tmp_path / "out"), timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.startswith(message) and proc.stderr.count("\n") == 1, proc.stderr
    assert not (tmp_path / "out" / "devices").exists()


def test_calibrate_unwritable_output_is_a_one_line_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    proc = run("calibrate", "--seconds", "1", "-o", str(blocker / "sub"), timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"partc: error: cannot write to {blocker / 'sub'}"), proc.stderr
    assert proc.stderr.count("\n") == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_calibrate_cuda_without_a_gpu_is_a_one_line_error(tmp_path: Path) -> None:
    proc = run("calibrate", "--device", "cuda:1", "-o", str(tmp_path), timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.startswith("partc: error: cannot calibrate cuda:1: "), proc.stderr
    assert "(hint: " in proc.stderr and proc.stderr.count("\n") == 1


def test_a_wake_credit_that_cannot_be_measured_leaves_the_rest_of_the_calibration(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where processes cannot be pinned to one CPU (a container that forbids affinity), the hog
    and the sleeper would run side by side and the credit would read as the whole of the work:
    the measurement refuses, and calibrate writes its configs without a wake credit and says
    why in its summary."""
    import partc.hardware.local as local
    import partc.hardware.wake_credit as wake_credit
    from partc.hardware.calibration import calibrate, format_calibration

    monkeypatch.setattr(local, "core_cpus", lambda: [])  # what pinnable_cpus reads
    with pytest.raises(wake_credit.WakeCreditError, match="CPU affinity") as err:
        wake_credit.measure_wake_credit()
    assert err.value.hint
    result = calibrate(tmp_path, "cpu", seconds=0.5)
    assert result.wake is None and result.cluster.wake_credit_s == 0.0
    assert "wake_credit_s" not in result.cluster_path.read_text()
    summary = format_calibration(result)
    assert "wake credit not measured: measuring the wake credit needs processes pinned" in summary
    # the speed spread pins a process to each core too: left out the same way
    assert result.device.spec.speed_spread == {} and "speed_spread" not in \
        result.device_path.read_text()
    assert "speed spread not measured: measuring the speed spread needs processes pinned" in summary


def test_the_cpu_of_forked_measurements_is_calibrates_own() -> None:
    """calibrate's "other processes' CPU use meanwhile" subtracts its own: the measurement
    workers are the forkserver's children, not this process's, and counted through it (they
    read as 92-96% of a core of other processes' use on an idle machine before)."""
    before = _own_cpu_s()
    spread = measure_speed_spread(0.2, window_s=0.05)  # 2 x 4 windows of 0.05 s on each core
    busy = sum(len(core) for times in spread.times_s.values() for core in times) * 0.05
    assert _own_cpu_s() - before >= 0.75 * busy
