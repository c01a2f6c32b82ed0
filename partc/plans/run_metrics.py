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
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from partc.errors import PartcError

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


class RunMetricsError(PartcError):
    """A metrics file that is missing, empty, corrupt, or from another plan."""


def _hint(path: Path | str) -> str:
    return f"write it with `partc launch PLAN --metrics {path}`"


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

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index, "pipeline_rank": self.pipeline_rank,
                "forward_s": self.forward_s, "backward_s": self.backward_s,
                "p2p_s": self.p2p_s, "optimizer_s": self.optimizer_s,
                "ddp_allreduce_s": self.ddp_allreduce_s, "tied_sync_s": self.tied_sync_s,
                "peak_memory_bytes": self.peak_memory_bytes,
                "forward_cpu_s": self.forward_cpu_s, "backward_cpu_s": self.backward_cpu_s,
                "optimizer_cpu_s": self.optimizer_cpu_s}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StageMetrics:
        peak = d["peak_memory_bytes"]
        return cls(index=int(d["index"]), pipeline_rank=int(d["pipeline_rank"]),
                   forward_s=float(d["forward_s"]), backward_s=float(d["backward_s"]),
                   p2p_s=float(d["p2p_s"]), optimizer_s=float(d["optimizer_s"]),
                   ddp_allreduce_s=float(d["ddp_allreduce_s"]),
                   tied_sync_s=float(d["tied_sync_s"]),
                   peak_memory_bytes=None if peak is None else int(peak),
                   forward_cpu_s=_optional(d.get("forward_cpu_s")),
                   backward_cpu_s=_optional(d.get("backward_cpu_s")),
                   optimizer_cpu_s=_optional(d.get("optimizer_cpu_s")))


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
        return cls(version=int(d["version"]), step=int(d["step"]), loss=float(d["loss"]),
                   step_s=float(d["step_s"]), samples_per_s=float(d["samples_per_s"]),
                   stage_forward_s=tuple(float(x) for x in d["stage_forward_s"]),
                   stage_backward_s=tuple(float(x) for x in d["stage_backward_s"]),
                   stages=tuple(StageMetrics.from_dict(s) for s in d["stages"]),
                   num_microbatches=int(d["num_microbatches"]), replicas=int(d["replicas"]),
                   clock=str(d["clock"]), memory_method=str(d["memory_method"]),
                   plan=_optional_str(d.get("plan")),
                   plan_sha256=_optional_str(d.get("plan_sha256")),
                   traced=d.get("traced") is True)

    @property
    def profiled(self) -> bool:
        """Did a profiler watch this step (its times are slowed by it)?"""
        return self.memory_method == MEMORY_CPU_PROFILER or self.traced


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

    def compute_s(self, shared_core: bool) -> tuple[float, float, float] | None:
        """(forward, backward, optimizer) seconds of the stage's own work: the wall times, or
        where processes share a core the CPU times (the wall times there include the
        core-mates' turns); None where those were not measured."""
        if not shared_core:
            return self.forward_s, self.backward_s, self.optimizer_s
        if self.forward_cpu_s is None or self.backward_cpu_s is None or \
                self.optimizer_cpu_s is None:
            return None
        return self.forward_cpu_s, self.backward_cpu_s, self.optimizer_cpu_s


@dataclass(frozen=True)
class RunMetrics:
    """A metrics file: its steps in step order (a step run twice, after an elastic restart or a
    resume, counts with its last line)."""

    steps: tuple[StepMetrics, ...]
    source: str = ""  # where it was read from, for messages

    @classmethod
    def load(cls, path: str | Path) -> RunMetrics:
        """Read a metrics file; RunMetricsError if it is missing, empty or not partc metrics."""
        p = Path(path)
        try:
            text = p.read_text()
        except FileNotFoundError:
            raise RunMetricsError(f"metrics file {p} not found", hint=_hint(p)) from None
        except (OSError, UnicodeDecodeError) as exc:
            raise RunMetricsError(f"cannot read metrics file {p}: {exc}",
                                  hint=_hint(p)) from None
        by_step: dict[int, StepMetrics] = {}
        for n, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                if not isinstance(row, dict):
                    raise TypeError("not a JSON object")
                if "stages" not in row:
                    raise RunMetricsError(
                        f"{p}:{n} has no per-stage metrics (`stages`): written by an older "
                        "partc", hint=f"re-run `partc launch PLAN --metrics {p}` with this one")
                step = StepMetrics.from_dict(row)
            except RunMetricsError:
                raise
            except (ValueError, TypeError, KeyError) as exc:
                what = f"missing key {exc}" if isinstance(exc, KeyError) else str(exc)
                raise RunMetricsError(f"{p}:{n} is not a partc metrics line ({what})",
                                      hint=_hint(p)) from None
            if step.version > METRICS_VERSION:
                raise RunMetricsError(f"{p}:{n} has metrics version {step.version}, this partc "
                                      f"reads {METRICS_VERSION}", hint="upgrade partc")
            by_step[step.step] = step
        if not by_step:
            raise RunMetricsError(f"metrics file {p} has no steps", hint=_hint(p))
        steps = tuple(by_step[s] for s in sorted(by_step))
        counts = {len(s.stages) for s in steps}
        if len(counts) > 1:
            raise RunMetricsError(f"metrics file {p} mixes runs of {sorted(counts)} stages",
                                  hint="write each run to its own --metrics file")
        return cls(steps=steps, source=str(p))

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
                optimizer_cpu_s=_median_of_measured([r.optimizer_cpu_s for r in rows])))
        return tuple(out)

    @property
    def memory_method(self) -> str:
        """How peak memory was measured in this run (MEMORY_NONE if on no step)."""
        methods = [s.memory_method for s in self.steps if s.memory_method != MEMORY_NONE]
        return methods[-1] if methods else MEMORY_NONE


def _optional_str(value: Any) -> str | None:
    return None if value is None else str(value)


def _median(values: Iterable[float]) -> float:
    return float(statistics.median(list(values)))


def _median_of_measured(values: list[float | None]) -> float | None:
    """The median, or None if any step lacks the value."""
    if not values or any(v is None for v in values):
        return None
    return float(statistics.median(v for v in values if v is not None))


def _optional(value: Any) -> float | None:
    return None if value is None else float(value)
