"""CostTable: what every OpGraph node costs on a target device, at any micro-batch size.

For each node the table holds forward time, backward time and bytes saved for backward, each as a
`Curve` of the micro-batch size m: piecewise linear through the values measured at the profiled
sizes (or a line, for the analytic roofline), so the solver prices any micro-batch without
re-profiling, and exactly at the sizes that were measured; `loss` holds the same for the model
file's loss function (run by the last pipeline stage on the model's outputs, outside the graph).
Parameter bytes and boundary-tensor bytes come from the OpGraph the table belongs to
(`CostTable.graph`).

Two ways to fill it (docs/cost-model.md):
- measured (`partc.cost.measured`): onnxruntime per-node forward times on the target execution
  provider, backward from torch per op kind, calibrated against torch's whole-model times;
- analytic (`partc.cost.roofline`): a roofline per node from the device's peak FLOP/s and memory
  bandwidth (configs/devices/*.yaml), with per-op-class efficiencies and backward/forward ratios.

A table saved to disk (a "profile", YAML) carries the graph hash of the model it was taken on;
loading it against a different graph is refused.
"""
from __future__ import annotations

import bisect
import json
import math
import statistics
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, Sequence

import yaml

from partc.cost.autocast import AutocastDtypes, autocast_dtypes
from partc.cost.op_classes import held_params
from partc.cost.speed_probe import PROBE, probe_from
from partc.errors import PartcError
from partc.files import load_yaml, write_atomic, yaml_problem
from partc.graph.opgraph import INTEGER_DTYPES, OpGraph, dtype_bytes
from partc.hardware.specs import speed_modes_problem, vector_bytes_problem
from partc.options import Precision

PROFILE_FORMAT = "partc-profile"
# 2: the loss function's costs (`loss`), and measurements pinned to a core
# 3: the loss function's saved bytes measured (version 2 wrote 0)
PROFILE_VERSION = 3


class ProfileFileError(PartcError):
    """A profile file that cannot be used: missing, malformed, or for another model."""


@dataclass(frozen=True)
class Linear:
    """A cost as a function of the micro-batch size m: max(0, fixed + per_sample * m)."""

    fixed: float
    per_sample: float

    def at(self, m: float) -> float:
        return max(0.0, self.fixed + self.per_sample * m)

    @classmethod
    def fit(cls, points: Sequence[tuple[float, float]]) -> "Linear":
        """Least-squares line through (m, value) points, kept non-decreasing and non-negative
        at m >= 0: a negative slope (noise) becomes a constant, a negative intercept a line
        through the origin."""
        if not points:
            return cls(0.0, 0.0)
        if len(points) == 1 or len({m for m, _ in points}) == 1:
            m, v = points[0]
            return cls(0.0, v / m if m else 0.0)
        n = len(points)
        mx = sum(m for m, _ in points) / n
        my = sum(v for _, v in points) / n
        sxx = sum((m - mx) ** 2 for m, _ in points)
        slope = sum((m - mx) * (v - my) for m, v in points) / sxx
        intercept = my - slope * mx
        if slope < 0:
            return cls(max(0.0, my), 0.0)
        if intercept < 0:
            through_origin = sum(m * v for m, v in points) / sum(m * m for m, _ in points)
            return cls(0.0, max(0.0, through_origin))
        return cls(intercept, slope)


    def curve(self) -> "Curve":
        """The same line as a `Curve`."""
        return Curve.line(self.fixed, self.per_sample)


