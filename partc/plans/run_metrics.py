"""What a `partc launch --metrics FILE` run measured, as typed data: one `StepMetrics` per JSON
line, each with one `StageMetrics` per pipeline stage, and summaries of a whole run
(`RunMetrics`).

The launch runtime writes each line with `StepMetrics.to_dict` and this module reads it back with
`StepMetrics.from_dict`: one definition of the keys. It sits in plans/ (no torch) so that `partc
show` can draw a run beside its plan's prediction, and `partc compile --calibrate-from` can read
a run to correct its costs (partc.plans.recalibrate; each line names the plan it ran). Metrics
are run output, not plans: nothing here is written into a plan.

Units: seconds and bytes. `forward_s`/`backward_s` are per micro-batch (the mean over the step's
micro-batches); every other time is per step. With data-parallel replicas each stage value is the
maximum over the stage's replicas (the slowest replica sets the pace of the step).
"""
from __future__ import annotations

import json
import math
import re
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Iterable, Iterator

from partc.errors import PartcError
from partc.files import sha256_file, special_file
from partc.plans.plan import Plan, load_plan

METRICS_VERSION = 1

# How `peak_memory_bytes` was measured (StepMetrics.memory_method).
MEMORY_CUDA = "torch.cuda.max_memory_allocated"  # every step, peak stats reset at step start
# CPU: the method of partc.run.reference.measure_training_peak (tensors live at step start + the
# torch profiler's peak of allocations during the step), on one step of the run only: the
# profiler slows the step it watches, so that step is left out of the time summaries.
MEMORY_CPU_PROFILER = "torch.profiler"
MEMORY_NONE = "none"  # not measured on this step (peak_memory_bytes is null)
MEMORY_METHODS = (MEMORY_CUDA, MEMORY_CPU_PROFILER, MEMORY_NONE)

# How times were read (StepMetrics.clock).
CLOCK_CPU = "perf_counter"
CLOCK_CUDA = "perf_counter+cuda.synchronize"  # the device is synchronised before each reading
CLOCKS = (CLOCK_CPU, CLOCK_CUDA)


class RunMetricsError(PartcError):
    """A metrics file that is missing, empty, corrupt, or from another plan."""


def _hint(path: Path | str) -> str:
    return f"write it with `partc launch PLAN --metrics {path}`"


# The longest line the reader takes: a line is a step with a few hundred bytes per stage, so this
# is far beyond any run's, and a file without newlines (/dev/zero, a binary) fails here instead of
# filling the memory.
MAX_LINE_BYTES = 64 << 20
_INT64 = 2**63  # steps and byte counts beyond this are not a run's
_MAX_SECONDS = 1e6  # 11.6 days: no step, micro-batch or optimizer step a run times is so long


class _BadValue(ValueError):
    """Why one line is not a partc metrics line (the reader adds the file and line)."""


def _value(d: dict[str, Any], key: str, where: str) -> Any:
    if key not in d:
        raise _BadValue(f"missing key {where}{key}")
    return d[key]


