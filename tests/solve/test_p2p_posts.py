"""A pass's p2p posts and waits (DeviceSpec.p2p_post_cpu_s): the computing thread's CPU per
tensor a stage pass receives from or sends to another stage, priced once per such tensor (a
middle stage's passes two, the ends' one, a single stage's none), read from a device config,
and held in a searched plan's stage times. Real captures, real configs, real solves."""
from __future__ import annotations

from dataclasses import replace
from functools import lru_cache
from pathlib import Path

import pytest

from partc.cost.roofline import analytic_cost_table
from partc.cost.table import CostTable
from partc.frontend.capture import capture_graph
from partc.hardware.configs import ConfigError, device_from_dict, load_cluster, load_device
from partc.hardware.specs import ClusterSpec
from partc.options import SearchOptions, TrainingConfig
from partc.solve.search import search
from partc.solve.stage_problem import PipelineShape, p2p_post_s, stage_fixed_s

ROOT = Path(__file__).resolve().parents[2]
POST = 60e-6


def posting_cluster(name: str = "cpu-4") -> ClusterSpec:
    cluster = load_cluster(name)
    return replace(cluster, device=replace(cluster.device, p2p_post_cpu_s=POST))


@lru_cache(maxsize=None)
def mlp_table() -> CostTable:
    cluster = load_cluster("cpu-4")
    return analytic_cost_table(capture_graph(ROOT / "examples" / "mlp.py", 2,
                                             onnx=False).graph, cluster.device)


def test_each_pass_pays_one_post_per_tensor_it_moves() -> None:
    cluster = posting_cluster()
    four = PipelineShape(stages=4, replicas=1, num_microbatches=4, microbatch_size=8)
    assert p2p_post_s(cluster, four) == pytest.approx([POST, 2 * POST, 2 * POST, POST])
    assert p2p_post_s(cluster, replace(four, stages=2)) == pytest.approx([POST, POST])
    # one stage (replicas only): nothing to receive or send
    assert p2p_post_s(cluster, replace(four, stages=1, replicas=4)) == [0.0]
    # interleaved: every virtual stage but the first and last has a neighbour on either side
    inter = PipelineShape(stages=2, replicas=1, num_microbatches=4, microbatch_size=4,
                          schedule="interleaved-1f1b", chunks=2)
    assert p2p_post_s(cluster, inter) == pytest.approx([POST, 2 * POST, 2 * POST, POST])
    # a device without the measurement prices none (the shipped configs, the GPUs)
    plain = load_cluster("cpu-4")
    assert plain.device.p2p_post_cpu_s == 0.0
    assert p2p_post_s(plain, four) == [0.0] * 4


def test_stage_fixed_costs_hold_them_in_both_passes() -> None:
    four = PipelineShape(stages=4, replicas=1, num_microbatches=4, microbatch_size=8)
    plain = stage_fixed_s(mlp_table(), load_cluster("cpu-4"), four)
    posting = stage_fixed_s(mlp_table(), posting_cluster(), four)
    extra = [t - pt for pair, plain_pair in zip(posting, plain, strict=True)
             for t, pt in zip(pair, plain_pair, strict=True)]
    assert extra == pytest.approx([POST, POST, 2 * POST, 2 * POST, 2 * POST, 2 * POST,
                                   POST, POST])


def test_a_searched_plan_holds_them() -> None:
    """The search's plan holds the posts in every stage's passes, the middle stages twice: a
    deeper pipeline costs the posts its passes make."""
    options = SearchOptions(strategy="uniform", stages=4, replicas=1, num_microbatches=8)
    plain = search(mlp_table(), load_cluster("cpu-4"), 64, TrainingConfig(), options)
    posting = search(mlp_table(), posting_cluster(), 64, TrainingConfig(), options)
    assert plain.shape == posting.shape
    ends = [1, 2, 2, 1]
    for p, c, n in zip(plain.stages, posting.stages, ends, strict=True):
        assert c.forward_s - p.forward_s == pytest.approx(n * POST)
        assert c.backward_s - p.backward_s == pytest.approx(n * POST)
    assert posting.iteration_s > plain.iteration_s + 8 * 2 * POST


def test_the_device_config_reads_it() -> None:
    spec = load_device("cpu")
    read = device_from_dict({**spec.to_dict(), "p2p_post_cpu_s": "45us"}, "t.yaml")
    assert read.p2p_post_cpu_s == pytest.approx(45e-6)
    assert device_from_dict(read.to_dict(), "again.yaml") == read
    assert "p2p_post_cpu_s" not in spec.to_dict()  # unset: the old text
    with pytest.raises(ConfigError, match="p2p_post_cpu_s"):
        device_from_dict({**spec.to_dict(), "p2p_post_cpu_s": "-1us"}, "bad.yaml")
