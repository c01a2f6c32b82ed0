"""The closed loop: costs corrected by what a launched plan measured (`partc compile
--calibrate-from RUN.jsonl [--calibrate-from RUN2.jsonl ...]`).

A run's metrics (partc.plans.run_metrics) name the plan they trained (plan.yaml's absolute path and
the sha256 of its bytes at launch) and give, per stage, the forward and backward time per
micro-batch of every step. `load_launched_run` finds that plan, refuses what cannot be
compared (another model, a plan that changed or vanished, a run without timed steps, a stage
count that differs, several runs of different plans) and works out which OpGraph nodes each of
its stages held: plan.yaml does not list them, so the plan is re-solved exactly as `partc check`
re-solves it (`partc.plans.check.solve_as_recorded`) and the re-solved layout must equal the
plan's. The measured times are medians over the timed steps of every run given, pooled: one
launch on a shared machine can fall in a slow minute (a 221 ms BERT plan launched at 865 ms while
other launches shared the VM), and several launches of the plan keep one such spell from
setting the costs.

`corrected_costs` then scales, per stage, every node's forward `Curve` by one factor and its
backward `Curve` by another, chosen so that the corrected table predicts the measured times for
that stage at the plan's micro-batch size:

    forward factor  = (measured forward  - fixed) / forward work of the stage's nodes
    backward factor = (measured backward - fixed [- recomputed forward]) / backward work

`fixed` is what the solver adds to a stage's passes besides its operators
(partc.solve.stage_problem.stage_fixed_s): the device's `microbatch_overhead_s` (and its
`cold_pass_s` where the stage's process shares a core), and on the last stage the loss
function's forward and backward (launch's metrics count the loss in that stage's
times); with activation checkpointing the measured backward includes the recomputed forward, priced
at its corrected value. The work is summed from the table being corrected (the new compile's),
so a recompile of the same shape and cut predicts exactly the measured stage times, whatever
costs the launched plan was solved with. Fixed and per-sample parts scale alike: other
micro-batch sizes move proportionally. A stage whose work is zero keeps factor 1.

Where the plan's ranks share cores (more devices than cores, as cpu-4 on 2 cores) the measured
times are the stages' CPU times (launch records them beside the wall times), not the wall times,
which hold the core-mates' turns: the profile prices the work there by CPU time, and the
simulator shares the cores out itself. A run without CPU times (an older partc's) is refused.

The runs also give the spread of the stages' speed from step to step, which the corrected costs
(medians) leave out and a pipeline pays: a step waits for its slowest stage. `run_speed_spread`
takes, per stage and timed step, the stage's own work (forward + backward per micro-batch, as
above) over its median in that step's run (a run slower as a whole, all stages together, is the
machine's minute, which the pooled medians take in, not units drawing on their own); where a
stage's replicas run on R speed units (devices, or cores where processes share them:
ClusterSpec.core_of) the run reports their slowest, whose distribution is a unit's raised to
the R-th power if units draw on their own, so a unit's quantile q is the sample's quantile q^R.
Every stage's unit samples, pooled, cut into 4 modes (partc.hardware.speed_spread.modes_of),
are the table's `speed_modes`, which the solver prices in place of the device config's
(partc.solve.stragglers): the prediction becomes the expected (mean) step of the launches, its
priced speed the median stage work. With fewer than `MIN_SPREAD_STEPS` timed steps pooled, or
no run of `MIN_RUN_SPREAD_STEPS`, there is no spread (the device config's, if any, is priced).
Assumed, as for a calibrated spread: units draw on their own.

The runs' optimizer step is corrected too, by one factor for the whole model
(`run_optimizer_step`): the ranks' measured steps (their stages' median optimizer time, CPU time
on shared cores) summed over the priced ones (every held parameter's step on the device and
each stage optimizer's cold start, `step_cold_s`, as partc.solve.levers.step_seconds prices
them, before any run's factor), over the ranks whose optimizer state
is not sharded; the table's `optimizer_factor`, by which the solver multiplies every
parameter's step. One factor, not one per rank: a parameter's step costs the same wherever a
cut puts it.

The corrected table keeps its `kind` (what distributed time over nodes: "measured" or
"analytic") and records the correction in `calibration["calibrated_from"]` (CALIBRATED_FROM):
run and plan paths, the plan's sha256, the steps used and each stage's factors and times. Plans
layer: no torch is imported here (the capture is the caller's).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from partc.cost.op_classes import held_params
from partc.cost.table import CostTable, NodeCost
from partc.errors import PartcError
from partc.files import sha256_file
from partc.hardware.specs import DeviceSpec
from partc.hardware.speed_spread import modes_of
from partc.plans.check import recorded_profile, solve_as_recorded
from partc.plans.diff import layout_of_partition, layout_of_plan
from partc.plans.plan import Plan, load_plan
from partc.plans.run_metrics import RunMetrics, StepMetrics, host_per_pass_s
from partc.progress import Progress
from partc.solve.stage_problem import (
    gradient_add_s,
    p2p_posts_priced,
    stage_fixed_s,
    step_dispatch_s,
    step_seconds_of,
)

if TYPE_CHECKING:  # annotations only: the caller captures the model
    from partc.frontend.capture import CaptureResult

# Pooled timed steps of the runs below which they give no speed spread: two per mode.
MIN_SPREAD_STEPS = 8
# A run's timed steps below which it has no median of its own to read its steps' spread against
# (its steps still count in the pooled medians).
MIN_RUN_SPREAD_STEPS = 4

# The key of CostSource.calibration that marks a table corrected from a run (and of the profile
# file's `calibration` mapping).
CALIBRATED_FROM = "calibrated_from"


class CalibrationError(PartcError):
    """A run that cannot calibrate this compile: another model, a changed or missing plan, no
    timed steps, a different stage count or device."""


def _hint(run: Path | str) -> str:
    return f"launch the current plan again: `partc launch PLAN --steps 5 --metrics {run}`"


@dataclass(frozen=True)
class StageCalibration:
    """One stage of the launched plan: measured and predicted times per micro-batch, and the
    factors its nodes' forward and backward costs are scaled by."""

    index: int
    measured_forward_s: float  # median over the timed steps of every run
    measured_backward_s: float
    predicted_forward_s: float  # the launched plan's prediction (plan.yaml)
    predicted_backward_s: float
    forward_factor: float
    backward_factor: float

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index, "measured_forward_s": _round(self.measured_forward_s),
                "measured_backward_s": _round(self.measured_backward_s),
                "predicted_forward_s": _round(self.predicted_forward_s),
                "predicted_backward_s": _round(self.predicted_backward_s),
                "forward_factor": _round(self.forward_factor),
                "backward_factor": _round(self.backward_factor)}


