"""`partc compile`: model file -> plan directory (plan.yaml + one TorchScript file per stage).

load -> capture -> OpGraph -> CostTable -> coarsen -> solve (search + simulate) -> emit. The first
five steps are the passes of the earlier modules; `emit_plan` is this module's own step: re-export
the model at the chosen micro-batch size, cut it into stage graphs (partc.emit.stage_graph), trace
and save each stage (partc.emit.stage_code), and write plan.yaml (partc.plans.plan).
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import operator
import os
import re
import secrets
import shutil
import stat
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree

from partc.cost.autocast import autocast_dtypes
from partc.cost.plan_costs import solve_costs
from partc.cost.precision_scalars import saturate_scalars
from partc.cost.table import CostTable
from partc.emit.stage_code import stage_bytes, trace_stage
from partc.emit.stage_graph import MODEL_INPUT as SOURCE_INPUT
from partc.emit.stage_graph import SplitProgram, flatten_inputs, split_program
from partc.emit.stage_weights import set_stage_tensors, stage_tensors
from partc.errors import PartcError
from partc.files import sha256_file, write_atomic
from partc.frontend.capture import CaptureResult, capture_graph
from partc.frontend.export import export_program
from partc.frontend.model_file import inputs_to_meta
from partc.hardware.specs import ClusterSpec
from partc.interrupts import held_interrupts
from partc.options import DEFAULT_CAPTURE_BATCH, CostsMode, SearchOptions, TrainingConfig
from partc.plans.measurable_sizes import whole_model_fits
from partc.plans.plan import (
    ARTIFACT_NAMES,
    LOSS,
    MODEL_INPUT,
    PLAN_ARTIFACT,
    PLAN_FILE,
    PLAN_ROOT_ENV,
    PROFILE_FILE,
    WEIGHTS_AT_LAUNCH,
    WEIGHTS_IN_STAGE_FILES,
    ModelInfo,
    Plan,
    PlanCosts,
    PlanStage,
    TensorRef,
    TiedParameter,
    plan_tree_root,
    stage_file_name,
    validate_plan_dict,
    write_timings,
)
from partc.plans.priced_search import priced_search, warn_of_foreign_calibration
from partc.plans.recalibrate import (
    MIN_RUN_SPREAD_STEPS,
    MIN_SPREAD_STEPS,
    RunOfPlan,
    corrected_costs,
    load_launched_run,
    names_of,
)
from partc.progress import Progress
from partc.solve.coarsen import coarsen
from partc.solve.partition import Partition
from partc.solve.search import require_shapes, search
from partc.version import __version__, build_id


class CompileError(PartcError):
    """The plan cannot be written (output directory, re-export at the micro-batch size)."""


@dataclass(frozen=True)
class CompileOptions:
    """Everything `partc compile` takes besides the model file, the cluster and the output."""

    batch_size: int
    search: SearchOptions = field(default_factory=SearchOptions)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    profile: Path | None = None
    capture_batch: int = DEFAULT_CAPTURE_BATCH
    costs: CostsMode = "auto"  # without --profile: measured here, analytic, or auto
    # `partc launch --metrics` runs of one plan (`read_runs_of_plan`, before the capture):
    # correct the costs by what those runs measured, their timed steps pooled
    # (partc.plans.recalibrate); the corrected table is written as the plan's PROFILE_FILE.
    # Empty: not calibrated.
    calibrate_from: tuple[RunOfPlan, ...] = ()


@dataclass
class CompileResult:
    plan: Plan
    partition: Partition
    directory: Path
    timings: dict[str, float]


def compile_model(model_path: str | Path, cluster: ClusterSpec, output_dir: str | Path,
                  options: CompileOptions, progress: Progress | None = None) -> CompileResult:
    """Run every pass and write the plan directory (module docstring).

    The plan is built whole in a new directory beside `output_dir` (the same parent: the same
    filesystem, and the same paths relative to the plan) and then swapped in for the previous
    one (`_swap_in`). A compile that fails or is interrupted (KeyboardInterrupt; the CLI turns
    SIGTERM into one) removes that directory and leaves the previous plan as it was, byte for
    byte. Files of the previous plan directory that are not plan artifacts are carried over
    (`_carry_over`)."""
    progress = progress or Progress()
    output_dir = Path(output_dir)
    _refuse_a_model_outside_the_tree(Path(model_path), output_dir)
    _prepare_output(output_dir)
    staging: Path | None = None
    made: list[Path] = []  # parents created for a new plan directory
    try:
        # no Ctrl-C between making the directory and noting it
        with held_interrupts(again_acts=False):
            staging, made = _staging_directory(output_dir)
        result = _compile(model_path, cluster, output_dir, staging, options, progress)
        _carry_over(output_dir, staging, result.plan)
        _swap_in(staging, output_dir, progress)
    except BaseException:
        # a second Ctrl-C must not cut the clean-up short
        with held_interrupts(again_acts=False):
            if staging is not None:
                shutil.rmtree(staging, ignore_errors=True)
            for directory in made:
                with contextlib.suppress(OSError):
                    directory.rmdir()
        raise
    return result


def _refuse_a_model_outside_the_tree(model_path: Path, output_dir: Path) -> None:
    """A plan may only name a model file inside the tree it is reviewed in (`plan_tree_root`).
    Checked before anything is captured or priced (the answer depends only on the two paths,
    and a compile can take minutes), and again on the file capture read. (A missing model file
    is capture's to report.)"""
    root = plan_tree_root(output_dir)
    if root is not None and model_path.is_file() and not model_path.resolve().is_relative_to(root):
        raise CompileError(f"the model file {model_path} lies outside the repository "
                           f"{root} that holds the plan directory {output_dir}",
                           hint="a plan may only name a model file of its own repository: move "
                                f"the model into it or the plan out of it (or set "
                                f"{PLAN_ROOT_ENV})")


def _compile(model_path: str | Path, cluster: ClusterSpec, output_dir: Path, staging: Path,
             options: CompileOptions, progress: Progress) -> CompileResult:
    """Every pass; the plan is written into `staging`, with paths relative to `output_dir`."""
    timings: dict[str, float] = {}
    start = time.perf_counter()
    result = capture_graph(model_path, options.capture_batch, onnx=False, progress=progress)
    timings["capture_s"] = time.perf_counter() - start
    # pinned options no shape can satisfy fail before the model is priced (a profile: seconds
    # to minutes)
    require_shapes(cluster, options.batch_size,
                   min(len(result.graph.nodes), options.search.max_blocks), options.search)
    t = time.perf_counter()
    if not options.calibrate_from:
        # costs, cuts, and more measuring where the plan runs (partc.plans.priced_search)
        priced = priced_search(result, cluster, options.batch_size, options.training,
                               options.search, profile=options.profile, costs=options.costs,
                               progress=progress)
        partition = priced.partition
        measured_profile = priced.profile.read_bytes() if priced.profile is not None else None
        timings["costs_s"] = priced.costs_s
        timings["solve_s"] = priced.search_s
    else:
        warn_of_foreign_calibration(cluster, progress)  # priced_search says it for the rest
        table, cached = solve_costs(result, cluster, options.batch_size,
                                    profile=options.profile, costs=options.costs,
                                    precision=options.training.precision,
                                    fits=whole_model_fits(result, cluster.device,
                                                          options.training, progress),
                                    progress=progress)
        table, measured_profile = calibrated_costs(result, table, cluster, options,
                                                   options.calibrate_from, progress)
        with progress.step(f"coarsen to at most {options.search.max_blocks} blocks"):
            blocks = coarsen(table, options.search.max_blocks)
        partition = search(table, cluster, options.batch_size, options.training,
                           options.search, blocks=blocks, progress=progress)
        timings["costs_s"] = timings["solve_s"] = time.perf_counter() - t
    if partition.solver.wall_s is not None:  # always set by search; None only when read back
        timings["solver_wall_s"] = partition.solver.wall_s
    t = time.perf_counter()
    costs = recorded_costs(options, output_dir, measured_profile)
    plan = emit_plan(result, partition, cluster, staging, costs, progress,
                     profile=measured_profile, plan_directory=output_dir)
    timings["emit_s"] = time.perf_counter() - t
    timings["total_s"] = time.perf_counter() - start
    write_timings(staging, timings)
    return CompileResult(plan=plan, partition=partition, directory=output_dir, timings=timings)


def calibrated_costs(result: CaptureResult, table: CostTable, cluster: ClusterSpec,
                     options: CompileOptions, runs: tuple[RunOfPlan, ...],
                     progress: Progress) -> tuple[CostTable, bytes]:
    """`table` corrected by what the runs `runs` (of one plan) measured
    (partc.plans.recalibrate), and the profile bytes the plan directory gets. The table returned
    is the one read back from those bytes: the solve must use exactly the (rounded) costs
    `partc check` will load from the profile."""
    where = str(runs[0].run_path) if len(runs) == 1 else f"{len(runs)} runs ({names_of(runs)})"
    with progress.step(f"calibrating costs from {where}"):
        launched = load_launched_run(runs, result, progress)
        corrected = corrected_costs(table, launched, cluster.device)
        data = corrected.dumps().encode()
    fallback = ("the device config's is priced"
                if cluster.device.speed_modes(options.training.matmul_dtype) else "none is priced")
    if not corrected.speed_modes and len(launched.timed) < MIN_SPREAD_STEPS:
        progress.warn(f"{len(launched.timed)} timed step(s) in {where}, fewer than the "
                      f"{MIN_SPREAD_STEPS} a speed spread is taken from: {fallback} (launch "
                      "with more --steps for one)")
    elif not corrected.speed_modes and all(len(r.timed) < MIN_RUN_SPREAD_STEPS for r in runs):
        progress.warn(f"no run in {where} has the {MIN_RUN_SPREAD_STEPS} timed steps a speed "
                      f"spread is read within: {fallback} (launch with more --steps for one)")
    with tempfile.TemporaryDirectory(prefix="partc-calibrated-") as tmp:
        path = Path(tmp) / PROFILE_FILE
        path.write_bytes(data)
        return CostTable.load(path, result.graph, precision=options.training.precision), data


def recorded_costs(options: CompileOptions, output_dir: Path,
                   measured_profile: bytes | None = None) -> PlanCosts:
    """plan.yaml's `costs`: every solve input besides the model, cluster and training settings,
    so that `partc check` can re-solve exactly as compile did. A profile compile measured itself,
    or corrected from a run (--calibrate-from), is written into the plan directory
    (PROFILE_FILE); every profile is recorded with its sha256, which check verifies."""
    if measured_profile is not None:
        return PlanCosts(source="profile", profile=PROFILE_FILE,
                         capture_batch_size=options.capture_batch, search=options.search,
                         profile_sha256=hashlib.sha256(measured_profile).hexdigest())
    if options.profile:
        return PlanCosts(source="profile", profile=relative_path(options.profile, output_dir),
                         capture_batch_size=options.capture_batch, search=options.search,
                         profile_sha256=sha256_file(options.profile))
    return PlanCosts(source="analytic", profile=None, capture_batch_size=options.capture_batch,
                     search=options.search)


# What an interrupted compile of an earlier partc could leave in a plan directory: dropped,
# never carried over (everything else that is not a PLAN_ARTIFACT is the user's and is kept).
_LEFTOVER = re.compile(rf"^\.(?:{ARTIFACT_NAMES})\.(?:staged|.+\.tmp)$|^\.partc-write-test$")


def _prepare_output(directory: Path) -> None:
    """Refuse an output compile cannot replace whole: a file, a directory holding other things
    than a plan (`-o .` in a project), the current directory or one holding it. A missing or
    empty directory, or a plan directory, is fine."""
    if directory.exists() and not directory.is_dir():
        raise CompileError(f"output {directory} exists and is not a directory",
                           hint="pass -o with a directory for the plan")
    if not directory.is_dir():
        return
    try:
        names = sorted(os.listdir(directory))
    except OSError as exc:
        raise CompileError(f"cannot read the output directory {directory}: {exc.strerror}",
                           hint="pass -o with a directory you can read and write") from exc
    others = [n for n in names if not PLAN_ARTIFACT.match(n) and not _LEFTOVER.match(n)]
    if others and PLAN_FILE not in names:
        more = f" and {len(others) - 1} more" if len(others) > 1 else ""
        raise CompileError(f"output {directory} is not a plan directory: it holds no "
                           f"{PLAN_FILE} but other files ({others[0]}{more})",
                           hint="compile replaces its output directory whole: pass -o with a new "
                                "or empty directory, or an earlier plan's")
    here = Path.cwd().resolve()
    target = directory.resolve()
    if here == target or target in here.parents:
        raise CompileError(f"output {directory} is the current directory or holds it, and "
                           "compile replaces its output directory whole",
                           hint="run partc from outside the plan directory, e.g. from its "
                                "parent with -o NAME")


def _staging_directory(output_dir: Path) -> tuple[Path, list[Path]]:
    """A new, empty directory beside `output_dir` (symlinks followed) to build the plan in, and
    the parent directories created for it (deepest first; removed again if compile fails)."""
    target = output_dir.resolve()
    made: list[Path] = []
    parent = target.parent
    while not parent.exists():
        made.append(parent)
        parent = parent.parent
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        return _new_directory(target.parent, f".{target.name}.partc-new-"), made
    except OSError as exc:
        for directory in made:
            with contextlib.suppress(OSError):
                directory.rmdir()
        raise CompileError(f"cannot write to {output_dir.parent}: {exc.strerror}",
                           hint="compile builds the plan beside its output directory and swaps "
                                "it in: pass -o with a directory whose parent is writable"
                           ) from exc


def _new_directory(parent: Path, prefix: str) -> Path:
    """mkdir of a fresh name `prefix` + random hex in `parent` (mode from the umask)."""
    for _ in range(100):
        path = parent / f"{prefix}{secrets.token_hex(4)}"
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, f"no free name {prefix}* in {parent}")


