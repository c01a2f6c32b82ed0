"""The search ranks its final cuts by the simulator, not by the solver's smooth objective J.

docs/solver.md, step 5: the cuts of the best shapes (the strategy's own, the DP's and the
baselines' of the same shape) are simulated and the fastest simulated one is the plan, so partc
never emits a plan its own simulator puts slower than a baseline's cut of the same shape. The
problems here are synthetic chains built without torch: per-layer forward/backward times and
activation widths chosen so that transfers (which J counts as busy time and the simulator overlaps)
make J and the simulator disagree. The clusters are this machine's CPU device with 4 devices:
with gloo (the simulator exposes every transfer at the fused exchanges of torch's schedule and
copies it on both cores, docs/simulator.md) and with asynchronous, NCCL-style transfers (which it
overlaps with compute).
"""
from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path
from typing import Sequence

import jsonschema
import pytest

from partc.cost.table import CostSource, CostTable, Curve, NodeCost
from partc.graph.opgraph import GraphOutput, OpGraph, OpNode, Param, TensorSpec
from partc.hardware.configs import load_cluster
from partc.hardware.specs import ClusterSpec
from partc.options import SearchOptions, Strategy, TrainingConfig
from partc.solve.coarsen import coarsen
from partc.solve.partition import CutCandidate, Partition, SolverReport, round_seconds
from partc.solve.search import RERANK_SHAPES, TIE_TOLERANCE, build_partition, search
from partc.solve.stage_problem import StageProblem
from partc.solve.strategies.baselines import params_assignment, uniform_assignment

ROOT = Path(__file__).resolve().parents[2]
CPU4 = replace(load_cluster("cpu"), devices_per_node=4)  # gloo
ASYNC4 = replace(CPU4, backend="nccl")
CLUSTERS = {"gloo": CPU4, "async": ASYNC4}
BATCH = 4  # the captured batch size of the synthetic graphs


def chain_table(fwd_ms: Sequence[float], bwd_ms: Sequence[float],
                widths: Sequence[int], weight_columns: Sequence[int] = ()) -> CostTable:
    """A chain x -> layers.0 -> ... -> layers.{n-1} -> output of linear layers (one 64 x 64
    weight each unless `weight_columns` says otherwise, so `params` cuts like `uniform`):
    forward/backward times per layer at micro-batch BATCH, proportional to the micro-batch size;
    layer i's output is [batch, widths[i]] float32."""
    n = len(fwd_ms)
    nodes, params = [], []
    prev = "x"
    for i in range(n):
        weight = f"layers.{i}.weight"
        columns = weight_columns[i] if weight_columns else 64
        params.append(Param(weight, (64, columns), "float32", "parameter", True))
        nodes.append(OpNode(
            name=f"n{i}", target="aten.linear.default", kind="linear", module=f"layers.{i}",
            module_type="torch.nn.modules.linear.Linear", inputs=(prev,), params=(weight,),
            outputs=(TensorSpec(f"n{i}", (BATCH, widths[i]), "float32", 0),), flops=0,
            flops_per_sample=1, bytes_read=0, bytes_written=0, is_view=False))
        prev = f"n{i}"
    graph = OpGraph(model_name="synthetic", batch_size=BATCH, on_meta=False,
                    inputs=(TensorSpec("x", (BATCH, 64), "float32", 0),),
                    outputs=(GraphOutput(prev, "<output>"),), params=tuple(params),
                    nodes=tuple(nodes),
                    modules=tuple((f"layers.{i}", "torch.nn.modules.linear.Linear")
                                  for i in range(n)))
    source = CostSource(kind="analytic", device="cpu", device_kind="cpu", provider="", threads=0,
                        graph_hash=graph.content_hash(), model="synthetic",
                        batch_sizes=(BATCH,))
    costs = {f"n{i}": NodeCost(Curve.line(0.0, fwd_ms[i] * 1e-3 / BATCH),
                               Curve.line(0.0, bwd_ms[i] * 1e-3 / BATCH), Curve.line(0.0, 1e3),
                               "analytic") for i in range(n)}
    return CostTable(graph=graph, source=source, nodes=costs)