@dataclass(frozen=True)
class LaunchedRun:
    """One or more runs of one plan, checked against each other, the plan and the model being
    compiled (`load_launched_run`)."""

    runs: tuple[RunOfPlan, ...]  # in the order given; at least one
    plan: Plan
    plan_path: Path  # absolute, as the metrics record it
    plan_sha256: str
    stage_nodes: tuple[tuple[str, ...], ...]  # OpGraph nodes of each (virtual) stage

    @property
    def microbatch_size(self) -> int:
        return self.plan.training.shape.microbatch_size

    @property
    def timed(self) -> tuple[StepMetrics, ...]:
        """Every run's timed steps, pooled: what the medians are taken over."""
        return tuple(step for r in self.runs for step in r.timed)

    @property
    def name(self) -> str:
        """The run files, for messages."""
        return names_of(self.runs)

    @property
    def hint(self) -> str:
        return _hint(self.runs[0].run_path)


@dataclass(frozen=True)
class RunOfPlan:
    """A metrics file and the plan it names, read and checked against each other
    (`read_run_of_plan`): what calibration needs before the model is captured."""

    run: RunMetrics
    run_path: Path  # absolute
    plan: Plan
    plan_path: Path  # absolute, as the metrics record it
    plan_sha256: str
    timed: tuple[StepMetrics, ...]  # the steps the medians are taken over


