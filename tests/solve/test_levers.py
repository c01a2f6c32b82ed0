"""Memory levers per rank (partc.solve.levers): sharded optimizer state (ZeRO-1) in the memory
model and the search, and checkpointing / sharding only on the ranks whose memory needs them. Real
captures, real CP-SAT solves; the partition rule is checked against torch's own
ZeroRedundancyOptimizer in a real gloo process group."""
from __future__ import annotations

import random
from dataclasses import replace
from functools import lru_cache
from pathlib import Path

import pytest
import torch.multiprocessing as mp
from torch_zero_partition import torch_partition

from partc.cost.roofline import analytic_cost_table
from partc.cost.table import CostTable
from partc.frontend.capture import capture_graph
from partc.hardware.configs import load_cluster
from partc.hardware.specs import ClusterSpec, LinkSpec
from partc.options import SearchOptions, TrainingConfig
from partc.solve.levers import choose_levers, lever_options, step_seconds
from partc.solve.memory import optimizer_partition, param_memory, stage_memory
from partc.solve.partition import Partition
from partc.solve.search import search
from partc.solve.stage_problem import PipelineShape, RankLevers, ShapeError

ROOT = Path(__file__).resolve().parents[2]
_LINK = LinkSpec(bandwidth=4.02e9, latency_s=105e-6)
CPU8 = replace(load_cluster("cpu"), intra_node=_LINK, inter_node=_LINK, devices_per_node=8)


@lru_cache(maxsize=None)
def table_of(name: str) -> CostTable:
    folder = "tests/models" if name in ("gpt2_no_dropout", "mixed_dtypes") else "examples"
    model = ROOT / folder / f"{name}.py"
    return analytic_cost_table(capture_graph(model, 2, onnx=False).graph, CPU8.device)


def with_memory(cluster: ClusterSpec, nbytes: int) -> ClusterSpec:
    return replace(cluster, device=replace(cluster.device, memory_bytes=nbytes))


# ---- the partition ZeroRedundancyOptimizer makes -----------------------------------------------
def test_optimizer_partition_is_torchs() -> None:
    rng = random.Random(7)
    sizes = [rng.choice([1, 16, 16, 256, 1000, 4096]) for _ in range(23)]
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(torch_partition, args=(3, port, sizes, out), nprocs=3, join=True)
        expected = [sorted(x) for x in out["owned"]]
    assert [sorted(x) for x in optimizer_partition(sizes, 3)] == expected


# ---- the memory model ----------------------------------------------------------------------------
def test_sharded_optimizer_state_is_the_largest_share() -> None:
    table = table_of("transformer")
    graph = table.graph
    nodes = [n.name for n in graph.nodes]
    kwargs = dict(microbatch_size=4, num_microbatches=4, stage_index=0, num_stages=1)
    whole = stage_memory(table, nodes, config=TrainingConfig(), **kwargs)
    sharded = stage_memory(table, nodes, config=TrainingConfig(sharding="optimizer", shards=2),
                           **kwargs)
    trainable = [p for p in graph.params if p.kind == "parameter" and p.trainable]
    states = [param_memory(p, TrainingConfig())[2] for p in trainable]
    largest = max(sum(states[i] for i in part)
                  for part in optimizer_partition([p.numel for p in trainable], 2))
    assert sharded.optimizer_state == largest
    assert whole.optimizer_state == sum(states)
    assert sharded.optimizer_state < 0.6 * whole.optimizer_state  # close to half
    # weights and gradients stay whole on every replica (ZeRO-1)
    assert (sharded.parameters, sharded.gradients) == (whole.parameters, whole.gradients)
    assert sharded.total < whole.total