def random_table(seed: int, n: int = 8) -> CostTable:
    rng = random.Random(seed)
    fwd = [round(rng.uniform(0.2, 3.0), 2) for _ in range(n)]
    bwd = [round(f * rng.uniform(0.5, 4.0), 2) for f in fwd]
    return chain_table(fwd, bwd, [rng.choice([16, 4096, 65536]) for _ in range(n)])


# Found by sweeping random chains on CPU4: J puts the strategy's own cut 3.5% ahead of the
# uniform cut (layers 0-3 | 4-7); the simulator, which runs the schedule's order (J sees only each
# stage's forward + backward) and a gloo transfer as a rendezvous at the points torch posts and
# waits, puts the uniform cut 2.5% ahead.
DISAGREE = chain_table(fwd_ms=[1.8, 0.7, 2.9, 2.8, 1.5, 2.1, 0.8, 0.8],
                       bwd_ms=[2.7, 2.0, 3.6, 10.9, 1.1, 2.5, 0.6, 2.6],
                       widths=[4096, 16, 4096, 4096, 16, 65536, 4096, 4096])
PINNED = SearchOptions(stages=2, replicas=1, schedule="1f1b", num_microbatches=4,
                       time_limit_s=1)


def assignment_of(p: Partition) -> tuple[int, ...]:
    stage_of = {b: st.index for st in p.stages for b in st.blocks}
    return tuple(stage_of[b] for b in sorted(stage_of))


def baseline_cuts(p: Partition, table: CostTable, options: SearchOptions,
                  cluster: ClusterSpec) -> dict[str, Partition]:
    """The uniform and params cuts of the plan's shape, built and simulated like the plan."""
    from partc.solve.coarsen import coarsen

    blocks = coarsen(table, options.max_blocks)
    problem = StageProblem.build(blocks, table, cluster, TrainingConfig(), p.shape)
    usable = problem.usable_bytes()
    out = {}
    for name, fn in (("uniform", uniform_assignment), ("params", params_assignment)):
        a = fn(blocks, p.shape.virtual_stages)
        if a is not None and problem.valid(a) and \
                all(m.total <= usable for m in problem.exact_memory(a)):
            out[name] = build_partition(problem, a, p.global_batch_size, p.solver)
    return out


def test_the_simulator_overrules_the_objective_when_they_disagree() -> None:
    for strategy in ("cpsat", "chain-dp"):
        p = search(DISAGREE, CPU4, 8, options=replace(PINNED, strategy=strategy))
        r = p.solver
        assert r.strategy == strategy and r.chosen_cut == "uniform"
        assert assignment_of(p) == (0, 0, 0, 0, 1, 1, 1, 1)
        chosen, own = r.candidates[0], r.candidates[1]
        assert chosen.cut_from == "uniform" and own.cut_from == strategy
        # J prefers the strategy's own cut, the simulator the uniform one.
        assert own.objective_s < chosen.objective_s * 0.97
        assert chosen.iteration_s < own.iteration_s * 0.98
        assert chosen.iteration_s == p.iteration_s
        assert r.objective_s == pytest.approx(chosen.objective_s)  # J of the cut emitted
        # The bound is still over every cut of the shape, so it bounds the emitted cut's J too.
        assert r.bound_s is not None and r.bound_s <= r.objective_s
        assert r.gap is not None and r.gap > 0.03