def read_run_of_plan(run_path: str | Path) -> RunOfPlan:
    """Read a metrics file and the plan it names, and check that they belong together: the plan
    is there with the bytes it had at launch, the run's lines fit it (its stage count,
    micro-batches, replicas, stage placement and device kind: RunMetrics.check_shape) and it
    has timed steps. Torch-free and without the model, so that `partc compile
    --calibrate-from` refuses a bad metrics file before it captures anything. CalibrationError
    (or the RunMetricsError/PlanError of an unreadable file) otherwise."""
    run_path = Path(run_path).resolve()
    run = RunMetrics.load(run_path)
    plan_path, sha = run.launched_plan()
    if not plan_path.is_file():
        raise CalibrationError(f"the plan {plan_path} that {run_path.name} is a run of is gone",
                               hint="calibrate from a run of a plan that is still there")
    if sha256_file(plan_path) != sha:
        raise CalibrationError(
            f"{plan_path} changed since the run {run_path.name} launched it (sha256 differs "
            "from the metrics' plan_sha256)", hint=_hint(run_path))
    plan = load_plan(plan_path)
    # the lines of a run of that plan fit it; a hand-edited or stitched file may not
    run.check_shape(plan, f"its plan {plan_path}")
    timed = run.strictly_timed_steps()
    if not timed:
        raise CalibrationError(
            f"{run_path.name} has no timed steps (the first step is warm-up and profiled steps "
            "are slowed by the profiler)", hint=_hint(run_path))
    return RunOfPlan(run=run, run_path=run_path, plan=plan, plan_path=plan_path,
                     plan_sha256=sha, timed=timed)


def read_runs_of_plan(run_paths: Sequence[str | Path]) -> tuple[RunOfPlan, ...]:
    """`read_run_of_plan` of each metrics file, and CalibrationError unless they are runs of one
    plan (plan.yaml's bytes, by sha256: their timed steps are pooled, and steps of another cut
    or shape would price neither). A file given twice counts once."""
    reads: list[RunOfPlan] = []
    for path in run_paths:
        read = read_run_of_plan(path)
        if all(read.run_path != r.run_path for r in reads):
            reads.append(read)
    return _of_one_plan(reads)


def _of_one_plan(reads: Sequence[RunOfPlan]) -> tuple[RunOfPlan, ...]:
    """`reads`, or CalibrationError if they are runs of more than one plan (or none)."""
    if not reads:
        raise CalibrationError("no metrics file to calibrate from",
                               hint="pass a `partc launch --metrics` file")
    first = reads[0]
    for read in reads[1:]:
        # one plan is one plan.yaml's bytes (they name every stage file's sha256), wherever
        # the directory was copied to before its launch
        if read.plan_sha256 != first.plan_sha256:
            raise CalibrationError(
                f"{read.run_path.name} is a run of {read.plan_path} (sha256 "
                f"{read.plan_sha256[:12]}..), {first.run_path.name} of {first.plan_path} "
                f"(sha256 {first.plan_sha256[:12]}..): runs calibrated from together must be "
                "of one plan",
                hint="pass only runs of the plan to calibrate from (its `partc launch "
                     "--metrics` files)")
    return tuple(reads)


def names_of(reads: Sequence[RunOfPlan]) -> str:
    """The run files of `reads`, for messages: `a.jsonl`, `a.jsonl, b.jsonl`."""
    return ", ".join(r.run_path.name for r in reads)