@dataclass(frozen=True)
class Curve:
    """A cost as a function of the micro-batch size m: piecewise linear through `points` ((m,
    value) pairs, m ascending and distinct), continued beyond the first and the last point along
    the end segments, never below 0. One point: proportional to m; none: 0.

    Costs are not lines in m on real devices (caches, kernel choices), so a measured cost keeps
    the value measured at each profiled size rather than a fitted line, and is exact there."""

    points: tuple[tuple[float, float], ...]

    def at(self, m: float) -> float:
        p = self.points
        if len(p) < 2:
            if not p:
                return 0.0
            m0, v0 = p[0]
            return max(0.0, v0 * m / m0) if m0 else max(0.0, v0)
        if m <= p[0][0]:
            i = 0
        elif m >= p[-1][0]:
            i = len(p) - 2
        else:
            i = bisect.bisect_right(p, (m, math.inf)) - 1
        (a, va), (b, vb) = p[i], p[i + 1]
        return max(0.0, va + (vb - va) * (m - a) / (b - a))

    @classmethod
    def line(cls, fixed: float, per_sample: float) -> "Curve":
        """fixed + per_sample * m (clamped at 0)."""
        return cls(((0.0, float(fixed)), (1.0, float(fixed + per_sample))))

    @classmethod
    def through(cls, points: Sequence[tuple[float, float]]) -> "Curve":
        """Exactly through the points (distinct sizes), in size order."""
        ordered = tuple(sorted((float(m), float(v)) for m, v in points))
        if len({m for m, _ in ordered}) != len(ordered):
            raise ValueError(f"a curve's sizes must be distinct, got {[m for m, _ in ordered]}")
        return cls(ordered)

    @classmethod
    def measured(cls, points: Sequence[tuple[float, float]]) -> "Curve":
        """Through measured (size, value) points, kept non-negative and non-decreasing in the
        size: the median where a size repeats, and a value below the one at a smaller size
        (timing noise on an operator that does not grow) raised to it."""
        by_size: dict[float, list[float]] = {}
        for m, v in points:
            by_size.setdefault(float(m), []).append(max(0.0, float(v)))
        ordered: list[tuple[float, float]] = []
        for m in sorted(by_size):
            value = statistics.median(by_size[m])
            ordered.append((m, max(value, ordered[-1][1]) if ordered else value))
        return cls(tuple(ordered))

    @classmethod
    def total(cls, curves: Iterable["Curve"]) -> "Curve":
        """The sum of curves (exact: piecewise linear on the union of their points)."""
        items = [c for c in curves if c.points]
        sizes = sorted({m for c in items for m, _ in c.points})
        if len(sizes) == 1 and all(len(c.points) == 1 for c in items):
            return cls(((sizes[0], sum(c.points[0][1] for c in items)),))
        if len(sizes) == 1:  # lines and a point at one size: the lines have 2+ points
            sizes.append(sizes[0] + 1.0)
        return cls(tuple((m, sum(c.at(m) for c in items)) for m in sizes))

    def scaled(self, factor: float) -> "Curve":
        return Curve(tuple((m, v * factor) for m, v in self.points))

    def is_finite(self) -> bool:
        return all(math.isfinite(m) and math.isfinite(v) for m, v in self.points)


ZERO = Curve(())


@dataclass(frozen=True)
class NodeCost:
    """One node's costs: seconds forward and backward, bytes saved for backward; and what priced
    it ("onnxruntime", "torch", "analytic", or "none" for nodes with nothing to run)."""

    forward: Curve
    backward: Curve
    saved: Curve
    method: str


NO_COST = NodeCost(ZERO, ZERO, ZERO, "none")


@dataclass(frozen=True)
class SavedActivations:
    """Saved-for-backward bytes measured on meta (partc.cost.activations.saved_activations): per
    node, the bytes it saves as a `Linear` of the micro-batch size, and the nodes that keep their
    own result (`CostTable.keeps_result`)."""

    bytes: dict[str, Linear]
    keeps_result: frozenset[str]


@dataclass(frozen=True)
class CostSource:
    """Where a CostTable's numbers come from: recorded in every profile file."""

    kind: str  # "measured" | "analytic"
    device: str  # device name: "cpu", "cuda:0 (NVIDIA H100 80GB HBM3)", "a100-80gb", ...
    device_kind: str  # "cpu" | "cuda"
    provider: str  # onnxruntime execution provider ("" for analytic)
    threads: int  # intra-op threads the measurement used (0: not applicable)
    graph_hash: str
    model: str
    batch_sizes: tuple[int, ...]  # micro-batch sizes measured (or evaluated, for analytic)
    versions: dict[str, str] = field(default_factory=dict)  # torch, onnxruntime, onnx, partc
    calibration: dict[str, Any] = field(default_factory=dict)  # scales, ratios, validation
    # the training precision measured under (partc.options.PRECISIONS); profiles written before
    # the key existed were fp32
    precision: str = "fp32"


