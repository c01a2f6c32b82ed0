"""`partc check`'s parts that need no emitting: the model's changes against a plan's fingerprint,
the report and its format, re-solving a plan exactly as compile solved it, and finding plans.

The check itself (`partc.emit.check.check_plan`) re-captures the model (on the meta device when it
is built there), compares its graph hash with the plan's, and re-solves with the plan's recorded
inputs: the cluster as recorded in plan.yaml (not today's configs/ or this machine, so the check
gives the same answer on any CI runner), the training settings, and `costs` (cost source, a
checked-in profile, capture batch, blocks, strategy, time limit, pinned choices). The solver is
deterministic, so a current plan re-solves to an equal `Layout` (partc.plans.diff); then it
re-emits the plan and compares bytes.

Outcomes: `current` (exit 0); `stale` with reasons (exit 1): the model changed (which modules and
parameters, from the plan's fingerprint), its file's bytes changed, the profile no longer matches
the model, the plan no longer fits in memory, the re-solved plan differs (which modules move
between stages, old vs new predicted throughput) or the artifacts differ, and another partc
build or torch wrote them; `tampered` (exit TAMPERED_EXIT): the same partc build and torch, the
same model and recorded inputs give another plan.yaml or stage file than the checked-in one, so
it was edited after compile. Bad input (no plan, broken plan, missing model file, a model that no
longer exports) raises a PartcError (exit 2). docs/trust.md says what this guarantees.
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from partc.errors import PartcError
from partc.graph.opgraph import OpGraph
from partc.hardware.local import LOCAL_CLUSTER
from partc.hardware.specs import ClusterSpec
from partc.options import DEFAULT_CAPTURE_BATCH, to_argv
from partc.plans.diff import (
    Layout,
    LayoutDiff,
    collapse_modules,
    format_diff,
)
from partc.plans.plan import (
    PLAN_FILE,
    Plan,
    PlanError,
    resolve_in_plan_tree,
)
from partc.progress import Progress

if TYPE_CHECKING:  # annotations only: check imports the capture and the solver when it runs
    from partc.cost.table import CostTable
    from partc.frontend.capture import CaptureResult
    from partc.solve.partition import Partition

_MAX_ITEMS = 12  # names listed per kind of model change before "... and N more"
TAMPERED_EXIT = 4  # `partc check`: an artifact is not what compile writes (docs/trust.md)


@dataclass(frozen=True)
class ModelChanges:
    """How a model's graph differs from the one a plan was made from."""

    old_hash: str
    new_hash: str
    parameters_added: tuple[tuple[str, str], ...] = ()  # (FQN, "dtype[shape]")
    parameters_removed: tuple[tuple[str, str], ...] = ()
    parameters_changed: tuple[tuple[str, str, str], ...] = ()  # (FQN, old, new)
    modules_added: tuple[str, ...] = ()
    modules_removed: tuple[str, ...] = ()
    modules_changed: tuple[str, ...] = ()  # modules whose own operators changed

    @property
    def changed(self) -> bool:
        return self.old_hash != self.new_hash


def model_changes(plan: Plan, graph: OpGraph) -> ModelChanges:
    """Compare the plan's recorded fingerprint with a fresh capture's."""
    old_p, new_p = plan.model.parameter_signatures, graph.parameter_signatures()
    old_m, new_m = plan.model.module_fingerprints, graph.module_fingerprints()
    added = sorted(set(new_m) - set(old_m))
    removed = sorted(set(old_m) - set(new_m))
    return ModelChanges(
        old_hash=plan.model.graph_hash, new_hash=graph.content_hash(),
        parameters_added=tuple((n, new_p[n]) for n in sorted(set(new_p) - set(old_p))),
        parameters_removed=tuple((n, old_p[n]) for n in sorted(set(old_p) - set(new_p))),
        parameters_changed=tuple((n, old_p[n], new_p[n]) for n in sorted(set(old_p) & set(new_p))
                                 if old_p[n] != new_p[n]),
        modules_added=tuple(collapse_modules(added, set(new_m))),
        modules_removed=tuple(collapse_modules(removed, set(old_m))),
        modules_changed=tuple(m or "(root)" for m in sorted(set(old_m) & set(new_m))
                              if old_m[m] != new_m[m]))