def load_launched_run(reads: Sequence[RunOfPlan], result: CaptureResult,
                      progress: Progress | None = None) -> LaunchedRun:
    """Check runs of one plan (read and checked against it and each other by
    `read_runs_of_plan`) against `result`, the capture of the model being compiled; find each
    stage's nodes (module docstring). CalibrationError otherwise."""
    progress = progress or Progress()
    reads = _of_one_plan(reads)
    plan, plan_path, sha = reads[0].plan, reads[0].plan_path, reads[0].plan_sha256
    run_name = names_of(reads)
    graph = result.graph
    if plan.costs.capture_batch_size != graph.batch_size:
        raise CalibrationError(
            f"the plan {plan_path} was captured at batch size {plan.costs.capture_batch_size}, "
            f"this compile at {graph.batch_size}",
            hint=f"compile with --capture-batch {plan.costs.capture_batch_size}")
    if plan.model.graph_hash != graph.content_hash():
        raise CalibrationError(
            f"{run_name} is a run of another model: its plan {plan_path} has graph "
            f"{plan.model.graph_hash[:19]}.., this model {graph.content_hash()[:19]}..",
            hint="calibrate from a run of a plan of this model (recompile and launch it first)")
    profile = recorded_profile(plan, plan_path)
    if profile is not None and plan.costs.profile_sha256 is not None and \
            sha256_file(profile) != plan.costs.profile_sha256:
        raise CalibrationError(f"the profile {profile} of {plan_path} is not the one the plan "
                               "was compiled with (sha256 differs from plan.yaml's)",
                               hint=f"`partc check {plan_path}`, recompile and launch again")
    with progress.step(f"re-solving {plan_path} to find its stages' operators"):
        _, partition = solve_as_recorded(plan, result, profile, progress)
    # the model's name is its file's stem: a model file renamed since the launch re-solves to
    # the same stages under another name (the graph hash, checked above, is the model's identity)
    resolved = replace(layout_of_partition(partition, graph.module_fingerprints()),
                       model=plan.model.name)
    if resolved != layout_of_plan(plan):
        raise CalibrationError(
            f"{plan_path} no longer re-solves to itself, so which operators its stages held "
            "is unknown", hint=f"`partc check {plan_path}` says why; recompile and launch again")
    return LaunchedRun(runs=tuple(reads), plan=plan, plan_path=plan_path, plan_sha256=sha,
                       stage_nodes=tuple(st.nodes for st in partition.stages))


def stage_calibrations(table: CostTable, launched: LaunchedRun,
                       device: DeviceSpec) -> tuple[StageCalibration, ...]:
    """Per stage of the launched plan, the factors that make `table` predict its measured times
    on `device` (module docstring)."""
    plan = launched.plan
    if device.name != plan.cluster.device.name:
        raise CalibrationError(
            f"{launched.name} ran on {plan.cluster.device.name} devices, this compile "
            f"plans for {device.name}", hint="calibrate from a run on the cluster compiled for")
    # the costs are per precision (bf16 kernels are not fp32's): factors that make one
    # precision's table predict a run at another would price neither
    ran_at, priced_at = plan.training.config.precision, table.source.precision
    if ran_at != priced_at:
        raise CalibrationError(
            f"{launched.name} trained at precision {ran_at}, this compile prices "
            f"{priced_at}", hint=f"compile with --precision {ran_at}, or calibrate from a run of "
                                 f"a {priced_at} plan")
    m = launched.microbatch_size
    # what every stage pays besides its operators: the runtime's overhead, the loss on the last
    priced_on = replace(plan.cluster, device=device)
    fixed = stage_fixed_s(table, priced_on, plan.training.shape)
    posts, shared = _posts_and_sharing(plan, device)
    # the medians over every run's timed steps; the summaries' memory (the first run's) is not
    # calibrated
    summaries = launched.runs[0].run.stage_summaries(launched.timed)
    S = plan.training.shape.stages
    kept_whole = frozenset(n for t in plan.tied_parameters for n in (t.name, *t.aliases)
                           if len({k % S for k in t.stages}) > 1)
    graph = table.graph
    out = []
    for summary, nodes, stage in zip(summaries, launched.stage_nodes, plan.stages, strict=True):
        work = summary.compute_s(shared, posts[stage.index])
        if work is None:
            raise CalibrationError(
                f"{launched.name} ran processes that share cores but has no CPU "
                "times per stage (launched by an older partc), and its wall times hold the "
                "core-mates' turns", hint=launched.hint)
        forward_s, backward_s, _ = work
        fwd_work = table.sum_forward_s(nodes, m)
        bwd_work = table.sum_backward_s(nodes, m)
        # a pass that did priced work cannot time 0 s (the CPU between passes, added to each
        # pass, would otherwise hide an edited line and calibrate to a near-zero factor)
        between = host_per_pass_s(summary, posts[stage.index])  # what `compute_s` added
        for what, measured, priced in zip(("forward", "backward"),
                                          (forward_s - between, backward_s - between),
                                          (fwd_work, bwd_work), strict=True):
            if priced > 0 and measured <= 0:
                raise CalibrationError(
                    f"stage {stage.index}'s {what} in {launched.name} measured 0 s for work "
                    f"priced at {priced * 1e3:.3g} ms: no run of that stage times it so",
                    hint=launched.hint)
        fwd_fixed, bwd_fixed = fixed[stage.index]
        f = _factor(forward_s - fwd_fixed, fwd_work, stage.index, "forward", launched)
        # a checkpointing stage's measured backward recomputes its forward first; one sharding
        # its gradients reduces them inside each backward (the sharder's wall time, per step;
        # gloo reduces on its own threads, outside the computing thread's CPU time)
        recompute = f * fwd_work if stage.activation_checkpointing else 0.0
        reduces = summary.ddp_allreduce_s / plan.training.shape.num_microbatches \
            if stage.sharding == "gradients" and not shared else 0.0
        # and adds each micro-batch's gradients into the held ones, which the prediction prices
        # beside the operators (StageProblem's gradient_add_s), not in them
        params = _stage_parameters(table, nodes)
        adds = gradient_add_s((graph.param(p) for p in params), plan.training.config, device,
                              plan.training.shape, stage.sharding, kept_whole)
        b = _factor(backward_s - bwd_fixed - recompute - reduces - adds, bwd_work, stage.index,
                    "backward", launched)
        out.append(StageCalibration(
            index=stage.index, measured_forward_s=forward_s,
            measured_backward_s=backward_s, predicted_forward_s=stage.forward_s,
            predicted_backward_s=stage.backward_s, forward_factor=f, backward_factor=b))
    return tuple(out)


