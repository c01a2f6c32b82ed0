"""`partc check`: is a checked-in plan exactly what `partc compile` writes for the model?

Re-capture the model, compare its graph with the plan's fingerprint, re-solve with the plan's
recorded inputs (partc.plans.check), and, when model and solve agree, emit the plan again into a
temporary directory and compare every stage file's and plan.yaml's bytes with the checked-in ones
(`compare_artifacts`). It lives beside compile because it runs compile's emit; the outcomes are
documented in partc.plans.check and docs/trust.md.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import yaml

from partc.emit.compile import emit_plan, torch_version
from partc.errors import ModelFileError
from partc.files import sha256_file, special_file
from partc.frontend.capture import CaptureResult, capture_graph
from partc.plans.check import (
    TAMPERED_EXIT,
    CheckReport,
    model_changes,
    note_cluster_config,
    recorded_profile,
    solve_as_recorded,
)
from partc.plans.diff import diff_layouts, layout_of_partition, layout_of_plan
from partc.plans.plan import PLAN_FILE, PROFILE_FILE, Plan, load_plan
from partc.progress import Progress
from partc.solve.partition import Partition
from partc.solve.search import InfeasibleMemoryError
from partc.version import __version__, build_id


def check_plan(plan_path: str | Path, model: str | Path | None = None,
               progress: Progress | None = None) -> CheckReport:
    """Check a plan against its model (module docstring); `model` overrides the plan's path."""
    progress = progress or Progress()
    plan = load_plan(plan_path)
    path = Path(plan_path)
    path = path / "plan.yaml" if path.is_dir() else path
    with progress.step("checking stage file hashes"):
        plan.check_stage_files()
    model_path = Path(model) if model is not None else plan.model_path
    if model is not None and not model_path.is_file():
        raise ModelFileError(f"--model {model_path} is not a file",
                             hint="pass the model file the plan was compiled from")
    if not model_path.is_file():
        raise ModelFileError(f"model file {plan.model.file} recorded in {path} (resolved to "
                             f"{model_path}) not found",
                             hint="pass --model PATH to the model file the plan was compiled from")
    report = CheckReport(plan_path=path, plan=plan, model_path=model_path, current=True)
    if plan.partc_version != __version__:
        report.notes.append(f"plan written by partc {plan.partc_version}, checked with "
                            f"{__version__}")
    note_cluster_config(plan, report)

    costs = plan.costs
    # a recorded profile that is gone is an error: said before seconds of capture
    profile = recorded_profile(plan, path)
    result = capture_graph(model_path, costs.capture_batch_size, onnx=False, progress=progress)
    changes = model_changes(plan, result.graph)
    report.changes = changes
    if changes.changed:
        report.current = False
        report.reasons.append(f"the model changed since the plan was compiled (graph "
                              f"{changes.old_hash[:19]}.. -> {changes.new_hash[:19]}..)")
    if profile is not None:
        if costs.profile_sha256 is not None and sha256_file(profile) != costs.profile_sha256:
            # the costs the plan was solved with are not the ones reviewed: never re-solve
            # with them as if they were
            report.current = False
            report.reasons.append(f"profile {costs.profile} is not the one the plan was "
                                  f"compiled with (sha256 differs from plan.yaml's)")
            return _checked(plan, report)
        if changes.changed:
            report.reasons.append(
                f"profile {costs.profile} was measured on the old model: recompile (on the "
                f"machine it trains on, which measures the new model)"
                if costs.profile == PROFILE_FILE else
                f"profile {costs.profile} was measured on the old model: re-run partc profile "
                "before recompiling")
            return _checked(plan, report)
    try:
        _, partition = solve_as_recorded(plan, result, profile, progress)
    except InfeasibleMemoryError as exc:
        report.current = False
        report.reasons.append(f"no plan fits any more: {exc.one_line()}")
        return _checked(plan, report)
    new = layout_of_partition(partition, result.graph.module_fingerprints())
    report.new_layout = new
    old = layout_of_plan(plan)
    if old != new:
        report.current = False
        report.diff = diff_layouts(old, new)
        if not changes.changed and plan.partc_build == build_id():
            # same model, same recorded inputs, the same partc source, a deterministic solve:
            # the plan's stages or predictions were edited after compile wrote them
            report.tampered.append(f"{PLAN_FILE} is not what compile writes for this model: "
                                   "re-solving with its recorded inputs gives other stages or "
                                   "predictions:")
        else:
            report.reasons.append("re-solving with the plan's recorded inputs gives a different "
                                  "plan" if not changes.changed else
                                  "and the re-solved plan differs:")
        return _checked(plan, report)
    if not changes.changed:
        compare_artifacts(plan, path, result, partition, report, progress,
                          model_overridden=model is not None)
    return _checked(plan, report)


def _checked(plan: Plan, report: CheckReport) -> CheckReport:
    """`report`, noting another partc build when that may explain a stale plan (a current plan
    is current whichever build wrote it)."""
    if not report.current and plan.partc_build != build_id():
        report.notes.append(f"plan written by partc build {plan.partc_build}, checked with "
                            f"build {build_id()}")
    return report


