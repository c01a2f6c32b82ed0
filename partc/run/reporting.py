"""What rank 0 shows of a run: progress on stderr (a bar on a terminal, lines otherwise),
metrics as JSON lines (`StepMetrics.to_json`, read back by partc.plans.run_metrics), and the final
summary with measured vs predicted times on stdout (the table `partc show --metrics` prints)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TextIO

from partc.files import sha256_file
from partc.options import TrainOptions
from partc.plans.plan import PLAN_FILE, Plan
from partc.plans.report import format_measured
from partc.plans.run_metrics import RunMetrics, StepMetrics
from partc.run.checkpoint import Checkpoint
from partc.run.rank_layout import RankLayout


@dataclass
class RunSummary:
    """What rank 0 reports at the end (and the tests read)."""

    losses: dict[int, float] = field(default_factory=dict)  # step -> loss
    step_s: dict[int, float] = field(default_factory=dict)
    # [step][stage] per micro-batch
    stage_forward_s: list[list[float]] = field(default_factory=list)
    stage_backward_s: list[list[float]] = field(default_factory=list)
    metrics: list[StepMetrics] = field(default_factory=list)  # each step's metrics-file line
    resumed_from: int | None = None


class Reporter:
    """Progress on stderr (a bar on a terminal, lines otherwise), metrics as JSON lines, and the
    final summary on stdout."""

    def __init__(self, plan: Plan, options: TrainOptions, start: int, out: TextIO,
                 err: TextIO) -> None:
        self.plan = plan
        self.options = options
        self.start = start
        self.out = out
        self.err = err
        self.tty = bool(getattr(err, "isatty", lambda: False)())
        self.samples = plan.training.global_batch_size
        # Which plan this run trains, read once at launch: every metrics line names it, so a
        # later `partc compile --calibrate-from` finds it and sees if it changed since.
        plan_file = ((plan.directory or Path(".")) / PLAN_FILE).resolve()
        self.plan_file = str(plan_file)
        # of the bytes this run loaded (a plan.yaml edited during the run does not count)
        self.plan_sha256 = plan.digest.removeprefix("sha256:") or sha256_file(plan_file)
        self.metrics = None
        if options.metrics is not None:
            options.metrics.parent.mkdir(parents=True, exist_ok=True)
            cut_short = _ends_unfinished(options.metrics)
            self.metrics = open(options.metrics, "a")
            if cut_short:  # a run killed mid-write: end its line, so this run's first stays whole
                self.metrics.write("\n")

    def begin(self, layout: RankLayout, resume: Checkpoint | None, data_source: str) -> None:
        s = self.plan.training.shape
        self.err.write(f"partc launch: {self.plan.model.name}, {layout.num_stages} stage(s) on "
                       f"{layout.pipeline_size} pipeline rank(s) x {layout.replicas} replica(s), "
                       f"{s.schedule}, {s.num_microbatches} micro-batches of "
                       f"{s.microbatch_size}, {self.plan.training.config.optimizer}, "
                       f"{self.plan.cluster.backend}\n")
        self.err.write(f"partc launch: data: {data_source}\n")
        if resume is not None:
            self.err.write(f"partc launch: resuming from {resume.directory} (step {resume.step})\n")
        self.err.flush()

    def note(self, text: str) -> None:
        if self.tty:
            self.err.write("\r\033[K")
        self.err.write(f"partc launch: {text}\n")
        self.err.flush()

    def stamp(self, metrics: StepMetrics) -> StepMetrics:
        """`metrics` naming the plan of this run (StepMetrics.plan, .plan_sha256)."""
        return replace(metrics, plan=self.plan_file, plan_sha256=self.plan_sha256)

    def step(self, metrics: StepMetrics) -> None:
        done, total = metrics.step, self.options.steps
        stages = " ".join(f"{s.index}:{s.forward_s * 1e3:.1f}/{s.backward_s * 1e3:.1f}"
                          for s in metrics.stages)
        if self.metrics is not None:
            self.metrics.write(metrics.to_json() + "\n")
            self.metrics.flush()
        text = (f"step {done}/{total}  loss {metrics.loss:.6g}  "
                f"{metrics.samples_per_s:,.1f} samples/s  fwd/bwd ms per micro-batch {stages}")
        if self.tty:
            width = 24
            filled = int(width * done / total)
            self.err.write(f"\r\033[K[{'#' * filled}{'.' * (width - filled)}] {text}")
            if done == total:
                self.err.write("\n")
        elif done % self.options.log_every == 0 or done == total:
            self.err.write(text + "\n")
        self.err.flush()

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None

    def finish(self, summary: RunSummary) -> None:
        steps = sorted(summary.step_s)
        if not steps:
            self.out.write("partc launch: nothing to do (the checkpoint is at --steps)\n")
            return
        resumed = (f" (resumed from the checkpoint of step {summary.resumed_from})"
                   if summary.resumed_from is not None else "")
        lines = [f"trained steps {steps[0] + 1}..{steps[-1] + 1}{resumed}: loss "
                 f"{summary.losses[steps[0]]:.6g} -> {summary.losses[steps[-1]]:.6g}",
                 format_measured(self.plan, RunMetrics(steps=tuple(summary.metrics)))]
        self.out.write("\n".join(lines) + "\n")
        self.out.flush()


def _ends_unfinished(path: Path) -> bool:
    """Whether the file at `path` exists, is not empty and does not end with a newline: the last
    line of a run killed while writing it (readers skip it, partc.plans.run_metrics)."""
    try:
        with open(path, "rb") as f:
            if f.seek(0, os.SEEK_END) == 0:
                return False
            f.seek(-1, os.SEEK_END)
            return f.read(1) != b"\n"
    except OSError:  # missing (the run creates it) or unreadable (opening it says so)
        return False
