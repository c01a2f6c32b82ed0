"""Device and cluster configs: shipped files, unit parser, link math and every loader error."""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from partc.errors import PartcError
from partc.hardware.calibration import calibrate_cpu
from partc.hardware.configs import (
    ConfigError,
    cluster_from_dict,
    config_dir,
    device_from_dict,
    list_clusters,
    list_devices,
    load_cluster,
    load_device,
)
from partc.hardware.specs import OP_CLASSES, ClusterSpec, DeviceSpec, LinkSpec
from partc.hardware.units import format_quantity, parse_quantity

SHIPPED_DEVICES = {"cpu", "v100-32gb", "a100-40gb", "a100-80gb", "h100-80gb", "h200-141gb"}
SHIPPED_CLUSTERS = {"cpu", "4x8xv100-32gb", "8xa100-80gb", "1x8xa100-40gb", "4x8xh100-80gb",
                    "8x8xh100-80gb", "8xh200-141gb"}

DEVICE: dict[str, Any] = {
    "name": "toy",
    "kind": "cuda",
    "memory_bytes": "16GiB",
    "peak_flops": {"float32": "10TFLOP/s", "bfloat16": "100TFLOP/s", "tf32": "50TFLOP/s"},
    "memory_bandwidth": "1TB/s",
    "efficiency": {c: 0.5 for c in OP_CLASSES},
    "bandwidth_efficiency": 0.8,
    "op_overhead_s": "5us",
}

CLUSTER: dict[str, Any] = {
    "name": "toy4x8",
    "device": copy.deepcopy(DEVICE),
    "devices_per_node": 8,
    "num_nodes": 4,
    "backend": "nccl",
    "intra_node": {"bandwidth": "100GB/s", "latency_s": "2us"},
    "inter_node": {"bandwidth": "10GB/s", "latency_s": "10us"},
}


def write(tmp_path: Path, name: str, data: Any) -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


def error_of(fn: Any, *args: Any) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        fn(*args)
    assert isinstance(info.value, PartcError)
    return info.value


# -- shipped configs -------------------------------------------------------------------------

def test_names_are_listed() -> None:
    assert SHIPPED_DEVICES <= set(list_devices())
    assert SHIPPED_CLUSTERS <= set(list_clusters())
    assert list_devices() == sorted(list_devices())
    assert config_dir() == Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize("name", sorted(SHIPPED_DEVICES))
def test_shipped_device_loads(name: str) -> None:
    device = load_device(name)
    assert device.name == name
    assert device.source, "every shipped device says where its numbers come from"
    assert set(device.efficiency) == set(OP_CLASSES)
    assert device.flops_per_s("float32", "matmul") > 0
    assert device == load_device(config_dir() / "devices" / f"{name}.yaml")


@pytest.mark.parametrize("name", sorted(SHIPPED_CLUSTERS))
def test_shipped_cluster_loads(name: str) -> None:
    cluster = load_cluster(name)
    assert cluster.name == name
    assert cluster.source
    assert cluster.device == load_device(cluster.device.name)
    assert cluster.backend == ("gloo" if cluster.device.kind == "cpu" else "nccl")
    assert cluster.inter_node.bandwidth <= cluster.intra_node.bandwidth