def compare_artifacts(plan: Plan, plan_path: Path, result: CaptureResult, partition: Partition,
                      report: CheckReport, progress: Progress,
                      model_overridden: bool = False) -> None:
    """Re-emit the plan (compile is deterministic) into a temporary directory and compare every
    stage file's bytes and plan.yaml's with the checked-in ones. A difference while model, costs
    and solve agree is an artifact compile did not write: `report.tampered`, unless it is
    explained (the model file's bytes changed, another torch traced the stages: stale).
    `model_overridden`: --model named the model file, so plan.yaml's recorded path is kept as
    is."""
    directory = plan_path.parent
    with tempfile.TemporaryDirectory(prefix="partc-check-") as tmp, \
            progress.step(f"re-emitting {plan.num_stages} stage files to compare bytes"):
        (Path(tmp) / "plan").mkdir()
        fresh = emit_plan(result, partition, plan.cluster, Path(tmp) / "plan", plan.costs,
                          progress, plan_directory=directory)
        fresh_bytes = {st.file: (Path(tmp) / "plan" / st.file).read_bytes()
                       for st in fresh.stages}
    # partc_version, partc_build and torch_version are recorded, not compared (docs/trust.md):
    # which partc and torch wrote identical bytes does not matter; with --model the file is
    # wherever the user says, and plan.yaml keeps its recorded path
    fresh = replace(fresh, partc_version=plan.partc_version)
    if model_overridden:
        fresh = replace(fresh, model=replace(fresh.model, file=plan.model.file))
    if fresh.model.sha256 != plan.model.sha256:
        report.current = False
        report.reasons.append("the model file's bytes changed since the plan was compiled (its "
                              "graph did not): recompile to record them")
        return
    torch_differs = plan.torch_version != torch_version()
    if torch_differs:
        report.notes.append(f"stage files traced by torch {plan.torch_version}, checked with "
                            f"torch {torch_version()}")
    # the recorded versions are not what makes bytes differ: a difference they explain is below
    fresh = replace(fresh, torch_version=plan.torch_version, partc_build=plan.partc_build)
    # compared with what plan.yaml pins (the sha256 every loader checks), and with the bytes of
    # plan.yaml load_plan read (the file named on the command line, read once)
    problems = [f"{st.file} is not what compile writes for this model" for st in plan.stages
                if hashlib.sha256(fresh_bytes.get(st.file, b"")).hexdigest() != st.sha256]
    written = plan.raw
    if fresh.dumps().encode() != written:
        try:
            data = yaml.safe_load(written.decode())
        except (yaml.YAMLError, UnicodeDecodeError):
            data = None
        where = _first_difference(fresh.to_dict(), data)
        problems.append(f"{PLAN_FILE} is not what compile writes for this model ("
                        + (f"differs at {where})" if where else "formatting differs)"))
    if not problems:
        return
    report.current = False
    if torch_differs or plan.partc_build != build_id():
        # another torch traces, or another partc emits, other bytes: recompile, not an alarm
        report.reasons += [f"{p} with torch {torch_version()} and partc build {build_id()} (it "
                           f"was compiled with torch {plan.torch_version}, build "
                           f"{plan.partc_build}): recompile" for p in problems]
        return
    report.tampered += [p + (" (plan.yaml's sha256 of it was changed to match)"
                             if p.endswith(".pt is not what compile writes for this model")
                             else "") for p in problems]


def _first_difference(new: object, old: object, at: str = "") -> str:
    """The first key path where two plan.yaml contents differ ("" when they are equal)."""
    if isinstance(new, dict) and isinstance(old, dict):
        for key in sorted(set(new) | set(old), key=str):
            if key not in new or key not in old:
                return f"{at}/{key}".lstrip("/")
            found = _first_difference(new[key], old[key], f"{at}/{key}")
            if found:
                return found
        return ""
    if isinstance(new, list) and isinstance(old, list):
        if len(new) != len(old):
            return at.lstrip("/") or "(top level)"
        for i, (a, b) in enumerate(zip(new, old, strict=True)):
            found = _first_difference(a, b, f"{at}/{i}")
            if found:
                return found
        return ""
    return "" if new == old else (at.lstrip("/") or "(top level)")


# Set in the child process `check_in_child` starts: that child checks in-process.
ISOLATED_ENV = "PARTC_CHECK_ISOLATED"


def model_file_changed(plan_path: str | Path, model: str | Path | None = None) -> bool:
    """Whether the model file (the plan's, or `model`) is not the one the plan was compiled from
    (its sha256 differs from plan.yaml's); False when it cannot be read (check_plan says why).
    Reads plan.yaml and the file's bytes only: imports nothing."""
    plan = load_plan(plan_path)
    path = Path(model) if model is not None else plan.model_path
    if special_file(path):  # a named pipe would wait forever; the model's reader says what it is
        return False
    try:
        data = path.read_bytes()
    except OSError:
        return False
    return hashlib.sha256(data).hexdigest() != plan.model.sha256


def check_in_child(plan_path: str | Path, model: str | Path | None = None) -> int:
    """`partc check` of one plan in a child process, for a model file that changed since the
    plan was compiled: that file is code nobody reviewed with the plan, and code run in this
    process could decide the outcome (os._exit(0), patching partc). The child's report passes
    through; the outcome is never "current" (at least exit 1), whatever the child's exit."""
    command = [sys.executable, "-m", "partc", "check", str(plan_path),
               *(["--model", str(model)] if model is not None else [])]
    proc = subprocess.run(command, env={**os.environ, ISOLATED_ENV: "1"}, check=False)
    if proc.returncode in (1, 2, 3, TAMPERED_EXIT):
        return proc.returncode
    print(f"{plan_path}: STALE: the model file changed since the plan was compiled, and checking "
          f"it ended with exit {proc.returncode} (the model code ended the process)", flush=True)
    return 1