@pytest.mark.parametrize("strategy", ["cpsat", "chain-dp"])
@pytest.mark.parametrize("transfers", ["gloo", "async"])
def test_the_plan_never_simulates_slower_than_a_baseline_cut_of_its_shape(
        strategy: str, transfers: str) -> None:
    cluster = CLUSTERS[transfers]
    chosen_elsewhere = ties_to_conventional = 0
    for seed in range(10):
        table = random_table(seed)
        for options in (SearchOptions(time_limit_s=1),
                        replace(PINNED, stages=3), replace(PINNED, schedule="gpipe")):
            options = replace(options, strategy=strategy)
            p = search(table, cluster, 8, options=options)
            assert all(m.total <= p.usable_memory_bytes for m in p.memory)
            baselines = baseline_cuts(p, table, options, cluster)
            for name, b in baselines.items():
                assert round_seconds(p.iteration_s) <= round_seconds(b.iteration_s), \
                    (seed, options, name)
            r = p.solver
            # The candidates are listed fastest first; the chosen cut is the fastest, or one the
            # model cannot tell from it (a tie: TIE_TOLERANCE), then a conventional one, then
            # the one that holds the least memory.
            times = [round_seconds(c.iteration_s) for c in r.candidates]
            assert times == sorted(times) and len({c.shape for c in r.candidates}) <= RERANK_SHAPES
            peak = max(m.total for m in p.memory)
            assert all(c.peak_bytes is not None for c in r.candidates)
            chosen = [c for c in r.candidates if c.cut_from == r.chosen_cut
                      and round_seconds(c.iteration_s) == round_seconds(p.iteration_s)
                      and c.peak_bytes == peak]
            assert chosen, (seed, options)
            tied = [c for c in r.candidates
                    if c.iteration_s <= r.candidates[0].iteration_s * (1 + TIE_TOLERANCE)]
            assert chosen[0] in tied
            if any(c.cut_from in ("uniform", "params") for c in tied):
                # a conventional cut: uniform's or params', whichever source found it
                assert any(assignment_of(b) == assignment_of(p) for b in baselines.values())
                ties_to_conventional += chosen[0] is not r.candidates[0]
            elif len(tied) == 1:
                assert chosen[0] is r.candidates[0]
            chosen_elsewhere += r.chosen_cut != strategy
    assert chosen_elsewhere > 0  # the sweep does exercise the re-ranking
    if transfers == "async":
        # ... and the tie rule (these random chains never tie under gloo: none in 25 seeds)
        assert ties_to_conventional > 0


def test_the_search_is_deterministic_with_re_ranking(tmp_path: Path) -> None:
    for options in (PINNED, SearchOptions(time_limit_s=1)):
        a = search(DISAGREE, CPU4, 8, options=options)
        b = search(DISAGREE, CPU4, 8, options=options)
        assert a.to_dict(include_time=False) == b.to_dict(include_time=False)
        first = a.save(tmp_path / "a.yaml").read_bytes()
        assert first == b.save(tmp_path / "b.yaml").read_bytes()


@pytest.mark.parametrize("strategy", ["uniform", "params"])
def test_baselines_asked_for_directly_keep_their_own_cut(strategy: Strategy) -> None:
    from partc.solve.coarsen import coarsen

    fn = uniform_assignment if strategy == "uniform" else params_assignment
    blocks = coarsen(DISAGREE, PINNED.max_blocks)
    for options in (PINNED, replace(PINNED, stages=3), SearchOptions(time_limit_s=1)):
        p = search(DISAGREE, CPU4, 8, options=replace(options, strategy=strategy))
        assert p.solver.chosen_cut == strategy and p.solver.candidates == ()
        assert assignment_of(p) == fn(blocks, p.shape.virtual_stages)


def test_report_records_the_choice_and_reads_older_plans() -> None:
    p = search(DISAGREE, CPU4, 8, options=PINNED)
    d = p.solver.to_dict(include_time=False)
    assert d["cut_from"] == "uniform"
    assert [c["cut_from"] for c in d["candidates"]] == ["uniform", "cpsat"]
    assert SolverReport.from_dict(d).to_dict(include_time=False) == d
    assert p.solver.recorded().candidates == tuple(
        CutCandidate.from_dict(c) for c in d["candidates"])
    # The plan schema's solver section accepts it, and a plan written before these keys existed.
    schema = json.loads((ROOT / "partc/plans/schema/plan-v1.schema.json").read_text())
    solver_schema = {**schema["properties"]["solver"], "$defs": schema["$defs"]}
    jsonschema.validate(d, solver_schema)
    old = {k: v for k, v in d.items() if k not in ("cut_from", "candidates")}
    jsonschema.validate(old, solver_schema)
    read = SolverReport.from_dict(old)
    assert read.chosen_cut == read.strategy == "cpsat" and read.candidates == ()
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**d, "cut_from": "greedy"}, solver_schema)


