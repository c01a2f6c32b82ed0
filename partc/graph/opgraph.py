"""OpGraph: partc's graph IR, one node per operator of the exported program.

The OpGraph is built from the torch.export FX graph (see `partc.frontend.graph_builder`) and is the
input of the cost model and the solver, so it is plain data: dataclasses of ints, strings and tuples
that round-trip through JSON exactly. Everything batch-dependent is recorded at the captured batch
size together with how it scales, so later passes can price any micro-batch size without
re-capturing:

- a tensor's `batch_dim` is the dimension that grows with the batch (None: batch-independent, such
  as weights' derived values or position ids), so its size at batch b is `nbytes * b / batch_size`;
- a node's FLOPs are `flops + flops_per_sample * (b - batch_size)` (exact for ops whose cost is
  linear in the batch, which is every op whose inputs scale linearly; measured by counting FLOPs at
  two batch sizes, not assumed).
"""
from __future__ import annotations

import gzip
import hashlib
import json
import math
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any, Iterator

from partc.errors import GraphFileError
from partc.files import write_atomic

FORMAT_VERSION = 1

# Bytes per element of the dtypes torch.export can produce, by torch's own dtype names.
DTYPE_BYTES: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "uint16": 2, "uint32": 4,
    "uint64": 8, "bool": 1, "complex64": 8, "complex128": 16, "complex32": 4,
}
FLOATING_DTYPES = frozenset({"float64", "float32", "float16", "bfloat16", "float8_e4m3fn",
                             "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"})
INTEGER_DTYPES = frozenset({"int64", "int32", "int16", "int8", "uint8", "uint16", "uint32",
                            "uint64", "bool"})


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a torch dtype name such as 'float32'."""
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}") from None


class _Sized:
    """numel/nbytes of anything with a `shape` and a `dtype` name."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_bytes(self.dtype)


@dataclass(frozen=True)
class TensorSpec(_Sized):
    """A tensor value: shape and dtype at the captured batch size, and which dim is the batch."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    batch_dim: int | None = None

    def nbytes_at(self, batch: int, captured_batch: int) -> int:
        """Size in bytes when the model runs at `batch` instead of the captured batch size."""
        if self.batch_dim is None:
            return self.nbytes
        return self.nbytes * batch // captured_batch


@dataclass(frozen=True)
class Param(_Sized):
    """A parameter, buffer or lifted constant, under its original FQN.

    `aliases` lists the other FQNs of the same tensor (tied weights such as a language model's
    embedding and output projection); the tensor is one Param, counted once.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    kind: str  # "parameter" | "buffer" | "constant"
    trainable: bool
    aliases: tuple[str, ...] = ()


@dataclass(frozen=True)
class OpNode:
    """One operator (an FX call_function node of the exported program).

    `inputs` are tensor names (outputs of other nodes or graph inputs), `params` are Param names.
    Multi-output operators (split, batch_norm, ...) own one TensorSpec per result; FX's getitem
    nodes are folded into them. View/alias operators read and write no bytes (`is_view`).
    """

    name: str
    target: str  # e.g. "aten.linear.default"
    kind: str  # the overload packet, e.g. "linear", "scaled_dot_product_attention"
    module: str  # FQN of the innermost nn.Module that called it ("" = the root module)
    module_type: str  # that module's class, e.g. "torch.nn.modules.linear.Linear"
    inputs: tuple[str, ...]
    params: tuple[str, ...]
    outputs: tuple[TensorSpec, ...]
    flops: int
    flops_per_sample: int
    bytes_read: int
    bytes_written: int
    is_view: bool
    onnx_nodes: tuple[str, ...] = ()

    @property
    def batch_dependent(self) -> bool:
        return any(t.batch_dim is not None for t in self.outputs) or self.flops_per_sample > 0

    def flops_at(self, batch: int, captured_batch: int) -> int:
        return self.flops + self.flops_per_sample * (batch - captured_batch)


@dataclass(frozen=True)
class Edge:
    """A tensor flowing from the node (or graph input) `src` to the node `dst`."""

    src: str
    dst: str
    tensor: TensorSpec


@dataclass(frozen=True)
class GraphOutput:
    """A user-visible output: the tensor and its path in the model's output (e.g. "['logits']")."""

    tensor: str
    path: str


@dataclass(frozen=True)
class OnnxInfo:
    """How the ONNX export of the same program went, and where its nodes map in the OpGraph."""

    status: str  # "ok" | "failed" | "skipped"
    error: str = ""
    opset: int = 0
    num_nodes: int = 0
    mapped_nodes: int = 0  # ONNX nodes attributed to an OpGraph node
    static_shape_outputs: int = 0  # ONNX node outputs with a fully static inferred shape
    num_outputs: int = 0
    file: str = ""  # file name (relative to the OpGraph file's directory) when saved