@dataclass
class CostTable:
    """Per-node costs of an OpGraph on one device (see module docstring)."""

    graph: OpGraph
    source: CostSource
    nodes: dict[str, NodeCost]
    # the loss function on the model's outputs, per micro-batch: forward, backward (into the
    # outputs' gradients) and what it keeps for its backward; the last stage runs it
    loss: NodeCost = NO_COST
    # autocast's replay per precision (partc.cost.autocast), computed once
    _autocast: dict[str, AutocastDtypes] = field(default_factory=dict, repr=False, compare=False)
    # bytes of a batch of m samples as the model file's batches() yields it, inputs and target
    # (measured; the analytic table knows the graph inputs only): the data a CPU rank that draws
    # it holds in its own memory
    batch_bytes: Curve = ZERO
    # the most one matrix-multiply call of the model allocates and frees again (kernel scratch:
    # CPU bf16 GEMMs pack blocks of their operands), at any measured size and one intra-op
    # thread; measured (partc.cost.activations.gemm_scratch_bytes), 0 in an analytic table
    gemm_scratch_bytes: int = 0
    # the SIMD register width (bytes) of the CPU the table prices, which its kernels block
    # tensors by (DeviceSpec.vector_bytes; measured: this machine's); 0: not recorded (a GPU's
    # table, an older profile), read as DEFAULT_CPU_VECTOR_BYTES
    cpu_vector_bytes: int = 0
    # the nodes among whose saved bytes is their own result's storage (a ReLU's output, a fused
    # attention's): a tensor's storage is counted on its producer there, not on a later node
    # that saves it too (partc.cost.activations); None in profiles from before it was recorded,
    # where the memory model goes by operator kind
    keeps_result: frozenset[str] | None = None
    # how the priced times moved from step to step where they were measured, as (probability,
    # factor) modes of each stage's priced (median) time: a launched run's spread, set by
    # `partc compile --calibrate-from` (partc.plans.recalibrate) and priced by the solver in
    # place of the device config's; (): none (every profile and roofline table)
    speed_modes: tuple[tuple[float, float], ...] = ()
    # the launched runs' optimizer step over its price (compile --calibrate-from), which the
    # solver multiplies every parameter's step by; 1: not calibrated
    optimizer_factor: float = 1.0

    # ---- per node ------------------------------------------------------------------------------
    def cost(self, node: str) -> NodeCost:
        return self.nodes.get(node, NO_COST)

    def forward_s(self, node: str, m: float) -> float:
        return self.cost(node).forward.at(m)

    def backward_s(self, node: str, m: float) -> float:
        return self.cost(node).backward.at(m)

    def saved_bytes(self, node: str, m: float) -> float:
        return self.cost(node).saved.at(m)

    # ---- sums over node sets (stages, blocks) --------------------------------------------------
    def sum_forward_s(self, nodes: Iterable[str], m: float) -> float:
        return sum(self.forward_s(n, m) for n in nodes)

    def sum_backward_s(self, nodes: Iterable[str], m: float) -> float:
        return sum(self.backward_s(n, m) for n in nodes)

    def sum_saved_bytes(self, nodes: Iterable[str], m: float) -> float:
        return sum(self.saved_bytes(n, m) for n in nodes)

    def param_bytes(self, nodes: Iterable[str], trainable_only: bool = False) -> int:
        """Bytes of the distinct parameters (kind 'parameter') the nodes use; tied ones once."""
        seen: dict[str, int] = {}
        for n in nodes:
            for name in held_params(self.graph.node(n)):
                p = self.graph.param(name)
                if p.kind == "parameter" and (p.trainable or not trainable_only):
                    seen[p.name] = p.nbytes
        return sum(seen.values())

    def buffer_bytes(self, nodes: Iterable[str]) -> int:
        """Bytes of the distinct buffers and constants the nodes use."""
        seen: dict[str, int] = {}
        for n in nodes:
            for name in held_params(self.graph.node(n)):
                p = self.graph.param(name)
                if p.kind != "parameter":
                    seen[p.name] = p.nbytes
        return sum(seen.values())

    def runtime_dtype(self, tensor: str, precision: Precision) -> str:
        """The dtype `tensor` has when the graph runs under `precision` (autocast's rules,
        partc.cost.autocast): a bf16-mixed residual stream stays float32, a projection's output
        is bfloat16."""
        return self.autocast(precision).tensors.get(tensor, self.graph.tensor(tensor).dtype)

    def autocast(self, precision: Precision) -> AutocastDtypes:
        """autocast's rules replayed over the graph for `precision`: every tensor's dtype and
        every node's compute dtype (partc.cost.autocast.autocast_dtypes), computed once."""
        if precision not in self._autocast:
            self._autocast[precision] = autocast_dtypes(self.graph, precision,
                                                        self.source.device_kind)
        return self._autocast[precision]

    def runtime_bytes(self, tensor: str, m: float, precision: Precision) -> float:
        """`tensor_bytes` in the dtype the tensor has under `precision` (`runtime_dtype`)."""
        nbytes = self.tensor_bytes(tensor, m)
        captured = self.graph.tensor(tensor).dtype
        runtime = self.runtime_dtype(tensor, precision)
        return nbytes if runtime == captured else nbytes / dtype_bytes(captured) * \
            dtype_bytes(runtime)

    def tensor_bytes(self, tensor: str, m: float) -> float:
        """Size of a tensor (a node output or graph input) at micro-batch m: what a stage boundary
        carrying it sends per micro-batch."""
        spec = self.graph.tensor(tensor)
        if spec.batch_dim is None:
            return float(spec.nbytes)
        return spec.nbytes * m / self.graph.batch_size

    def total_forward_s(self, m: float) -> float:
        return self.sum_forward_s(self.nodes, m)

    def total_backward_s(self, m: float) -> float:
        return self.sum_backward_s(self.nodes, m)

    def total_saved_bytes(self, m: float) -> float:
        return self.sum_saved_bytes(self.nodes, m)

    def methods(self) -> dict[str, int]:
        """How many nodes each method priced."""
        counts: dict[str, int] = {}
        for c in self.nodes.values():
            counts[c.method] = counts.get(c.method, 0) + 1
        return dict(sorted(counts.items()))

    def scaled_at(self, batch_size: int, forward: float, backward: float) -> "CostTable":
        """This measured table with every node's forward and backward at `batch_size` (one of its
        sizes) multiplied by `forward` and `backward`: its whole-model totals timed again
        (partc.cost.measured.extend_profile), the nodes' shares kept. The calibration records
        the new totals and the factors."""
        if batch_size not in self.source.batch_sizes:
            raise ValueError(f"batch size {batch_size} is not one of {self.source.batch_sizes}")

        def point(curve: Curve, factor: float) -> Curve:
            return Curve.through([(m, v * factor if m == batch_size else v)
                                  for m, v in curve.points])

        nodes = {n: replace(c, forward=point(c.forward, forward),
                            backward=point(c.backward, backward))
                 for n, c in self.nodes.items()}
        measured = dict(self.source.calibration.get("measured", {}))
        row = dict(measured.get(str(batch_size), {}))
        for key, factor in (("torch_forward_s", forward), ("torch_backward_s", backward)):
            if isinstance(row.get(key), (int, float)):
                row[key] = float(f"{row[key] * factor:.6g}")
        row["retimed"] = {"forward_scale": float(f"{forward:.6g}"),
                          "backward_scale": float(f"{backward:.6g}")}
        measured[str(batch_size)] = row
        source = replace(self.source,
                         calibration={**self.source.calibration, "measured": measured})
        return replace(self, source=source, nodes=nodes)

    def merged(self, other: "CostTable") -> "CostTable":
        """This measured table and `other` (the same graph, device and conditions, at other batch
        sizes) as one: every cost through the points of both, the sizes and the per-size
        measurements of both."""
        if other.graph.content_hash() != self.graph.content_hash():
            raise ValueError("cannot merge the costs of two different graphs")
        sizes = tuple(sorted(set(self.source.batch_sizes) | set(other.source.batch_sizes)))

        def union(a: NodeCost, b: NodeCost) -> NodeCost:
            def curve(x: Curve, y: Curve) -> Curve:
                points = dict(x.points)
                points.update(y.points)  # a size measured in both: the newer measurement
                return Curve.through(sorted(points.items()))
            method = a.method if a.method != "none" else b.method
            return NodeCost(curve(a.forward, b.forward), curve(a.backward, b.backward),
                            curve(a.saved, b.saved), method)

        calibration = {**self.source.calibration, **other.source.calibration,
                       "measured": {**self.source.calibration.get("measured", {}),
                                    **other.source.calibration.get("measured", {})}}
        source = replace(self.source, batch_sizes=sizes, calibration=calibration)
        names = sorted(set(self.nodes) | set(other.nodes))
        batch = dict(self.batch_bytes.points)
        batch.update(other.batch_bytes.points)
        return CostTable(graph=self.graph, source=source,
                         nodes={n: union(self.cost(n), other.cost(n)) for n in names},
                         loss=union(self.loss, other.loss),
                         batch_bytes=Curve.through(sorted(batch.items())),
                         gemm_scratch_bytes=max(self.gemm_scratch_bytes,
                                                other.gemm_scratch_bytes),
                         cpu_vector_bytes=self.cpu_vector_bytes or other.cpu_vector_bytes,
                         speed_modes=self.speed_modes or other.speed_modes,
                         optimizer_factor=self.optimizer_factor
                         if self.optimizer_factor != 1.0 else other.optimizer_factor,
                         keeps_result=other.keeps_result if self.keeps_result is None
                         else self.keeps_result if other.keeps_result is None
                         else self.keeps_result | other.keeps_result)

    # ---- files ---------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        src = asdict(self.source)
        src["batch_sizes"] = list(self.source.batch_sizes)
        # Every cost is written as its values at the profiled sizes (exact for a measured curve,
        # whose points they are, and for a line). Totals are summed from the rounded rows the file
        # holds, so a loaded profile saves back to the same bytes.
        sizes = self.source.batch_sizes
        written = CostTable(self.graph, self.source, {
            name: _at_sizes(c, sizes) for name, c in sorted(self.nodes.items())},  # file order
            loss=_at_sizes(self.loss, sizes), batch_bytes=self.batch_bytes,
            gemm_scratch_bytes=self.gemm_scratch_bytes, cpu_vector_bytes=self.cpu_vector_bytes)
        return {
            "format": PROFILE_FORMAT,
            "format_version": PROFILE_VERSION,
            **src,
            "methods": self.methods(),
            "totals_at_batch_sizes": {
                str(b): {"forward_s": _round(written.total_forward_s(b)),
                         "backward_s": _round(written.total_backward_s(b)),
                         "saved_bytes": int(written.total_saved_bytes(b))}
                for b in self.source.batch_sizes},
            "loss": _row(written.loss, sizes),
            "batch_bytes": [int(round(self.batch_bytes.at(b))) for b in sizes],
            "gemm_scratch_bytes": self.gemm_scratch_bytes,
            **({"cpu_vector_bytes": self.cpu_vector_bytes} if self.cpu_vector_bytes else {}),
            **({"speed_spread": [[p, f] for p, f in self.speed_modes]}
               if self.speed_modes else {}),
            **({"optimizer_factor": self.optimizer_factor}
               if self.optimizer_factor != 1.0 else {}),
            **({} if self.keeps_result is None
               else {"keeps_result": sorted(self.keeps_result)}),
            "nodes": {name: _row(c, sizes) for name, c in written.nodes.items()},
        }

    def save(self, path: str | Path) -> Path:
        """Write the table as a profile YAML (`dumps`)."""
        return write_atomic(Path(path), self.dumps())

    def dumps(self) -> str:
        """The profile YAML `save` writes (nodes one per line: method, then forward seconds,
        backward seconds and saved bytes at each of `batch_sizes`): for callers that need the
        bytes themselves (a profile written into a plan directory with the stage files)."""
        d = self.to_dict()
        nodes = d.pop("nodes")
        header = ("# partc profile: per-node costs of one model on one device.\n"
                  "# nodes (and loss, the loss function's): name: [method, [forward s], "
                  "[backward s], [saved bytes]], each at batch_sizes; a cost between and beyond\n"
                  "# them is piecewise linear (docs/cost-model.md)\n")
        body = yaml.safe_dump(d, sort_keys=True, default_flow_style=False, width=100)
        lines = [header, body, "nodes:\n"]
        for name, row in nodes.items():
            # JSON is YAML's flow syntax: one quoted name and one list per line.
            lines.append(f"  {json.dumps(name)}: {json.dumps(row)}\n")
        if not nodes:
            lines[-1] = "nodes: {}\n"
        return "".join(lines)

    @classmethod
    def load(cls, path: str | Path, graph: OpGraph, precision: str | None = None) -> "CostTable":
        """Read a profile for `graph`; refuse one taken on a different model (graph hash) and,
        when `precision` is given, one priced at another precision."""
        path = Path(path)
        try:
            d = load_yaml(path.read_text(), fast=True)
        except FileNotFoundError:
            raise ProfileFileError(
                f"profile not found: {path}",
                hint="create one with: partc profile MODEL -o profile.yaml") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ProfileFileError(f"cannot read profile {path}: {str(exc).splitlines()[0]}",
                                   hint="re-create it with partc profile") from exc
        except yaml.YAMLError as exc:
            raise ProfileFileError(f"cannot read profile {path}: not valid YAML "
                                   f"{yaml_problem(exc)}",
                                   hint="re-create it with partc profile") from exc
        if not isinstance(d, dict) or d.get("format") != PROFILE_FORMAT:
            raise ProfileFileError(f"{path} is not a partc profile",
                                   hint="pass a file written by partc profile")
        if d.get("format_version") != PROFILE_VERSION:
            raise ProfileFileError(
                f"{path} has profile format_version {d.get('format_version')!r}; this partc reads "
                f"{PROFILE_VERSION}", hint="re-create it with this partc version (partc profile)")
        if d.get("graph_hash") != graph.content_hash():
            raise ProfileFileError(
                f"profile {path} was taken on a different model "
                f"(graph hash {str(d.get('graph_hash'))[:19]}, "
                f"this model has {graph.content_hash()[:19]})",
                hint="the model changed since profiling: re-run partc profile on it")
        try:
            source = CostSource(
                kind=str(d["kind"]), device=str(d["device"]), device_kind=str(d["device_kind"]),
                provider=str(d["provider"]), threads=int(d["threads"]),
                graph_hash=str(d["graph_hash"]), model=str(d["model"]),
                batch_sizes=tuple(int(b) for b in d["batch_sizes"]),
                versions=dict(d.get("versions") or {}),
                calibration=dict(d.get("calibration") or {}),
                precision=str(d.get("precision", "fp32")))
            sizes = source.batch_sizes
            if len(sizes) < 2 or len(set(sizes)) != len(sizes):
                raise ValueError(f"batch_sizes must be two or more distinct sizes, got {sizes}")
            nodes = {str(name): _cost(row, sizes)
                     for name, row in (d.get("nodes") or {}).items()}
            loss = _cost(d["loss"], sizes)
            batch = [int(x) for x in d["batch_bytes"]]
            if len(batch) != len(sizes) or min(batch) < 0:
                raise ValueError(f"batch_bytes must be {len(sizes)} sizes >= 0, got {batch}")
            batch_bytes = Curve.through(list(zip(sizes, batch, strict=True)))
            scratch = int(d.get("gemm_scratch_bytes", 0))  # absent in older profiles
            if scratch < 0:
                raise ValueError(f"gemm_scratch_bytes must be >= 0, got {scratch}")
            vector = d.get("cpu_vector_bytes", 0)  # absent in older profiles
            if (problem := vector_bytes_problem(vector)) is not None:
                raise ValueError(f"cpu_vector_bytes {problem}")
            spread = d.get("speed_spread")  # a run's (absent: none)
            if spread is not None and (problem := speed_modes_problem(spread,
                                                                      mean_one=False)):
                raise ValueError(f"speed_spread {problem}")
            optimizer = d.get("optimizer_factor", 1.0)  # a run's (absent: 1)
            if isinstance(optimizer, bool) or not isinstance(optimizer, (int, float)) or \
                    not (math.isfinite(optimizer) and optimizer > 0):
                raise ValueError(f"optimizer_factor must be a number > 0, got {optimizer!r}")
            keepers = d.get("keeps_result")  # absent in older profiles
            if keepers is not None and (not isinstance(keepers, list)
                                        or not all(isinstance(k, str) for k in keepers)):
                raise ValueError(f"keeps_result must be a list of node names, got {keepers!r}")
        # AttributeError: a key of the wrong type (`nodes: [...]`)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ProfileFileError(f"malformed profile {path}: {exc!r}",
                                   hint="re-create it with partc profile") from exc
        if precision is not None and source.precision != precision:
            raise ProfileFileError(
                f"profile {path} was taken at precision {source.precision}, not {precision}",
                hint=f"profile again with --precision {precision}")
        unknown = sorted((set(nodes) | set(keepers or ())) - {n.name for n in graph.nodes})
        if unknown:
            raise ProfileFileError(f"profile {path} prices nodes the model does not have: "
                                   f"{', '.join(unknown[:3])}",
                                   hint="re-create it with partc profile")
        return cls(graph=graph, source=source, nodes=nodes, loss=loss, batch_bytes=batch_bytes,
                   gemm_scratch_bytes=scratch, cpu_vector_bytes=int(vector),
                   keeps_result=None if keepers is None else frozenset(keepers),
                   speed_modes=tuple((float(p), float(f)) for p, f in spread or ()),
                   optimizer_factor=float(optimizer))


