"""The hybrid-parallel search: CostTable + cluster + global batch -> Partition.

Outer search over pipeline shapes (stages S, replicas R with S*R <= devices, micro-batches M,
schedule, activation checkpointing, placement), inner stage assignment per shape by the chosen
strategy. Every strategy gets the same outer search, cost model, memory model and simulator, so
their plans compare like for like:

1. Enumerate the shapes the options allow (docs/solver.md lists the rules: torch's schedule
   constraints, M dividing the per-replica batch, interleaving only when M is a multiple of S).
2. Give each an analytic lower bound of its objective (perfect balance, no communication, the
   average rank's all-reduce) and drop shapes whose parameters alone cannot fit.
3. Evaluate shapes in order of their bound, stopping once the next bound is no better than the
   best plan found (branch and bound; shapes compared by `_Candidate.estimate_s`, J paced by
   shared cores where ranks share one): `uniform`/`params` place their cut, `chain-dp` and `cpsat`
   run the exact contiguous DP. Each assignment is checked with the exact memory model; when the
   linear model inside the solvers was too optimistic for a rank, that rank's capacity is
   tightened and the shape re-solved.
4. `cpsat` then optimises the best `refine` shapes with CP-SAT over the block DAG, seeded with the
   DP's and baselines' cuts, and reports its bound and gap.
5. `cpsat` and `chain-dp`: the cuts of the best RERANK_SHAPES layouts (by the objective) -- the
   strategy's own, the DP's and the baselines' of the same shape -- are simulated
   (partc.solve.simulator) and the fastest simulated one that fits memory is the plan: the
   objective is a smooth estimate that can disagree with the simulator, and a plan must never be
   one the simulator puts slower than a baseline's cut of its shape. Cuts within TIE_TOLERANCE
   of the fastest are a tie the model cannot break, which goes to the conventional cut (uniform's
   or params'; a cut is conventional whichever source found it) whose busiest rank holds the
   least memory, then the faster. `uniform` and `params` keep
   their own cut. The plan is simulated for the
   predicted iteration time and bubble.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from itertools import product
from typing import Any, Callable, Sequence

from partc.cost.table import CostTable
from partc.errors import PartcError, SearchError
from partc.hardware.specs import ClusterSpec
from partc.hardware.units import format_quantity
from partc.options import (
    SHARDED_STATE,
    SHARDINGS,
    STRATEGIES,
    Placement,
    Schedule,
    SearchOptions,
    Sharding,
    Strategy,
    TrainingConfig,
)
from partc.progress import Progress
from partc.solve.coarsen import BlockGraph, coarsen
from partc.solve.levers import (
    allreduce_seconds,
    choose_levers,
    gradient_reduce_seconds,
    rank_parameters,
    step_seconds,
)
from partc.solve.memory import (
    in_flight_microbatches,
    param_memory,
    stage_boundary,
    usable_memory,
)
from partc.solve.partition import (
    CutCandidate,
    Partition,
    SolverReport,
    SpeedSpreadPrice,
    StagePlan,
    round_seconds,
)
from partc.solve.simulator import PipelineSpec, StageTiming, TiedSync, simulate
from partc.solve.stage_problem import (
    PipelineShape,
    RankLevers,
    StageProblem,
    gradient_add_s,
    stage_fixed_s,
    sync_bytes,
    wire_bytes,
)
from partc.solve.stragglers import expected_iteration_s
from partc.solve.strategies.baselines import params_assignment, uniform_assignment
from partc.solve.strategies.chain_dp import solve_chain_dp
from partc.solve.strategies.cpsat import solve_cpsat

_MAX_CORRECTION_ROUNDS = 4

# How many of the best shapes (by the solver's objective J, after refinement) have their cuts
# re-ranked by the simulator (module docstring, step 5). J and the simulated iteration disagree
# by up to ~20% between cuts of one shape but rarely reorder shapes J puts far apart; 3 shapes of
# up to 4 cuts each cost 12 simulations, negligible next to the solves. A constant, not an
# option: it changes plans, and SearchOptions' fields are recorded in every plan.
RERANK_SHAPES = 3
# Strategies whose cut is re-ranked against the baselines'; a baseline asked for runs its own cut.
RERANKED_STRATEGIES: tuple[Strategy, ...] = ("cpsat", "chain-dp")
# Simulated iterations closer than this (relative) are a tie the model cannot break: the re-ranking
# then takes a conventional cut (uniform's or params'), the one users already trust. Measured
# on this repository's CPU machine, two cuts predicted 0.01% apart ran 6-7% apart, either way round
# from run to run (docs/benchmarks.md); the calibrated model is good to a few percent, not better.
TIE_TOLERANCE = 0.005
# The conventional cuts a tie goes to (the faster of them).
_CONVENTIONAL = frozenset({"uniform", "params"})


class InfeasibleMemoryError(PartcError):
    """No shape fits the devices' memory however the model is cut."""


@dataclass
class _Candidate:
    shape: PipelineShape
    lower_bound_s: float
    problem: StageProblem | None = None
    assignment: tuple[int, ...] | None = None
    objective_s: float = math.inf
    status: str = ""
    bound_s: float | None = None  # proven lower bound for this shape (CP-SAT / exact DP)
    hints: tuple[tuple[int, ...], ...] = ()
    source: Strategy | None = None  # whose cut `assignment` is
    dp_assignment: tuple[int, ...] | None = None  # the exact DP's cut, when it fits
    # (assignment, objective_s) -> estimate: the shared-core objective is O(blocks) and read
    # in every comparison of the branch and bound and the sorts; the key keeps it right when
    # the search replaces a candidate's cut.
    _estimate_memo: tuple[tuple[int, ...], float, float] | None = field(
        default=None, repr=False, compare=False)

    @property
    def estimate_s(self) -> float:
        """What shapes are compared by (the branch and bound, the shapes CP-SAT refines and the
        re-ranking simulates): J of its cut with the steady state paced by shared cores
        (`StageProblem.shared_core_objective`); J itself where no core is shared. The cut
        within a shape is still J's."""
        if self.assignment is None or self.problem is None:
            return math.inf
        if not self.problem.core_sharing:
            return self.objective_s
        memo = self._estimate_memo
        if memo is not None and memo[0] == self.assignment and memo[1] == self.objective_s:
            return memo[2]
        unit = self.problem.time_unit_s / self.shape.chunks
        # max(): CP-SAT's objective is integer-scaled and may round below the Python J
        estimate = max(self.objective_s,
                       self.problem.shared_core_objective(self.assignment) * unit)
        self._estimate_memo = (self.assignment, self.objective_s, estimate)
        return estimate