def test_a_config_says_how_far_it_was_checked() -> None:
    """`checked_against`: where a datasheet config was compared with its device. It travels
    with a plan's recorded cluster, and prices nothing: equality ignores it."""
    from dataclasses import replace

    from partc.hardware.specs import priced_by_text

    h100, a100, cpu = load_device("h100-80gb"), load_device("a100-80gb"), load_device("cpu")
    assert "2026-11-27" in h100.checked_against and "docs/benchmarks.md#" in h100.checked_against
    assert not any(load_device(n).checked_against for n in ("a100-40gb", "a100-80gb",
                                                            "v100-32gb", "h200-141gb"))
    assert h100.pricing_text() == (f"h100-80gb's datasheet numbers, compared with measurements: "
                                   f"{h100.checked_against}")
    assert a100.pricing_text() == ("a100-80gb's datasheet numbers, never compared with a "
                                   "measured a100-80gb: unverified")
    assert cpu.calibrated_on and cpu.pricing_text() == f"cpu, calibrated on {cpu.calibrated_on}"
    assert priced_by_text(a100, None) == "priced by: the roofline of " + a100.pricing_text()
    assert priced_by_text(a100, "profile.yaml") == "priced by: the profile profile.yaml"
    again = device_from_dict(h100.to_dict(), "plan.yaml")
    assert again.checked_against == h100.checked_against and again == h100
    assert "checked_against" not in a100.to_dict()
    assert replace(h100, checked_against="") == h100
    data = copy.deepcopy(a100.to_dict())
    data["checked_against"] = 3
    error = error_of(device_from_dict, data, "mine.yaml")
    assert "checked_against" in str(error) and "expected a string" in str(error)


def test_shipped_numbers() -> None:
    h100 = load_device("h100-80gb")
    assert h100.peak_flops["bfloat16"] == 989.5e12
    assert h100.memory_bandwidth == 3.35e12
    assert h100.memory_bytes == 79 * 2**30
    assert load_cluster("4x8xh100-80gb").inter_node.bandwidth == 50e9  # 400 Gb/s per GPU
    rannc = load_cluster("4x8xv100-32gb")
    assert (rannc.num_nodes, rannc.devices_per_node, rannc.num_devices) == (4, 8, 32)
    cpu = load_device("cpu")
    assert cpu.kind == "cpu" and "calibrated by bench/calibrate_cpu.py" in cpu.source


def test_to_dict_round_trips_through_yaml() -> None:
    for name in SHIPPED_DEVICES:
        device = load_device(name)
        text = yaml.safe_dump(device.to_dict(), sort_keys=True)
        assert device_from_dict(yaml.safe_load(text), "round trip") == device
    for name in SHIPPED_CLUSTERS:
        cluster = load_cluster(name)
        text = yaml.safe_dump(cluster.to_dict(), sort_keys=True)
        assert cluster_from_dict(yaml.safe_load(text), "round trip") == cluster


# -- units -----------------------------------------------------------------------------------

@pytest.mark.parametrize("value, unit, expected", [
    (34359738368, "B", 34359738368),
    ("32GiB", "B", 32 * 2**30),
    ("80GB", "B", 80e9),
    ("1.5 MiB", "B", 1.5 * 2**20),
    ("512kB", "B", 512e3),
    ("900GB/s", "B/s", 900e9),
    ("1.555TB/s", "B/s", 1.555e12),
    ("400Gbit/s", "B/s", 50e9),
    ("100Gb/s", "B/s", 12.5e9),
    ("2GiB/s", "B/s", 2 * 2**30),
    ("15.7TFLOP/s", "FLOP/s", 15.7e12),
    ("312 TFLOPS", "FLOP/s", 312e12),
    ("1e9", "FLOP/s", 1e9),
    ("5us", "s", 5e-6),
    ("5\u00b5s", "s", 5e-6),
    ("1.5ms", "s", 1.5e-3),
    ("20ns", "s", 20e-9),
    ("2s", "s", 2.0),
    (0.25, "", 0.25),
    ("3", "", 3.0),
])
def test_parse_quantity(value: Any, unit: str, expected: float) -> None:
    assert parse_quantity(value, unit) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("value, unit", [
    ("32gb", "B"),            # lower-case: bits or bytes? refused rather than guessed
    ("32GiB/s", "B"),         # a rate where a size is expected
    ("15.7TiFLOP/s", "FLOP/s"),  # binary prefixes are for bytes only
    ("5 min", "s"),
    ("fast", "B/s"),
    (True, ""),
    ([1], "B"),
    ("inf", ""),
    (float("nan"), ""),
])
def test_parse_quantity_rejects(value: Any, unit: str) -> None:
    with pytest.raises(ValueError):
        parse_quantity(value, unit)