def test_gradient_buckets_follow_each_owner_and_bound_the_window() -> None:
    """Sharded gradients: each owner's parameters in the order their gradients form, a bucket
    closed at the cap; the window is what a replica holds of the others' (filling buckets and
    the flat copy a bucket of several parameters is reduced from)."""
    from partc.solve.memory import (
        GRADIENT_BUCKET_MIN_BYTES,
        gradient_bucket_bytes,
        gradient_buckets,
        gradient_window,
    )

    cap = GRADIENT_BUCKET_MIN_BYTES
    assert gradient_bucket_bytes(4 * cap, 2) == cap  # small stages: the smallest bucket
    assert gradient_bucket_bytes(10**12, 8) == 32 << 20  # huge ones: the largest
    assert gradient_bucket_bytes(64 * cap, 2) == 4 * cap  # else 1/8 of a replica's share
    half = cap // 2
    sizes, owners = [half] * 4 + [3 * cap], [0, 1, 0, 1, 0]
    assert gradient_buckets(sizes, owners, 2) == [[0, 2], [1, 3], [4]]
    # replica 0 holds most of others' at replica 1's bucket: its two halves and their flat copy;
    # replica 1 at the last parameter, larger than a bucket, which is reduced in place (no copy)
    assert gradient_window(sizes, owners, 2) == [2 * cap, 3 * cap]
    assert gradient_window([3 * cap], [1], 2) == [3 * cap, 0]
    with pytest.raises(ValueError, match="sizes for"):
        gradient_buckets([1, 2], [0], 2)


def test_sharded_gradients_are_the_largest_share_and_the_window() -> None:
    """ZeRO-2 in the memory model: a replica keeps the gradients of the parameters it owns and
    the window of the others' (`gradient_window`), parameters other ranks hold too whole; its
    optimizer state is ZeRO-1's."""
    from partc.solve.memory import gradient_window

    table = table_of("gpt2_no_dropout")
    graph = table.graph
    nodes = [n.name for n in graph.nodes]
    kwargs = dict(microbatch_size=4, num_microbatches=4, stage_index=0, num_stages=1)
    zero1 = stage_memory(table, nodes, config=TrainingConfig(sharding="optimizer", shards=2),
                         **kwargs)
    zero2 = stage_memory(table, nodes, config=TrainingConfig(sharding="gradients", shards=2),
                         gradients_resident=False, **kwargs)
    trainable = [p for p in dict.fromkeys(graph.param(q) for n in graph.nodes
                                          for q in n.params)
                 if p.kind == "parameter" and p.trainable]
    grads = [param_memory(p, TrainingConfig())[1] for p in trainable]
    parts = optimizer_partition([p.numel for p in trainable], 2)
    owner = {i: r for r, part in enumerate(parts) for i in part}
    order = list(reversed(range(len(trainable))))
    window = gradient_window([grads[i] for i in order], [owner[i] for i in order], 2)
    states = [param_memory(p, TrainingConfig())[2] for p in trainable]
    r = max(range(2), key=lambda r: (sum(grads[i] for i in parts[r]) + window[r]
                                     + sum(states[i] for i in parts[r])))
    assert zero2.optimizer_state == zero1.optimizer_state
    assert zero2.gradients <= sum(grads[i] for i in parts[r]) + window[r]
    assert zero2.gradients < 0.8 * zero1.gradients
    assert zero2.total < zero1.total
    # a parameter another rank also holds (the tied embedding) keeps its whole gradient
    tied = next(p.name for p in trainable if p.aliases)
    kept = stage_memory(table, nodes, config=TrainingConfig(sharding="gradients", shards=2),
                        gradients_resident=False, kept_whole={tied}, **kwargs)
    assert kept.gradients > zero2.gradients


def test_sharding_needs_replicas() -> None:
    with pytest.raises(ShapeError, match="needs data-parallel replicas"):
        PipelineShape(stages=2, replicas=1, num_microbatches=2, microbatch_size=2,
                      sharding="optimizer")


# ---- the search ----------------------------------------------------------------------------------
def _plan(table: CostTable, cluster: ClusterSpec, **pinned: object) -> Partition:
    return search(table, cluster, 32, TrainingConfig(),
                  SearchOptions(stages=2, replicas=2, max_blocks=32, **pinned))  # type: ignore[arg-type]