# ---- shapes ----------------------------------------------------------------------------------
def enumerate_shapes(cluster: ClusterSpec, global_batch: int, num_blocks: int,
                     options: SearchOptions) -> list[PipelineShape]:
    """Every shape the options allow on the cluster (module docstring, step 1)."""
    N = cluster.num_devices
    if options.stages is not None and options.stages > N:
        raise SearchError(f"--stages {options.stages} needs more devices than the cluster's {N}",
                          hint=f"use at most {N} stages or a larger cluster")
    if options.stages is not None and options.stages > num_blocks:
        raise SearchError(f"--stages {options.stages} is more than the model's {num_blocks} "
                          "blocks", hint="use fewer stages or raise --max-blocks")
    if options.replicas is not None and global_batch % options.replicas:
        raise SearchError(f"global batch {global_batch} is not divisible by --replicas "
                          f"{options.replicas}", hint="pick a batch size that splits evenly")
    if options.sharding not in (None, "none"):
        if options.replicas == 1 or N < 2:
            raise SearchError(f"--sharding {options.sharding} shards over a stage's data-parallel "
                              "replicas, and this search has none"
                              + (" (--replicas 1)" if options.replicas == 1 else
                                 f" (the cluster has {N} device)"),
                              hint="use --replicas 2 or more, or --sharding none")
        if options.schedule == "interleaved-1f1b":
            raise SearchError(f"--sharding {options.sharding} with --schedule interleaved-1f1b is "
                              "not supported", hint="use --sharding none, or another schedule")
    stage_counts = [options.stages] if options.stages else range(1, min(N, num_blocks) + 1)
    # replicas split the global batch: only its divisors, not every count up to N (a cluster of
    # 10^5 devices made that loop the search's slowest step, and 10^9 never ended)
    batch_divisors = _divisors(global_batch, N)
    shapes: list[PipelineShape] = []
    for S in stage_counts:
        replica_counts = [options.replicas] if options.replicas else \
            [R for R in batch_divisors if R <= N // S]
        for R in replica_counts:
            if S * R > N or global_batch % R:
                continue
            per_replica = global_batch // R
            if options.num_microbatches:
                counts = [options.num_microbatches] if per_replica % options.num_microbatches \
                    == 0 else []
            else:
                counts = [M for M in range(1, min(per_replica, options.max_microbatches) + 1)
                          if per_replica % M == 0]
            for M in counts:
                for schedule, chunks in _schedules(S, M, num_blocks, options.schedule):
                    for ckpt in ((options.activation_checkpointing,)
                                 if options.activation_checkpointing is not None
                                 else (False, True)):
                        placements: list[Placement] = ["stage-major"]
                        if cluster.num_nodes > 1 and S > 1 and R > 1:
                            placements.append("pipeline-major")
                        for placement, sharding in product(placements,
                                                           _shardings(R, chunks, options)):
                            shapes.append(PipelineShape(
                                stages=S, replicas=R, num_microbatches=M,
                                microbatch_size=per_replica // M, schedule=schedule,
                                chunks=chunks, activation_checkpointing=ckpt,
                                placement=placement, sharding=sharding))
    if not shapes:
        pinned = _pinned(options)
        hint = "the per-replica batch must split into the micro-batches; 1F1B needs at least " \
               "as many micro-batches as stages"
        if options.schedule == "interleaved-1f1b":
            hint = ("interleaved 1F1B needs 2 stages or more, a micro-batch count that is a "
                    "multiple of the stages, and 2 blocks per stage (--max-blocks); " + hint)
        raise SearchError(f"no pipeline shape fits global batch {global_batch} on {N} devices"
                          + (f" with {pinned}" if pinned else ""), hint=hint)
    return shapes


def _divisors(n: int, limit: int) -> list[int]:
    """The divisors of n up to limit, ascending: from n's prime factors (trial division stops
    at the square root of what is left, so a batch of 2^60 factors at once, and at limit:
    a larger prime divides no divisor up to it)."""
    factors: dict[int, int] = {}
    rest, p = n, 2
    while p * p <= rest and p <= limit:
        while rest % p == 0:
            factors[p] = factors.get(p, 0) + 1
            rest //= p
        p += 1 if p == 2 else 2
    if rest > 1:
        factors[rest] = factors.get(rest, 0) + 1
    divisors = [1] if limit >= 1 else []
    for prime, power in factors.items():
        divisors = [d * prime ** e for d in divisors for e in range(power + 1)
                    if d * prime ** e <= limit]
    return sorted(divisors)


def require_shapes(cluster: ClusterSpec, global_batch: int, max_blocks: int,
                   options: SearchOptions) -> None:
    """SearchError when no shape the options allow can fit, whatever blocks the model's costs
    coarsen to: `enumerate_shapes` with `max_blocks`, the most there can be (more blocks only
    allow more shapes). Called before pricing, so that a batch the pinned micro-batches cannot
    split fails in seconds, not after a profile is measured; the search checks again with the
    real block count."""
    enumerate_shapes(cluster, global_batch, max_blocks, options)


def _shardings(replicas: int, chunks: int, options: SearchOptions) -> tuple[Sharding, ...]:
    """What a shape of `replicas` replicas and `chunks` virtual stages per rank may shard:
    nothing without replicas or with virtual stages (PipelineShape); else the pinned choice, or
    every one (each rank then turns it off where it does not pay, partc.solve.levers)."""
    if replicas < 2 or chunks > 1:
        return ("none",) if options.sharding in (None, "none") else ()
    return (options.sharding,) if options.sharding is not None else SHARDINGS


def _schedules(S: int, M: int, num_blocks: int,
               pinned: Schedule | None) -> list[tuple[Schedule, int]]:
    """(schedule, virtual stages per rank) pairs torch can run for S ranks and M micro-batches.
    One rank: 1F1B only (GPipe holds every micro-batch for nothing). torch's Schedule1F1B needs
    M >= S; interleaving runs when M is a multiple of S. Interleaved 1F1B is searched only when
    pinned: the objective assumes balanced virtual stages, and CP-SAT exploits that with cuts the
    simulator finds up to 28% slower (docs/solver.md, limits)."""
    options: list[tuple[Schedule, int]] = []
    if S == 1:
        options = [("1f1b", 1)]
    else:
        options.append(("gpipe", 1))
        if M >= S:
            options.append(("1f1b", 1))
        if pinned == "interleaved-1f1b" and M % S == 0 and num_blocks >= 2 * S:
            options.append(("interleaved-1f1b", 2))
    if pinned is not None:
        if pinned == "gpipe" and S == 1:
            return [("gpipe", 1)]
        options = [o for o in options if o[0] == pinned]
    return options


def _pinned(options: SearchOptions) -> str:
    parts = []
    for name, flag in (("stages", "--stages"), ("replicas", "--replicas"),
                       ("num_microbatches", "--microbatches"), ("schedule", "--schedule")):
        value = getattr(options, name)
        if value is not None:
            parts.append(f"{flag} {value}")
    if options.activation_checkpointing is not None:
        parts.append("--checkpointing" if options.activation_checkpointing
                     else "--no-checkpointing")
    if options.sharding is not None:
        parts.append(f"--sharding {options.sharding}")
    return " ".join(parts)


# ---- bounds ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class ParameterTotals:
    """What the shape bounds need from the parameters, which depends on the training settings but
    not on the shape: computed once per search, not once per shape (with thousands of shapes on
    64 devices and thousands of parameters, recomputing it dominated the search)."""

    static_bytes: int  # weights + gradients + optimizer state of the whole model
    block_static_bytes: tuple[int, ...]  # the same per block
    grad_bytes: int  # gradient bytes all-reduced per iteration
    step_bytes: int  # bytes the optimizer step moves
    state_bytes: int = 0  # the optimizer state alone (what sharding splits)
    block_state_bytes: tuple[int, ...] = ()  # the same per block
    block_grad_bytes: tuple[int, ...] = ()  # gradient bytes per block (what ZeRO-2 splits)

    @classmethod
    def of(cls, blocks: BlockGraph, table: CostTable,
           training: TrainingConfig) -> "ParameterTotals":
        graph = table.graph
        per_param = {p.name: param_memory(p, training) for p in graph.params}
        block_static = tuple(sum(sum(per_param[p][:3]) for p in b.params) for b in blocks.blocks)
        block_state = tuple(sum(per_param[p][2] for p in b.params) for b in blocks.blocks)
        block_grads = tuple(sum(per_param[p][1] for p in b.params) for b in blocks.blocks)
        grad_bytes = step_bytes = 0
        for p in graph.params:
            g_bytes, moved = sync_bytes(p, training)
            grad_bytes += g_bytes
            step_bytes += moved
        return cls(static_bytes=sum(sum(m[:3]) for m in per_param.values()),
                   block_static_bytes=block_static, grad_bytes=grad_bytes, step_bytes=step_bytes,
                   state_bytes=sum(m[2] for m in per_param.values()),
                   block_state_bytes=block_state, block_grad_bytes=block_grads)

    def static_with(self, shards: int, gradients: bool = False) -> tuple[float, float]:
        """(the model's static bytes, the largest block's) with the optimizer state (and with
        `gradients` the gradients) split over `shards` replicas: lower bounds of what the ranks
        hold (a replica's share is at least an even one; tied gradients, kept whole, are counted
        split too, which keeps it a bound)."""
        cut = 1 - 1 / shards
        static = self.static_bytes - (self.state_bytes + self.grad_bytes * gradients) * cut
        block = max((b - (st + g * gradients) * cut for b, st, g in
                     zip(self.block_static_bytes, self.block_state_bytes or
                         (0,) * len(self.block_static_bytes), self.block_grad_bytes or
                         (0,) * len(self.block_static_bytes), strict=True)), default=0.0)
        return static, block


def _remembered(memo: dict[tuple[Any, ...], Any], key: tuple[Any, ...],
                compute: Callable[[], Any]) -> Any:
    """memo[key], computed once."""
    if key not in memo:
        memo[key] = compute()
    return memo[key]


def shape_lower_bound(blocks: BlockGraph, table: CostTable, cluster: ClusterSpec,
                      training: TrainingConfig, shape: PipelineShape,
                      totals: ParameterTotals | None = None,
                      memo: dict[tuple[Any, ...], Any] | None = None) -> tuple[float, bool]:
    """(lower bound of the objective in seconds, whether the parameters can fit at all).

    Time: perfectly balanced ranks, no transfers, the fastest rank's gradient sync and the
    average rank's step. Memory: every rank needs its parameters' static bytes, so their total
    over the ranks and the largest single block must fit. `totals` (ParameterTotals.of the same
    blocks, table and training) saves recomputing the parameters' sizes per shape; `memo` (a
    dict kept over one search's shapes, of the same blocks, table, cluster and training) the
    terms many shapes share: the blocks' work per micro-batch size, the sync per stages,
    replicas and placement (it walks every replica's device), the in-flight counts per
    schedule. A cluster of a thousand devices has tens of thousands of shapes."""
    totals = totals or ParameterTotals.of(blocks, table, training)
    memo = {} if memo is None else memo
    m = shape.microbatch_size
    ckpt = shape.activation_checkpointing
    S, v, M = shape.stages, shape.chunks, shape.num_microbatches

    def work_of() -> tuple[float, float]:
        comp = [b.forward.at(m) * (2.0 if ckpt else 1.0) + b.backward.at(m)
                for b in blocks.blocks]
        return sum(comp), max(comp)

    work = _remembered(memo, ("work", m, ckpt), work_of)
    # every virtual stage's fixed work (runtime overhead, the loss on the last) is paid whatever
    # the cut
    W = work[0] + sum(f + b for f, b in stage_fixed_s(table, cluster, shape))
    T = max(W / S, work[1] if v == 1 or S == 1 else 0.0)
    sync = 0.0
    if shape.replicas > 1:
        reduces = shape.sharding == "gradients"
        # a reduce per micro-batch streams the rank's gradients once, else one all-reduce (at
        # least its even share of the model's)
        collective = cluster.reduce_s if reduces else cluster.allreduce_s
        fastest = _remembered(
            memo, ("sync", S, shape.replicas, shape.placement, reduces),
            lambda: min(collective(max(1, totals.grad_bytes // S), shape.rank_devices(d))
                        for d in range(S)))
        sync = M * fastest if reduces else fastest
    # at the fastest rate a step can stream (cached, where the device has a cache term): a bound
    # (scaled as every step is where the costs were calibrated from launched runs)
    sync += totals.step_bytes / S / shape.shards / cluster.device.stream_bytes_per_s(1.0) \
        * table.optimizer_factor
    bound = (M - 1) * T + sync + T + (W - T) / v
    usable = usable_memory(cluster.device.memory_bytes, shape.training_config(training))
    gradients = shape.sharding == "gradients"
    static, block_static = _remembered(memo, ("static", shape.shards, gradients),
                                       lambda: totals.static_with(shape.shards, gradients))
    # The fullest rank holds at least static_d + coef_d * saved_d (StageProblem.rank_memory; coef
    # = in-flight micro-batches / chunks, 1 / chunks with checkpointing). Summing
    # saved_d <= (X - static_d) / coef_d over ranks bounds the peak X from below; without this,
    # large models screened every shape whose weights alone fit, all infeasible, before pruning.
    saved = _remembered(memo, ("saved", m), lambda: sum(b.saved.at(m) for b in blocks.blocks))

    def coefs_of() -> tuple[float, float]:
        coef = [(1.0 if ckpt else in_flight_microbatches(shape.schedule, d, S, M, v)) / v
                for d in range(S)]
        return max(coef), sum(1.0 / c for c in coef)

    coefs = _remembered(memo, ("in flight", shape.schedule, S, M, v, ckpt), coefs_of)
    peak = max(static / S, (saved + static / coefs[0]) / coefs[1])
    slack = usable * 1e-6 + 1.0  # float rounding must never exclude a feasible shape
    fits = peak <= usable + slack and block_static <= usable + slack
    return bound, fits


# ---- the search ------------------------------------------------------------------------------
def search(table: CostTable, cluster: ClusterSpec, global_batch: int,
           training: TrainingConfig | None = None, options: SearchOptions | None = None,
           blocks: BlockGraph | None = None, progress: Progress | None = None) -> Partition:
    """Find the partition with the best predicted iteration time (module docstring)."""
    training = training or TrainingConfig()
    options = options or SearchOptions()
    progress = progress or Progress()
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise SearchError(f"global batch size must be an integer >= 1, got {global_batch!r}",
                          hint="pass --batch-size")
    start = time.perf_counter()
    if blocks is None:
        with progress.step(f"coarsen to at most {options.max_blocks} blocks"):
            blocks = coarsen(table, options.max_blocks)
    shapes = enumerate_shapes(cluster, global_batch, len(blocks.blocks), options)
    candidates = []
    totals = ParameterTotals.of(blocks, table, training)
    memo: dict[tuple, Any] = {}  # StageProblem.build's shape-independent pieces
    bound_memo: dict[tuple[Any, ...], Any] = {}  # shape_lower_bound's shared terms
    for shape in shapes:
        bound, fits = shape_lower_bound(blocks, table, cluster, training, shape, totals,
                                        bound_memo)
        if fits:
            candidates.append(_Candidate(shape, bound))
    candidates.sort(key=lambda c: (c.lower_bound_s, c.shape.label()))
    strategy = options.strategy
    forced = forced_levers(options)
    best: _Candidate | None = None
    evaluated: list[_Candidate] = []
    pruned = 0
    with progress.step(f"{strategy}: search {len(shapes)} shapes"):
        for i, cand in enumerate(candidates):
            if best is not None and cand.lower_bound_s >= best.estimate_s:
                pruned = len(candidates) - i
                break
            _screen(cand, blocks, table, cluster, training, strategy, memo, forced)
            evaluated.append(cand)
            if cand.assignment is not None and (best is None
                                                or cand.estimate_s < best.estimate_s):
                best = cand
    if best is None:
        raise _infeasible(blocks, table, cluster, training, global_batch, options)
    if strategy == "cpsat":
        ranked = sorted((c for c in evaluated if c.assignment is not None),
                        key=lambda c: (c.estimate_s, c.shape.label()))
        for cand in ranked[:options.refine]:
            with progress.step(f"cpsat: {cand.shape.label()} ({len(blocks.blocks)} blocks)"):
                _refine(cand, options)
        best = min((c for c in evaluated if c.assignment is not None),
                   key=lambda c: (c.estimate_s, c.shape.label()))
    # Lower bound over every shape: proven per-shape bounds where a solver gave one, the
    # analytic bound elsewhere; pruned shapes have bounds no better than the best objective.
    bounds = [c.bound_s if c.bound_s is not None else c.lower_bound_s for c in evaluated]
    search_bound = min(bounds + [best.objective_s])
    assert best.problem is not None and best.assignment is not None and best.source is not None
    cut = _Cut(best, best.assignment, best.source, best.objective_s, None)
    considered: tuple[CutCandidate, ...] = ()
    if strategy in RERANKED_STRATEGIES:
        with progress.step(f"{strategy}: simulate the cuts of the best {RERANK_SHAPES} shapes"):
            cut, considered = _rerank(evaluated, blocks, global_batch)
    best = cut.shape
    wall = time.perf_counter() - start
    report = SolverReport(
        strategy=strategy, status=best.status, objective_s=cut.objective_s,
        # chain-dp has a bound only where it is exact (a chain block graph, one stage per rank)
        bound_s=best.bound_s if strategy in RERANKED_STRATEGIES else None,
        gap=_gap(cut.objective_s, best.bound_s) if best.bound_s is not None else None,
        search_bound_s=search_bound, search_gap=_gap(cut.objective_s, search_bound) or 0.0,
        shapes_enumerated=len(shapes), shapes_evaluated=len(evaluated), shapes_pruned=pruned,
        blocks=len(blocks.blocks), time_limit_s=options.time_limit_s, wall_s=wall,
        cut_from=cut.source, candidates=considered)
    if report.bound_s is None:
        report = replace(report, gap=None)
    assert best.problem is not None
    if cut.partition is not None:  # already built (and simulated) by the re-ranking
        return replace(cut.partition, solver=report)
    return build_partition(best.problem, cut.assignment, global_batch, report)


@dataclass
class _Cut:
    """One cut of one evaluated shape, as the re-ranking builds and simulates it."""

    shape: _Candidate
    assignment: tuple[int, ...]
    source: Strategy
    objective_s: float  # J of this cut
    partition: Partition | None  # built (simulated) with a placeholder report
    # a conventional baseline's cut too (uniform's or params'), whichever source found it first
    conventional: bool = False


def _shape_cuts(cand: _Candidate, blocks: BlockGraph
                ) -> list[tuple[tuple[int, ...], Strategy, bool]]:
    """The cuts of one shape worth simulating, the shape's own (the strategy's answer) first,
    then the DP's and the baselines', each once and only if it fits the exact memory model:
    (cut, the first source that found it, whether it is a conventional baseline's cut too)."""
    problem = cand.problem
    assert problem is not None and cand.assignment is not None and cand.source is not None
    cuts: list[tuple[tuple[int, ...], Strategy]] = [(cand.assignment, cand.source)]
    if cand.dp_assignment is not None:
        cuts.append((cand.dp_assignment, "chain-dp"))
    V = cand.shape.virtual_stages
    for name, fn in (("uniform", uniform_assignment), ("params", params_assignment)):
        a = fn(blocks, V)
        if a is not None and problem.valid(a) and _exact_fits(problem, a):
            cuts.append((a, name))  # type: ignore[arg-type]  # a Strategy literal
    # one entry per cut; a cut the strategy found that is also uniform's or params' is still the
    # conventional cut (a tie goes to it)
    conventional = {a for a, name in cuts if name in _CONVENTIONAL}
    unique: dict[tuple[int, ...], Strategy] = {}
    for a, name in cuts:
        unique.setdefault(a, name)
    return [(a, name, a in conventional) for a, name in unique.items()]


def _rerank(evaluated: Sequence[_Candidate], blocks: BlockGraph,
            global_batch: int) -> tuple[_Cut, tuple[CutCandidate, ...]]:
    """Simulate the cuts of the best RERANK_SHAPES layouts by J (shapes whatever levers they
    allow, every evaluated lever policy of each) and pick the fastest (module docstring, step
    5). Cuts within TIE_TOLERANCE of the fastest tie, unless a conventional cut of their own
    layout is faster, and a tie goes to a conventional cut (uniform's or params'), the one whose
    most loaded rank's predicted peak is least, then the faster; otherwise, and among equals,
    to the least peak, the faster, then the shape's own
    cut of the strategy, the DP's, uniform's, params', then the layout better by J: the same
    inputs always give the same plan. Returns the chosen cut and every cut simulated, fastest
    first."""
    ranked = sorted((c for c in evaluated if c.assignment is not None),
                    key=lambda c: (c.estimate_s, c.shape.label()))
    # The best RERANK_SHAPES layouts, each with every lever policy it was evaluated under: shapes
    # that differ only in the levers they allow often end as the same plan (a rank keeps only the
    # levers its memory needs), and must not crowd the other layouts out of the re-ranking.
    layouts = list(dict.fromkeys(_layout(c.shape) for c in ranked))[:RERANK_SHAPES]
    scored: list[tuple[tuple[float, int, int], _Cut]] = []
    seen: set[tuple[tuple[int, ...], tuple[RankLevers, ...], PipelineShape]] = set()
    for cand in (c for c in ranked if _layout(c.shape) in layouts):
        shape_rank = layouts.index(_layout(cand.shape))
        problem = cand.problem
        assert problem is not None
        unit = problem.time_unit_s / cand.shape.chunks
        for priority, (a, source, conventional) in enumerate(_shape_cuts(cand, blocks)):
            objective = cand.objective_s if priority == 0 else problem.objective(a) * unit
            placeholder = _placeholder_report(cand, source, objective)
            partition = build_partition(problem, a, global_batch, placeholder)
            plan_key = (a, partition.levers, _layout(cand.shape))
            if plan_key in seen:  # the same plan under a wider lever policy
                continue
            seen.add(plan_key)
            key = (round_seconds(partition.iteration_s), priority, shape_rank)
            scored.append((key, _Cut(cand, a, source, objective, partition, conventional)))
    scored.sort(key=lambda kc: kc[0])
    considered = tuple(CutCandidate(shape=c.shape.shape.label(), cut_from=c.source,
                                    objective_s=c.objective_s,
                                    iteration_s=c.partition.iteration_s if c.partition else 0.0,
                                    peak_bytes=_peak(c))
                       for _, c in scored)
    # Never a cut slower than a conventional cut of its own layout, whatever a tie prefers: the
    # plan is never one the simulator puts slower than a baseline's cut of its shape.
    conventional_best: dict[PipelineShape, float] = {}
    for key, cut in scored:  # fastest first
        if cut.conventional:
            conventional_best.setdefault(_layout(cut.shape.shape), key[0])
    fastest = scored[0][0][0]
    tied = [(key, cut) for key, cut in scored if key[0] <= fastest * (1 + TIE_TOLERANCE)
            and key[0] <= conventional_best.get(_layout(cut.shape.shape), math.inf)]
    chosen = min(tied, key=lambda kc: (not kc[1].conventional, _peak(kc[1]), kc[0]))
    return chosen[1], considered


def _peak(cut: _Cut) -> int:
    """The predicted peak of a simulated cut's most loaded rank: among cuts whose times tie, the
    one that holds less. The memory model is good to a few percent where time is not, and a
    lower peak is headroom, and on a CPU less memory for the allocator to fault in (the same cut
    under GPipe and 1F1B, predicted 0.28% apart, measured GPipe 3-8% slower: docs/solver.md)."""
    assert cut.partition is not None
    return max(m.total for m in cut.partition.memory)


def _layout(shape: PipelineShape) -> PipelineShape:
    """The shape without the levers it allows: what the re-ranking counts as one layout."""
    return replace(shape, activation_checkpointing=False, sharding="none")


def _placeholder_report(cand: _Candidate, source: Strategy, objective_s: float) -> SolverReport:
    """What build_partition gets while the re-ranking compares cuts; search() replaces it."""
    return SolverReport(strategy=source, status=cand.status, objective_s=objective_s,
                        bound_s=None, gap=None, search_bound_s=0.0, search_gap=0.0,
                        shapes_enumerated=0, shapes_evaluated=0, shapes_pruned=0, blocks=1,
                        time_limit_s=1.0, wall_s=None, cut_from=source)


def _gap(objective: float, bound: float | None) -> float | None:
    if bound is None:
        return None
    return max(0.0, (objective - bound) / objective) if objective > 0 else 0.0


def forced_levers(options: SearchOptions) -> RankLevers:
    """The levers the user pinned on (--checkpointing, --sharding X): every rank keeps them."""
    return RankLevers(activation_checkpointing=options.activation_checkpointing is True,
                      sharding=options.sharding or "none")


def _screen(cand: _Candidate, blocks: BlockGraph, table: CostTable, cluster: ClusterSpec,
            training: TrainingConfig, strategy: Strategy, memo: dict[tuple, Any],
            forced: RankLevers) -> None:
    """First assignment of a shape: the strategy's own cut, or the exact DP for dp/cpsat."""
    problem = StageProblem.build(blocks, table, cluster, training, cand.shape, memo,
                                 forced_levers=forced)
    cand.problem = problem
    V = cand.shape.virtual_stages
    unit = problem.time_unit_s / cand.shape.chunks
    hints: list[tuple[int, ...]] = []
    if strategy in ("uniform", "params"):
        fn = uniform_assignment if strategy == "uniform" else params_assignment
        a = fn(blocks, V)
        if a is not None and problem.valid(a) and _exact_fits(problem, a):
            cand.assignment, cand.status, cand.source = a, "heuristic", strategy
            cand.objective_s = problem.objective(a) * unit
        else:
            cand.status = "does not fit"
        return
    for rounds in range(_MAX_CORRECTION_ROUNDS):
        result = solve_chain_dp(problem)
        if result.assignment is None:
            cand.status = "infeasible"
            if blocks.is_chain and cand.shape.chunks == 1:
                cand.bound_s = math.inf  # proven: no contiguous cut fits the linear model
            break
        if _exact_fits(problem, result.assignment):
            cand.assignment = cand.dp_assignment = result.assignment
            cand.source = "chain-dp"
            cand.objective_s = problem.objective(result.assignment) * unit
            exact = cand.shape.chunks == 1 and rounds == 0
            cand.status = "optimal" if exact and blocks.is_chain else "screened"
            if strategy == "chain-dp":
                cand.status = "optimal-contiguous" if cand.shape.chunks == 1 else "heuristic"
            if exact and blocks.is_chain:
                cand.bound_s = cand.objective_s
            break
        _tighten(problem, result.assignment)
    if strategy == "cpsat":
        baselines: list[tuple[tuple[int, ...], Strategy]] = []
        for name, fn in (("uniform", uniform_assignment), ("params", params_assignment)):
            a = fn(blocks, V)
            if a is not None and problem.valid(a):
                baselines.append((a, name))  # type: ignore[arg-type]  # a Strategy literal
        hints = [a for a, _ in baselines]
        if cand.assignment is not None:
            hints.insert(0, cand.assignment)
        cand.hints = tuple(hints)
        for a, name in baselines:
            # A baseline cut can beat the DP's on interleaved shapes (the DP balances virtual
            # stages there) and on DAGs never; keep whichever is better as the screen value.
            if problem.fits(a) and _exact_fits(problem, a):
                value = problem.objective(a) * unit
                if value < cand.objective_s:
                    cand.assignment, cand.objective_s, cand.status = a, value, "screened"
                    cand.source = name


def _refine(cand: _Candidate, options: SearchOptions) -> None:
    """CP-SAT over the block DAG for one shape, checked against the exact memory model."""
    problem = cand.problem
    assert problem is not None
    unit = problem.time_unit_s / cand.shape.chunks
    hints = list(cand.hints)
    for _ in range(_MAX_CORRECTION_ROUNDS):
        result = solve_cpsat(problem, time_limit_s=options.time_limit_s, workers=options.workers,
                             hints=hints)
        if result.assignment is None:
            cand.status = result.status.lower()
            if result.status == "INFEASIBLE":
                cand.bound_s = math.inf
            cand.assignment = None
            cand.objective_s = math.inf
            return
        if _exact_fits(problem, result.assignment):
            assert result.objective is not None  # CP-SAT returns one with every assignment
            cand.assignment = result.assignment
            cand.source = "cpsat"
            cand.objective_s = result.objective * unit
            cand.status = result.status.lower()
            cand.bound_s = None if result.bound is None else result.bound * unit
            return
        _tighten(problem, result.assignment)
        hints = [h for h in hints if problem.fits(h)]
    cand.status, cand.assignment, cand.objective_s = "memory model did not converge", None, \
        math.inf


def _exact_fits(problem: StageProblem, assignment: Sequence[int]) -> bool:
    usable = problem.usable_bytes()
    return all(m.total <= usable for m in problem.exact_memory(assignment))


def _tighten(problem: StageProblem, assignment: Sequence[int]) -> None:
    """Raise the corrections of the ranks the exact model finds over capacity, so the linear
    model is at least the exact one for this assignment (which becomes infeasible)."""
    usable = problem.usable_bytes()
    linear = problem.rank_memory(assignment)
    for d, mem in enumerate(problem.exact_memory(assignment)):
        if mem.total > usable:
            exact_units = math.ceil(mem.total / problem.memory_unit)
            problem.corrections[d] += max(1, exact_units - linear[d] + 1)


def _infeasible(blocks: BlockGraph, table: CostTable, cluster: ClusterSpec,
                training: TrainingConfig, global_batch: int,
                options: SearchOptions) -> InfeasibleMemoryError:
    """The error for a model that fits no shape: the least memory any cut needs per device."""
    N = cluster.num_devices
    R = options.replicas or 1
    S = max(1, min(options.stages or N // R, len(blocks.blocks), N // R))
    per_replica = global_batch // R if global_batch % R == 0 else global_batch
    # The most micro-batches the search tries (the smallest micro-batch it could use): a message
    # about a shape the search never considered could claim a need below the usable memory.
    M = options.num_microbatches or max(
        k for k in range(1, min(per_replica, options.max_microbatches) + 1) if per_replica % k == 0)
    m = max(1, per_replica // M)
    schedule = options.schedule or ("1f1b" if M >= S else "gpipe")
    ckpt = options.activation_checkpointing if options.activation_checkpointing is not None \
        else True
    # with replicas pinned, the least memory they need, their optimizer state sharded where
    # that is allowed
    sharding: Sharding = ("gradients" if options.sharding is None else options.sharding) \
        if R > 1 else "none"
    shape = PipelineShape(stages=S, replicas=R, num_microbatches=M, microbatch_size=m,
                          schedule=schedule if schedule != "interleaved-1f1b" else "1f1b",
                          activation_checkpointing=ckpt, sharding=sharding)
    problem = StageProblem.build(blocks, table, cluster, training, shape)
    need = _least_peak(problem)
    usable = problem.usable_bytes()
    dev = cluster.device
    pinned = _pinned(options)
    return InfeasibleMemoryError(
        f"the model does not fit: even cut into {S} stage(s)"
        f"{f' x {R} replicas' if R > 1 else ''} with micro-batch {m}"
        f"{' and activation checkpointing' if ckpt else ''}"
        f"{f' and the {SHARDED_STATE[sharding]} sharded' if sharding != 'none' else ''}"
        f"{f' ({pinned})' if pinned else ''}, the fullest device needs at least "
        f"{format_quantity(need, 'B')} but one {dev.name} has "
        f"{format_quantity(usable, 'B')} usable ({format_quantity(dev.memory_bytes, 'B')} minus "
        f"the {training.memory_margin:.0%} margin)",
        hint="use more or larger devices (--cluster), --precision bf16-mixed or a lighter "
             "--optimizer, a smaller batch, or leave stages/replicas/micro-batches/"
             "checkpointing/sharding to the search")


def _least_peak(problem: StageProblem) -> int:
    """Smallest possible largest rank memory (bytes) over contiguous cuts, exact model."""
    n = problem.num_blocks
    V = problem.shape.virtual_stages
    # Balance the linear model with the DP on a memory-only objective: binary search the limit.
    lo, hi = 0, sum(problem.static) + sum(problem.saved) * problem.shape.num_microbatches \
        + sum(p.static for p in problem.shared) + problem.capacity * 4 + 1
    saved_cap = problem.capacity
    found: tuple[int, ...] | None = None
    while lo < hi:
        mid = (lo + hi) // 2
        problem.capacity = mid
        result = solve_chain_dp(problem)
        if result.assignment is not None:
            hi, found = mid, result.assignment
        else:
            lo = mid + 1
    problem.capacity = saved_cap
    if found is None:
        found = tuple(i * V // n for i in range(n))
    return int(max(m.total for m in problem.exact_memory(found)))


# ---- the result --------------------------------------------------------------------------------
def build_partition(problem: StageProblem, assignment: Sequence[int], global_batch: int,
                    report: SolverReport) -> Partition:
    """Turn a shape's assignment into a Partition: stages, exact memory, simulation."""
    shape = problem.shape
    blocks = problem.blocks
    table = problem.table
    graph = table.graph
    cluster = problem.cluster
    m = shape.microbatch_size
    S, V = shape.stages, shape.virtual_stages
    bf16 = problem.training.precision == "bf16-mixed"
    members: list[list[int]] = [[] for _ in range(V)]
    for b, k in enumerate(assignment):
        members[k].append(b)
    stages: list[StagePlan] = []
    timings: list[StageTiming] = []
    levers = choose_levers(problem, assignment)
    memory = problem.exact_memory(assignment, levers)
    bare = [RankLevers()] * S
    without = memory if tuple(bare) == levers else problem.exact_memory(assignment, bare)
    # What the plan records as allowed: the levers its ranks use, and those the user pinned, not
    # the policy of whichever shape variant this cut was evaluated under (the same plan from
    # two policies must be the same plan.yaml)
    forced = problem.forced_levers
    shape = replace(shape, activation_checkpointing=forced.activation_checkpointing or any(
        r.activation_checkpointing for r in levers), sharding=max(
            (forced.sharding, *(r.sharding for r in levers)), key=SHARDINGS.index))
    links = shape.boundary_links(cluster)
    sends_fwd = [0.0] * (V + 1)
    sends_bwd = [0.0] * (V + 1)
    latency_fwd = [0.0] * (V + 1)  # of those, the links' per-message latencies
    latency_bwd = [0.0] * (V + 1)
    for t in blocks.tensors:
        lo = 0 if t.producer is None else assignment[t.producer]
        hi = V - 1 if t.is_output else max((assignment[c] for c in t.consumers), default=lo)
        nbytes = int(wire_bytes(table, t.name, m, bf16))
        for k in range(lo + 1, hi + 1):
            link = links[k]
            assert link is not None  # only boundary 0, which nothing crosses, has no link
            sends_fwd[k - 1] += link.transfer_s(nbytes)
            latency_fwd[k - 1] += link.latency_part_s(nbytes)
            if t.requires_grad:
                sends_bwd[k] += link.transfer_s(nbytes)
                latency_bwd[k] += link.latency_part_s(nbytes)
    fixed = stage_fixed_s(table, cluster, shape)
    held = rank_parameters(problem, assignment)
    tied = problem.tied_across_ranks(assignment)
    # sharded gradients: each micro-batch's backward also reduces its buckets, one after the other
    reduces = [gradient_reduce_seconds(problem, held[d], d, tied)
               if levers[d].sharding == "gradients" else 0.0 for d in range(S)]
    for k in range(V):
        nodes = tuple(n for b in members[k] for n in blocks.blocks[b].nodes)
        rank = k % S
        ckpt = levers[rank].activation_checkpointing
        # runtime host work per pass, the loss on the last stage (StageProblem.stage_fixed)
        work = sum(blocks.blocks[b].forward.at(m) for b in members[k])
        params = tuple(dict.fromkeys(p for b in members[k] for p in blocks.blocks[b].params
                                     if graph.param(p).kind == "parameter"))
        # each pass also adds its parameters' gradients into the held ones (the profile's
        # backwards start from none)
        adds = gradient_add_s((graph.param(p) for p in params), problem.training,
                              cluster.device, shape, levers[rank].sharding, tied)
        fwd = fixed[k][0] + work
        bwd = fixed[k][1] + sum(blocks.blocks[b].backward.at(m) for b in members[k]) + (
            work if ckpt else 0.0) + reduces[rank] + adds
        receives, sends = stage_boundary(graph, nodes)
        stages.append(StagePlan(
            index=k, rank=rank, devices=shape.rank_devices(rank),
            blocks=tuple(members[k]), nodes=nodes, modules=_outer_modules(blocks, members[k]),
            parameters=params, parameter_count=sum(graph.param(p).numel for p in params),
            forward_s=fwd, backward_s=bwd, receives=tuple(receives), sends=tuple(sends),
            activation_checkpointing=ckpt, sharding=levers[rank].sharding))
        saved = sum(blocks.blocks[b].saved.at(m) for b in members[k])
        rank_mem = memory[rank]
        static = (rank_mem.parameters + rank_mem.gradients + rank_mem.optimizer_state) \
            if k < S else 0.0
        timings.append(StageTiming(
            forward_s=fwd, backward_s=bwd, send_forward_s=sends_fwd[k] if k < V - 1 else 0.0,
            send_backward_s=sends_bwd[k] if k > 0 else 0.0,
            activation_bytes=saved if not ckpt else 0.0, static_bytes=float(static),
            send_forward_latency_s=latency_fwd[k] if k < V - 1 else 0.0,
            send_backward_latency_s=latency_bwd[k] if k > 0 else 0.0))
    allreduce, step = _sync_times(problem, assignment, levers)
    pipeline = PipelineSpec(schedule=shape.schedule, num_ranks=S,
                            num_microbatches=shape.num_microbatches, stages=tuple(timings),
                            allreduce_s=tuple(allreduce), optimizer_s=tuple(step),
                            tied=_tied_syncs(problem, assignment), host_sends=cluster.host_sends,
                            core_sharing=shape.core_sharing(cluster),
                            wake_credit_s=cluster.wake_credit_s)
    simulation = simulate(pipeline)
    # a launched run's spread (compile --calibrate-from) over the device config's
    modes = table.speed_modes or cluster.device.speed_modes(problem.training.matmul_dtype)
    expected = None
    if modes:
        units = [tuple(cluster.core_of(d) for d in shape.rank_devices(r)) for r in range(S)]
        expected = SpeedSpreadPrice(modes=modes,
                                    iteration_s=expected_iteration_s(pipeline, units, modes),
                                    source="run" if table.speed_modes else "device")
    return Partition(model=graph.model_name, graph_hash=graph.content_hash(), cluster=cluster.name,
                     num_devices=cluster.num_devices, global_batch_size=global_batch,
                     shape=shape, training=shape.training_config(problem.training),
                     stages=tuple(stages),
                     memory=tuple(memory), usable_memory_bytes=problem.usable_bytes(),
                     solver=report, pipeline=pipeline, simulation=simulation, levers=levers,
                     memory_without_levers=tuple(m.total for m in without),
                     speed_spread=expected)


def _sync_times(problem: StageProblem, assignment: Sequence[int],
                levers: Sequence[RankLevers]) -> tuple[list[float], list[float]]:
    """Per rank: gradient all-reduce over its replicas (sharded gradients: the tied ones'), and
    the optimizer step with its levers (sharded: its share's step and the all-gather of the
    weights, partc.solve.levers)."""
    allreduce, step = [], []
    tied = problem.tied_across_ranks(assignment)
    for d, params in enumerate(rank_parameters(problem, assignment)):
        allreduce.append(allreduce_seconds(problem, params, d, levers[d], tied))
        step.append(step_seconds(problem, params, d, levers[d]))
    return allreduce, step


def _tied_syncs(problem: StageProblem, assignment: Sequence[int]) -> tuple[TiedSync, ...]:
    """The gradient sums of trainable parameters held by two or more pipeline ranks, in the
    order launch runs them (by name): an all-reduce of the gradient over those ranks' devices
    (replica 0's; every replica has the same layout)."""
    shape = problem.shape
    graph = problem.table.graph
    syncs = []
    for p in problem.shared:  # sorted by name
        ranks = tuple(sorted({assignment[b] % shape.stages for b in p.blocks}))
        grad_bytes, _ = sync_bytes(graph.param(p.name), problem.training)
        if len(ranks) < 2 or not grad_bytes:
            continue
        devices = tuple(shape.device(rank, 0) for rank in ranks)
        syncs.append(TiedSync(ranks, problem.cluster.allreduce_s(grad_bytes, devices)))
    return tuple(syncs)


def _outer_modules(blocks: BlockGraph, members: list[int]) -> tuple[str, ...]:
    """The stage's modules, each named at the outermost level the stage holds entirely
    ('bert.encoder.layer.3' rather than its 20 submodules), in order."""
    inside = [m for b in members for m in blocks.blocks[b].modules]
    outside = {m for i, b in enumerate(blocks.blocks) if i not in set(members) for m in b.modules}
    names: list[str] = []
    for path in dict.fromkeys(inside):
        parts = path.split(".") if path else []
        chosen = path
        for depth in range(1, len(parts) + 1):
            prefix = ".".join(parts[:depth])
            if not any(o == prefix or o.startswith(prefix + ".") for o in outside):
                chosen = prefix
                break
        chosen = chosen or "(root)"
        if chosen not in names:
            names.append(chosen)
    return tuple(names)


def compare_strategies(table: CostTable, cluster: ClusterSpec, global_batch: int,
                       training: TrainingConfig | None = None,
                       options: SearchOptions | None = None,
                       strategies: Sequence[Strategy] = STRATEGIES,
                       blocks: BlockGraph | None = None,
                       progress: Progress | None = None) -> dict[Strategy, Partition | PartcError]:
    """Run the search once per strategy on the same block graph: strategy -> Partition (or the
    error it ended with, e.g. a baseline that fits no shape)."""
    options = options or SearchOptions()
    blocks = blocks or coarsen(table, options.max_blocks)
    out: dict[Strategy, Partition | PartcError] = {}
    for strategy in strategies:
        try:
            out[strategy] = search(table, cluster, global_batch, training,
                                   replace(options, strategy=strategy), blocks=blocks,
                                   progress=progress)
        except PartcError as exc:
            out[strategy] = exc
    return out


__all__ = ["InfeasibleMemoryError", "search", "RERANK_SHAPES", "RERANKED_STRATEGIES",
           "compare_strategies", "enumerate_shapes", "shape_lower_bound", "ParameterTotals",
           "build_partition"]
