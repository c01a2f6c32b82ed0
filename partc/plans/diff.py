"""What differs between two plans of a model: `partc diff`, and the "what moved" half of
`partc check`.

Both sides are reduced to a `Layout`: the pipeline shape, each stage's place, modules and
predicted costs, the predicted iteration and the solver's report, rounded exactly as plan.yaml
rounds them. A Layout comes from a plan (`layout_of_plan`) or straight from a solver result
(`layout_of_partition`, which `partc check` uses without writing stage files), so "the re-solved
plan equals the checked-in plan" is plain equality of two Layouts. A plan's Layout also carries
what it was priced with (`CostsInfo`: cost source, profile and its sha256, and what the profile
file says it is: measured, analytic, calibrated from a run); `partc diff` shows a change of it,
equality ignores it (a solver result has none).

Stage boundaries are compared by module path at the granularity of the model's fingerprint
(every module that calls operators itself): each such module is attributed to the stages whose
module lists name it or an ancestor of it, so two plans that list modules at different depths
("bert.encoder.layer.1" vs its "attention" and "output") still compare module by module.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import yaml

from partc.cost.speed_correction import SPEED_CORRECTION, correction_factor
from partc.files import load_yaml
from partc.plans.plan import Plan, PlanError, resolve_in_plan_tree
from partc.solve.partition import Partition, Prediction, SolverReport, TrainingSetup, round_seconds

ROOT_MODULE = "(root)"  # how stage module lists name the root module ("" in fingerprints)
_MAX_LINES = 24  # moved-module lines shown before "... and N more"
_MAX_PROFILE_BYTES = 1 << 30  # a profile larger than this is not read to describe it


@dataclass(frozen=True)
class LayoutStage:
    """One (virtual) stage: where it runs, what it holds, what it is predicted to cost."""

    index: int
    rank: int
    devices: tuple[int, ...]
    modules: tuple[str, ...]
    parameters: int
    forward_s: float
    backward_s: float
    peak_memory_bytes: int
    send_forward_s: float
    send_backward_s: float
    activation_bytes: int
    static_bytes: int
    levers: str = "-"  # the memory levers it uses ("ckpt+shard-optimizer", "-": none)


@dataclass(frozen=True)
class CostsInfo:
    """What a plan was priced with, as `partc diff` shows it: plan.yaml's cost source and
    profile, and what the profile file itself says it is (when it is in the plan directory)."""

    source: str  # "analytic" | "profile" (plan.yaml's costs.source)
    profile: str | None = None  # relative to the plan directory
    profile_sha256: str | None = None
    profile_kind: str | None = None  # the profile's own kind: "measured" | "analytic"; None:
    #                                  not readable from the plan directory
    calibrated_from: str | None = None  # the run a calibrated profile was corrected from
    # the factor the profile's times are scaled by to the device config's calibrated mean speed
    # (partc.cost.speed_correction): a config's new reference re-prices an unchanged profile
    speed_factor: float | None = None

    def describe(self) -> str:
        if self.source != "profile":
            return self.source
        what = [w for w in (self.profile_kind,
                            self.calibrated_from and f"calibrated from {self.calibrated_from}",
                            self.speed_factor is not None
                            and f"speed-corrected x{self.speed_factor:.3f}",
                            self.profile_sha256 and f"sha256 {self.profile_sha256[:12]}")
                if w]
        return f"profile {self.profile}" + (f" ({', '.join(what)})" if what else "")


def costs_of_plan(plan: Plan) -> CostsInfo:
    """The plan's CostsInfo: its recorded costs, and the profile file's kind and calibration
    read from the plan directory when the file is there (anything unreadable is left None)."""
    costs = plan.costs
    if costs.source != "profile" or costs.profile is None:
        return CostsInfo(source=costs.source)
    kind = run = factor = None
    try:
        # the profile plan.yaml names, inside the plan's tree, a regular file of a sane size
        path = resolve_in_plan_tree(plan.directory or Path("."), costs.profile, "profile")
        if not path.is_file() or path.stat().st_size > _MAX_PROFILE_BYTES:
            raise OSError("not a profile file")
        d = load_yaml(path.read_text(), fast=True)
    except (OSError, UnicodeDecodeError, yaml.YAMLError, PlanError):
        d = None  # diff describes what it can; `partc check` reports a broken profile
    if isinstance(d, dict):
        kind = str(d["kind"]) if "kind" in d else None
        calibration = d.get("calibration")
        # the key partc.plans.recalibrate writes (CALIBRATED_FROM; diff stays below it)
        record = calibration.get("calibrated_from") if isinstance(calibration, dict) else None
        if isinstance(record, dict):
            run = _calibration_runs(record)
        if isinstance(calibration, dict):
            factor = correction_factor(d.get("kind"), d.get("device"), d.get("threads"),
                                       calibration, plan.cluster.device)
            recorded = calibration.get(SPEED_CORRECTION)  # corrected before it was written
            if factor is None and isinstance(recorded, dict) \
                    and isinstance(recorded.get("factor"), (int, float)):
                factor = float(recorded["factor"])
    return CostsInfo(source=costs.source, profile=costs.profile,
                     profile_sha256=costs.profile_sha256, profile_kind=kind, calibrated_from=run,
                     speed_factor=factor)


def _calibration_runs(record: dict[str, Any]) -> str | None:
    """The run file(s) a calibration record names: `runs` (a list of {run, steps}), or the
    single `run` of profiles calibrated before several runs could be pooled (2026-12-02)."""
    runs = record.get("runs")
    if isinstance(runs, list):
        paths = [str(r["run"]) for r in runs if isinstance(r, dict) and r.get("run") is not None]
        if paths:
            return paths[0] if len(paths) == 1 else f"{len(paths)} runs ({', '.join(paths)})"
    return str(record["run"]) if record.get("run") is not None else None


@dataclass(frozen=True)
class Layout:
    """The comparable content of a plan (module docstring). Fingerprints ride along for
    explanations and are not compared (the graph hash stands for them)."""

    model: str
    graph_hash: str
    cluster: str
    training: TrainingSetup
    stages: tuple[LayoutStage, ...]
    predicted: Prediction
    solver: SolverReport  # as recorded: rounded, no wall time
    module_fingerprints: dict[str, str] = field(default_factory=dict, compare=False)
    # What it was priced with (plans only; None from a solver result): diff shows a change,
    # equality (check's "re-solves to the same plan") ignores it
    costs: CostsInfo | None = field(default=None, compare=False)
    # The files a plan pins (plans only): model file and stage files -> sha256. diff shows which
    # differ (a stage file re-traced or edited with an unchanged layout); equality ignores them
    files: dict[str, str] | None = field(default=None, compare=False)
    # The cluster config a plan records, flattened to dotted keys (plans only): diff shows the
    # keys that differ (a recalibrated link, device or scheduler under the same cluster name);
    # equality ignores them, as it does the costs' source
    cluster_config: dict[str, Any] | None = field(default=None, compare=False)

    @property
    def devices_used(self) -> int:
        return self.training.shape.num_devices

    @property
    def samples_per_s(self) -> float:
        return self.predicted.samples_per_s

    @property
    def iteration_s(self) -> float:
        return self.predicted.iteration_s


def layout_of_plan(plan: Plan) -> Layout:
    """A plan's Layout."""
    stages = tuple(LayoutStage(
        index=s.index, rank=s.rank, devices=tuple(s.devices), modules=tuple(s.modules),
        parameters=s.parameters, forward_s=s.forward_s, backward_s=s.backward_s,
        peak_memory_bytes=s.peak_memory_bytes, send_forward_s=s.send_forward_s,
        send_backward_s=s.send_backward_s, activation_bytes=s.activation_bytes,
        static_bytes=s.static_bytes,
        levers=s.levers.label) for s in plan.stages)
    return Layout(model=plan.model.name, graph_hash=plan.model.graph_hash,
                  cluster=plan.cluster.name, training=plan.training, stages=stages,
                  predicted=plan.predicted, solver=plan.solver,
                  module_fingerprints=dict(plan.model.module_fingerprints),
                  costs=costs_of_plan(plan),
                  files={f"model file {plan.model.file}": plan.model.sha256,
                         **{s.file: s.sha256 for s in plan.stages}},
                  cluster_config=_flattened(plan.cluster.to_dict()))