@pytest.mark.parametrize("value, unit", [(15.7e12, "FLOP/s"), (900e9, "B/s"), (5e-6, "s"),
                                         (1.5e-3, "s"), (12.5e9, "B/s"), (0.578, "")])
def test_format_quantity_round_trips(value: float, unit: str) -> None:
    text = format_quantity(value, unit)
    assert parse_quantity(text, unit) == pytest.approx(value, rel=1e-9)


# -- device math -----------------------------------------------------------------------------

def test_flops_per_s_rules() -> None:
    device = device_from_dict(DEVICE, "toy")
    assert device.flops_per_s("bfloat16", "matmul") == 100e12 * 0.5
    assert device.flops_per_s("torch.bfloat16", "matmul") == 100e12 * 0.5
    assert device.flops_per_s("float16", "matmul") == 10e12 * 0.5  # not listed: float32 peak
    assert device.flops_per_s("int64", "gather") == 10e12 * 0.5
    assert device.flops_per_s("float32", "matmul") == 10e12 * 0.5  # tf32 off by default
    assert device.flops_per_s("bfloat16", "elementwise") == 10e12 * 0.5  # vector units
    tf32 = device_from_dict({**DEVICE, "allow_tf32": True}, "toy")
    assert tf32.flops_per_s("float32", "matmul") == 50e12 * 0.5
    assert tf32.flops_per_s("float32", "norm") == 10e12 * 0.5
    assert device.bytes_per_s() == 1e12 * 0.8
    with pytest.raises(ValueError):
        device.flops_per_s("float32", "matmull")


def test_float8_names_map_to_float8() -> None:
    h100 = load_device("h100-80gb")
    assert h100.flops_per_s("float8_e4m3fn", "matmul") == 1979e12 * h100.efficiency["matmul"]


def test_invalid_spec_built_in_code_is_refused() -> None:
    good = device_from_dict(DEVICE, "toy")
    with pytest.raises(ValueError):
        DeviceSpec(**{**good.__dict__, "efficiency": {"matmul": 0.5}})
    with pytest.raises(ValueError):
        LinkSpec(bandwidth=0, latency_s=1e-6)


# -- cluster math ----------------------------------------------------------------------------

def test_links_and_allreduce_on_4x8() -> None:
    c = cluster_from_dict(CLUSTER, "toy")
    assert isinstance(c, ClusterSpec)
    assert c.num_devices == 32
    assert [c.node_of(i) for i in (0, 7, 8, 31)] == [0, 0, 1, 3]
    assert c.link(0, 7) == LinkSpec(100e9, 2e-6)
    assert c.link(7, 8) == LinkSpec(10e9, 10e-6)
    assert c.link(3, 3) == c.intra_node
    assert c.intra_node.transfer_s(0) == 0.0
    assert c.intra_node.transfer_s(10**9) == pytest.approx(2e-6 + 1e9 / 100e9)

    gib = 2**30
    node0 = list(range(8))
    assert c.allreduce_s(gib, node0) == pytest.approx(2 * 7 / 8 * gib / 100e9 + 14 * 2e-6)
    across = [0, 8, 16, 24]  # one per node: inter-node links only
    assert c.allreduce_s(gib, across) == pytest.approx(2 * 3 / 4 * gib / 10e9 + 6 * 10e-6)
    mixed = [0, 1, 8]  # spans nodes: the slowest link, inter-node, bounds the ring
    assert c.allreduce_s(gib, mixed) == pytest.approx(2 * 2 / 3 * gib / 10e9 + 4 * 10e-6)
    assert c.allreduce_s(gib, range(32)) > c.allreduce_s(gib, node0)
    assert c.allreduce_s(gib, [5]) == 0.0
    assert c.allreduce_s(gib, []) == 0.0
    assert c.allreduce_s(0, node0) == 0.0
    with pytest.raises(ValueError):
        c.allreduce_s(gib, [0, 0])
    with pytest.raises(ValueError):
        c.node_of(32)


