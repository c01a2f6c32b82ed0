"""Partition: the solver's decision, as plain data (what plan.yaml will record).

A Partition names the pipeline shape (stages, replicas, micro-batches, schedule, checkpointing,
placement), every virtual stage's blocks, OpGraph nodes, modules, parameters, devices, boundary
tensors and predicted times, every rank's memory (partc.solve.memory), the solver's report
(strategy, status, objective, bound, gap, time) and the simulated iteration. `to_dict` is
deterministic (sorted keys, rounded floats); wall-clock solve times are kept apart in
`SolverReport.wall_s` so callers can leave them out of hashed content.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Mapping

import yaml

from partc.files import write_atomic
from partc.options import Sharding, Strategy, TrainingConfig
from partc.solve.memory import StageMemory
from partc.solve.simulator import PipelineSpec, Simulation, TiedSync
from partc.solve.stage_problem import PipelineShape, RankLevers

PARTITION_FORMAT = "partc-partition"
PARTITION_VERSION = 1


@dataclass(frozen=True)
class StagePlan:
    """One virtual stage: what it runs, where, and what it costs per micro-batch."""

    index: int
    rank: int  # pipeline rank (device position in a pipeline) running it
    devices: tuple[int, ...]  # cluster device per replica
    blocks: tuple[int, ...]
    nodes: tuple[str, ...]
    modules: tuple[str, ...]  # outermost module paths fully or partly in the stage, in order
    parameters: tuple[str, ...]  # canonical FQNs of the parameters it uses
    parameter_count: int
    forward_s: float
    backward_s: float  # includes the recomputed forward under checkpointing
    receives: tuple[str, ...]  # tensors from earlier stages (or the inputs)
    sends: tuple[str, ...]  # tensors to later stages (or the loss)
    # the levers its rank uses (partc.solve.levers): recompute, and what its replicas shard
    activation_checkpointing: bool = False
    sharding: Sharding = "none"

    @property
    def levers(self) -> RankLevers:
        """The memory levers its rank uses."""
        return RankLevers(self.activation_checkpointing, self.sharding)

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index, "rank": self.rank, "devices": list(self.devices),
                "activation_checkpointing": self.activation_checkpointing,
                "sharding": self.sharding,
                "blocks": [self.blocks[0], self.blocks[-1]] if self.blocks else [],
                "num_nodes": len(self.nodes), "modules": list(self.modules),
                "parameters": list(self.parameters), "parameter_count": self.parameter_count,
                "forward_s": round_seconds(self.forward_s),
                "backward_s": round_seconds(self.backward_s),
                "receives": list(self.receives), "sends": list(self.sends)}


@dataclass(frozen=True)
class CutCandidate:
    """One cut the search simulated before choosing the plan (SolverReport.candidates): the
    shape's label, whose cut it is, its solver objective J, its simulated iteration time and
    the predicted peak of its most loaded rank (what breaks a tie; None in older plans)."""

    shape: str  # PipelineShape.label()
    cut_from: Strategy
    objective_s: float
    iteration_s: float
    peak_bytes: int | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"shape": self.shape, "cut_from": self.cut_from,
                             "objective_s": round_seconds(self.objective_s),
                             "iteration_s": round_seconds(self.iteration_s)}
        if self.peak_bytes is not None:
            d["peak_bytes"] = self.peak_bytes
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CutCandidate":
        return cls(shape=d["shape"], cut_from=d["cut_from"], objective_s=d["objective_s"],
                   iteration_s=d["iteration_s"], peak_bytes=d.get("peak_bytes"))


@dataclass(frozen=True)
class SolverReport:
    """How the partition was found and how good it provably is (plan.yaml's `solver`).

    objective_s: the solver's iteration-time estimate (partc.solve.stage_problem) of the chosen
    assignment. bound_s: a proven lower bound of that estimate over every assignment of the block
    graph for the chosen shape (CP-SAT's best bound; None for heuristics). search_bound_s: a lower
    bound over every shape the search enumerated (CP-SAT bounds where it ran, analytic bounds
    elsewhere), so search_gap says how far any other shape could possibly be better. wall_s: the
    solve's wall-clock time; None once recorded (`recorded`), since a plan holds no timings.

    cut_from: whose cut of the chosen shape the plan runs. For the optimizing strategies (cpsat,
    chain-dp) the search simulates the cuts of its best shapes (its own and the baselines', see
    partc.solve.search.RERANK_SHAPES) and keeps the fastest simulated one, so this can be
    "uniform" or "params" (or "chain-dp" under cpsat: a shape CP-SAT did not refine, or whose
    DP cut simulates faster); `candidates` lists every cut simulated, fastest first, the chosen
    one first. status, bound_s and gap remain those of the solver on the chosen shape (no bound
    when it is a shape CP-SAT did not refine); objective_s is J of the chosen cut. Baseline
    strategies run their own cut: cut_from = strategy, no candidates. Plans written before these
    fields read back as cut_from = strategy, no candidates.
    """

    strategy: Strategy
    status: str
    objective_s: float
    bound_s: float | None
    gap: float | None
    search_bound_s: float
    search_gap: float
    shapes_enumerated: int
    shapes_evaluated: int
    shapes_pruned: int
    blocks: int
    time_limit_s: float
    wall_s: float | None
    cut_from: Strategy | None = None  # None: the strategy's own cut (see `chosen_cut`)
    candidates: tuple[CutCandidate, ...] = ()

    @property
    def chosen_cut(self) -> Strategy:
        """Whose cut the plan runs (cut_from, or the strategy itself when not recorded)."""
        return self.cut_from or self.strategy

    def to_dict(self, include_time: bool = True) -> dict[str, Any]:
        d = {"strategy": self.strategy, "status": self.status, "cut_from": self.chosen_cut,
             "candidates": [c.to_dict() for c in self.candidates],
             "objective_s": round_seconds(self.objective_s),
             "bound_s": None if self.bound_s is None else round_seconds(self.bound_s),
             "gap": None if self.gap is None else round(self.gap, 6),
             "search_bound_s": round_seconds(self.search_bound_s),
             "search_gap": round(self.search_gap, 6),
             "shapes": {"enumerated": self.shapes_enumerated, "evaluated": self.shapes_evaluated,
                        "pruned_by_bound": self.shapes_pruned},
             "blocks": self.blocks, "time_limit_s": self.time_limit_s}
        if include_time and self.wall_s is not None:
            d["wall_s"] = round(self.wall_s, 3)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SolverReport":
        """Read `to_dict`'s output back (wall_s None when it was left out)."""
        shapes = d["shapes"]
        return cls(strategy=d["strategy"], status=d["status"], objective_s=d["objective_s"],
                   bound_s=d["bound_s"], gap=d["gap"], search_bound_s=d["search_bound_s"],
                   search_gap=d["search_gap"], shapes_enumerated=shapes["enumerated"],
                   shapes_evaluated=shapes["evaluated"], shapes_pruned=shapes["pruned_by_bound"],
                   blocks=d["blocks"], time_limit_s=d["time_limit_s"], wall_s=d.get("wall_s"),
                   cut_from=d.get("cut_from", d["strategy"]),
                   candidates=tuple(CutCandidate.from_dict(c) for c in d.get("candidates", ())))

    def recorded(self) -> "SolverReport":
        """The report as a plan records it: rounded as plan.yaml writes it, without wall time."""
        return SolverReport.from_dict(self.to_dict(include_time=False))


@dataclass(frozen=True)
class TrainingSetup:
    """The training shape and settings of a plan (plan.yaml's `training`): the global batch, the
    pipeline shape and the TrainingConfig it was solved for."""

    global_batch_size: int
    shape: PipelineShape
    config: TrainingConfig

    def __post_init__(self) -> None:
        if self.shape.global_batch_size != self.global_batch_size:
            raise ValueError(f"global batch {self.global_batch_size} is not replicas x "
                             f"micro-batches x micro-batch size = {self.shape.global_batch_size}")
        if (self.config.schedule, self.config.activation_checkpointing, self.config.sharding) \
                != (self.shape.schedule, self.shape.activation_checkpointing, self.shape.sharding):
            raise ValueError("the training config's schedule, checkpointing and sharding differ "
                             "from the pipeline shape's")

    def to_dict(self) -> dict[str, Any]:
        s, c = self.shape, self.config
        return {"global_batch_size": self.global_batch_size, "stages": s.stages,
                "replicas": s.replicas, "num_microbatches": s.num_microbatches,
                "microbatch_size": s.microbatch_size, "schedule": s.schedule,
                "virtual_stages_per_rank": s.chunks,
                "activation_checkpointing": s.activation_checkpointing,
                "sharding": s.sharding,
                "placement": s.placement, "optimizer": c.optimizer, "precision": c.precision,
                "memory_margin": c.memory_margin}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TrainingSetup":
        shape = PipelineShape(stages=d["stages"], replicas=d["replicas"],
                              num_microbatches=d["num_microbatches"],
                              microbatch_size=d["microbatch_size"], schedule=d["schedule"],
                              chunks=d["virtual_stages_per_rank"],
                              activation_checkpointing=d["activation_checkpointing"],
                              placement=d["placement"], sharding=d.get("sharding", "none"))
        config = shape.training_config(TrainingConfig(optimizer=d["optimizer"],
                                                      precision=d["precision"],
                                                      memory_margin=d["memory_margin"]))
        return cls(global_batch_size=d["global_batch_size"], shape=shape, config=config)


SpreadSource = Literal["device", "run"]
"""Where a priced speed spread comes from: the device config's (partc calibrate), or the
launched runs a compile was calibrated from (--calibrate-from, partc.plans.recalibrate)."""


def spread_clause(source: SpreadSource) -> str:
    """What an expectation is over, for the one-line summaries."""
    return ("the devices' speed spread" if source == "device"
            else "the speed spread of the runs calibrated from")


@dataclass(frozen=True)
class SpeedSpreadPrice:
    """The step priced over a speed spread (partc.solve.stragglers): the device config's modes of
    the plan's matmul dtype, or the launched runs' (the cost table's), and the expected
    iteration under them."""

    modes: tuple[tuple[float, float], ...]
    iteration_s: float
    source: SpreadSource = "device"


@dataclass(frozen=True)
class Prediction:
    """What the plan is predicted to do (plan.yaml's `predicted`): the simulated iteration, peak
    memory per rank by kind against the usable memory, and the per-rank sync times the
    simulation used. Values are rounded as plan.yaml writes them."""

    iteration_s: float
    samples_per_s: float
    bubble_fraction: float
    peak_memory_bytes: tuple[int, ...]  # per rank, from the simulated schedule
    usable_memory_bytes: int
    memory: tuple[StageMemory, ...]  # per rank, the memory model's terms
    allreduce_s: tuple[float, ...]  # per rank
    optimizer_s: tuple[float, ...]  # per rank
    tied_sync: tuple[TiedSync, ...] = ()  # cross-rank sums of tied gradients, in run order
    # per rank, the memory model's peak with none of the levers (no checkpointing, no sharding):
    # what the rank's levers save is this minus its `memory` total; () in older plans
    memory_without_levers: tuple[int, ...] = ()
    # where a speed spread was priced: its modes, and the iteration at the priced speed
    # (`iteration_s` being the expectation over the modes); None: no spread priced. Its source
    # is written only when it is the runs' (plans priced over a device's read as before).
    speed_modes: tuple[tuple[float, float], ...] = ()
    iteration_at_priced_speed_s: float | None = None
    speed_spread_source: SpreadSource = "device"

    @classmethod
    def of(cls, partition: "Partition") -> "Prediction":
        return cls(iteration_s=round_seconds(partition.iteration_s),
                   samples_per_s=round(partition.samples_per_s, 3),
                   bubble_fraction=round(partition.simulation.bubble_fraction, 6),
                   peak_memory_bytes=tuple(int(x) for x in
                                           partition.simulation.peak_memory_bytes),
                   usable_memory_bytes=int(partition.usable_memory_bytes),
                   memory=tuple(partition.memory),
                   allreduce_s=tuple(round_seconds(x) for x in partition.pipeline.allreduce_s),
                   optimizer_s=tuple(round_seconds(x) for x in partition.pipeline.optimizer_s),
                   tied_sync=tuple(TiedSync(t.ranks, round_seconds(t.seconds))
                                   for t in partition.pipeline.tied),
                   memory_without_levers=tuple(int(x)
                                               for x in partition.memory_without_levers),
                   speed_modes=spread.modes if (spread := partition.speed_spread) else (),
                   iteration_at_priced_speed_s=round_seconds(partition.simulation.iteration_s)
                   if spread else None,
                   speed_spread_source=spread.source if spread else "device")

    def spread_text(self) -> str:
        """Where the iteration is an expectation over the devices' speed spread, what it is at
        the priced speed (a clause for the one-line summaries); "" otherwise."""
        if not self.speed_modes or self.iteration_at_priced_speed_s is None:
            return ""
        return (f" (expected over {spread_clause(self.speed_spread_source)}; "
                f"{self.iteration_at_priced_speed_s * 1e3:.3f} ms at the priced speed)")

    def lever_savings(self, rank: int) -> int:
        """Bytes the rank's levers save on its peak (0 when not recorded)."""
        if rank >= len(self.memory_without_levers):
            return 0
        return max(0, self.memory_without_levers[rank] - self.memory[rank].total)

    def summary_dict(self) -> dict[str, Any]:
        """Time, throughput, bubble and peak memory per rank (a partition file's `predicted`)."""
        return {"iteration_s": self.iteration_s, "samples_per_s": self.samples_per_s,
                "bubble_fraction": self.bubble_fraction,
                "peak_memory_bytes": list(self.peak_memory_bytes)}

    def to_dict(self) -> dict[str, Any]:
        return {**self.summary_dict(), "usable_memory_bytes": self.usable_memory_bytes,
                "memory": [m.to_dict() for m in self.memory],
                "allreduce_s": list(self.allreduce_s), "optimizer_s": list(self.optimizer_s),
                "tied_sync": [{"ranks": list(t.ranks), "seconds": t.seconds}
                              for t in self.tied_sync],
                "memory_without_levers": list(self.memory_without_levers),
                **({"speed_spread": {"modes": [[p, f] for p, f in self.speed_modes],
                                     "iteration_at_priced_speed_s":
                                         self.iteration_at_priced_speed_s,
                                     **({"source": self.speed_spread_source}
                                        if self.speed_spread_source != "device" else {})}}
                   if self.speed_modes else {})}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Prediction":
        return cls(iteration_s=d["iteration_s"], samples_per_s=d["samples_per_s"],
                   bubble_fraction=d["bubble_fraction"],
                   peak_memory_bytes=tuple(d["peak_memory_bytes"]),
                   usable_memory_bytes=d["usable_memory_bytes"],
                   memory=tuple(StageMemory.from_dict(m) for m in d["memory"]),
                   allreduce_s=tuple(d["allreduce_s"]), optimizer_s=tuple(d["optimizer_s"]),
                   tied_sync=tuple(TiedSync(tuple(t["ranks"]), t["seconds"])
                                   for t in d.get("tied_sync", ())),
                   memory_without_levers=tuple(d.get("memory_without_levers", ())),
                   speed_modes=tuple((float(p), float(f))
                                     for p, f in d.get("speed_spread", {}).get("modes", ())),
                   iteration_at_priced_speed_s=d.get("speed_spread", {}).get(
                       "iteration_at_priced_speed_s"),
                   speed_spread_source=d.get("speed_spread", {}).get("source", "device"))


@dataclass(frozen=True)
class Partition:
    """The chosen hybrid-parallel layout of one model on one cluster (module docstring)."""

    model: str
    graph_hash: str
    cluster: str
    num_devices: int  # devices the cluster has
    global_batch_size: int
    shape: PipelineShape
    training: TrainingConfig
    stages: tuple[StagePlan, ...]
    memory: tuple[StageMemory, ...]  # per rank
    usable_memory_bytes: int
    solver: SolverReport
    pipeline: PipelineSpec  # what was simulated: per-stage times and transfers, per-rank sync
    simulation: Simulation
    levers: tuple[RankLevers, ...] = ()  # per rank (partc.solve.levers); (): none anywhere
    memory_without_levers: tuple[int, ...] = ()  # per rank: the peak with no lever on
    # the step's expectation over the device's speed spread, where its config gives one
    speed_spread: SpeedSpreadPrice | None = None

    @property
    def iteration_s(self) -> float:
        """The predicted iteration: the expectation over the devices' speed spread where the
        device config gives one, else the simulated schedule's time."""
        if self.speed_spread is not None:
            return self.speed_spread.iteration_s
        return self.simulation.iteration_s

    @property
    def samples_per_s(self) -> float:
        return self.global_batch_size / self.iteration_s if self.iteration_s > 0 else 0.0

    @property
    def training_setup(self) -> TrainingSetup:
        return TrainingSetup(self.global_batch_size, self.shape, self.training)

    @property
    def prediction(self) -> Prediction:
        return Prediction.of(self)

    def to_dict(self, include_time: bool = True, include_timeline: bool = False) -> dict[str, Any]:
        """Plain data, deterministic for the same inputs (without `include_time`)."""
        s = self.shape
        d: dict[str, Any] = {
            "format": PARTITION_FORMAT, "format_version": PARTITION_VERSION,
            "model": self.model, "graph_hash": self.graph_hash,
            "cluster": {"name": self.cluster, "num_devices": self.num_devices,
                        "devices_used": s.num_devices},
            "training": self.training_setup.to_dict(),
            "stages": [st.to_dict() for st in self.stages],
            "memory": {"usable_bytes_per_device": self.usable_memory_bytes,
                       "ranks": [m.to_dict() for m in self.memory]},
            "solver": self.solver.to_dict(include_time),
            "predicted": self.prediction.summary_dict(),
        }
        if include_timeline:
            d["simulation"] = self.simulation.to_dict()
        return d

    def save(self, path: str | Path, include_time: bool = False) -> Path:
        """Write as YAML (sorted keys; byte-identical for the same inputs)."""
        return write_atomic(path, yaml.safe_dump(self.to_dict(include_time=include_time),
                                                 sort_keys=True, default_flow_style=False,
                                                 width=100))


def round_seconds(x: float) -> float:
    """Seconds to 1 ns: stable text, more precision than any estimate has."""
    return float(f"{x:.9g}") if x else 0.0


def format_partition(p: Partition, priced_by: str | None = None) -> str:
    """A terminal table: one row per stage, then the prediction (and `priced_by`, the line saying
    what priced it: partc.hardware.specs.priced_by_text) and the solver's report."""
    s = p.shape
    lines = [f"{p.model}: {s.label()} on {s.num_devices}/{p.num_devices} devices of {p.cluster}, "
             f"global batch {p.global_batch_size}"]
    header = f"{'stage':>5} {'rank':>4} {'devices':<12} {'params':>10} {'fwd ms':>9} " \
             f"{'bwd ms':>9} {'memory':>10} {'levers':<22}  modules"
    lines.append(header)
    for st in p.stages:
        mem = p.memory[st.rank].total if st.rank < len(p.memory) else 0
        devices = ",".join(str(d) for d in st.devices)
        modules = ", ".join(st.modules[:3]) + (f" ... ({len(st.modules)})"
                                               if len(st.modules) > 3 else "")
        saved = p.prediction.lever_savings(st.rank)
        lever_text = st.levers.label + (f" -{_gib(saved)}" if saved > 0 else "")
        lines.append(f"{st.index:>5} {st.rank:>4} {devices:<12.12} {st.parameter_count:>10,} "
                     f"{st.forward_s * 1e3:>9.3f} {st.backward_s * 1e3:>9.3f} "
                     f"{_gib(mem):>10} {lever_text:<22}  {modules}")
    r = p.solver
    gap = "-" if r.gap is None else f"{r.gap:.2%}"
    lines.append(f"predicted: {p.iteration_s * 1e3:.3f} ms/iteration, {p.samples_per_s:,.1f} "
                 f"samples/s, bubble {p.simulation.bubble_fraction:.1%}; usable memory "
                 f"{_gib(p.usable_memory_bytes)} per device")
    if priced_by is not None:
        lines.append(priced_by)
    cut = "" if r.chosen_cut == r.strategy else f" ({r.chosen_cut}'s cut simulates faster)"
    lines.append(f"solver: {r.strategy} {r.status}{cut}, objective {r.objective_s * 1e3:.3f} ms, "
                 f"gap {gap}, search gap {r.search_gap:.2%} ({r.shapes_evaluated} of "
                 f"{r.shapes_enumerated} shapes evaluated, {r.shapes_pruned} pruned by bound), "
                 f"{r.blocks} blocks" + (f", {r.wall_s:.1f} s" if r.wall_s is not None else ""))
    return "\n".join(lines)


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB"


def format_comparison(results: Mapping[Strategy, Partition | Exception]) -> str:
    """One row per strategy: shape, predicted iteration, objective, gap, solve time."""
    lines = [f"{'strategy':<9} {'shape':<40} {'iteration ms':>13} {'objective ms':>13} "
             f"{'gap':>7} {'solve s':>8}"]
    for name, p in results.items():
        if not isinstance(p, Partition):
            message = getattr(p, "message", str(p))
            lines.append(f"{name:<9} {'no plan: ' + message:<.100}")
            continue
        gap = "-" if p.solver.gap is None else f"{p.solver.gap:.2%}"
        lines.append(f"{name:<9} {p.shape.label():<40} {p.iteration_s * 1e3:>13.3f} "
                     f"{p.solver.objective_s * 1e3:>13.3f} {gap:>7} {p.solver.wall_s:>8.2f}")
    return "\n".join(lines)