def _needed(partition: Partition, table: CostTable, cluster: ClusterSpec) -> None:
    """Every rank fits, and every lever a rank uses is one its memory needs: without it (the
    other lever kept) the rank would not fit."""
    from partc.solve.coarsen import coarsen
    from partc.solve.stage_problem import StageProblem

    problem = StageProblem.build(coarsen(table, 32), table, cluster, TrainingConfig(),
                                 partition.shape)
    usable = problem.usable_bytes()
    assert all(m.total <= usable for m in partition.memory)
    S = partition.shape.stages
    holders: dict[str, set[int]] = {}
    for st in partition.stages:
        for name in st.parameters:
            holders.setdefault(name, set()).add(st.rank)
    tied = {name for name, ranks in holders.items() if len(ranks) > 1}
    for d, levers in enumerate(partition.levers):
        nodes = [n for st in partition.stages if st.rank == d for n in st.nodes]
        relayed = [t for st in partition.stages if st.rank == d for t in st.sends
                   if t in st.receives]
        assert partition.memory[d].total == problem.rank_memory_with(d, nodes, relayed,
                                                                     levers, tied).total
        held = [problem.table.graph.param(p) for p in dict.fromkeys(
            p for st in partition.stages if st.rank == d for p in st.parameters)]
        for fewer in (replace(levers, activation_checkpointing=False),
                      replace(levers, sharding="none"),
                      replace(levers, sharding="optimizer" if levers.sharding == "gradients"
                              else levers.sharding)):
            if fewer == levers or problem.rank_memory_with(d, nodes, relayed, fewer,
                                                           tied).total > usable:
                continue
            # not needed for memory: only sharding, and only where it is faster by itself (its
            # share of the optimizer step saves more than the all-gather of the weights costs)
            assert fewer == replace(levers, sharding="none"), (d, levers)
            assert step_seconds(problem, held, d, levers) <= \
                step_seconds(problem, held, d, fewer), (d, levers)
    assert len(partition.levers) == S


def _least_peak(table: CostTable, shape: PipelineShape) -> int:
    from partc.solve.coarsen import coarsen
    from partc.solve.search import _least_peak as least
    from partc.solve.stage_problem import StageProblem

    return least(StageProblem.build(coarsen(table, 32), table, CPU8, TrainingConfig(), shape))


@pytest.mark.parametrize("lever", ["checkpointing", "sharding", "gradients", "both"])
def test_levers_only_where_memory_binds(lever: str) -> None:
    table = table_of("gpt2_no_dropout")
    free = _plan(table, CPU8, sharding="none", activation_checkpointing=False)
    assert all(levers == RankLevers() for levers in free.levers)
    shape = replace(free.shape, activation_checkpointing=False, sharding="none")
    ckpt, shard = replace(shape, activation_checkpointing=True), replace(shape,
                                                                          sharding="optimizer")
    bare = _least_peak(table, shape)
    # memory between what the best cut needs with the lever(s) and without: some rank of every
    # cut needs them
    if lever == "checkpointing":
        low, high, pinned = _least_peak(table, ckpt), bare, {"sharding": "none"}
    elif lever == "sharding":
        low, high, pinned = _least_peak(table, shard), bare, {"activation_checkpointing": False}
    elif lever == "gradients":  # where sharding the optimizer state is not enough
        low, high = _least_peak(table, replace(shard, sharding="gradients")), \
            _least_peak(table, shard)
        pinned = {"activation_checkpointing": False}
    else:
        low = _least_peak(table, replace(ckpt, sharding="optimizer"))
        high, pinned = min(_least_peak(table, ckpt), _least_peak(table, shard)), {}
    assert low < high
    tight = with_memory(CPU8, int((low + high) / 2 / (1 - 0.1)))
    # the free plan's schedule too: another one (1F1B holds fewer micro-batches) may fit bare
    p = _plan(table, tight, num_microbatches=free.shape.num_microbatches,
              schedule=free.shape.schedule, **pinned)
    _needed(p, table, tight)
    used = [levers for levers in p.levers if levers != RankLevers()]
    assert used
    if lever == "checkpointing":
        assert all(levers == RankLevers(True) for levers in used)
    elif lever == "sharding":
        assert all(levers == RankLevers(sharding="optimizer") for levers in used)
    elif lever == "gradients":
        assert RankLevers(sharding="gradients") in used
        assert all(levers.sharding != "none" and not levers.activation_checkpointing
                   for levers in used)
    # what the levers save is recorded per rank
    assert any(w > m.total for w, m in zip(p.memory_without_levers, p.memory, strict=True))
    for st in p.stages:
        assert (st.activation_checkpointing, st.sharding) == \
            (p.levers[st.rank].activation_checkpointing, p.levers[st.rank].sharding)