def test_cluster_device_by_name_override_and_path(tmp_path: Path) -> None:
    by_name = load_cluster(write(tmp_path, "a.yaml", {
        **CLUSTER, "device": "a100-80gb", "device_memory_bytes": "70GiB"}))
    assert by_name.name == "toy4x8"
    assert by_name.device.memory_bytes == 70 * 2**30
    assert by_name.device.peak_flops == load_device("a100-80gb").peak_flops
    # A device file beside the cluster, in a private configs tree.
    (tmp_path / "mine" / "devices").mkdir(parents=True)
    (tmp_path / "mine" / "clusters").mkdir()
    write(tmp_path / "mine" / "devices", "gadget.yaml", {k: v for k, v in DEVICE.items()
                                                         if k != "name"})
    cluster = load_cluster(write(tmp_path / "mine" / "clusters", "pair.yaml", {
        **CLUSTER, "device": "gadget", "num_nodes": 1, "inter_node": None}))
    assert cluster.device.name == "gadget"  # the file's stem
    assert cluster.name == "toy4x8"
    assert cluster.inter_node == cluster.intra_node  # one node: optional
    relative = load_cluster(write(tmp_path / "mine" / "clusters", "rel.yaml", {
        **CLUSTER, "device": "../devices/gadget.yaml"}))
    assert relative.device == cluster.device


def test_config_dir_override(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "devices").mkdir()
    write(tmp_path / "devices", "only.yaml", DEVICE)
    monkeypatch.setenv("PARTC_CONFIG_DIR", str(tmp_path))
    assert config_dir() == tmp_path
    assert list_devices() == ["only"]
    assert list_clusters() == []
    assert load_device("only").name == "toy"


# -- errors ----------------------------------------------------------------------------------

def test_missing_file_and_unknown_name(tmp_path: Path) -> None:
    err = error_of(load_device, tmp_path / "nope.yaml")
    assert "not found" in err.message and "nope.yaml" in err.message
    err = error_of(load_device, "a100-80")
    assert "unknown device 'a100-80'" in err.message
    assert "a100-80gb" in err.hint and "h100-80gb" in err.hint
    err = error_of(load_cluster, "8xa100")
    assert "unknown cluster '8xa100'" in err.message and "8xa100-80gb" in err.hint
    assert err.one_line().count("\n") == 0 and "(hint: " in err.one_line()


@pytest.mark.parametrize("text, expected", [
    ("name: [unclosed\n", "not valid YAML at line"),
    ("- a\n- b\n", "must be a mapping"),
    ("", "must be a mapping"),
])
def test_unreadable_files(tmp_path: Path, text: str, expected: str) -> None:
    path = write(tmp_path, "bad.yaml", text)
    err = error_of(load_device, path)
    assert str(path) in err.message and expected in err.message


def _with(base: dict[str, Any], **changes: Any) -> dict[str, Any]:
    """A deep copy of `base` with `a__b=value` setting data['a']['b'] (DELETE removes it)."""
    data = copy.deepcopy(base)
    for dotted, value in changes.items():
        *parents, last = dotted.split("__")
        target = data
        for p in parents:
            target = target[p]
        if value is DELETE:
            del target[last]
        else:
            target[last] = value
    return data


DELETE = object()