def test_a_tie_goes_to_a_conventional_cut_the_strategy_also_found() -> None:
    """The strategy's own cut can be uniform's cut too: it is then the conventional cut a tie goes
    to, not a slower conventional one. 40 equal layers but a near-free 21st: cutting after layer
    20 (uniform's cut, and the optimum) or after 21 (params' cut: the last layer's weight is twice
    the others) differ by that layer alone, 0.05%, within TIE_TOLERANCE. The plan was params' cut
    while uniform's, found first by cpsat, was faster: slower than a baseline's cut of its shape
    (found on the BERT example under bf16-mixed, 277.98 against 278.53 ms)."""
    n = 40
    fwd = [0.01 if i == 20 else 1.0 for i in range(n)]
    table = chain_table(fwd, [2 * f for f in fwd], [16] * n,
                        weight_columns=[128 if i == n - 1 else 64 for i in range(n)])
    for strategy in ("cpsat", "chain-dp"):
        p = search(table, CPU4, 8, options=replace(PINNED, strategy=strategy))
        shape = p.solver.candidates[0].shape
        cuts = {c.cut_from: c for c in p.solver.candidates if c.shape == shape}
        assert "params" in cuts and "uniform" not in cuts  # uniform's cut is the strategy's own
        assert cuts["params"].iteration_s > cuts[strategy].iteration_s
        assert cuts["params"].iteration_s <= cuts[strategy].iteration_s * (1 + TIE_TOLERANCE)
        assert assignment_of(p) == tuple(0 if i < 20 else 1 for i in range(n))
        for name, b in baseline_cuts(p, table, replace(PINNED, strategy=strategy), CPU4).items():
            assert round_seconds(p.iteration_s) <= round_seconds(b.iteration_s), name


def test_a_tie_goes_to_the_cut_that_holds_less_memory() -> None:
    """Among cuts whose simulated times tie, the plan is the one whose most loaded rank holds
    the least. The same cut under GPipe and 1F1B (4 micro-batches, 2 stages): GPipe simulates
    0.4% faster, within TIE_TOLERANCE, and holds all 4 micro-batches' activations on rank 0
    where 1F1B holds 2. Measured on this repository's CPU machine, the BERT example's cut
    predicted so ran 3-8% slower under GPipe (docs/solver.md); the time model cannot tell them
    apart, the memory model can."""
    table = random_table(1)
    free = SearchOptions(stages=2, replicas=1, num_microbatches=4, time_limit_s=1)
    for strategy in ("cpsat", "chain-dp"):
        options = replace(free, strategy=strategy)
        p = search(table, CPU4, 16, options=options)
        gpipe = search(table, CPU4, 16, options=replace(options, schedule="gpipe"))
        assert assignment_of(gpipe) == assignment_of(p)
        assert p.shape.schedule == "1f1b" and gpipe.shape.schedule == "gpipe"
        assert gpipe.iteration_s < p.iteration_s <= gpipe.iteration_s * (1 + TIE_TOLERANCE)
        assert max(m.total for m in p.memory) < max(m.total for m in gpipe.memory)
        assert p.solver.candidates[0].shape.endswith("gpipe")  # the fastest, not chosen


def test_shapes_are_compared_with_their_cores_shared() -> None:
    # On cpu-4 (4 processes on 2 cores) a 2-stage, 2-replica pipeline's stages share cores
    # whichever way its replicas are placed, so more micro-batches overlap nothing: J, blind to
    # the sharing, put 8 micro-batches 40% ahead of 1 and its bound pruned the shapes the
    # simulator puts first. Compared with their cores shared, the searched plan is as fast as
    # the best of every micro-batch count pinned.
    shared = load_cluster("cpu-4")
    assert shared.devices_per_core > 1
    table = chain_table([1.0] * 8, [2.0] * 8, [64] * 8)
    options = SearchOptions(stages=2, replicas=2, time_limit_s=1)
    searched = search(table, shared, 32, options=options)
    pinned = [search(table, shared, 32, options=replace(options, num_microbatches=m))
              for m in (1, 2, 4, 8)]
    assert searched.iteration_s <= min(p.iteration_s for p in pinned) * (1 + TIE_TOLERANCE)
    # the estimate is J's where no core is shared, and never below J
    problem = StageProblem.build(coarsen(table, 128), table, shared, TrainingConfig(),
                                 searched.shape)
    cut = assignment_of(searched)
    assert problem.shared_core_objective(cut) >= problem.objective(cut)
    alone = StageProblem.build(coarsen(table, 128), table, CPU4, TrainingConfig(),
                               searched.shape)
    assert alone.shared_core_objective(cut) == alone.objective(cut)
