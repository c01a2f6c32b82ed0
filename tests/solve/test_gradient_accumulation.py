"""Gradient accumulation across micro-batches (partc.solve.stage_problem.gradient_add_s): a
profile times each backward with the gradients set to None, launch's passes add into the held
ones; the search prices the adds in every stage's backward, as many as launch makes. Real
captures and real solves; what torch does (an in-place add, not a copy) is checked on real
tensors."""
from __future__ import annotations

from dataclasses import replace
from functools import lru_cache
from pathlib import Path

import pytest
import torch

from partc.cost.roofline import analytic_cost_table
from partc.cost.table import CostTable
from partc.frontend.capture import capture_graph
from partc.graph.opgraph import Param
from partc.hardware.configs import load_cluster, load_device
from partc.options import SearchOptions, TrainingConfig
from partc.solve.search import search
from partc.solve.stage_problem import (
    PipelineShape,
    add_seconds_of,
    gradient_add_s,
    gradient_adds,
)

ROOT = Path(__file__).resolve().parents[2]
CPU4 = load_cluster("cpu-4")


@lru_cache(maxsize=None)
def table_of(name: str) -> CostTable:
    return analytic_cost_table(capture_graph(ROOT / "examples" / f"{name}.py", 2,
                                             onnx=False).graph, CPU4.device)


def test_how_many_adds_launch_makes() -> None:
    """Without replicas the first micro-batch's gradient is taken over (set to None before the
    step), under DDP every micro-batch adds into the zeroed buckets, with sharded gradients a
    replica adds into its own share (1/R) and into the kept-whole tied weights."""
    one = PipelineShape(stages=2, replicas=1, num_microbatches=4, microbatch_size=2)
    ddp = replace(one, replicas=2)
    assert gradient_adds(one, "none", kept_whole=False) == 3
    assert gradient_adds(replace(one, num_microbatches=1), "none", kept_whole=False) == 0
    assert gradient_adds(ddp, "none", kept_whole=False) == 4
    assert gradient_adds(ddp, "optimizer", kept_whole=False) == 4
    assert gradient_adds(ddp, "gradients", kept_whole=False) == pytest.approx(1.5)
    assert gradient_adds(ddp, "gradients", kept_whole=True) == 3


def test_autograd_adds_in_place_into_a_held_gradient() -> None:
    """What the count rests on: a backward into a parameter without a gradient takes the fresh
    one over (no copy); into one that has a gradient, it adds in place (the same storage)."""
    w = torch.nn.Parameter(torch.randn(64, 64))
    x = torch.randn(8, 64)
    (x @ w).sum().backward()
    held = w.grad
    assert held is not None
    first = held.clone()
    ptr = held.data_ptr()
    (x @ w).sum().backward()
    assert w.grad is not None and w.grad.data_ptr() == ptr  # added into, not replaced
    assert torch.allclose(w.grad, 2 * first)


def test_one_add_is_three_passes_over_the_gradient() -> None:
    cpu = replace(load_device("cpu"), cache_bytes=8 << 20, cache_bandwidth=60e9)
    training = TrainingConfig()
    small = Param(name="w", shape=(256, 256), dtype="float32", kind="parameter", trainable=True)
    large = replace(small, shape=(4096, 1024))
    memory = cpu.bytes_per_s()
    g = 256 * 256 * 4
    assert add_seconds_of(small, training, cpu) == pytest.approx(
        g / memory + 2 * g / 60e9 + cpu.no_grad_overhead_s())
    G = 4096 * 1024 * 4
    assert add_seconds_of(large, training, cpu) == pytest.approx(
        3 * G / memory + cpu.no_grad_overhead_s())
    gpu = load_device("h100-80gb")
    assert add_seconds_of(small, training, gpu) == pytest.approx(3 * g / gpu.bytes_per_s())
    assert add_seconds_of(replace(small, trainable=False), training, cpu) == 0.0
    buffer = replace(small, kind="buffer")
    assert add_seconds_of(buffer, training, cpu) == 0.0
    # bf16-mixed keeps float32 parameters and gradients: the same bytes
    bf16 = TrainingConfig(precision="bf16-mixed")
    assert add_seconds_of(small, bf16, cpu) == add_seconds_of(small, training, cpu)


@pytest.mark.parametrize("replicas", [1, 2])
def test_every_stage_backward_carries_its_adds(replicas: int) -> None:
    """The same pinned cut searched on two devices that differ only in memory bandwidth (the
    table's operator costs are fixed): each stage's backward differs by exactly the difference
    of its `gradient_add_s`, and the adds are what the shape makes (3 of 4 micro-batches without
    replicas, 4 of 4 with DDP)."""
    table = table_of("transformer")
    slow = replace(CPU4, device=replace(CPU4.device, memory_bandwidth=CPU4.device.memory_bandwidth
                                        / 4))
    options = SearchOptions(stages=2, replicas=replicas, num_microbatches=4, schedule="1f1b",
                            strategy="uniform", sharding="none",
                            activation_checkpointing=False)
    fast_plan = search(table, CPU4, 8 * replicas, TrainingConfig(), options)
    slow_plan = search(table, slow, 8 * replicas, TrainingConfig(), options)
    graph = table.graph
    assert [s.blocks for s in fast_plan.stages] == [s.blocks for s in slow_plan.stages]
    shape = fast_plan.shape
    for fast, slow_stage in zip(fast_plan.stages, slow_plan.stages, strict=True):
        params = [graph.param(p) for p in fast.parameters]
        adds = [gradient_add_s(params, TrainingConfig(), c.device, shape, "none")
                for c in (CPU4, slow)]
        assert adds[1] > adds[0] > 0
        assert slow_stage.backward_s - fast.backward_s == pytest.approx(adds[1] - adds[0],
                                                                        rel=1e-6)
        assert slow_stage.forward_s == pytest.approx(fast.forward_s)
    adds_per_step = 3 if replicas == 1 else 4
    p = graph.param(fast_plan.stages[0].parameters[0])
    want = add_seconds_of(p, TrainingConfig(), CPU4.device) * adds_per_step / 4
    assert gradient_add_s([p], TrainingConfig(), CPU4.device, shape, "none") == \
        pytest.approx(want)