@pytest.mark.parametrize("changes, key, expected", [
    ({"memory_bandwidth": DELETE}, "memory_bandwidth", "missing"),
    ({"peak_flops__float32": DELETE}, "peak_flops.float32", "missing"),
    ({"efficiency__norm": DELETE}, "efficiency.norm", "missing"),
    ({"memory_bytes": [16]}, "memory_bytes", "expected a size"),
    ({"memory_bytes": "16gb"}, "memory_bytes", "expected a size"),
    ({"kind": 3}, "kind", "expected a string"),
    ({"kind": "tpu"}, "kind", "is not one of"),
    ({"allow_tf32": "yes please"}, "allow_tf32", "expected true or false"),
    ({"memory_bandwidth": 0}, "memory_bandwidth", "must be positive"),
    ({"memory_bytes": "-1GB"}, "memory_bytes", "must be positive"),
    ({"peak_flops__bfloat16": "0TFLOP/s"}, "peak_flops.bfloat16", "must be positive"),
    ({"op_overhead_s": "-1us"}, "op_overhead_s", "must not be negative"),
    ({"efficiency__matmul": 1.5}, "efficiency.matmul", "at most 1"),
    ({"efficiency__matmull": 0.5}, "efficiency.matmull", "unknown op class"),
    ({"peak_flops__fp32": "1TFLOP/s"}, "peak_flops.fp32", "unknown dtype"),
    ({"bandwith_efficiency": 0.8}, "bandwith_efficiency", "unknown key"),
    ({"peak_flops": "lots"}, "peak_flops", "must be a mapping"),
    # values no device has: compile crashed (exit 3) or wrote a plan of 6e306 s per iteration
    ({"microbatch_overhead_s": "1e300s"}, "microbatch_overhead_s", "outside what any device"),
    ({"memory_bandwidth": "1e-300B/s"}, "memory_bandwidth", "outside what any device"),
    ({"efficiency__matmul": 1e-300}, "efficiency.matmul", "outside what any device"),
    ({"peak_flops__float32": "1e30FLOP/s"}, "peak_flops.float32", "outside what any device"),
    ({"vector_bytes": 48}, "vector_bytes", "must be one of 16, 32, 64"),
    ({"vector_bytes": True}, "vector_bytes", "must be one of"),
    ({"kind": "cuda", "vector_bytes": 64}, "vector_bytes", "on a cuda device"),
])
def test_device_errors_name_file_and_key(tmp_path: Path, changes: dict[str, Any], key: str,
                                         expected: str) -> None:
    path = write(tmp_path, "dev.yaml", _device_with(**changes))
    err = error_of(load_device, path)
    assert f"{path}: key '{key}'" in err.message
    assert expected in err.message
    assert err.hint


def test_typo_hints(tmp_path: Path) -> None:
    err = error_of(load_device, write(tmp_path, "a.yaml", _device_with(efficiency__matmull=0.5)))
    assert "did you mean 'matmul'" in err.hint
    err = error_of(load_device, write(tmp_path, "b.yaml", _device_with(peak_flops__bfloat=1e12)))
    assert "did you mean 'bfloat16'" in err.hint
    err = error_of(load_device, write(tmp_path, "d.yaml", _device_with(peak_flops__fp32=1e12)))
    assert "did you mean 'float32'" in err.hint
    err = error_of(load_device, write(tmp_path, "c.yaml", {**DEVICE, "memory_bandwith": 1e9}))
    assert "did you mean 'memory_bandwidth'" in err.hint


def _device_with(**changes: Any) -> dict[str, Any]:
    return _with(DEVICE, **changes)


def _cluster_with(**changes: Any) -> dict[str, Any]:
    return _with(CLUSTER, **changes)