def _stage_parameters(table: CostTable, nodes: Sequence[str]) -> list[str]:
    """The parameters (not buffers) a stage's nodes hold, in order, each once."""
    graph = table.graph
    return list(dict.fromkeys(p for n in nodes for p in held_params(graph.node(n))
                              if graph.param(p).kind == "parameter"))


@dataclass(frozen=True)
class RunOptimizerStep:
    """What `run_optimizer_step` found: the runs' optimizer step over its price, and per
    pipeline rank it was taken from the measured and the priced step (seconds)."""

    factor: float
    ranks: tuple[int, ...]
    measured_s: tuple[float, ...]
    priced_s: tuple[float, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"factor": _round(self.factor), "ranks": list(self.ranks),
                "measured_s": [_round(x) for x in self.measured_s],
                "priced_s": [_round(x) for x in self.priced_s]}


def run_optimizer_step(table: CostTable, launched: LaunchedRun,
                       device: DeviceSpec) -> RunOptimizerStep | None:
    """The launched runs' optimizer step over its price on `device` (module docstring), over the
    pipeline ranks whose optimizer state is not sharded (a sharded step holds the weights'
    broadcast, the link's); None where no such rank steps a parameter or timed its step."""
    plan = launched.plan
    training = plan.training.config
    posts, shared = _posts_and_sharing(plan, device)
    summaries = launched.runs[0].run.stage_summaries(launched.timed)
    dispatch = step_dispatch_s(training, device)
    measured: dict[int, float] = {}
    priced: dict[int, float] = {}
    sharded: set[int] = set()
    for stage, summary, nodes in zip(plan.stages, summaries, launched.stage_nodes, strict=True):
        work = summary.compute_s(shared, posts[stage.index])
        if work is None:
            return None
        if stage.sharding != "none":
            sharded.add(stage.rank)
        # each stage steps its own parameters (a tied one in every stage holding it), as
        # partc.solve.levers.step_seconds prices a rank's step before any run's factor
        steps = [step_seconds_of(table.graph.param(p), training, device)
                 for p in _stage_parameters(table, nodes)]
        cold = device.step_cold_s if any(steps) else 0.0  # its optimizer's start from cold
        priced[stage.rank] = priced.get(stage.rank, 0.0) + sum(s + dispatch for s in steps if s) \
            + cold
        measured[stage.rank] = measured.get(stage.rank, 0.0) + work[2]
    ranks = tuple(r for r in sorted(priced)
                  if r not in sharded and priced[r] > 0 and measured[r] > 0)
    if not ranks:
        return None
    return RunOptimizerStep(
        factor=math.fsum(measured[r] for r in ranks) / math.fsum(priced[r] for r in ranks),
        ranks=ranks, measured_s=tuple(measured[r] for r in ranks),
        priced_s=tuple(priced[r] for r in ranks))