def _carry_over(old: Path, new: Path, plan: Plan) -> None:
    """Copy into `new` what the old plan directory holds besides plan artifacts (a README, a
    profile the new plan names, metrics, checkpoints): hard links where possible. Stage files,
    plan.yaml and timings.yaml are the new plan's; a profile.yaml only when the new plan has
    none and names that file (`--profile` pointing into the plan directory)."""
    if not old.is_dir():
        return
    keep_profile = plan.costs.profile == PROFILE_FILE and not (new / PROFILE_FILE).exists()
    with os.scandir(old) as scan:
        entries = sorted(scan, key=lambda e: e.name)
    for entry in entries:
        name = entry.name
        if _LEFTOVER.match(name) or (PLAN_ARTIFACT.match(name)
                                     and not (name == PROFILE_FILE and keep_profile)):
            continue
        source, target = Path(entry.path), new / name
        if entry.is_symlink():
            os.symlink(os.readlink(source), target)
        elif entry.is_dir():
            shutil.copytree(source, target, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(str(source), str(target))


def _link_or_copy(source: str, target: str) -> str:
    try:
        os.link(source, target, follow_symlinks=False)
    except OSError:
        shutil.copy2(source, target, follow_symlinks=False)
    return target


def _swap_in(new: Path, output_dir: Path, progress: Progress) -> None:
    """Make the complete plan directory `new` the output directory, in one step where the kernel
    can (renameat2 RENAME_EXCHANGE), else by renaming the old one aside, the new one in and
    removing the old one; SIGINT and SIGTERM wait until it is done."""
    target = output_dir.resolve()
    old: Path | None = None  # where the previous plan ends up, to be removed
    with held_interrupts(again_acts=False):
        try:
            if not target.is_dir():
                os.rename(new, target)
            else:
                os.chmod(new, stat.S_IMODE(target.stat().st_mode))
                if _exchange(new, target):
                    old = new  # the previous plan is now at the staging name
                else:
                    aside = target.parent / f".{target.name}.partc-old-{secrets.token_hex(4)}"
                    os.rename(target, aside)
                    try:
                        os.rename(new, target)
                    except BaseException:
                        os.rename(aside, target)
                        raise
                    old = aside
            _fsync_directory(target.parent)
        except OSError as exc:
            raise CompileError(f"cannot replace {output_dir} with the new plan: "
                               f"{exc.strerror or exc}",
                               hint="check the permissions of the directory and its parent"
                               ) from exc
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
            if old.exists():
                progress.warn(f"could not remove the previous plan, now at {old}")


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


@lru_cache(maxsize=1)
def _renameat2() -> Any:
    """libc's renameat2, or None (not Linux, or a C library without it)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                         ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


def _exchange(a: Path, b: Path) -> bool:
    """Swap two existing directory entries atomically; False where the C library, the kernel or
    the filesystem cannot (then nothing changed)."""
    function = _renameat2()
    if function is None:
        return False
    if function(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _fsync_directory(directory: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def relative_path(path: str | Path, directory: Path) -> str:
    """`path` relative to the plan directory: plans hold no absolute paths, and they stay valid
    when the repository is cloned elsewhere."""
    return Path(os.path.relpath(Path(path).resolve(), directory.resolve())).as_posix()


def _exported_at(result: CaptureResult, batch: int,
                 progress: Progress) -> tuple[torch.export.ExportedProgram, dict[str, str] | None]:
    """The program at the micro-batch size, and (when its operators differ from the captured
    graph's) how its nodes map to OpGraph nodes; None when the names match one to one."""
    cap = result.capture
    if batch == cap.batch_size:
        return cap.exported, None
    inputs = cap.model_file.inputs(batch)
    if cap.on_meta:
        inputs = inputs_to_meta(inputs)
    with progress.step(f"capturing at the micro-batch size {batch}"):
        exported = export_program(cap.model, inputs, f"{cap.model_file.name} (batch size {batch})")
    fresh = [n for n in exported.graph.nodes if n.op == "call_function"]
    known = {n.name for n in result.graph.nodes}
    if [(n.name, str(n.target)) for n in fresh if n.name in known] == \
            [(n.name, n.target) for n in result.graph.nodes] and \
            all(n.name in known or n.target is operator.getitem for n in fresh):
        return exported, None
    # Some operators exist at one batch size only (an expand that is a no-op at batch 1), and
    # export numbers nodes per operator, so names after them shift: match by (module, operator,
    # occurrence) instead.
    seen: dict[tuple[str, str], list[str]] = {}
    for node in result.graph.nodes:
        seen.setdefault((node.module, node.target), []).append(node.name)
    counts: dict[tuple[str, str], int] = {}
    matched: dict[str, str] = {}
    for node in fresh:
        stack = node.meta.get("nn_module_stack") or {}
        module = str(list(stack.values())[-1][0]) if stack else ""
        key = (module, str(node.target))
        i = counts.get(key, 0)
        counts[key] = i + 1
        if i < len(seen.get(key, ())):
            matched[node.name] = seen[key][i]
    # Nothing a user can act on (verify checks the result): a progress step, not a warning.
    unmatched = len(fresh) - len(matched)
    with progress.step(f"matching the graph at micro-batch size {batch} to the one captured at "
                       f"batch size {cap.batch_size}: {len(matched)} operators by module, "
                       f"{unmatched} placed after their inputs"):
        pass
    return exported, matched


def _spec_text(spec: pytree.TreeSpec) -> str:
    try:
        return pytree.treespec_dumps(spec)
    except Exception:  # a type registered without a serialised name: launch re-derives it
        return ""


def emit_plan(result: CaptureResult, partition: Partition, cluster: ClusterSpec,
              output_dir: str | Path, costs: PlanCosts,
              progress: Progress | None = None, profile: bytes | None = None,
              plan_directory: str | Path | None = None) -> Plan:
    """Write the stage files and plan.yaml of `partition` into `output_dir`; return the Plan.
    `profile`: the measured profile the plan was solved with, written as PROFILE_FILE with the
    stage files (a plan without one removes an earlier compile's). `plan_directory`: where the
    plan will live when `output_dir` is only where it is built (compile_model builds it beside
    its directory and swaps it in): plan.yaml's paths are relative to it, and so are `costs`'s
    (recorded_costs). A sibling of it gives the same paths except for files inside it."""
    progress = progress or Progress()
    output_dir = Path(output_dir)
    cap = result.capture
    m = partition.shape.microbatch_size
    exported, matched = _exported_at(result, m, progress)
    stage_of = {node: st.index for st in partition.stages for node in st.nodes}
    if matched is not None:
        stage_of = {fresh: stage_of[old] for fresh, old in matched.items() if old in stage_of}
    num_stages = len(partition.stages)
    with progress.step(f"splitting the program into {num_stages} stages"):
        split = split_program(exported, stage_of, num_stages, clamp=matched is not None)
    inputs = cap.model_file.inputs(m)
    if cap.on_meta:
        inputs = inputs_to_meta(inputs)
    flat = flatten_inputs(inputs, split.in_spec)

    staged: dict[Path, Path] = {}  # stage file -> its staging name until the plan is complete
    try:
        profile_path = output_dir / PROFILE_FILE
        if profile is not None:
            staged[profile_path] = write_atomic(
                profile_path.with_name(f".{PROFILE_FILE}.staged"), profile)
        plan = _emit(result, partition, cluster, output_dir, costs, split, flat, staged, progress)
        if plan_directory is not None:
            home = Path(plan_directory)
            plan = replace(plan, directory=home, model=replace(
                plan.model, file=relative_path(cap.model_file.path, home)))
        validate_plan_dict(plan.to_dict(), "the plan being written")
        # Never leave a plan.yaml next to stage files it does not describe: drop the old one,
        # move the new stage files in, then write the new plan.yaml (atomically).
        had_plan = (output_dir / PLAN_FILE).is_file()
        (output_dir / PLAN_FILE).unlink(missing_ok=True)
        while staged:
            final, staging = staged.popitem()
            os.replace(staging, final)
        if had_plan:  # then stage files there were an earlier plan's, not the user's
            _remove_stale_stages(output_dir, len(plan.stages))
        with progress.step("writing plan.yaml"):
            plan.save(output_dir)
        if profile is None and costs.profile != PROFILE_FILE:
            # an earlier compile's measured profile, which this plan does not use
            profile_path.unlink(missing_ok=True)
    finally:
        for staging in staged.values():
            staging.unlink(missing_ok=True)
    return plan


def _emit(result: CaptureResult, partition: Partition, cluster: ClusterSpec, output_dir: Path,
          costs: PlanCosts, split: SplitProgram, flat: list[torch.Tensor],
          staged: dict[Path, Path], progress: Progress) -> Plan:
    """Trace and write every stage (to staging names, recorded in `staged`); the Plan."""
    cap = result.capture
    graph = result.graph
    entries: list[PlanStage] = []
    holders: dict[str, list[int]] = {}
    current = flat
    # Tracing runs each stage forward in training mode, which updates buffers in place (batch-norm
    # statistics): the files must hold the buffers as build_model() made them.
    pristine = [{n: b.detach().clone() for n, b in sg.module.named_buffers()}
                for sg in split.stages]
    runtime = autocast_dtypes(graph, partition.training.precision, cluster.device.kind).tensors
    for sg, st, timing in zip(split.stages, partition.stages, partition.pipeline.stages,
                              strict=True):
        with progress.step(f"tracing stage {sg.index} ({len(sg.nodes)} operators) to TorchScript"):
            saturate_scalars(sg.module, partition.training.precision)  # as autocast runs it
            traced = trace_stage(sg, current)
            with torch.no_grad():
                current = list(traced(*current))
            set_stage_tensors(traced, pristine[sg.index])
            data = stage_bytes(traced)
        path = output_dir / stage_file_name(sg.index)
        staged[path] = write_atomic(path.with_name(f".{path.name}.staged"), data)
        tensors = stage_tensors(traced)
        for name in sg.parameters:
            holders.setdefault(name, []).append(sg.index)
        entries.append(PlanStage(
            index=sg.index, rank=st.rank, file=path.name, sha256=hashlib.sha256(data).hexdigest(),
            replicas=len(st.devices), devices=st.devices,
            parameters=sum(tensors[n].numel() for n in sg.parameters),
            parameter_names=sg.parameters, buffer_names=sg.buffers,
            constant_names=sg.constants, modules=st.modules,
            num_nodes=len(sg.nodes),
            inputs=tuple(_ref(split, name, sg.index, "in", runtime) for name in sg.inputs),
            outputs=tuple(_ref(split, name, sg.index, "out", runtime, relay=name in sg.relayed)
                          for name in sg.outputs),
            forward_s=st.forward_s, backward_s=st.backward_s,
            peak_memory_bytes=partition.memory[st.rank].total,
            send_forward_s=timing.send_forward_s, send_backward_s=timing.send_backward_s,
            send_forward_latency_s=timing.send_forward_latency_s,
            send_backward_latency_s=timing.send_backward_latency_s,
            activation_bytes=int(timing.activation_bytes), static_bytes=int(timing.static_bytes),
            activation_checkpointing=st.activation_checkpointing, sharding=st.sharding))

    names_of: dict[str, tuple[str, ...]] = {}  # any FQN of a tensor -> all its FQNs
    for p in graph.params:
        for n in (p.name, *p.aliases):
            names_of[n] = (p.name, *p.aliases)
    tied = tuple(TiedParameter(name=n, aliases=tuple(sorted(set(names_of.get(n, (n,))) - {n})),
                               stages=tuple(s)) for n, s in sorted(holders.items()) if len(s) > 1)
    model = ModelInfo(
        file=relative_path(cap.model_file.path, output_dir), sha256=cap.model_file.sha256,
        name=graph.model_name,
        graph_hash=graph.content_hash(), on_meta=cap.on_meta,
        parameters=sum(p.numel for p in graph.params if p.kind == "parameter"),
        weights=WEIGHTS_AT_LAUNCH if cap.on_meta else WEIGHTS_IN_STAGE_FILES,
        inputs=tuple(TensorRef(name=n, shape=split.tensors[n].shape, dtype=split.tensors[n].dtype,
                               path=p)
                     for n, p in zip(split.inputs, split.input_paths, strict=True)),
        outputs=tuple(TensorRef(name=n, shape=split.tensors[n].shape,
                                dtype=split.tensors[n].dtype, path=p)
                      for n, p in zip(split.outputs, split.output_paths, strict=True)),
        input_spec=_spec_text(split.in_spec), output_spec=_spec_text(split.out_spec),
        tied_weights=tuple(sorted((p.name, *p.aliases) for p in graph.params if p.aliases)),
        module_fingerprints=graph.module_fingerprints(),
        parameter_signatures=graph.parameter_signatures())
    # again on the file capture read: compile_model's early check saw the path before it ran
    _refuse_a_model_outside_the_tree(cap.model_file.path, output_dir)
    return Plan(partc_version=__version__, partc_build=build_id(),
                torch_version=torch_version(), model=model,
                cluster=cluster,
                training=partition.training_setup, costs=costs, stages=tuple(entries),
                tied_parameters=tied, solver=partition.solver.recorded(),
                predicted=partition.prediction, directory=output_dir)


def torch_version() -> str:
    """The torch that traces stage files, as plan.yaml records it: the public version (a CPU and
    a CUDA build of one release write the same TorchScript)."""
    return torch.__version__.split("+")[0]


def _ref(split: SplitProgram, name: str, stage: int, side: str, runtime: dict[str, str],
         relay: bool = False) -> TensorRef:
    """A stage boundary tensor; `runtime`: every tensor's dtype under the plan's precision."""
    t = split.tensors[name]
    if side == "in":
        peer: tuple[int | str, ...] = (MODEL_INPUT if t.source == SOURCE_INPUT else t.source,)
    else:
        last = len(split.stages)
        peer = tuple(LOSS if c == last else c for c in t.consumers if c > stage)
    # between stages it travels in the dtype the precision's autocast gives it (the data and
    # what the loss gets keep theirs)
    between = peer != (MODEL_INPUT,) and peer != (LOSS,)
    wire = runtime.get(name, t.dtype) if between else t.dtype
    return TensorRef(name=name, shape=t.shape, dtype=t.dtype, peer=peer, relay=relay,
                     wire_dtype=wire if wire != t.dtype else "",
                     wire_order=t.memory_order if between else ())


def _remove_stale_stages(directory: Path, num_stages: int) -> None:
    """Stage files of an earlier compile with more stages would look like part of this plan."""
    for path in directory.glob("stage_*.pt"):
        suffix = path.stem.split("_", 1)[1]
        if suffix.isdigit() and int(suffix) >= num_stages:
            path.unlink()