@pytest.mark.parametrize("changes, key, expected", [
    ({"device": "a100-80"}, "device", "unknown device 'a100-80'"),
    ({"device": 7}, "device", "expected a device name or a mapping"),
    ({"device__memory_bytes": DELETE}, "device.memory_bytes", "missing"),
    ({"device__efficiency__conv": 2}, "device.efficiency.conv", "at most 1"),
    ({"devices_per_node": "eight"}, "devices_per_node", "expected a whole number"),
    ({"devices_per_node": 8.0}, "devices_per_node", "expected a whole number"),
    ({"num_nodes": 0}, "num_nodes", "at least 1"),
    ({"inter_node": DELETE}, "inter_node", "missing"),
    ({"intra_node__bandwith": "1GB/s"}, "intra_node.bandwith", "unknown key"),
    ({"intra_node__latency_s": "fast"}, "intra_node.latency_s", "expected a time"),
    ({"inter_node__bandwidth": 0}, "inter_node.bandwidth", "must be positive"),
    ({"backend": "mpi"}, "backend", "is not one of"),
    ({"device__kind": "cpu"}, "backend", "nccl needs a cuda device"),
    ({"devices": 8}, "devices", "unknown key"),
])
def test_cluster_errors_name_file_and_key(tmp_path: Path, changes: dict[str, Any], key: str,
                                          expected: str) -> None:
    path = write(tmp_path, "clu.yaml", _cluster_with(**changes))
    err = error_of(load_cluster, path)
    assert f"{path}: key '{key}'" in err.message
    assert expected in err.message
    assert err.hint


def test_unknown_device_in_cluster_lists_devices(tmp_path: Path) -> None:
    err = error_of(load_cluster, write(tmp_path, "c.yaml", _cluster_with(device="a100-80")))
    assert "a100-80gb" in err.hint and "v100-32gb" in err.hint


def test_dict_loaders_name_where() -> None:
    err = error_of(device_from_dict, {**DEVICE, "kind": "tpu"}, "plan.yaml:device")
    assert err.message.startswith("plan.yaml:device: key 'kind'")
    err = error_of(cluster_from_dict, ["not", "a", "mapping"], "plan.yaml:cluster")
    assert err.message.startswith("plan.yaml:cluster")


# -- calibration -----------------------------------------------------------------------------

def test_calibrate_cpu_smoke() -> None:
    """A quick run (small sizes): it measures something plausible and builds a valid spec."""
    spec = calibrate_cpu(threads=1, seconds=0.5)
    assert spec.kind == "cpu" and spec.name == "cpu"
    assert 1e8 < spec.peak_flops["float32"] < 1e13
    assert 1e8 < spec.memory_bandwidth < 1e12
    assert 0 < spec.op_overhead_s < 1e-3
    assert device_from_dict(spec.to_dict(), "calibrated") == spec