def _flattened(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested mapping as {"a.b.c": leaf}; lists and other values are leaves."""
    out: dict[str, Any] = {}
    for key, value in d.items():
        if isinstance(value, dict):
            out.update(_flattened(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def layout_of_partition(partition: Partition, module_fingerprints: dict[str, str]) -> Layout:
    """The Layout `partc compile` would write for `partition` (same fields, same rounding)."""
    stages = tuple(LayoutStage(
        index=st.index, rank=st.rank, devices=tuple(st.devices), modules=tuple(st.modules),
        parameters=st.parameter_count, forward_s=round_seconds(st.forward_s),
        backward_s=round_seconds(st.backward_s),
        peak_memory_bytes=partition.memory[st.rank].total,
        send_forward_s=round_seconds(t.send_forward_s),
        send_backward_s=round_seconds(t.send_backward_s),
        activation_bytes=int(t.activation_bytes), static_bytes=int(t.static_bytes),
        levers=st.levers.label)
        for st, t in zip(partition.stages, partition.pipeline.stages, strict=True))
    return Layout(model=partition.model, graph_hash=partition.graph_hash,
                  cluster=partition.cluster, training=partition.training_setup, stages=stages,
                  predicted=partition.prediction, solver=partition.solver.recorded(),
                  module_fingerprints=dict(module_fingerprints))


# ---- module attribution ----------------------------------------------------------------------

def module_stages(stages: Sequence[LayoutStage], modules: list[str]) -> dict[str, tuple[int, ...]]:
    """Each of `modules` (fingerprint paths, "" = root) -> the stages holding its own operators.

    A stage lists a module either because it holds the whole module (then it names the outermost
    such ancestor) or because it holds some of the module's own operators (then it names the
    module itself); either way the stages holding a module's operators are exactly those listing
    its nearest listed ancestor-or-self."""
    listing: dict[str, list[int]] = {}
    for s in stages:
        for m in s.modules:
            listing.setdefault("" if m == ROOT_MODULE else m, []).append(s.index)
    out: dict[str, tuple[int, ...]] = {}
    for module in modules:
        path = module
        while path not in listing and path:
            path = path.rpartition(".")[0]
        out[module] = tuple(sorted(set(listing.get(path, ()))))
    return out


def _module_order(a: Layout, b: Layout) -> list[str]:
    """Fingerprint modules both layouts have, in the order stages hold them (then by name)."""
    # Modules only one side has (an added layer) have no stage to move from: partc check lists
    # them as model changes instead.
    names = set(a.module_fingerprints) & set(b.module_fingerprints)
    if not names:  # layouts without fingerprints: compare the listed paths themselves
        names = {("" if m == ROOT_MODULE else m) for lay in (a, b) for s in lay.stages
                 for m in s.modules}
    first = module_stages(a.stages, sorted(names))
    return sorted(names, key=lambda m: (first[m][0] if first[m] else 1 << 30, m))


def collapse_modules(paths: list[str], universe: set[str]) -> list[str]:
    """Shortest description of `paths`: a module whose whole subtree (within `universe`) is in
    `paths` is named once instead of listing its submodules."""
    chosen = set(paths)
    out: list[str] = []
    covered: set[str] = set()
    for path in paths:
        if path in covered:
            continue
        parts = path.split(".") if path else []
        name = path
        for depth in range(1, len(parts)):
            prefix = ".".join(parts[:depth])
            subtree = {u for u in universe if u == prefix or u.startswith(prefix + ".")}
            if subtree and subtree <= chosen:
                name = prefix
                covered |= subtree
                break
        covered.add(path)
        if name not in out:
            out.append(name)
    return out


# ---- the diff ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class ModuleMove:
    modules: tuple[str, ...]  # collapsed module paths
    old: tuple[int, ...]
    new: tuple[int, ...]


@dataclass(frozen=True)
class LayoutDiff:
    """Everything that differs between layouts `old` and `new` (empty lists: nothing)."""

    old: Layout
    new: Layout
    shape: list[tuple[str, Any, Any]]  # (what, old, new) for training settings that differ
    moves: list[ModuleMove]
    stages_changed: bool  # any stage's place, modules or predicted costs differ
    predicted_changed: bool
    solver_changed: bool
    costs: tuple[CostsInfo, CostsInfo] | None = None  # (old, new) when both known and different
    files: tuple[str, ...] = ()  # pinned files whose sha256 differs (both sides plans)
    # the recorded cluster config's keys whose values differ (both sides plans)
    cluster_config: tuple[str, ...] = ()

    @property
    def same(self) -> bool:
        return self.old == self.new and self.costs is None and not self.files and \
            not self.cluster_config


_SHAPE_KEYS = (("stages", "pipeline stages"), ("replicas", "replicas"),
               ("virtual_stages_per_rank", "virtual stages per rank"),
               ("num_microbatches", "micro-batches"), ("microbatch_size", "micro-batch size"),
               ("global_batch_size", "global batch"), ("schedule", "schedule"),
               ("activation_checkpointing", "activation checkpointing allowed"),
               ("sharding", "sharding allowed"),
               ("placement", "placement"), ("optimizer", "optimizer"),
               ("precision", "precision"), ("memory_margin", "memory margin"))


def diff_layouts(old: Layout, new: Layout) -> LayoutDiff:
    """Compare two layouts (module docstring)."""
    before, after = old.training.to_dict(), new.training.to_dict()
    shape = [(label, before[key], after[key]) for key, label in _SHAPE_KEYS
             if before[key] != after[key]]
    if old.cluster != new.cluster:
        shape.insert(0, ("cluster", old.cluster, new.cluster))
    if old.devices_used != new.devices_used:
        shape.insert(0, ("devices used", old.devices_used, new.devices_used))
    order = _module_order(old, new)
    was, now = module_stages(old.stages, order), module_stages(new.stages, order)
    groups: dict[tuple[tuple[int, ...], tuple[int, ...]], list[str]] = {}
    for m in order:
        if was[m] != now[m]:
            groups.setdefault((was[m], now[m]), []).append(m)
    universe = set(order)
    moves = [ModuleMove(modules=tuple(ROOT_MODULE if p == "" else p
                                      for p in collapse_modules(paths, universe)), old=o, new=n)
             for (o, n), paths in groups.items()]
    return LayoutDiff(old=old, new=new, shape=shape, moves=moves,
                      stages_changed=old.stages != new.stages,
                      predicted_changed=old.predicted != new.predicted,
                      solver_changed=old.solver != new.solver,
                      costs=(old.costs, new.costs) if old.costs is not None and
                      new.costs is not None and old.costs != new.costs else None,
                      files=_files_that_differ(old, new),
                      cluster_config=_cluster_keys_that_differ(old, new))


def _cluster_keys_that_differ(old: Layout, new: Layout) -> tuple[str, ...]:
    if old.cluster_config is None or new.cluster_config is None:
        return ()
    was, now = old.cluster_config, new.cluster_config
    # the description, source and checked_against texts follow the numbers; the name is shown
    # as the cluster
    return tuple(sorted(k for k in set(was) | set(now) if was.get(k) != now.get(k)
                        and k.rsplit(".", 1)[-1] not in ("description", "source",
                                                         "checked_against", "name")))


def _files_that_differ(old: Layout, new: Layout) -> tuple[str, ...]:
    if old.files is None or new.files is None:
        return ()
    return tuple(sorted(f for f in set(old.files) | set(new.files)
                        if old.files.get(f) != new.files.get(f)))


def _stages_text(stages: tuple[int, ...]) -> str:
    if not stages:
        return "nowhere"
    return ("stage " if len(stages) == 1 else "stages ") + ", ".join(map(str, stages))


def _sha(digest: str | None) -> str:
    return f"sha256 {digest[:12]}.." if digest else "-"


def _ms(x: float) -> str:
    return f"{x * 1e3:.3f}"


def _gib(x: float) -> str:
    return f"{x / 2**30:.3f}"


def _change(old: float, new: float) -> str:
    if old == new:
        return "="
    if old == 0:
        return "new"
    return f"{(new - old) / old:+.1%}"


def _span(stage: LayoutStage) -> str:
    if not stage.modules:
        return "(no modules)"
    if len(stage.modules) == 1:
        return stage.modules[0]
    return f"{stage.modules[0]} .. {stage.modules[-1]}"


def format_diff(diff: LayoutDiff, old_name: str = "a", new_name: str = "b",
                indent: str = "") -> str:
    """The human-readable diff: shape changes, modules that change stage, a per-stage table of
    devices, predicted times and memory, and old vs new throughput."""
    old, new = diff.old, diff.new
    lines: list[str] = []
    if diff.same:
        return indent + "no differences"
    if old.graph_hash != new.graph_hash:
        lines.append(f"model graph: {old.graph_hash[:19]}.. ({old_name}) vs "
                     f"{new.graph_hash[:19]}.. ({new_name})")
    for what, a, b in diff.shape:
        lines.append(f"{what}: {a} -> {b}")
    if diff.costs is not None:
        lines.append(f"costs: {diff.costs[0].describe()} -> {diff.costs[1].describe()}")
    if diff.cluster_config:
        was, now = old.cluster_config or {}, new.cluster_config or {}
        lines.append(f"cluster config {new.cluster} ({len(diff.cluster_config)} key(s) differ):")
        keys = diff.cluster_config[:_MAX_LINES]
        lines += [f"  {k}: {was.get(k, '-')} -> {now.get(k, '-')}" for k in keys]
        if len(diff.cluster_config) > len(keys):
            lines.append(f"  ... and {len(diff.cluster_config) - len(keys)} more")
    if diff.files:
        was, now = old.files or {}, new.files or {}
        lines.append(f"files that differ ({len(diff.files)}):")
        lines += [f"  {f}: {_sha(was.get(f))} -> {_sha(now.get(f))}" for f in diff.files]
    if diff.moves:
        count = sum(len(m.modules) for m in diff.moves)
        lines.append(f"modules that change stage ({count}):")
        shown = 0
        for move in diff.moves:
            for module in move.modules:
                if shown < _MAX_LINES:
                    lines.append(f"  {module}: {_stages_text(move.old)} -> "
                                 f"{_stages_text(move.new)}")
                shown += 1
        if shown > _MAX_LINES:
            lines.append(f"  ... and {shown - _MAX_LINES} more")
    if diff.stages_changed or diff.moves:
        lines.append(f"{'stage':>5}  {'devices':<17} {'fwd ms':<19} {'bwd ms':<19} "
                     f"{'memory GiB':<17} {'levers':<24}  modules ({old_name} -> {new_name})")
        for k in range(max(len(old.stages), len(new.stages))):
            a = old.stages[k] if k < len(old.stages) else None
            b = new.stages[k] if k < len(new.stages) else None
            lines.append(_stage_row(k, a, b))
    lines.append(f"predicted: {_ms(old.iteration_s)} -> {_ms(new.iteration_s)} ms/iteration, "
                 f"{old.samples_per_s:,.1f} -> {new.samples_per_s:,.1f} samples/s "
                 f"({_change(old.samples_per_s, new.samples_per_s)}), bubble "
                 f"{old.predicted.bubble_fraction:.1%} -> {new.predicted.bubble_fraction:.1%}")
    spreads = (_spread_text(old.predicted), _spread_text(new.predicted))
    if spreads[0] != spreads[1]:
        lines.append(f"speed spread: {spreads[0]} -> {spreads[1]}")
    a, b = old.solver, new.solver

    def gap(r: SolverReport) -> str:
        return "-" if r.gap is None else f"{r.gap:.2%}"

    if (a.strategy, a.status, gap(a)) != (b.strategy, b.status, gap(b)):
        lines.append(f"solver: {a.strategy} {a.status} (gap {gap(a)}) -> "
                     f"{b.strategy} {b.status} (gap {gap(b)})")
    return "\n".join(indent + line for line in lines)


def _spread_text(p: Prediction) -> str:
    """The speed spread a prediction is an expectation over, in brief: its source and range."""
    if not p.speed_modes:
        return "none"
    factors = [f for _, f in p.speed_modes]
    return f"{p.speed_spread_source}'s, {min(factors):.3f}-{max(factors):.3f}x"


def _stage_row(k: int, a: LayoutStage | None, b: LayoutStage | None) -> str:
    def pair(f: Any, getter: Any) -> str:
        if a is None:
            return f"- -> {f(getter(b))}"
        if b is None:
            return f"{f(getter(a))} -> -"
        x, y = f(getter(a)), f(getter(b))
        return x if x == y else f"{x} -> {y}"

    devices = pair(lambda d: ",".join(map(str, d)), lambda s: s.devices)
    fwd = pair(_ms, lambda s: s.forward_s)
    bwd = pair(_ms, lambda s: s.backward_s)
    mem = pair(_gib, lambda s: s.peak_memory_bytes)
    levers = pair(lambda x: x, lambda s: s.levers)
    span = pair(lambda x: x, _span)
    return f"{k:>5}  {devices:<17} {fwd:<19} {bwd:<19} {mem:<17} {levers:<24}  {span}"