def _row(c: NodeCost, sizes: Sequence[int]) -> list[Any]:
    """A cost as one row of a profile file: its values at the profiled sizes."""
    return [c.method, *([curve.at(b) for b in sizes] for curve in (c.forward, c.backward,
                                                                   c.saved))]


# Per column (forward s, backward s, saved bytes), what no operator's cost reaches: far above
# what a device config partc accepts can price (1 B/s moving 1 EiB: 1e18 s), far below where a
# plan's sums overflow. A profile pricing a node at 1e300 s compiled a plan predicting 1e300 s
# per iteration, which every command then refused to load.
_MOST = (1e30, 1e30, 1e30)


def _cost(row: Any, sizes: Sequence[int]) -> NodeCost:
    """A profile file's row as a cost (TypeError/ValueError for a malformed one)."""
    method, *columns = row
    if len(columns) != 3:
        raise ValueError(f"a row holds a method and 3 lists, got {row!r}")
    curves = []
    for values, most in zip(columns, _MOST, strict=True):
        if not isinstance(values, list) or len(values) != len(sizes):
            raise ValueError(f"expected {len(sizes)} values (one per batch size) in {row!r}")
        floats = [float(x) for x in values]
        if not all(math.isfinite(x) and x >= 0 for x in floats):
            raise ValueError(f"negative or non-finite cost in {row!r}")
        if max(floats, default=0.0) >= most:
            raise ValueError(f"a cost beyond any measurement's ({most:g} or more) in {row!r}")
        curves.append(Curve.through(list(zip(sizes, floats, strict=True))))
    return NodeCost(curves[0], curves[1], curves[2], str(method))