def test_pinned_levers_are_on_everywhere() -> None:
    table = table_of("transformer")
    p = _plan(table, CPU8, sharding="optimizer", activation_checkpointing=True)
    assert p.levers == (RankLevers(True, "optimizer"),) * 2
    assert p.shape.sharding == "optimizer" and p.shape.activation_checkpointing
    assert all(st.activation_checkpointing and st.sharding == "optimizer" for st in p.stages)
    # the summary says per stage what it uses and saves
    from partc.solve.partition import format_partition

    rows = [ln for ln in format_partition(p).splitlines() if "ckpt+shard-optimizer -" in ln]
    assert len(rows) == 2
    # a lever on costs time: the same cut without them is predicted faster
    off = _plan(table, CPU8, sharding="none", activation_checkpointing=False)
    assert off.iteration_s < p.iteration_s


def test_lever_options_follow_the_shape_and_the_pins() -> None:
    from partc.solve.coarsen import coarsen
    from partc.solve.stage_problem import StageProblem

    table = table_of("mlp")
    blocks = coarsen(table, 8)
    shape = PipelineShape(stages=2, replicas=2, num_microbatches=2, microbatch_size=4,
                          activation_checkpointing=True, sharding="optimizer")
    free = StageProblem.build(blocks, table, CPU8, TrainingConfig(), shape)
    assert len(lever_options(free)) == 4
    pinned = StageProblem.build(blocks, table, CPU8, TrainingConfig(), shape,
                                forced_levers=RankLevers(sharding="optimizer"))
    assert {o.sharding for o in lever_options(pinned)} == {"optimizer"}
    plain = replace(shape, activation_checkpointing=False, sharding="none")
    assert lever_options(StageProblem.build(blocks, table, CPU8, TrainingConfig(), plain)) == \
        [RankLevers()]
    # a cut that fits without levers never recomputes, and shards only where that is faster
    # by itself, unless pinned
    from partc.solve.levers import rank_parameters

    a = tuple(i * 2 // len(blocks.blocks) for i in range(len(blocks.blocks)))
    for d, (levers, params) in enumerate(zip(choose_levers(free, a), rank_parameters(free, a),
                                             strict=True)):
        faster = step_seconds(free, params, d, RankLevers(sharding="optimizer")) < \
            step_seconds(free, params, d, RankLevers())
        assert levers == RankLevers(sharding="optimizer" if faster else "none")
    assert choose_levers(pinned, a) == (RankLevers(sharding="optimizer"),) * 2
    # on a slow link sharding costs more than it saves, and a cut that fits does not shard
    slow = replace(CPU8, intra_node=LinkSpec(bandwidth=1e8, latency_s=1e-3))
    assert choose_levers(StageProblem.build(blocks, table, slow, TrainingConfig(), shape), a) \
        == (RankLevers(),) * 2


# ---- what cannot be sharded, and what a plan records ------------------------------------------
def test_sharding_pins_that_cannot_run_are_one_line_errors() -> None:
    from partc.errors import SearchError

    table = table_of("mlp")
    with pytest.raises(SearchError, match="replicas, and this search has none"):
        search(table, CPU8, 32, TrainingConfig(), SearchOptions(replicas=1, sharding="optimizer"))
    with pytest.raises(SearchError, match="interleaved-1f1b is not supported"):
        search(table, CPU8, 32, TrainingConfig(),
               SearchOptions(schedule="interleaved-1f1b", sharding="optimizer"))
    with pytest.raises(ShapeError, match="virtual stages per rank is not supported"):
        PipelineShape(stages=2, replicas=2, num_microbatches=4, microbatch_size=2,
                      schedule="interleaved-1f1b", chunks=2, sharding="optimizer")
    # ZeroRedundancyOptimizer refuses parameters of two dtypes: pinned, the search says so; free,
    # it never shards them
    mixed = table_of("mixed_dtypes")
    with pytest.raises(SearchError, match="several dtypes"):
        search(mixed, CPU8, 32, TrainingConfig(),
               SearchOptions(stages=1, replicas=2, sharding="optimizer"))
    free = search(mixed, CPU8, 32, TrainingConfig(), SearchOptions(stages=1, replicas=2))
    assert free.levers == (RankLevers(),)


def test_a_plan_records_the_levers_it_uses() -> None:
    """The policy plan.yaml records as allowed is what some rank uses or the user pinned: on a
    slow link nothing shards and nothing recomputes, so the plan says none, whichever shape
    variant its cut came from."""
    slow = replace(CPU8, intra_node=LinkSpec(bandwidth=1e8, latency_s=1e-3),
                   inter_node=LinkSpec(bandwidth=1e8, latency_s=1e-3))
    p = search(table_of("transformer"), slow, 32, TrainingConfig(),
               SearchOptions(stages=2, replicas=2))
    assert p.levers == (RankLevers(),) * 2
    assert (p.shape.activation_checkpointing, p.shape.sharding) == (False, "none")
    assert (p.training.activation_checkpointing, p.training.sharding) == (False, "none")


def test_a_sharded_step_broadcasts_each_share() -> None:
    """torch's _sync_params broadcasts each replica's updated share on the replicas' group, one
    after the other: the shares' bytes once over the link, (R - 1) latencies each."""
    link = CPU8.intra_node
    group = (0, 1, 2, 3)
    assert CPU8.broadcast_s(4_000_000, group) == pytest.approx(
        4_000_000 / link.bandwidth + 3 * link.latency_s)
    assert CPU8.broadcast_s(0, group) == 0.0 and CPU8.broadcast_s(10, (0,)) == 0.0


# ---- the optimizer step's time ------------------------------------------------------------------
def test_optimizer_step_pays_a_dispatch_per_tensor_on_cpu_only() -> None:
    """torch's foreach step runs its kernels tensor by tensor on a CPU: a rank's step is its bytes
    at the memory bandwidth plus `step_kernels` dispatches per tensor (ResNet's many small batch
    norm tensors step in 1 ms where their bytes take 0.1 ms); a GPU's foreach kernels take many
    tensors per launch. Those kernels run outside autograd: the device's dispatch without it
    (`dispatch_overhead_s`, 1.14 us on the shipped CPU against 1.81 us with autograd). The
    solver's per-rank units price the same step."""
    from partc.hardware.configs import load_device
    from partc.solve.coarsen import coarsen
    from partc.solve.levers import rank_parameters
    from partc.solve.stage_problem import (
        StageProblem,
        step_dispatch_s,
        step_seconds_of,
        sync_bytes,
    )

    table = table_of("resnet")
    blocks = coarsen(table, 16)
    shape = PipelineShape(stages=2, replicas=1, num_microbatches=2, microbatch_size=4)
    gpu = replace(CPU8, device=replace(load_device("h100-80gb"), memory_bytes=1 << 40))
    for optimizer in ("adam", "sgd"):
        training = TrainingConfig(optimizer=optimizer)
        for cluster in (CPU8, gpu):
            problem = StageProblem.build(blocks, table, cluster, training, shape)
            a = tuple(i * 2 // len(blocks.blocks) for i in range(len(blocks.blocks)))
            assert cluster.device.kind != "cpu" or \
                cluster.device.no_grad_overhead_s() < cluster.device.op_overhead_s
            per_tensor = training.optimizer_spec.step_kernels * \
                cluster.device.no_grad_overhead_s()
            assert step_dispatch_s(training, cluster.device) == \
                (per_tensor if cluster.device.kind == "cpu" else 0.0)
            units = problem.rank_sync(a)
            for d, params in enumerate(rank_parameters(problem, a)):
                stepped = [p for p in params if sync_bytes(p, training)[0]]
                assert len(stepped) > 10  # convolutions' and batch norms' weights and biases
                want = sum(step_seconds_of(p, training, cluster.device) for p in stepped) + \
                    len(stepped) * step_dispatch_s(training, cluster.device)
                got = step_seconds(problem, params, d, RankLevers())
                assert got == pytest.approx(want, rel=1e-9)
                # the solver's integer units: the same step, each parameter rounded to a unit
                unit = problem.time_unit_s
                assert abs(units[d] * unit - got) <= len(stepped) * unit, (d, units[d] * unit, got)


def test_each_ranks_step_starts_cold_once() -> None:
    """launch's optimizer steps follow the backward's and the transfers' work: each starts from
    evicted caches and pays the device's measured `step_cold_s` once (per optimizer: one per
    chunk a rank holds), on top of its parameters' steps; a rank without trainable parameters
    steps nothing and pays nothing. The closed loop's priced step holds the same term, so its
    optimizer factor corrects what is left."""
    from partc.solve.coarsen import coarsen
    from partc.solve.levers import rank_parameters
    from partc.solve.stage_problem import StageProblem

    table = table_of("resnet")
    blocks = coarsen(table, 16)
    shape = PipelineShape(stages=2, replicas=1, num_microbatches=2, microbatch_size=4)
    training = TrainingConfig(optimizer="adamw")
    cold = replace(CPU8, device=replace(CPU8.device, step_cold_s=0.6e-3))
    a = tuple(i * 2 // len(blocks.blocks) for i in range(len(blocks.blocks)))
    warm_problem = StageProblem.build(blocks, table, CPU8, training, shape)
    cold_problem = StageProblem.build(blocks, table, cold, training, shape)
    for d, params in enumerate(rank_parameters(warm_problem, a)):
        warm = step_seconds(warm_problem, params, d, RankLevers())
        assert step_seconds(cold_problem, params, d, RankLevers()) == \
            pytest.approx(warm + 0.6e-3, rel=1e-9)
    assert step_seconds(cold_problem, [], 0, RankLevers()) == 0.0
    frozen = [replace(p, trainable=False) for p in rank_parameters(cold_problem, a)[0]]
    assert step_seconds(cold_problem, frozen, 0, RankLevers()) == 0.0


def test_a_cpu_steps_a_parameter_from_its_cache_when_its_working_set_fits() -> None:
    """A CPU optimizer steps one parameter at a time. Where the parameter's step working set
    (weights, gradient, states, temporary) fits the device's cache, its first pass reads them
    from memory and the other passes run at the cache's rate; a larger one streams every pass
    from memory, as does every parameter on a device without a cache term (the GPUs')."""
    from partc.graph.opgraph import Param
    from partc.hardware.configs import load_device
    from partc.solve.memory import param_memory
    from partc.solve.stage_problem import step_seconds_of, sync_bytes

    cpu = replace(load_device("cpu"), cache_bytes=96 << 20, cache_bandwidth=27e9)
    memory = cpu.bytes_per_s()
    training = TrainingConfig(optimizer="adamw")
    small = Param(name="w", shape=(1024, 1024), dtype="float32", kind="parameter",
                  trainable=True)
    large = replace(small, shape=(30522, 1024))
    moved = sync_bytes(small, training)[1]
    assert moved == 1024 * 1024 * 80  # AdamW: 20 passes of 4 bytes
    weights, grads, states, temps = param_memory(small, training)
    assert weights + grads + states + temps <= cpu.cache_bytes
    first = weights + grads + states
    assert step_seconds_of(small, training, cpu) == pytest.approx(
        first / memory + (moved - first) / 27e9)
    # 2.4x faster than every pass from memory, as measured on the shipped CPU's machine
    assert step_seconds_of(small, training, replace(cpu, cache_bytes=0, cache_bandwidth=0.0)) \
        == pytest.approx(moved / memory)
    assert sum(param_memory(large, training)) > cpu.cache_bytes
    assert step_seconds_of(large, training, cpu) == pytest.approx(
        sync_bytes(large, training)[1] / memory)
    frozen = replace(small, trainable=False)
    assert step_seconds_of(frozen, training, cpu) == 0.0
    # a cache slower than memory is no faster than memory
    slow = replace(cpu, cache_bandwidth=memory / 2)
    assert step_seconds_of(small, training, slow) == pytest.approx(moved / memory)