def _posts_and_sharing(plan: Plan, device: DeviceSpec) -> tuple[list[float | None], bool]:
    """Per stage, its passes' p2p posts at the price the stage's fixed costs hold (a run cannot
    part them from the copies of the bytes, which the link prices: host_per_pass_s); and whether
    the plan's ranks share cores: their wall times then hold the core-mates' turns, which the
    simulator adds itself, and the stages' own work is their CPU time, as the profile prices it
    there."""
    priced_on = replace(plan.cluster, device=device)
    return (list(p2p_posts_priced(priced_on, plan.training.shape)),
            plan.pipeline_spec().shares_cores)


@dataclass(frozen=True)
class RunSpeedSpread:
    """What `run_speed_spread` found: the modes of a speed unit's time over the stages' median
    times, and how many timed steps and unit samples they were cut from."""

    modes: tuple[tuple[float, float], ...]
    steps: int
    samples: int

    def to_dict(self) -> dict[str, Any]:
        return {"modes": [[p, f] for p, f in self.modes], "steps": self.steps,
                "samples": self.samples}


def unit_samples_of_maxima(maxima: Sequence[float], units: int) -> list[float]:
    """As many samples of one unit's factor as `maxima`, samples of the largest of `units`
    independent units' (a stage's slowest replica, as a run reports it): the distribution of the
    max is a unit's raised to the power `units`, so a unit's quantile q is the maxima's quantile
    q**units, read at the midpoints q = (i + 1/2) / n. One unit: the maxima, sorted."""
    if units < 1:
        raise ValueError(f"units must be >= 1, got {units}")
    ordered = sorted(maxima)
    n = len(ordered)
    return [ordered[min(n - 1, int(((i + 0.5) / n) ** units * n))] for i in range(n)]


def run_speed_spread(launched: LaunchedRun, device: DeviceSpec) -> RunSpeedSpread | None:
    """The speed spread of the launched runs' stages (module docstring), or None with fewer than
    MIN_SPREAD_STEPS timed steps pooled or no stage whose work was timed. Each run's steps are
    read against that run's own medians, so a run slower or faster as a whole (the machine's
    minute, all stages alike) moves the pooled medians, not the spread; runs with fewer than
    MIN_RUN_SPREAD_STEPS timed steps have no median of their own to read them against."""
    if len(launched.timed) < MIN_SPREAD_STEPS:
        return None
    posts, shared = _posts_and_sharing(launched.plan, device)
    samples: list[float] = []
    steps = 0
    for run in launched.runs:
        if len(run.timed) >= MIN_RUN_SPREAD_STEPS:
            found = _unit_samples(launched.plan, run, posts, shared)
            steps += len(run.timed) if found else 0
            samples += found
    if not samples:
        return None
    return RunSpeedSpread(modes=modes_of(samples, reference=1.0), steps=steps,
                          samples=len(samples))