def _at_sizes(c: NodeCost, sizes: Sequence[int]) -> NodeCost:
    """The cost as the file keeps it: through its rounded values at the profiled sizes."""
    def curve(x: Curve) -> Curve:
        return Curve.through([(b, _round(x.at(b))) for b in sizes])
    return NodeCost(curve(c.forward), curve(c.backward), curve(c.saved), c.method)


def _round(x: float) -> float:
    """12 significant digits: stable text without losing anything a timer can tell."""
    return float(f"{x:.12g}")






def needs_backward(graph: OpGraph) -> set[str]:
    """Nodes autograd will run backward for: those with an input that requires grad (a trainable
    parameter, or a floating tensor downstream of one). Graph inputs do not require grad."""
    return _requires_grad(graph)[0]


def requires_grad_tensors(graph: OpGraph) -> set[str]:
    """The tensors (node outputs) that require grad: floating outputs of `needs_backward`
    nodes."""
    return _requires_grad(graph)[1]


def _requires_grad(graph: OpGraph) -> tuple[set[str], set[str]]:
    requires: set[str] = set()  # tensor names
    result: set[str] = set()
    for n in graph.nodes:
        trainable = any(graph.param(p).trainable for p in n.params)
        if trainable or any(t in requires for t in n.inputs):
            result.add(n.name)
            for t in n.outputs:
                if t.dtype not in INTEGER_DTYPES:
                    requires.add(t.name)
    return result, requires