def test_cores_and_pinning() -> None:
    """`core_cpus` groups this process's CPUs by physical core; `pin_to_core` binds a process
    (here a child, so this one stays free) to core i modulo their number; `pinned_to_core`
    restores the affinity after its block."""
    import os
    import subprocess
    import sys

    from partc.hardware.local import core_cpus, physical_cores, pinned_to_core

    cores = core_cpus()
    assert len(cores) == physical_cores() >= 1
    assert set().union(*cores) <= os.sched_getaffinity(0)
    code = ("import os; from partc.hardware.local import pin_to_core; "
            "print(sorted(pin_to_core(5)), sorted(os.sched_getaffinity(0)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split("]")
    expected = sorted(cores[5 % len(cores)])
    assert out[0] + "]" == str(expected) and out[1].strip() + "]" == str(expected)
    # a device of two cores (fewer processes than cores): a block of two
    code = ("import os; from partc.hardware.local import pin_to_core; "
            "print(sorted(pin_to_core(1, 2)))")
    out2 = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip()
    blocks = max(1, len(cores) // 2)
    start = (1 % blocks) * min(2, len(cores))
    assert out2 == str(sorted(set().union(*cores[start:start + min(2, len(cores))])))
    before = os.sched_getaffinity(0)
    with pinned_to_core(0) as cpus:
        assert cpus is not None and os.sched_getaffinity(0) == set(cpus)
    assert os.sched_getaffinity(0) == before


def test_devices_sharing_cores(tmp_path: Path) -> None:
    """A CPU cluster with more processes than cores: `cores_per_node` in the config, device i on
    core i % cores, and the pipeline ranks each core's devices run (the simulator's
    core_sharing)."""
    from partc.solve.stage_problem import PipelineShape

    cluster = load_cluster("cpu-4")
    assert cluster.cores_per_node == 2 and cluster.devices_per_core == 2.0
    assert cluster.busy_cores_per_node == 2
    assert [cluster.core_of(i) for i in range(4)] == [(0, 0), (0, 1), (0, 0), (0, 1)]
    four = PipelineShape(stages=4, replicas=1, num_microbatches=4, microbatch_size=1)
    assert four.core_sharing(cluster) == ((0, 2), (1, 3), (0, 2), (1, 3))
    # 2 stages x 2 replicas, stage-major: devices 0, 1 run rank 0, devices 2, 3 rank 1
    two = PipelineShape(stages=2, replicas=2, num_microbatches=4, microbatch_size=1)
    assert two.core_sharing(cluster) == ((0, 1), (0, 1))
    assert four.core_sharing(load_cluster("cpu")) == ()  # a core per device
    assert cluster_from_dict(cluster.to_dict(), "test") == cluster
    with pytest.raises(ConfigError, match="cores_per_node"):
        cluster_from_dict({**cluster.to_dict(), "cores_per_node": 0}, "test")
    # the scheduler's wake credit where cores are shared (partc.solve.shared_cores): cpu-4
    # records one measured, it reads back with a unit, and it is never negative
    assert 0 < cluster.wake_credit_s < 0.05
    assert cluster.to_dict()["wake_credit_s"] == cluster.wake_credit_s
    assert cluster_from_dict({**cluster.to_dict(), "wake_credit_s": "2.5ms"},
                             "test").wake_credit_s == pytest.approx(2.5e-3)
    with pytest.raises(ConfigError, match="wake_credit_s"):
        cluster_from_dict({**cluster.to_dict(), "wake_credit_s": "-1ms"}, "test")
    # absent: processor sharing, and nothing written for it
    plain = cluster_from_dict({k: v for k, v in cluster.to_dict().items()
                               if k != "wake_credit_s"}, "test")
    assert plain.wake_credit_s == 0.0 and "wake_credit_s" not in plain.to_dict()


def test_a_config_calibrated_on_another_machine_is_told_apart() -> None:
    """`foreign_calibration`: a cluster that is this machine (a one-node CPU config, `local`),
    priced with a device config whose `calibrated_on` names another CPU, is told apart; the same
    config calibrated here, a datasheet config (no `calibrated_on`) and a cluster that is not
    this machine are not. The key round-trips through the device's dict and is left out when
    empty (plans of datasheet devices keep their bytes)."""
    from dataclasses import replace

    from partc.hardware.local import cpu_model, foreign_calibration, local_cluster

    cpu = load_cluster("cpu")
    here = replace(cpu, device=replace(cpu.device, calibrated_on=cpu_model()))
    assert foreign_calibration(here) is None
    # whitespace in /proc/cpuinfo's model name is not a different machine
    spaced = replace(cpu, device=replace(cpu.device,
                                         calibrated_on="  " + cpu_model().replace(" ", "  ")))
    assert foreign_calibration(spaced) is None
    elsewhere = replace(cpu, device=replace(cpu.device, calibrated_on="Imaginary CPU 9000"))
    found = foreign_calibration(elsewhere)
    assert found is not None
    assert (found.config, found.calibrated_on, found.this_machine) == \
        ("cpu", "Imaginary CPU 9000", cpu_model())
    message = found.message()
    assert "calibrated on Imaginary CPU 9000" in message and cpu_model() in message
    assert "partc calibrate -o DIR" in message and "\n" not in message
    # `local` is this machine whatever its device config says
    local = replace(local_cluster(), device=replace(local_cluster().device,
                                                    calibrated_on="Imaginary CPU 9000"))
    assert foreign_calibration(local) is not None
    datasheet = replace(cpu, device=replace(cpu.device, calibrated_on=""))
    assert foreign_calibration(datasheet) is None
    assert "calibrated_on" not in datasheet.device.to_dict()
    gpus = load_cluster("4x8xh100-80gb")
    remote = replace(gpus, device=replace(gpus.device, calibrated_on="NVIDIA H100 80GB HBM3"))
    assert foreign_calibration(remote) is None  # planned for, not measured here
    assert device_from_dict(elsewhere.device.to_dict(), "test") == elsewhere.device
    assert load_device("cpu").calibrated_on  # the shipped one says which machine it is of


# -- speed spread ----------------------------------------------------------------------------

def test_a_speed_spread_reads_back_and_bad_ones_are_one_line_errors() -> None:
    """`speed_spread` (partc.solve.stragglers' input): dtype -> [[probability, factor], ...],
    probabilities summing to 1 and a mean factor of 1; absent: nothing written, no modes."""
    good = device_from_dict(DEVICE, "toy")
    assert good.speed_spread == {} and "speed_spread" not in good.to_dict()
    assert good.speed_modes("float32") == ()
    spread = {"float32": [[0.6, 0.8], [0.4, 1.3]], "bfloat16": [[1.0, 1.0]]}
    spec = device_from_dict({**DEVICE, "speed_spread": spread}, "toy")
    assert spec.speed_modes("float32") == ((0.6, 0.8), (0.4, 1.3))
    assert spec.speed_modes("torch.bfloat16") == ((1.0, 1.0),)  # torch names accepted
    assert spec.speed_modes("float16") == ()  # a dtype not measured: none
    assert device_from_dict(spec.to_dict(), "again") == spec
    for bad, message in (
            ({"float32": [[0.5, 0.8], [0.4, 1.3]]}, "summing to 0.9"),
            ({"float32": [[0.5, 0.9], [0.5, 1.3]]}, "mean factor of 1.1000"),
            ({"float32": [[0.5, -1.0], [0.5, 3.0]]}, "a factor > 0"),
            ({"float32": [[1.0]]}, "not a \\[probability, factor\\] pair"),
            ({"float32": []}, "non-empty list"),
            ({"fp32": [[1.0, 1.0]]}, "unknown dtype"),
            ([[1.0, 1.0]], "must be a mapping")):
        with pytest.raises(ConfigError, match=message) as info:
            device_from_dict({**DEVICE, "speed_spread": bad}, "toy.yaml")
        assert "speed_spread" in info.value.message and "\n" not in info.value.message
        assert info.value.hint
    with pytest.raises(ValueError, match="speed_spread"):  # built in code, the same rule
        DeviceSpec(**{**good.__dict__, "speed_spread": {"float32": ((0.5, 2.0), (0.5, 1.0))}})


def test_a_speed_reference_reads_back_and_bad_ones_are_one_line_errors() -> None:
    """`speed_reference_s` (partc.cost.speed_correction's input): dtype -> the spread kernel's
    mean call time, with units; absent: nothing written, no correction."""
    good = device_from_dict(DEVICE, "toy")
    assert good.speed_reference_s == {} and "speed_reference_s" not in good.to_dict()
    spec = device_from_dict({**DEVICE, "speed_reference_s": {"float32": "677.2us",
                                                             "bfloat16": 3.189e-4}}, "toy")
    assert spec.speed_reference_s == {"float32": pytest.approx(677.2e-6), "bfloat16": 3.189e-4}
    assert device_from_dict(spec.to_dict(), "again") == spec
    for bad, message in (({"fp32": "1ms"}, "unknown dtype"),
                         ({"float32": "-1ms"}, "must be positive"),
                         ({"float32": "fast"}, "speed_reference_s.float32"),
                         ([1.0], "must be a mapping")):
        with pytest.raises(ConfigError, match=message) as info:
            device_from_dict({**DEVICE, "speed_reference_s": bad}, "toy.yaml")
        assert "speed_reference_s" in info.value.message and "\n" not in info.value.message
        assert info.value.hint
    with pytest.raises(ValueError, match="speed_reference_s"):  # built in code, the same rule
        DeviceSpec(**{**good.__dict__, "speed_reference_s": {"float32": float("nan")}})