def _number(value: Any, what: str) -> float:
    """A JSON number (not a boolean, not a string of digits) as a float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _BadValue(f"{what} is {json.dumps(value)[:40]}, not a number")
    try:
        return float(value)
    except OverflowError:  # an integer beyond any float
        return math.inf


def _finite(value: Any, what: str, unit: str) -> float:
    """A finite number >= 0 (a NaN or an infinity is nothing a run measured)."""
    if type(value) is float and 0.0 <= value < math.inf:  # what runs write: the fast path
        return value
    x = _number(value, what)
    if not math.isfinite(x) or x < 0:
        raise _BadValue(f"{what} is {value!r}, not {unit} (finite, >= 0)")
    return x


def _seconds(value: Any, what: str) -> float:
    """A duration a run measured: finite, not negative, and under _MAX_SECONDS (a larger one
    is a damaged file, which --calibrate-from would scale a compile's costs by)."""
    x = _finite(value, what, "a time in seconds")
    if x >= _MAX_SECONDS:
        raise _BadValue(f"{what} is {value!r}, beyond any run's ({_MAX_SECONDS:.0e} s or more)")
    return x


def _optional_seconds(value: Any, what: str) -> float | None:
    return None if value is None else _seconds(value, what)


def _integer(value: Any, what: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _BadValue(f"{what} is {json.dumps(value)[:40]}, not a whole number >= {minimum}")
    if value >= _INT64:
        raise _BadValue(f"{what} is {str(value)[:40]}, beyond any run's (2**63 or more)")
    return value


def _choice(value: Any, what: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise _BadValue(f"{what} is {json.dumps(value)[:40]}, not one of {', '.join(allowed)}")
    return str(value)


def _optional_text(value: Any, what: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise _BadValue(f"{what} is {json.dumps(value)[:40]}, not a string")
    return value


@dataclass(frozen=True)
class StageMetrics:
    """One pipeline stage in one step, measured on the ranks running it (the maximum over its
    data-parallel replicas).

    `p2p_s`, `tied_sync_s` and `peak_memory_bytes` belong to the stage's pipeline rank: with an
    interleaved schedule every virtual stage of one rank reports the same value (the schedule
    batches one rank's sends and receives for several stages together)."""

    index: int
    pipeline_rank: int
    forward_s: float  # per micro-batch: compute of its forwards (mean over micro-batches)
    backward_s: float  # per micro-batch: its backwards (with recompute, and the last one's wait
    #                    for the DDP all-reduce: DDP finishes the reduction inside it)
    p2p_s: float  # per step: posting and waiting for the rank's sends and receives (waiting
    #               includes waiting for the neighbour stages: pipeline bubbles)
    optimizer_s: float  # per step: this stage's optimizer step
    ddp_allreduce_s: float  # per step: first gradient bucket posted to last one reduced (it
    #                         overlaps the backward); with sharded gradients the time in their
    #                         reduces (inside the backwards) and the tied ones' all-reduce; 0
    #                         without replicas
    tied_sync_s: float  # per step: summing tied parameters' gradients across stages (rank)
    peak_memory_bytes: int | None  # the rank's peak in this step; None when not measured
    # The CPU time of forward_s, backward_s and optimizer_s (the computing thread's; where
    # processes share a core, the work without the core-mates' turns). None on CUDA and in
    # metrics files of earlier partc versions.
    forward_cpu_s: float | None = None
    backward_cpu_s: float | None = None
    optimizer_cpu_s: float | None = None
    # Per pass (forward or backward) of the stage's rank: the computing thread's CPU time between
    # its passes (torch's schedule loop, the step's setup), which the device's
    # microbatch_overhead_s prices with the rest of the runtime's time per pass; the p2p posts
    # and waits are not in it (partc before 2026-12-06 counted them in). None on CUDA and in
    # metrics files of earlier partc versions.
    between_cpu_s: float | None = None
    # Per pass of the stage's rank, as between_cpu_s: the computing thread's CPU time in its p2p
    # posts and waits (gloo copies a send's bytes into the socket on the posting thread, the
    # link's work, which the link's price holds). None on CUDA and in metrics files of earlier
    # partc versions.
    p2p_cpu_s: float | None = None

    def compute_s(self, shared_core: bool, post_s: float | None = None
                  ) -> tuple[float, float, float] | None:
        """The stage's own work in this step (`own_work_s`)."""
        return own_work_s(self, shared_core, post_s)

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index, "pipeline_rank": self.pipeline_rank,
                "forward_s": self.forward_s, "backward_s": self.backward_s,
                "p2p_s": self.p2p_s, "optimizer_s": self.optimizer_s,
                "ddp_allreduce_s": self.ddp_allreduce_s, "tied_sync_s": self.tied_sync_s,
                "peak_memory_bytes": self.peak_memory_bytes,
                "forward_cpu_s": self.forward_cpu_s, "backward_cpu_s": self.backward_cpu_s,
                "optimizer_cpu_s": self.optimizer_cpu_s,
                **({} if self.between_cpu_s is None else {"between_cpu_s": self.between_cpu_s}),
                **({} if self.p2p_cpu_s is None else {"p2p_cpu_s": self.p2p_cpu_s})}

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "") -> StageMetrics:
        """A stage of a metrics line, checked: ValueError naming the key (prefixed by `where`,
        e.g. "stages[1]."), and why, for a value no run writes (a time that is negative, NaN or
        not a number, a fractional byte count)."""
        if not isinstance(d, dict):
            raise _BadValue(f"{where.rstrip('.') or 'a stage'} is not a JSON object")

        def time(key: str) -> float:
            return _seconds(_value(d, key, where), where + key)

        def cpu(key: str) -> float | None:  # absent in earlier partc versions' lines, and CUDA's
            return _optional_seconds(d.get(key), where + key)

        peak = _value(d, "peak_memory_bytes", where)
        return cls(index=_integer(_value(d, "index", where), where + "index", 0),
                   pipeline_rank=_integer(_value(d, "pipeline_rank", where),
                                          where + "pipeline_rank", 0),
                   forward_s=time("forward_s"), backward_s=time("backward_s"),
                   p2p_s=time("p2p_s"), optimizer_s=time("optimizer_s"),
                   ddp_allreduce_s=time("ddp_allreduce_s"), tied_sync_s=time("tied_sync_s"),
                   peak_memory_bytes=None if peak is None else _integer(
                       peak, where + "peak_memory_bytes", 0),
                   forward_cpu_s=cpu("forward_cpu_s"), backward_cpu_s=cpu("backward_cpu_s"),
                   optimizer_cpu_s=cpu("optimizer_cpu_s"), between_cpu_s=cpu("between_cpu_s"),
                   p2p_cpu_s=cpu("p2p_cpu_s"))


@dataclass(frozen=True)
class StepMetrics:
    """One line of a metrics file: one training step as rank 0 saw it.

    `stage_forward_s`/`stage_backward_s` (per stage, per micro-batch, the mean over replicas) are
    the keys of earlier partc versions, kept for readers of those; `stages` has the rest."""

    step: int  # 1-based: the number of steps done after it
    loss: float  # mean over micro-batches and replicas
    step_s: float  # rank 0's wall time of the step
    samples_per_s: float
    stage_forward_s: tuple[float, ...]
    stage_backward_s: tuple[float, ...]
    stages: tuple[StageMetrics, ...]
    num_microbatches: int
    replicas: int
    clock: str  # CLOCK_CPU or CLOCK_CUDA
    memory_method: str  # one of MEMORY_METHODS
    version: int = METRICS_VERSION
    # The plan the run trained, as it was at launch: plan.yaml's absolute path and the sha256 of
    # its bytes, so that `partc compile --calibrate-from` can find the plan and refuse a changed
    # one. None on lines written before partc recorded them.
    plan: str | None = None
    plan_sha256: str | None = None
    traced: bool = False  # `partc launch --trace` profiled this step

    def to_dict(self) -> dict[str, Any]:
        # plan keys only when known: lines without them read back as they were written
        named: dict[str, Any] = (
            {"plan": self.plan, "plan_sha256": self.plan_sha256} if self.plan else {})
        if self.traced:  # only then: untraced lines read as they were written before
            named["traced"] = True
        return {"version": self.version, "step": self.step, "loss": self.loss,
                "step_s": self.step_s, "samples_per_s": self.samples_per_s,
                "stage_forward_s": list(self.stage_forward_s),
                "stage_backward_s": list(self.stage_backward_s),
                "stages": [s.to_dict() for s in self.stages],
                "num_microbatches": self.num_microbatches, "replicas": self.replicas,
                "clock": self.clock, "memory_method": self.memory_method, **named}

    def to_json(self) -> str:
        """The metrics file's line for this step (without the newline)."""
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StepMetrics:
        """A metrics line, checked: ValueError naming the key and why for a value no run writes
        (StageMetrics.from_dict; a step that is not a whole number >= 1, a step time that is not
        above 0, stages whose indices are not 0, 1, ..., an unknown clock or memory method).
        The loss may be anything numeric: a diverging run's NaN is what it measured."""
        if not isinstance(d, dict):
            raise _BadValue("not a JSON object")
        for key in _LINE_KEYS:  # every missing key first: the most likely corruption
            _value(d, key, "")

        def times(key: str) -> tuple[float, ...]:
            values = _value(d, key, "")
            if not isinstance(values, list):
                raise _BadValue(f"{key} is not a list")
            return tuple(_seconds(x, f"{key}[{k}]") for k, x in enumerate(values))

        rows = _value(d, "stages", "")
        if not isinstance(rows, list) or not rows:
            raise _BadValue("stages is not a non-empty list")
        stages = tuple(StageMetrics.from_dict(row, f"stages[{k}].") for k, row in enumerate(rows))
        for k, stage in enumerate(stages):
            if stage.index != k:  # the readers take stage k from position k
                raise _BadValue(f"stages[{k}].index is {stage.index}, not {k}")
        traced = d.get("traced", False)
        if not isinstance(traced, bool):
            raise _BadValue(f"traced is {json.dumps(traced)[:40]}, not true or false")
        step_s = _seconds(_value(d, "step_s", ""), "step_s")
        if step_s <= 0:
            raise _BadValue("step_s is 0: no step takes no time")
        return cls(version=_integer(_value(d, "version", ""), "version", 1),
                   step=_integer(_value(d, "step", ""), "step", 1),
                   loss=_number(_value(d, "loss", ""), "loss"), step_s=step_s,
                   samples_per_s=_finite(_value(d, "samples_per_s", ""), "samples_per_s",
                                         "a rate"),
                   stage_forward_s=times("stage_forward_s"),
                   stage_backward_s=times("stage_backward_s"), stages=stages,
                   num_microbatches=_integer(_value(d, "num_microbatches", ""),
                                             "num_microbatches", 1),
                   replicas=_integer(_value(d, "replicas", ""), "replicas", 1),
                   clock=_choice(_value(d, "clock", ""), "clock", CLOCKS),
                   memory_method=_choice(_value(d, "memory_method", ""), "memory_method",
                                         MEMORY_METHODS),
                   plan=_optional_text(d.get("plan"), "plan"),
                   plan_sha256=_optional_text(d.get("plan_sha256"), "plan_sha256"),
                   traced=traced)

    @property
    def profiled(self) -> bool:
        """Did a profiler watch this step (its times are slowed by it)?"""
        return self.memory_method == MEMORY_CPU_PROFILER or self.traced


# the keys every metrics line has (StepMetrics.to_dict)
_LINE_KEYS = ("version", "step", "loss", "step_s", "samples_per_s", "stage_forward_s",
              "stage_backward_s", "stages", "num_microbatches", "replicas", "clock",
              "memory_method")


@dataclass(frozen=True)
class StageSummary:
    """One stage over a run: the median of each StageMetrics value over the timed steps (peak
    memory: the median over the steps that measured it, None if none did)."""

    index: int
    pipeline_rank: int
    forward_s: float
    backward_s: float
    p2p_s: float
    optimizer_s: float
    ddp_allreduce_s: float
    tied_sync_s: float
    peak_memory_bytes: int | None
    # medians of the CPU times, None unless every timed step has them
    forward_cpu_s: float | None = None
    backward_cpu_s: float | None = None
    optimizer_cpu_s: float | None = None
    between_cpu_s: float | None = None
    p2p_cpu_s: float | None = None

    def compute_s(self, shared_core: bool, post_s: float | None = None
                  ) -> tuple[float, float, float] | None:
        """The median of the stage's own work (`own_work_s`)."""
        return own_work_s(self, shared_core, post_s)


def host_per_pass_s(stage: StageMetrics | StageSummary, post_s: float | None) -> float:
    """What `own_work_s` adds to each of a stage's passes besides the pass itself: the computing
    thread's CPU between passes where it was measured (`between_cpu_s`: the device's
    microbatch_overhead_s prices it in every pass) and the pass's p2p posts and waits.

    `post_s`: the posts' price per pass of this stage (partc.solve.stage_problem.p2p_post_s)
    where the device prices them apart (`p2p_post_cpu_s`); None where its microbatch_overhead_s
    holds them. A run's posts hold gloo's copy of a send's bytes, which the simulator prices as
    the link's transfer, and nothing in a run separates the two: with a price the posts are
    taken at it; without one as measured (`p2p_cpu_s`), as that device's overhead was measured.
    Runs of partc before 2026-12-06 (no `p2p_cpu_s`) counted them in `between_cpu_s`."""
    between = stage.between_cpu_s or 0.0
    if stage.p2p_cpu_s is None:
        return between
    return between + (stage.p2p_cpu_s if post_s is None else post_s)


def own_work_s(stage: StageMetrics | StageSummary, shared_core: bool,
               post_s: float | None = None) -> tuple[float, float, float] | None:
    """(forward, backward, optimizer) seconds of a stage's own work, in one step or over a run,
    as a prediction prices a stage's passes: the wall times, or where processes share a core
    the CPU times (the wall times there include the core-mates' turns); each pass with the
    host work between passes (`host_per_pass_s`, `post_s` the stage's priced p2p posts per
    pass, None where the device does not price them apart). None where the CPU times were not
    measured."""
    between = host_per_pass_s(stage, post_s)
    if not shared_core:
        return stage.forward_s + between, stage.backward_s + between, stage.optimizer_s
    if stage.forward_cpu_s is None or stage.backward_cpu_s is None or \
            stage.optimizer_cpu_s is None:
        return None
    return (stage.forward_cpu_s + between, stage.backward_cpu_s + between,
            stage.optimizer_cpu_s)


@dataclass(frozen=True)
class RunMetrics:
    """A metrics file: its steps in step order (a step run twice, after an elastic restart or a
    resume, counts with its last line)."""

    steps: tuple[StepMetrics, ...]
    source: str = ""  # where it was read from, for messages
    # what the reader skipped and why (a line cut short by a run that stopped while writing
    # it), for the commands to warn about: the steps are the complete lines
    notes: tuple[str, ...] = ()

    @classmethod
    def load(cls, path: str | Path) -> RunMetrics:
        """Read a metrics file; RunMetricsError if it is missing or unreadable, has no steps, is
        not partc metrics, holds a value no run writes (StepMetrics.from_dict), or mixes runs
        of different shapes or plans.

        A run killed while it wrote a line leaves that line cut short: as the last line, or,
        when a resumed run appended to the file, on a line of its own before the resumed run's
        (launch ends a cut-short line before appending) or, in files of partc before
        2026-11-29, glued in front of the resumed run's first line. Either way the cut-short
        part is skipped and `notes` says so; every complete line is used. Any other line that
        is not JSON is an error: it is not a run's."""
        p = Path(path)
        notes: list[str] = []
        by_step: dict[int, StepMetrics] = {}
        kind = special_file(p)
        if kind:  # a named pipe would wait for a writer forever
            raise RunMetricsError(f"metrics file {p} is {kind}, not a file", hint=_hint(p))
        try:
            with open(p, "rb") as f:  # line by line: a long run's file need not fit twice
                for n, text, complete in _lines(f, p):
                    row = _parse(text, n, complete, p, notes)
                    if row is not _SKIP:
                        step = _step(row, n, p)
                        by_step[step.step] = step
        except FileNotFoundError:
            raise RunMetricsError(f"metrics file {p} not found", hint=_hint(p)) from None
        except IsADirectoryError:
            raise RunMetricsError(f"metrics file {p} is a directory",
                                  hint="pass the metrics file itself") from None
        except PermissionError:
            raise RunMetricsError(f"cannot read metrics file {p}: permission denied",
                                  hint=f"make it readable (chmod u+r {p})") from None
        except OSError as exc:
            raise RunMetricsError(f"cannot read metrics file {p}: {exc.strerror or exc}",
                                  hint=_hint(p)) from None
        if not by_step:
            cut = ": its only step is cut short (the run stopped while writing it)" if notes \
                else ""
            raise RunMetricsError(f"metrics file {p} has no steps{cut}", hint=_hint(p))
        steps = tuple(by_step[s] for s in sorted(by_step))
        _check_one_run(steps, p)
        return cls(steps=steps, source=str(p), notes=tuple(notes))

    @property
    def num_stages(self) -> int:
        return len(self.steps[0].stages)

    def check_stages(self, num_stages: int, plan: str = "the plan") -> None:
        """RunMetricsError unless the run had `num_stages` pipeline stages (a run of that plan)."""
        if self.num_stages != num_stages:
            raise RunMetricsError(
                f"metrics file {self.source or '(metrics)'} is a run of {self.num_stages} "
                f"stage(s), {plan} has {num_stages}",
                hint="pass the metrics of a `partc launch` of this plan")

    def check_shape(self, plan: Plan, name: str = "the plan") -> None:
        """RunMetricsError unless the run could be one of `plan` (called `name` in messages):
        its stage count, micro-batches per step, replicas, each stage's pipeline rank and the
        device kind its clock says (CUDA or CPU) are the plan's. What the lines record of the
        run, nothing more: `check_run_of` compares the plan the run names."""
        self.check_stages(plan.num_stages, name)
        where = self.source or "(metrics)"
        shape = plan.training.shape
        step = self.steps[-1]  # load checked that every line agrees
        hint = "pass the metrics of a `partc launch` of this plan"
        for what, ran, has in (("micro-batches per step", step.num_microbatches,
                                shape.num_microbatches),
                               ("replicas", step.replicas, shape.replicas)):
            if ran != has:
                raise RunMetricsError(f"metrics file {where} is a run of {ran} {what}, {name} "
                                      f"has {has}", hint=hint)
        for measured, stage in zip(step.stages, plan.stages, strict=True):
            if measured.pipeline_rank != stage.rank:
                raise RunMetricsError(
                    f"metrics file {where} ran stage {stage.index} on pipeline rank "
                    f"{measured.pipeline_rank}, {name} on rank {stage.rank}", hint=hint)
        # launch runs a plan on CUDA with NCCL and on the CPU otherwise (rank_setup)
        clock = CLOCK_CUDA if plan.cluster.backend == "nccl" else CLOCK_CPU
        if step.clock != clock:
            ran_on, runs_on = (("CUDA", "CPU") if step.clock == CLOCK_CUDA else ("CPU", "CUDA"))
            raise RunMetricsError(f"metrics file {where} is a run on {ran_on} devices, {name} "
                                  f"runs on {runs_on} ({plan.cluster.device.name})", hint=hint)

    def check_run_of(self, plan: Plan, name: str = "the plan") -> str | None:
        """Is this a run of `plan` (loaded, so that its digest is plan.yaml's sha256)? None when
        the lines name it (or name no plan: an older partc's) or the plan bytes it names are
        another plan's; a note when they name another plan file that has the same model,
        training shape, devices, precision and stages as `plan` (a recompile, a calibrated
        plan: a stage-by-stage comparison still holds), or one that is gone or changed so
        that it cannot be told (the caller warns); RunMetricsError when the plan it names is
        there and differs (another model, shape, device, precision or cut)."""
        named = {(s.plan, s.plan_sha256) for s in self.steps
                 if s.plan is not None and s.plan_sha256 is not None}
        mine = plan.digest.removeprefix("sha256:")
        if not named or not mine:
            return None
        ran, sha = named.pop()  # load refused lines of several plans
        assert ran is not None and sha is not None
        if sha == mine:
            return None
        where = self.source or "(metrics)"
        other = _plan_if_unchanged(Path(ran), sha)
        if other is None:
            return (f"{where} is a run of {ran} as it was at launch (sha256 {sha[:12]}), not "
                    f"of {name} (sha256 {mine[:12]}), and {ran} is gone or changed since: it "
                    "is compared as a run of a plan of this shape, which it may not have been")
        difference = _plan_difference(other, plan)
        if difference:
            raise RunMetricsError(
                f"metrics file {where} is a run of another plan, {ran}: {difference}",
                hint=f"`partc show {ran} --metrics {where}` sets it beside its own plan")
        return (f"{where} is a run of {ran}, another plan file with the same model, shape, "
                f"devices and stages as {name}: compared stage by stage")

    def launched_plan(self) -> tuple[Path, str]:
        """The plan.yaml the run trained and the sha256 its bytes had at launch (StepMetrics.plan,
        .plan_sha256). RunMetricsError when the lines do not say (written by an older partc) or
        name more than one plan (runs of several plans appended to one file)."""
        named = {(s.plan, s.plan_sha256) for s in self.steps}
        where = self.source or "(metrics)"
        if any(plan is None or sha is None for plan, sha in named):
            raise RunMetricsError(
                f"metrics file {where} does not name the plan it ran (written by an older "
                "partc)", hint="re-run `partc launch PLAN --metrics FILE` with this partc")
        if len(named) > 1:
            raise RunMetricsError(f"metrics file {where} mixes runs of {len(named)} plans "
                                  "(or of a plan that changed between runs)",
                                  hint="write each run to its own --metrics file")
        plan, sha = named.pop()
        assert plan is not None and sha is not None  # checked above
        return Path(plan), sha

    def strictly_timed_steps(self) -> tuple[StepMetrics, ...]:
        """`timed_steps` without its fallback: possibly none (a run of one step, or of a
        warm-up and a profiled step only)."""
        first = self.steps[0].step
        return tuple(s for s in self.steps if s.step != first and not s.profiled)

    def timed_steps(self) -> tuple[StepMetrics, ...]:
        """The steps time summaries use: all but the first (warm-up: lazy allocations, first
        communications) and those a profiler slowed; all steps if that leaves none."""
        return self.strictly_timed_steps() or self.steps

    def median_step_s(self) -> float:
        """The median step time over `timed_steps`."""
        return statistics.median(s.step_s for s in self.timed_steps())

    def mean_step_s(self) -> float:
        """The mean step time over `timed_steps`: what a prediction over the devices' speed
        spread (an expectation) is of, and what sets the run's throughput."""
        return statistics.fmean(s.step_s for s in self.timed_steps())

    def stage_summaries(self, steps: tuple[StepMetrics, ...] | None = None
                        ) -> tuple[StageSummary, ...]:
        """Per stage, the median of each value over `steps` (default: `timed_steps`; see
        StageSummary)."""
        timed = steps if steps is not None else self.timed_steps()
        out = []
        for k in range(self.num_stages):
            rows = [s.stages[k] for s in timed]
            # memory: any step that measured it (on CPU only the profiled one does)
            peaks = [s.stages[k].peak_memory_bytes for s in self.steps[1:] or self.steps]
            measured = [p for p in peaks if p is not None]
            if not measured:
                measured = [p for s in self.steps
                            if (p := s.stages[k].peak_memory_bytes) is not None]
            out.append(StageSummary(
                index=k, pipeline_rank=rows[0].pipeline_rank,
                forward_s=_median(r.forward_s for r in rows),
                backward_s=_median(r.backward_s for r in rows),
                p2p_s=_median(r.p2p_s for r in rows),
                optimizer_s=_median(r.optimizer_s for r in rows),
                ddp_allreduce_s=_median(r.ddp_allreduce_s for r in rows),
                tied_sync_s=_median(r.tied_sync_s for r in rows),
                peak_memory_bytes=int(statistics.median(measured)) if measured else None,
                forward_cpu_s=_median_of_measured([r.forward_cpu_s for r in rows]),
                backward_cpu_s=_median_of_measured([r.backward_cpu_s for r in rows]),
                optimizer_cpu_s=_median_of_measured([r.optimizer_cpu_s for r in rows]),
                between_cpu_s=_median_of_measured([r.between_cpu_s for r in rows]),
                p2p_cpu_s=_median_of_measured([r.p2p_cpu_s for r in rows])))
        return tuple(out)

    @property
    def memory_method(self) -> str:
        """How peak memory was measured in this run (MEMORY_NONE if on no step)."""
        methods = [s.memory_method for s in self.steps if s.memory_method != MEMORY_NONE]
        return methods[-1] if methods else MEMORY_NONE


def _lines(f: IO[bytes], path: Path) -> Iterator[tuple[int, str, bool]]:
    """(line number, text, whether it ends in a newline) of each line of `f`; RunMetricsError
    for a line longer than MAX_LINE_BYTES or not UTF-8 (partc writes ASCII)."""
    n = 0
    while raw := f.readline(MAX_LINE_BYTES + 1):
        n += 1
        complete = raw.endswith(b"\n")
        if not complete and len(raw) > MAX_LINE_BYTES:
            raise RunMetricsError(f"{path}:{n} is longer than {MAX_LINE_BYTES >> 20} MiB: not a "
                                  "partc metrics file", hint=_hint(path))
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise RunMetricsError(f"{path}:{n} is not text (bytes that are not UTF-8): not a "
                                  "partc metrics file", hint=_hint(path)) from None
        yield n, text, complete


_SKIP = object()  # _parse's value for a line that holds no step


def _parse(text: str, n: int, complete: bool, path: Path, notes: list[str]) -> Any:
    """The JSON value of line `n` (_SKIP for a blank line, or a cut-short one, with a note;
    RunMetrics.load)."""
    text = text.strip()  # JSON's error positions are then the line's
    if not text:
        return _SKIP
    try:
        return json.loads(text, parse_int=_json_int)
    except _HugeInteger as exc:
        raise RunMetricsError(f"{path}:{n} holds an integer of {exc.args[0]} digits, beyond any "
                              "run's", hint=_hint(path)) from None
    except (ValueError, RecursionError) as exc:
        glued = _record_after_cut(text)
        if glued is not None:
            notes.append(f"{path}:{n} starts with a line cut short (a run stopped while writing "
                         "it, and a resumed run appended after it): that part is skipped")
            return glued
        if not complete and text.startswith("{"):
            notes.append(f"{path}:{n}, the last line, is cut short (the run stopped while "
                         f"writing it): skipped; the {n - 1} line(s) before it are used")
            return _SKIP
        if (start := _LINE_START.match(text)) is not None and start.group(1) in _STEP_KEYS:
            # a metrics line's opening that does not parse: a run stopped while writing it
            # and a resumed run, which ends such a line first (partc.run.reporting), appended
            notes.append(f"{path}:{n} is cut short (a run stopped while writing it, and a "
                         "resumed run appended after it): skipped")
            return _SKIP
        why = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise RunMetricsError(f"{path}:{n} is not a partc metrics line (not JSON: {why})",
                              hint=_hint(path)) from None


class _HugeInteger(Exception):
    """A JSON integer of more digits than any metrics value (not a ValueError: those are JSON
    that does not parse, which _parse may take for a line cut short)."""


def _json_int(digits: str) -> int:
    """A JSON integer; one of over 100 digits is refused (2**63 has 19): int() of over 4300
    raised Python's conversion-limit ValueError, which skipped the line as cut short."""
    if len(digits) > 100:
        raise _HugeInteger(len(digits))
    return int(digits)


# A metrics line is a JSON object whose first key is one of these (json.dumps sorts the keys);
# a stage's object starts with a StageMetrics key, none of which is one of these.
_LINE_START = re.compile(r'\{\s*"([a-z_0-9]+)"\s*:')
_STEP_KEYS = frozenset(
    f.name for f in StepMetrics.__dataclass_fields__.values()) - frozenset(
    f.name for f in StageMetrics.__dataclass_fields__.values())
_MAX_GLUE_TRIES = 64


def _record_after_cut(text: str) -> dict[str, Any] | None:
    """The complete metrics line at the end of `text` when `text` is a cut-short line with a
    complete one appended to it (`RunMetrics.load`), else None. Only openings of a line's
    object are tried, so a long line of garbage costs one scan."""
    body = text.strip()
    decoder = json.JSONDecoder()
    tries = 0
    for match in _LINE_START.finditer(body, 1):
        if match.group(1) not in _STEP_KEYS:
            continue
        tries += 1
        if tries > _MAX_GLUE_TRIES:
            break
        try:
            value, end = decoder.raw_decode(body, match.start())
        except (ValueError, RecursionError):
            continue
        if end == len(body) and isinstance(value, dict) and "stages" in value:
            return value
    return None


def _step(row: Any, n: int, path: Path) -> StepMetrics:
    """Line `n`'s JSON value as a StepMetrics, or RunMetricsError saying why it is not one."""
    if not isinstance(row, dict):
        raise RunMetricsError(f"{path}:{n} is not a partc metrics line (not a JSON object)",
                              hint=_hint(path))
    version = row.get("version")
    if isinstance(version, int) and not isinstance(version, bool) and version > METRICS_VERSION:
        # before the keys: a newer version's lines may have other ones
        raise RunMetricsError(f"{path}:{n} has metrics version {version}, this partc reads "
                              f"{METRICS_VERSION}", hint="upgrade partc")
    if "stages" not in row:
        raise RunMetricsError(
            f"{path}:{n} has no per-stage metrics (`stages`): written by an older partc",
            hint=f"re-run `partc launch PLAN --metrics {path}` with this one")
    try:
        return StepMetrics.from_dict(row)
    except (ValueError, TypeError) as exc:
        raise RunMetricsError(f"{path}:{n} is not a partc metrics line ({exc})",
                              hint=_hint(path)) from None


def _check_one_run(steps: tuple[StepMetrics, ...], path: Path) -> None:
    """RunMetricsError unless `steps` (a file's, a line per step) are of one run's shape and
    plan: medians over steps of different runs would describe none of them."""
    hint = "write each run to its own --metrics file"
    for what, of in (("stages", lambda s: len(s.stages)),
                     ("micro-batches per step", lambda s: s.num_microbatches),
                     ("replicas", lambda s: s.replicas),
                     ("clocks (CPU and CUDA)", lambda s: s.clock)):
        values = {of(s) for s in steps}
        if len(values) > 1:
            raise RunMetricsError(f"metrics file {path} mixes runs of {sorted(values)} {what}",
                                  hint=hint)
    if len({tuple(st.pipeline_rank for st in s.stages) for s in steps}) > 1:
        raise RunMetricsError(f"metrics file {path} mixes runs that placed the stages on other "
                              "pipeline ranks", hint=hint)
    named = {(s.plan, s.plan_sha256) for s in steps if s.plan is not None}
    if len(named) > 1:
        raise RunMetricsError(f"metrics file {path} mixes runs of {len(named)} plans (or of a "
                              "plan that changed between runs)", hint=hint)


_MAX_PLAN_BYTES = 64 << 20  # a plan.yaml is kilobytes; a path to anything larger is no plan


def _plan_if_unchanged(path: Path, sha: str) -> Plan | None:
    """The plan at `path` if it is still the one whose bytes had `sha`, else None (gone,
    changed, not a regular file, unreadable)."""
    try:
        if not path.is_file() or path.stat().st_size > _MAX_PLAN_BYTES or \
                sha256_file(path) != sha:
            return None
        return load_plan(path)
    except (OSError, PartcError):
        return None


def _plan_difference(ran: Plan, plan: Plan) -> str:
    """What makes a run of plan `ran` no measure of `plan`'s stages ("" when nothing does)."""
    if ran.model.graph_hash != plan.model.graph_hash:
        return (f"another model ({ran.model.name}, graph {ran.model.graph_hash[:19]}.., not "
                f"{plan.model.name}, graph {plan.model.graph_hash[:19]}..)")
    a, b = ran.training.config.precision, plan.training.config.precision
    if a != b:
        return f"trained at precision {a}, not {b}"
    if ran.cluster.device.name != plan.cluster.device.name:
        return (f"ran on {ran.cluster.device.name} devices, not {plan.cluster.device.name}")
    if ran.training.shape != plan.training.shape:
        return f"another training shape ({_shape(ran)}, not {_shape(plan)})"
    for x, y in zip(ran.stages, plan.stages, strict=True):
        if x.modules != y.modules:
            return f"its stage {x.index} holds other modules"
        if (x.activation_checkpointing, x.sharding) != (y.activation_checkpointing, y.sharding):
            return f"its stage {x.index} uses other memory levers"
    return ""


def _shape(plan: Plan) -> str:
    s = plan.training.shape
    return (f"{s.stages} stages x {s.replicas} replicas, {s.num_microbatches} micro-batches "
            f"of {s.microbatch_size}, {s.schedule}")


def _median(values: Iterable[float]) -> float:
    return float(statistics.median(list(values)))


def _median_of_measured(values: list[float | None]) -> float | None:
    """The median, or None if any step lacks the value."""
    if not values or any(v is None for v in values):
        return None
    return float(statistics.median(v for v in values if v is not None))