def format_cost_summary(table: CostTable, top: int = 8) -> str:
    """A terminal summary: totals per batch size, methods, and the most expensive op kinds."""
    from partc.graph.module_summary import human_bytes

    src = table.source
    lines = [f"{src.kind} costs of {src.model} on {src.device}"
             + f", {src.precision}"
             + (f" [{src.provider}, {src.threads} thread(s)]" if src.provider else ""),
             f"graph hash: {src.graph_hash}",
             "priced by: " + ", ".join(f"{k} {v}" for k, v in table.methods().items())]
    lines.append(f"{'micro-batch':>11}  {'forward':>10}  {'backward':>10}  {'saved for bwd':>13}")
    for b in src.batch_sizes:
        lines.append(f"{b:>11}  {_ms(table.total_forward_s(b)):>10}  "
                     f"{_ms(table.total_backward_s(b)):>10}  "
                     f"{human_bytes(int(table.total_saved_bytes(b))):>13}")
    b = src.batch_sizes[-1]
    by_kind: dict[str, float] = {}
    for node in table.graph.nodes:
        by_kind[node.kind] = by_kind.get(node.kind, 0.0) + (
            table.forward_s(node.name, b) + table.backward_s(node.name, b))
    total = sum(by_kind.values()) or 1.0
    ranked = sorted(by_kind.items(), key=lambda kv: (-kv[1], kv[0]))[:top]
    lines.append(f"fwd+bwd by op kind at micro-batch {b}: " + ", ".join(
        f"{k} {100 * v / total:.0f}%" for k, v in ranked if v > 0))
    if table.loss.method != "none":
        lines.append(f"loss function at micro-batch {b} (on the last stage): forward "
                     f"{_ms(table.loss.forward.at(b))}, backward {_ms(table.loss.backward.at(b))}, "
                     f"keeps {human_bytes(int(table.loss.saved.at(b)))} for its backward")
    probe = probe_from(src.calibration.get(PROBE))
    if probe is not None:
        lines.append(f"machine speed while the totals were timed: a "
                     f"{'x'.join(map(str, probe.kernel))} {probe.dtype} matmul took "
                     f"{_ms(probe.median_s)} (median of {probe.rounds} rounds; a config "
                     f"calibrated here scales the profile to its mean speed by it)")
    measured = src.calibration.get("measured") or {}
    for size, m in sorted(measured.items(), key=lambda kv: int(kv[0])):
        if m.get("ort_forward_s") is not None:
            lines.append(f"batch {size}: torch fwd {_ms(m['torch_forward_s'])}, bwd "
                         f"{_ms(m['torch_backward_s'])}; onnxruntime fwd {_ms(m['ort_forward_s'])}")
    return "\n".join(lines)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


def relative_error(predicted: float, measured: float) -> float:
    """(predicted - measured) / measured; inf when nothing was measured."""
    return (predicted - measured) / measured if measured else math.inf