@dataclass
class CheckReport:
    """The outcome of `check_plan`."""

    plan_path: Path
    plan: Plan
    model_path: Path
    current: bool
    reasons: list[str] = field(default_factory=list)  # one line each, why it is stale
    changes: ModelChanges | None = None
    diff: LayoutDiff | None = None
    notes: list[str] = field(default_factory=list)  # worth knowing, not staleness
    new_layout: Layout | None = None
    # artifacts that are not what compile writes although the model and the solve agree: a
    # stage file or plan.yaml edited by hand (with its recorded sha256 updated to match)
    tampered: list[str] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        if self.tampered:
            return TAMPERED_EXIT
        return 0 if self.current else 1


def find_plans(paths: tuple[Path, ...] | list[Path]) -> list[Path]:
    """The plan files named by `paths`: a plan.yaml, or a directory holding one, or a directory
    searched for every plan.yaml under it (sorted). Raises PlanError for a path that names none."""
    found: list[Path] = []
    for path in paths:
        if path.is_dir() and not (path / PLAN_FILE).is_file():
            below = sorted(path.rglob(PLAN_FILE))
            if not below:
                raise PlanError(f"no {PLAN_FILE} in {path} or below it",
                                hint="pass a plan.yaml written by partc compile, or its directory")
            found += below
        else:
            found.append(path / PLAN_FILE if path.is_dir() else path)
    return list(dict.fromkeys(found))


def recorded_profile(plan: Plan, plan_path: Path) -> Path | None:
    """The profile file plan.yaml's `costs` names, resolved against the plan directory (None:
    the plan was solved with the analytic roofline); PlanError when it is missing. Its sha256 is
    the caller's to verify: check reports a mismatch as staleness, others refuse it."""
    costs = plan.costs
    if costs.source != "profile":
        return None
    profile = resolve_in_plan_tree(plan.directory or Path("."), str(costs.profile), "profile")
    if not profile.is_file():
        raise PlanError(f"the profile {costs.profile} recorded in {plan_path} is missing "
                        f"({profile})", hint="check the profile in next to the plan, or "
                                             "recompile without --profile")
    return profile


def solve_as_recorded(plan: Plan, result: CaptureResult, profile: Path | None,
                      progress: Progress | None = None) -> tuple[CostTable, Partition]:
    """Re-solve `plan` as compile solved it: the CostTable it was solved with (`profile`, from
    `recorded_profile`, or the analytic roofline on the recorded device) and the Partition the
    search gives with the recorded cluster (not today's configs/ or this machine), training
    settings and search options. `result` is a capture at the plan's capture batch. The solver
    is deterministic, so for a current plan the Partition's layout equals the plan's, and its
    stages name the OpGraph nodes each plan stage holds (which plan.yaml does not record).
    Raises InfeasibleMemoryError when nothing fits any more."""
    from partc.cost.plan_costs import plan_costs
    from partc.solve.coarsen import coarsen
    from partc.solve.search import search

    progress = progress or Progress()
    cluster, training, options = plan.cluster, plan.training.config, plan.costs.search
    table = plan_costs(result, cluster.device, profile, progress, precision=training.precision)
    with progress.step(f"coarsen to at most {options.max_blocks} blocks"):
        blocks = coarsen(table, options.max_blocks)
    partition = search(table, cluster, plan.training.global_batch_size, training, options,
                       blocks=blocks, progress=progress)
    return table, partition


def note_cluster_config(plan: Plan, report: CheckReport) -> None:
    """A named cluster config that now says something else than the plan recorded is worth a
    note: the check uses the recorded cluster, a recompile by that name would use the config
    (shipped configs change; `partc calibrate` writes its own under the shipped names)."""
    name = plan.cluster.name
    if name == LOCAL_CLUSTER or named_cluster(plan) in (None, plan.cluster):
        return
    report.notes.append(f"configs/clusters/{name}.yaml differs from the cluster recorded in "
                        f"the plan; the check used the recorded one (--cluster "
                        f"{_shown(report.plan_path)} recompiles for it, --cluster {name} for "
                        "the config)")