@dataclass(frozen=True)
class OpGraph:
    """The whole operator graph of a model at one batch size. Nodes are in topological order."""

    model_name: str
    batch_size: int
    on_meta: bool
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[GraphOutput, ...]
    params: tuple[Param, ...]
    nodes: tuple[OpNode, ...]
    # (path, class) of every module seen in the graph, in order of first use; "" is the root.
    modules: tuple[tuple[str, str], ...] = ()
    onnx: OnnxInfo = field(default_factory=lambda: OnnxInfo(status="skipped"))
    notes: tuple[str, ...] = ()  # warnings from the build (unpriced FLOPs, unmatched shapes)

    # ---- lookups -----------------------------------------------------------------------------
    def node(self, name: str) -> OpNode:
        return self._node_index()[name]

    def module_type(self, path: str) -> str:
        """Class of the module at `path` ('' if the graph never entered it)."""
        return dict(self.modules).get(path, "")

    def param(self, name: str) -> Param:
        """A Param by its FQN or any alias of it."""
        return self._param_index()[name]

    def tensor(self, name: str) -> TensorSpec:
        return self._tensor_index()[name][1]

    def producer(self, tensor: str) -> str | None:
        """Name of the node producing `tensor`, or None for a graph input."""
        return self._tensor_index()[tensor][0]

    def _node_index(self) -> dict[str, OpNode]:
        idx = self.__dict__.get("_nodes_by_name")
        if idx is None:
            idx = {n.name: n for n in self.nodes}
            self.__dict__["_nodes_by_name"] = idx
        return idx

    def _param_index(self) -> dict[str, Param]:
        idx = self.__dict__.get("_params_by_name")
        if idx is None:
            idx = {}
            for p in self.params:
                for name in (p.name, *p.aliases):
                    idx[name] = p
            self.__dict__["_params_by_name"] = idx
        return idx

    def _tensor_index(self) -> dict[str, tuple[str | None, TensorSpec]]:
        idx = self.__dict__.get("_tensors_by_name")
        if idx is None:
            idx = {t.name: (None, t) for t in self.inputs}
            for n in self.nodes:
                for t in n.outputs:
                    idx[t.name] = (n.name, t)
            self.__dict__["_tensors_by_name"] = idx
        return idx

    # ---- derived views -----------------------------------------------------------------------
    def edges(self) -> Iterator[Edge]:
        """Every (producer, consumer, tensor) triple; graph inputs have src '<input>'."""
        index = self._tensor_index()
        for n in self.nodes:
            for t in n.inputs:
                src, spec = index[t]
                yield Edge(src=src if src is not None else "<input>", dst=n.name, tensor=spec)

    @property
    def total_flops(self) -> int:
        return sum(n.flops for n in self.nodes)

    @property
    def num_parameters(self) -> int:
        """Count of trainable-or-not parameter elements (kind 'parameter'), tied ones once."""
        return sum(p.numel for p in self.params if p.kind == "parameter")

    @property
    def parameter_bytes(self) -> int:
        return sum(p.nbytes for p in self.params if p.kind == "parameter")

    @property
    def tied_parameters(self) -> list[Param]:
        return [p for p in self.params if p.aliases]

    # ---- serialisation -----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["format_version"] = FORMAT_VERSION
        d["graph_hash"] = self.content_hash()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "OpGraph":
        if d.get("format_version") != FORMAT_VERSION:
            raise GraphFileError(
                f"unsupported OpGraph format_version {d.get('format_version')!r} "
                f"(this partc reads {FORMAT_VERSION})",
                hint="re-create the graph file with this partc version (partc inspect --save)")

        def spec(t: dict[str, Any]) -> TensorSpec:
            return TensorSpec(name=t["name"], shape=tuple(t["shape"]), dtype=t["dtype"],
                              batch_dim=t["batch_dim"])

        try:
            graph = cls(
                model_name=d["model_name"],
                batch_size=d["batch_size"],
                on_meta=d["on_meta"],
                inputs=tuple(spec(t) for t in d["inputs"]),
                outputs=tuple(GraphOutput(**o) for o in d["outputs"]),
                params=tuple(Param(name=p["name"], shape=tuple(p["shape"]), dtype=p["dtype"],
                                   kind=p["kind"], trainable=p["trainable"],
                                   aliases=tuple(p["aliases"])) for p in d["params"]),
                nodes=tuple(OpNode(
                    name=n["name"], target=n["target"], kind=n["kind"], module=n["module"],
                    module_type=n["module_type"], inputs=tuple(n["inputs"]),
                    params=tuple(n["params"]), outputs=tuple(spec(t) for t in n["outputs"]),
                    flops=n["flops"], flops_per_sample=n["flops_per_sample"],
                    bytes_read=n["bytes_read"], bytes_written=n["bytes_written"],
                    is_view=n["is_view"], onnx_nodes=tuple(n["onnx_nodes"])) for n in d["nodes"]),
                modules=tuple((m[0], m[1]) for m in d["modules"]),
                onnx=OnnxInfo(**d["onnx"]),
                notes=tuple(d["notes"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise GraphFileError(f"malformed OpGraph file: {exc!r}",
                                 hint="re-create it with partc inspect --save") from exc
        recorded = d.get("graph_hash")
        if recorded != graph.content_hash():
            raise GraphFileError(
                "OpGraph file content does not match its recorded graph_hash (edited or corrupted)",
                hint="re-create it with partc inspect --save")
        return graph

    def save(self, path: str | Path) -> Path:
        """Write as JSON (gzip-compressed when the name ends in .gz), sorted keys: byte-stable."""
        path = Path(path)
        text = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")) + "\n"
        if path.suffix == ".gz":
            # mtime=0: the same graph gives the same bytes.
            return write_atomic(path, gzip.compress(text.encode(), mtime=0))
        return write_atomic(path, text)

    @classmethod
    def load(cls, path: str | Path) -> "OpGraph":
        path = Path(path)
        try:
            raw = path.read_bytes()
            text = gzip.decompress(raw).decode() if raw[:2] == b"\x1f\x8b" else raw.decode()
            d = json.loads(text)
        except FileNotFoundError:
            raise GraphFileError(f"OpGraph file not found: {path}",
                                 hint="create one with partc inspect MODEL --save DIR") from None
        except RecursionError:
            raise GraphFileError(f"cannot read OpGraph file {path}: nested too deeply",
                                 hint="re-create it with partc inspect --save") from None
        except (OSError, UnicodeDecodeError, ValueError, EOFError) as exc:
            # ValueError: JSONDecodeError, and int()'s digit limit on a number of 4300+ digits
            raise GraphFileError(f"cannot read OpGraph file {path}: {str(exc).split(';')[0]}",
                                 hint="re-create it with partc inspect --save") from exc
        if not isinstance(d, dict):
            raise GraphFileError(f"{path} is not an OpGraph file", hint="pass a graph.json")
        return cls.from_dict(d)

    # ---- identity ----------------------------------------------------------------------------
    def content_hash(self) -> str:
        """sha256 of the model's structure: what changes when the model changes.

        It does not depend on the batch size the graph was captured at, so a profile or plan made
        from one capture matches the same model captured at another batch size: batch dimensions
        are written as multiples of the batch ("B*128"), FLOPs as their batch-independent part plus
        per-sample FLOPs, and bytes moved (derived from shapes) are left out. It also leaves out the
        ONNX mapping (it depends on exporter versions, not on the model), build notes, module class
        names (which depend on the name the model file was imported under), the model name and
        `on_meta` (the same model built on meta or on cpu has the same structure).
        """
        cached = self.__dict__.get("_hash")
        if cached is not None:
            return cached
        batch = self.batch_size

        def spec(t: TensorSpec) -> dict[str, Any]:
            return {"name": t.name, "shape": _batch_free_shape(t, batch), "dtype": t.dtype,
                    "batch_dim": t.batch_dim}

        def node(n: OpNode) -> dict[str, Any]:
            return {"name": n.name, "target": n.target, "kind": n.kind, "module": n.module,
                    "inputs": list(n.inputs), "params": list(n.params),
                    "outputs": [spec(t) for t in n.outputs], "is_view": n.is_view,
                    "flops_fixed": n.flops - n.flops_per_sample * batch,
                    "flops_per_sample": n.flops_per_sample}

        payload = {
            "inputs": [spec(t) for t in self.inputs],
            "outputs": [asdict(o) for o in self.outputs],
            "params": [asdict(p) for p in self.params],
            "nodes": [node(n) for n in self.nodes],
        }
        blob = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()
        digest = "sha256:" + hashlib.sha256(blob).hexdigest()
        self.__dict__["_hash"] = digest
        return digest

    def module_fingerprints(self) -> dict[str, str]:
        """Module path -> a short hash of the operators it calls itself (not its submodules'):
        targets, batch-free input/output shapes and dtypes, the parameters it reads (relative to
        the module) and per-sample FLOPs. Node names are left out, so adding an operator in one
        module changes that module's fingerprint only. `partc check` compares these to say which
        modules of a model changed since its plan was made."""
        batch = self.batch_size
        own: dict[str, list[Any]] = {}
        for n in self.nodes:
            prefix = f"{n.module}." if n.module else ""
            own.setdefault(n.module, []).append([
                n.target, [_batch_free_shape(self.tensor(t), batch) for t in n.inputs],
                [[_batch_free_shape(t, batch), t.dtype] for t in n.outputs],
                [p.removeprefix(prefix) for p in n.params],
                n.flops - n.flops_per_sample * batch, n.flops_per_sample])
        return {path: hashlib.sha256(json.dumps(ops, separators=(",", ":")).encode()
                                     ).hexdigest()[:12]
                for path, ops in sorted(own.items())}

    def parameter_signatures(self) -> dict[str, str]:
        """FQN -> "dtype[shape]" of every parameter and buffer (tied tensors under their first
        name), for explaining what changed between two captures of a model."""
        return {p.name: f"{p.dtype}{list(p.shape)}"
                for p in sorted(self.params, key=lambda p: p.name)
                if p.kind in ("parameter", "buffer")}


def _batch_free_shape(t: TensorSpec, batch: int) -> list[Any]:
    """The shape with the batch dimension written as a multiple of the batch ("B*128"), so that
    captures at different batch sizes agree."""
    shape: list[Any] = list(t.shape)
    if t.batch_dim is not None:
        shape[t.batch_dim] = f"B*{Fraction(t.shape[t.batch_dim], batch)}"
    return shape