def _unit_samples(plan: Plan, run: RunOfPlan, posts: Sequence[float | None],
                  shared: bool) -> list[float]:
    """One run's samples of a speed unit's factor: per stage and timed step, the stage's own
    work over its median in this run, read through `unit_samples_of_maxima` where its replicas
    run on several units."""
    samples: list[float] = []
    for stage, summary in zip(plan.stages, run.run.stage_summaries(run.timed), strict=True):
        k = stage.index
        median = summary.compute_s(shared, posts[k])
        works = [step.stages[k].compute_s(shared, posts[k]) for step in run.timed]
        if median is None or median[0] + median[1] <= 0 or \
                any(w is None or w[0] + w[1] <= 0 for w in works):
            continue  # no timed work (a run without CPU times on shared cores: refused before)
        reference = median[0] + median[1]
        units = len({plan.cluster.core_of(d) for d in stage.devices}) or 1
        samples += unit_samples_of_maxima([(w[0] + w[1]) / reference
                                           for w in works if w is not None], units)
    return samples


def _factor(measured_work: float, predicted_work: float, stage: int, what: str,
            launched: LaunchedRun) -> float:
    if predicted_work <= 0:
        return 1.0  # nothing to scale (views only): keep the costs as they are
    if not math.isfinite(measured_work) or not math.isfinite(predicted_work):
        # RunMetrics.load refuses such times; a table's costs are finite by construction
        raise CalibrationError(f"stage {stage}'s {what} in {launched.name} is not a "
                               "finite time", hint=launched.hint)
    if measured_work <= 0:
        raise CalibrationError(
            f"stage {stage}'s measured {what} in {launched.name} is not above the "
            "device's fixed costs per pass (microbatch_overhead_s, cold_pass_s on a shared "
            "core, the loss's): there is no work left to calibrate",
            hint="lower microbatch_overhead_s (or cold_pass_s) in the device config, or launch "
                 "with larger micro-batches")
    return measured_work / predicted_work


def corrected_costs(table: CostTable, launched: LaunchedRun, device: DeviceSpec) -> CostTable:
    """`table` (the new compile's costs) with every node's forward and backward `Linear` scaled by
    its stage's factor in the launched plan (`stage_calibrations`), the runs' speed spread as
    its `speed_modes` where they give one (`run_speed_spread`) and their optimizer step over its
    price as its `optimizer_factor` (`run_optimizer_step`); saved bytes unchanged. The
    source keeps its kind and records the correction under calibration[CALIBRATED_FROM]."""
    stages = stage_calibrations(table, launched, device)
    factor_of: dict[str, StageCalibration] = {}
    for stage, members in zip(stages, launched.stage_nodes, strict=True):
        for n in members:
            factor_of[n] = stage
    spread = run_speed_spread(launched, device)
    optimizer = run_optimizer_step(table, launched, device)
    nodes: dict[str, NodeCost] = {}
    for name, cost in table.nodes.items():
        st = factor_of.get(name)
        if st is None:  # in no stage (nothing runs it): unchanged
            nodes[name] = cost
            continue
        nodes[name] = NodeCost(cost.forward.scaled(st.forward_factor),
                               cost.backward.scaled(st.backward_factor), cost.saved,
                               cost.method)
    record = {"runs": [{"run": str(r.run_path), "steps": [s.step for s in r.timed]}
                       for r in launched.runs],
              "plan": str(launched.plan_path), "plan_sha256": launched.plan_sha256,
              "microbatch_size": launched.microbatch_size,
              "stages": [st.to_dict() for st in stages],
              **({"speed_spread": spread.to_dict()} if spread is not None else {}),
              **({"optimizer": optimizer.to_dict()} if optimizer is not None else {})}
    source = replace(table.source, calibration={**table.source.calibration,
                                                CALIBRATED_FROM: record})
    # everything else the table knows (saved-result nodes, kernel scratch) stays as measured
    return replace(table, source=source, nodes=nodes,
                   speed_modes=spread.modes if spread is not None else (),
                   optimizer_factor=_round(optimizer.factor) if optimizer is not None else 1.0)


def calibrated_from(calibration: dict[str, Any]) -> dict[str, Any] | None:
    """The correction a CostSource.calibration (or a profile file's `calibration`) records, or
    None for costs not corrected from a run."""
    record = calibration.get(CALIBRATED_FROM)
    return record if isinstance(record, dict) else None



def _round(x: float) -> float:
    """12 significant digits, as profiles round their costs: stable text."""
    return float(f"{x:.12g}")