def named_cluster(plan: Plan) -> ClusterSpec | None:
    """The cluster config the plan's cluster name gives now (None: no config has that name)."""
    from partc.hardware.configs import load_cluster

    try:
        return load_cluster(plan.cluster.name)
    except PartcError:
        return None


def cluster_argument(plan: Plan, plan_path: Path) -> str:
    """`--cluster` for a recompile of `plan` to the cluster it records: `local` (this machine,
    whichever it is), its config's name where that config still says the same, else the plan
    itself (`cluster_of`): a calibrated cluster, or a config changed since."""
    name = plan.cluster.name
    if name == LOCAL_CLUSTER or named_cluster(plan) == plan.cluster:
        return name
    return _shown(plan_path)


def compile_command(plan: Plan, plan_path: Path, model_path: Path | None = None) -> str:
    """The `partc compile` command line that reproduces `plan` (for the stale hint): the flags
    of its recorded options that differ from their defaults."""
    costs = plan.costs
    directory = plan_path.parent
    model = model_path if model_path is not None else plan.model_path
    args = ["partc", "compile", _shown(model), "-b", str(plan.training.global_batch_size),
            "--cluster", cluster_argument(plan, plan_path), *to_argv(costs.search)]
    if costs.source == "profile":
        args += ["--profile", _shown(directory / str(costs.profile))]
    else:  # said outright: on this machine the default (auto) would measure instead
        args += ["--costs", "analytic"]
    if costs.capture_batch_size != DEFAULT_CAPTURE_BATCH:
        args += ["--capture-batch", str(costs.capture_batch_size)]
    args += to_argv(plan.training.config)
    args += ["-o", _shown(directory)]
    return " ".join(shlex.quote(a) for a in args)


def _shown(path: Path) -> str:
    """A path as the user would type it: relative to the working directory when inside it."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def format_check(report: CheckReport) -> str:
    """The check's output: one status line, then (when stale) why, what moved and the fix."""
    plan = report.plan
    shape = plan.training.shape
    head = (f"{report.plan_path}: {'current' if report.current else 'STALE'} "
            f"({plan.model.name}, {shape.stages} stage(s) x {shape.replicas} replica(s) on "
            f"{plan.cluster.name}, {plan.predicted.samples_per_s:,.1f} samples/s predicted)")
    if report.tampered:
        head = head.replace(": STALE (", ": TAMPERED (", 1)
    lines = [head, f"  plan digest: {plan.digest}"]
    lines += [f"  note: {n}" for n in report.notes]
    if report.current:
        return "\n".join(lines)
    if report.tampered:
        lines += [f"  {t}" for t in report.tampered]
        if report.diff is not None:
            lines.append(format_diff(report.diff, "plan", "compiled", indent="    "))
        lines.append("  fix: never edit a plan directory by hand; review who changed it, then "
                     f"recompile: {compile_command(plan, report.plan_path, report.model_path)}")
        return "\n".join(lines)
    ch = report.changes
    for reason in report.reasons:
        lines.append(f"  {reason}")
        if ch is not None and ch.changed and reason.startswith("the model changed"):
            lines += _format_changes(ch)
    if report.diff is not None:
        lines.append(format_diff(report.diff, "plan", "now", indent="    "))
    lines.append(f"  fix: {compile_command(plan, report.plan_path, report.model_path)}")
    return "\n".join(lines)


def _format_changes(ch: ModelChanges) -> list[str]:
    out: list[str] = []

    def listing(title: str, items: list[str]) -> None:
        if not items:
            return
        out.append(f"    {title} ({len(items)}):")
        out.extend(f"      {x}" for x in items[:_MAX_ITEMS])
        if len(items) > _MAX_ITEMS:
            out.append(f"      ... and {len(items) - _MAX_ITEMS} more")

    listing("parameters changed", [f"{n}: {a} -> {b}" for n, a, b in ch.parameters_changed])
    listing("parameters added", [f"{n}: {s}" for n, s in ch.parameters_added])
    listing("parameters removed", [f"{n}: {s}" for n, s in ch.parameters_removed])
    listing("modules added", list(ch.modules_added))
    listing("modules removed", list(ch.modules_removed))
    listing("modules whose operators changed", list(ch.modules_changed))
    if not out:
        out.append("    (no module or parameter differs: the inputs, outputs or the order of "
                   "operators changed)")
    return out
