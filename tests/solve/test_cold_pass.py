"""The cold start of a stage pass on a shared core (DeviceSpec.cold_pass_s): measured by
`partc calibrate` (partc.run.overhead.measure_cold_pass, a real flush and real passes), read
from a device config, and paid in every pass of a rank whose process shares its core with
another, nowhere else. Real captures, real configs, real solves."""
from __future__ import annotations

from dataclasses import replace
from functools import lru_cache
from pathlib import Path

import pytest
import yaml

from partc.cost.roofline import analytic_cost_table
from partc.cost.table import CostTable
from partc.frontend.capture import capture_graph
from partc.hardware.configs import ConfigError, device_from_dict, load_cluster, load_device
from partc.hardware.specs import ClusterSpec
from partc.options import SearchOptions, TrainingConfig
from partc.run.overhead import ColdPass, measure_cold_pass
from partc.solve.search import search
from partc.solve.stage_problem import PipelineShape, stage_fixed_s

ROOT = Path(__file__).resolve().parents[2]
COLD = 300e-6


def cold_cluster(name: str, devices_per_node: int | None = None) -> ClusterSpec:
    cluster = load_cluster(name)
    cluster = replace(cluster, device=replace(cluster.device, cold_pass_s=COLD))
    return cluster if devices_per_node is None else replace(cluster,
                                                            devices_per_node=devices_per_node)


@lru_cache(maxsize=None)
def mlp_table() -> CostTable:
    cluster = load_cluster("cpu-4")
    return analytic_cost_table(capture_graph(ROOT / "examples" / "mlp.py", 2,
                                             onnx=False).graph, cluster.device)


def per_pass(cluster: ClusterSpec, shape: PipelineShape) -> list[float]:
    """stage_fixed_s without the last stage's loss, each virtual stage's forward then
    backward."""
    fixed = stage_fixed_s(mlp_table(), cluster, shape)
    loss = mlp_table().loss
    m = shape.microbatch_size
    f, b = fixed[-1]
    fixed[-1] = (f - loss.forward.at(m), b - loss.backward.at(m))
    return [t for pair in fixed for t in pair]


def test_paid_by_the_ranks_that_share_a_core_only() -> None:
    shared = cold_cluster("cpu-4")  # 4 processes on 2 cores
    base = shared.device.microbatch_overhead_s
    four = PipelineShape(stages=4, replicas=1, num_microbatches=4, microbatch_size=8)
    assert per_pass(shared, four) == pytest.approx([base + COLD] * 8)
    # two of the four devices: each on its own core
    two = replace(four, stages=2)
    assert per_pass(shared, two) == pytest.approx([base] * 4)
    # three processes on two cores: ranks 0 and 2 share core 0, rank 1 has core 1
    three = cold_cluster("cpu-4", devices_per_node=3)
    assert per_pass(three, replace(four, stages=3)) == pytest.approx(
        [base + COLD] * 2 + [base] * 2 + [base + COLD] * 2)
    # replicas of one stage on one core are processes too: they evict each other
    assert per_pass(shared, replace(four, stages=1, replicas=4)) == pytest.approx(
        [base + COLD] * 2)
    # interleaved: virtual stage k runs on rank k % stages
    inter = PipelineShape(stages=3, replicas=1, num_microbatches=6, microbatch_size=4,
                          schedule="interleaved-1f1b", chunks=2)
    assert [t - base for t in per_pass(three, inter)[::2]] == pytest.approx(
        [COLD, 0.0, COLD, COLD, 0.0, COLD])
    # a device without the measurement pays nothing more
    plain = load_cluster("cpu-4")
    assert plain.device.cold_pass_s == 0.0
    assert per_pass(plain, four) == pytest.approx([base] * 8)


def test_a_plan_on_shared_cores_is_priced_with_it() -> None:
    """The search's plan holds it in every stage's forward and backward, so more micro-batches
    cost what their passes cost."""
    options = SearchOptions(strategy="uniform", stages=4, replicas=1, num_microbatches=8)
    plain = search(mlp_table(), load_cluster("cpu-4"), 64, TrainingConfig(), options)
    cold = search(mlp_table(), cold_cluster("cpu-4"), 64, TrainingConfig(), options)
    assert plain.shape == cold.shape
    for p, c in zip(plain.stages, cold.stages, strict=True):
        assert c.forward_s - p.forward_s == pytest.approx(COLD)
        assert c.backward_s - p.backward_s == pytest.approx(COLD)
    assert cold.iteration_s > plain.iteration_s + 8 * COLD


def test_the_device_config_reads_it(tmp_path: Path) -> None:
    spec = load_device("cpu")
    data = {**spec.to_dict(), "cold_pass_s": "320us"}
    read = device_from_dict(data, "t.yaml")
    assert read.cold_pass_s == pytest.approx(320e-6)
    assert device_from_dict(read.to_dict(), "again.yaml") == read
    assert "cold_pass_s" not in spec.to_dict()  # unset: the old text
    with pytest.raises(ConfigError, match="cold_pass_s"):
        device_from_dict({**spec.to_dict(), "cold_pass_s": "-1us"}, "bad.yaml")
    path = tmp_path / "dev.yaml"
    path.write_text(yaml.safe_dump({**spec.to_dict(), "cold_pass_s": "0.4ms"}))
    assert load_device(path).cold_pass_s == pytest.approx(400e-6)


# The measurement from a real flush and real passes, in the slow set: the default run measures
# it inside `partc calibrate` (tests/hardware/test_calibrate.py, the calibrated cold_pass_s
# between 0 and 10 ms), which runs this same function
@pytest.mark.slow
def test_measured_from_a_real_flush() -> None:
    found = measure_cold_pass("cpu")
    # evicted caches cost a pass time, a bounded amount on any machine
    assert 0 <= found.forward_s < 0.05 and 0 <= found.backward_s < 0.05
    assert found.pass_s == pytest.approx((found.forward_s + found.backward_s) / 2)
    assert set(found.measurements()) == {"cold_forward_s", "cold_backward_s"}


def test_a_cold_pass_is_the_mean_of_its_directions_and_nothing_on_a_gpu() -> None:
    found = ColdPass(forward_s=300e-6, backward_s=500e-6)
    assert found.pass_s == pytest.approx(400e-6)
    assert found.measurements() == {"cold_forward_s": 300e-6, "cold_backward_s": 500e-6}
    # a GPU's host runs ahead of its kernels: nothing is measured or charged there
    assert measure_cold_pass("cuda").pass_s == 0.0
