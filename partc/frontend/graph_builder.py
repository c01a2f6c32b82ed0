"""Build the OpGraph from a Capture (and, when there is one, its ONNX export).

The FX graph of the captured ExportedProgram is the source of truth:
- shapes and dtypes come from each node's `meta['val']` (fake tensors, so meta models work);
- FLOPs come from torch.utils.flop_counter: each node's operator is re-run on its fake inputs under
  FlopCounterMode (plus the formulas in partc.frontend.flop_count), so composite ops (linear,
  scaled_dot_product_attention, conv2d) are counted by torch's own formulas for the kernels they
  dispatch to, not by hand-written ones;
- batch dimensions and FLOPs-per-sample come from comparing with the capture at twice the batch;
- parameters keep their original FQNs, tied ones merged into one Param with aliases;
- module paths come from `nn_module_stack`.
"""
from __future__ import annotations

import contextlib
import operator
import re
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch
import torch.fx
from torch._guards import detect_fake_mode
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind

from partc.frontend.export import Capture, dtype_name, output_paths, quiet_torch
from partc.frontend.flop_count import flop_counter_mode
from partc.frontend.model_file import ModelFile
from partc.graph.opgraph import GraphOutput, OnnxInfo, OpGraph, OpNode, Param, TensorSpec
from partc.progress import Progress

if TYPE_CHECKING:  # the runtime imports this module (dtype_name): onnx stays out of its ranks
    from partc.frontend.onnx_export import OnnxExport

# Ops that read only the rows they return from their (parameter) table, not the whole table.
GATHER_KINDS = frozenset({"embedding", "embedding_bag", "_embedding_bag", "index_select", "gather",
                          "index", "take"})

_PARAM_KINDS = {
    InputKind.PARAMETER: "parameter",
    InputKind.BUFFER: "buffer",
    InputKind.CONSTANT_TENSOR: "constant",
}


def _tensor_leaves(value: Any) -> list[torch.Tensor | None] | None:
    """A node value's tensors: [t] for a tensor, per-element for a flat tuple/list (None where an
    element is not a tensor), None when the value holds no tensor at all."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in value):
        return [v if isinstance(v, torch.Tensor) else None for v in value]
    return None


def op_kind(target: Any) -> str:
    """Short operator kind: the overload packet name for aten ops ('linear'), else the name."""
    if isinstance(target, torch._ops.OpOverload):
        return target.overloadpacket.__name__
    if isinstance(target, torch._ops.HigherOrderOperator):
        return target.name()
    return getattr(target, "__name__", str(target))


def is_view_op(target: Any) -> bool:
    """True when the op's result aliases its input without writing (view, reshape-as-view,
    transpose, expand, ...): such ops move no bytes."""
    if not isinstance(target, torch._ops.OpOverload):
        return False
    returns = target._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write
                                 for r in returns)


def count_flops(exported: ExportedProgram) -> tuple[dict[str, int], list[str]]:
    """FLOPs of every call_function node, by re-running its op on fake inputs under
    FlopCounterMode. Returns (flops by node name, names of nodes that could not be run)."""
    graph_module = exported.graph_module
    vals = [n.meta.get("val") for n in exported.graph.nodes if n.op == "placeholder"]
    fake_mode = detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
    flops: dict[str, int] = {}
    failed: list[str] = []

    def value(n: torch.fx.Node) -> Any:
        if n.op == "get_attr":
            return getattr(graph_module, str(n.target))
        return n.meta.get("val")

    with quiet_torch():
        for node in exported.graph.nodes:
            if node.op != "call_function" or node.target is operator.getitem:
                continue
            args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), value)
            mutable = isinstance(node.target, torch._ops.OpOverload) \
                and node.target._schema.is_mutable
            try:
                with fake_mode if fake_mode is not None else contextlib.nullcontext():
                    if mutable:
                        # In-place ops would write into the graph's own meta values.
                        args, kwargs = torch.utils._pytree.tree_map_only(
                            torch.Tensor, lambda t: t.clone(), (args, kwargs))
                    with flop_counter_mode() as counter:
                        node.target(*args, **kwargs)
                flops[node.name] = int(counter.get_total_flops())
            except Exception:  # an op that cannot re-run on fake inputs: priced by time alone later
                flops[node.name] = 0
                failed.append(node.name)
    return flops, failed


def _shapes(exported: ExportedProgram) -> dict[str, tuple[str, list[tuple[int, ...] | None]]]:
    """name -> (target, shapes of its tensor leaves) for every node, to compare two captures."""
    out: dict[str, tuple[str, list[tuple[int, ...] | None]]] = {}
    for n in exported.graph.nodes:
        leaves = _tensor_leaves(n.meta.get("val"))
        if leaves is not None:
            out[n.name] = (str(n.target), [tuple(int(d) for d in t.shape) if t is not None else None
                                           for t in leaves])
    return out


@dataclass
class _BatchDims:
    """Finds the batch dimension of each tensor by comparing the two captures."""

    batch: int
    scaled_batch: int
    scaled: dict[str, tuple[str, list[tuple[int, ...] | None]]] | None
    guessed: list[str] = field(default_factory=list)
    irregular: list[str] = field(default_factory=list)

    def find(self, node: torch.fx.Node, index: int, shape: tuple[int, ...]) -> int | None:
        if self.scaled is not None:
            entry = self.scaled.get(node.name)
            if entry is not None and entry[0] == str(node.target) and index < len(entry[1]):
                other = entry[1][index]
                if other is not None and len(other) == len(shape):
                    changed = [d for d, (a, b) in enumerate(zip(shape, other, strict=True))
                               if a != b]
                    if not changed:
                        return None
                    if len(changed) > 1 or \
                            other[changed[0]] * self.batch != shape[changed[0]] * self.scaled_batch:
                        self.irregular.append(node.name)
                    return changed[0]
        # No counterpart in the second capture: assume the batch is the leading dimension when it
        # has the batch size (the common layout) and note that this was a guess.
        self.guessed.append(node.name)
        return 0 if shape and shape[0] == self.batch else None


def _qualified(cls: Any) -> str:
    return cls if isinstance(cls, str) else f"{cls.__module__}.{cls.__qualname__}"


def _module_stack(node: torch.fx.Node, model_file: ModelFile) -> list[tuple[str, str]]:
    """(module path, class name) from the root module down to the innermost one calling `node`."""
    stack = node.meta.get("nn_module_stack") or {}
    return [(str(path), model_file.display_class(_qualified(cls))) for path, cls in stack.values()]


def build_opgraph(capture: Capture, onnx_export: OnnxExport | None = None,
                  progress: Progress | None = None) -> OpGraph:
    """The OpGraph of a capture; `onnx_export` adds the ONNX node mapping when the export worked."""
    progress = progress or Progress()
    with progress.step("building the OpGraph (shapes, FLOPs, parameters)"):
        return _build(capture, onnx_export)


@dataclass
class _Placeholders:
    """What the program's placeholders are: parameters (tied ones merged) and user inputs."""

    param_of: dict[str, str]  # placeholder name -> canonical parameter FQN
    params: list[Param]
    inputs: list[TensorSpec]


def _placeholders(capture: Capture, dims: _BatchDims) -> _Placeholders:
    ep = capture.exported
    found = _Placeholders(param_of={}, params=[], inputs=[])
    seen_params: dict[str, str] = {}  # any FQN -> canonical FQN, to merge tied placeholders
    for spec, node in zip(ep.graph_signature.input_specs,
                          (n for n in ep.graph.nodes if n.op == "placeholder"), strict=True):
        val = node.meta.get("val")
        if spec.kind in _PARAM_KINDS and isinstance(val, torch.Tensor):
            fqn = str(spec.target)
            group = capture.tied.get(fqn, (fqn,))
            canonical = next((seen_params[g] for g in group if g in seen_params), None)
            if canonical is None:
                canonical = fqn
                kind = _PARAM_KINDS[spec.kind]
                found.params.append(Param(
                    name=fqn, shape=tuple(int(d) for d in val.shape), dtype=dtype_name(val.dtype),
                    kind=kind,
                    trainable=kind == "parameter" and capture.trainable.get(fqn, True),
                    aliases=tuple(sorted(g for g in group if g != fqn))))
                for g in group:
                    seen_params[g] = fqn
            found.param_of[node.name] = canonical
        elif spec.kind == InputKind.USER_INPUT and isinstance(val, torch.Tensor):
            shape = tuple(int(d) for d in val.shape)
            found.inputs.append(TensorSpec(name=node.name, shape=shape, dtype=dtype_name(val.dtype),
                                           batch_dim=dims.find(node, 0, shape)))
    return found


def _onnx_by_fx(onnx_export: OnnxExport | None) -> dict[str, list[str]]:
    """FX node name -> the ONNX nodes exported from it."""
    by_fx: dict[str, list[str]] = {}
    if onnx_export is not None and onnx_export.model is not None:
        for onnx_node in onnx_export.model.graph.node:
            fx_name = onnx_export.node_to_fx.get(onnx_node.name)
            if fx_name is not None:
                by_fx.setdefault(fx_name, []).append(onnx_node.name)
    return by_fx


def _operands(node: torch.fx.Node, param_of: dict[str, str], input_names: set[str],
              outputs_of: dict[str, tuple[str, ...]]) -> tuple[list[str], list[str]]:
    """(tensor names, parameter FQNs) a node reads, each once, in argument order."""
    in_tensors: list[str] = []
    in_params: list[str] = []

    def collect(arg: torch.fx.Node) -> torch.fx.Node:
        if arg.name in param_of:
            if param_of[arg.name] not in in_params:
                in_params.append(param_of[arg.name])
        elif arg.name in input_names:
            if arg.name not in in_tensors:
                in_tensors.append(arg.name)
        else:
            for t in outputs_of.get(arg.name, ()):
                if t not in in_tensors:
                    in_tensors.append(t)
        return arg

    torch.fx.node.map_arg((node.args, node.kwargs), collect)
    return in_tensors, in_params


@dataclass
class _Nodes:
    """The OpGraph nodes of a program and what the output pass needs from building them."""

    nodes: list[OpNode]
    modules: dict[str, str]  # path -> class, in order of first use
    outputs_of: dict[str, tuple[str, ...]]  # FX node name -> tensor names it stands for
    specs: dict[str, TensorSpec]  # tensor name -> spec
    failed_flops: list[str]


def _nodes(capture: Capture, found: _Placeholders, dims: _BatchDims,
           onnx_export: OnnxExport | None) -> _Nodes:
    """One OpNode per call_function node (tuple getitems folded into their producer)."""
    ep = capture.exported
    batch = capture.batch_size
    param_nbytes = {p.name: p.nbytes for p in found.params}
    flops, failed = count_flops(ep)
    scaled_flops = count_flops(capture.scaled)[0] if capture.scaled is not None else {}
    onnx_by_fx = _onnx_by_fx(onnx_export)
    input_names = {t.name for t in found.inputs}
    out = _Nodes(nodes=[], modules={}, outputs_of={}, specs={t.name: t for t in found.inputs},
                 failed_flops=failed)
    owner: dict[str, str] = {}  # FX node name (incl. folded getitems) -> OpGraph node name
    model_file = capture.model_file
    for node in ep.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is operator.getitem:
            src, index = node.args
            if isinstance(src, torch.fx.Node) and src.name in owner and isinstance(index, int):
                name = f"{src.name}.{index}"
                if name in out.outputs_of.get(src.name, ()):
                    out.outputs_of[node.name] = (name,)
                    owner[node.name] = owner[src.name]
                    continue
            # a getitem that is not a plain tuple index becomes a node of its own (below)
        leaves = _tensor_leaves(node.meta.get("val"))
        outs: list[TensorSpec] = []
        if leaves is not None:
            single = isinstance(node.meta.get("val"), torch.Tensor)
            for i, t in enumerate(leaves):
                if t is None:
                    continue
                shape = tuple(int(d) for d in t.shape)
                outs.append(TensorSpec(name=node.name if single else f"{node.name}.{i}",
                                       shape=shape, dtype=dtype_name(t.dtype),
                                       batch_dim=dims.find(node, i, shape)))
        out.outputs_of[node.name] = tuple(t.name for t in outs)
        owner[node.name] = node.name
        for spec in outs:
            out.specs[spec.name] = spec
        in_tensors, in_params = _operands(node, found.param_of, input_names, out.outputs_of)
        view = is_view_op(node.target)
        param_bytes = sum(param_nbytes[p] for p in in_params)
        out_bytes = sum(t.nbytes for t in outs)
        if op_kind(node.target) in GATHER_KINDS:
            param_bytes = min(param_bytes, out_bytes)
        f1 = flops.get(node.name, 0)
        f2 = scaled_flops.get(node.name)
        if f2 is not None:
            per_sample = max(0, round((f2 - f1) / (capture.scaled_batch_size - batch)))
        else:
            per_sample = f1 // batch if any(t.batch_dim is not None for t in outs) else 0
        stack = _module_stack(node, model_file)
        for path, cls in stack:
            out.modules.setdefault(path, cls)
        module, module_type = stack[-1] if stack else ("", "")
        out.nodes.append(OpNode(
            name=node.name,
            target=str(node.target),
            kind=op_kind(node.target),
            module=module,
            module_type=module_type,
            inputs=tuple(in_tensors),
            params=tuple(in_params),
            outputs=tuple(outs),
            flops=f1,
            flops_per_sample=per_sample,
            bytes_read=0 if view else sum(out.specs[t].nbytes for t in in_tensors) + param_bytes,
            bytes_written=0 if view else out_bytes,
            is_view=view,
            onnx_nodes=tuple(onnx_by_fx.get(node.name, ())),
        ))

    # ONNX nodes of folded getitems belong to their producer.
    extra: dict[str, list[str]] = {}
    for fx_name, onnx_nodes in onnx_by_fx.items():
        target = owner.get(fx_name)
        if target is not None and target != fx_name:
            extra.setdefault(target, []).extend(onnx_nodes)
    if extra:
        out.nodes = [_with_onnx(n, extra[n.name]) if n.name in extra else n for n in out.nodes]

    # Containers never called themselves (ModuleList, ModuleDict) are not on any module stack.
    for path, mod in capture.model.named_modules():
        out.modules.setdefault(path, model_file.display_class(_qualified(type(mod))))
    return out


def _graph_outputs(ep: ExportedProgram, built: _Nodes) -> list[GraphOutput]:
    """The model's outputs: each tensor with its path in the output structure."""
    outputs: list[GraphOutput] = []
    user_specs = [s for s in ep.graph_signature.output_specs if s.kind == OutputKind.USER_OUTPUT]
    for path, spec in zip(output_paths(ep), user_specs, strict=True):
        name = spec.arg.name
        for t in built.outputs_of.get(name, ()) or ((name,) if name in built.specs else ()):
            outputs.append(GraphOutput(tensor=t, path=path))
    return outputs


# Operator namespaces of torch itself: their ops are in torch's FLOP registry or cost none.
_TORCH_NAMESPACES = frozenset({"aten", "prim", "prims", "quantized", "_quantized", "profiler",
                               "higher_order", "_c10d_functional", "c10d_functional"})
_OPERATOR = re.compile(r"(\w+)\.(\w+)\.\w+")


def _library_operator(target: str) -> str:
    """`ns::name` of an OpOverload target registered by a library (torch.library), '' for
    torch's own operators and for Python callables."""
    m = _OPERATOR.fullmatch(target)
    return f"{m.group(1)}::{m.group(2)}" if m and m.group(1) not in _TORCH_NAMESPACES else ""


def _build_notes(capture: Capture, found: _Placeholders, built: _Nodes,
                 dims: _BatchDims) -> list[str]:
    """Warnings about what the build could not establish (recorded in the OpGraph)."""
    notes: list[str] = []
    tensors = (*found.inputs, *(o for n in built.nodes for o in n.outputs))
    if capture.scaled is not None and not any(t.batch_dim is not None for t in tensors):
        notes.append("no tensor changes size with the batch: does example_inputs(batch_size) "
                     "use its batch_size argument?")
    failed = built.failed_flops
    if failed:
        notes.append(f"FLOPs not counted for {len(failed)} node(s) that cannot re-run on fake "
                     f"tensors: {', '.join(failed[:5])}")
    foreign = [op for op in map(_library_operator, (n.target for n in built.nodes if not n.flops
                                                    and n.name not in failed)) if op]
    if foreign:
        notes.append(f"FLOPs unknown for {len(foreign)} call(s) of operators from outside torch "
                     f"({', '.join(sorted(set(foreign))[:5])}): the analytic model prices them "
                     "by the bytes they move alone; a measured profile times them")
    if dims.guessed:
        notes.append(f"batch dimension guessed (no counterpart at batch "
                     f"{capture.scaled_batch_size}) for {len(dims.guessed)} tensor(s): "
                     f"{', '.join(sorted(set(dims.guessed))[:5])}")
    if dims.irregular:
        notes.append(f"{len(dims.irregular)} tensor(s) do not scale linearly with the batch: "
                     f"{', '.join(sorted(set(dims.irregular))[:5])}")
    return notes


def _onnx_info(onnx_export: OnnxExport | None) -> OnnxInfo:
    if onnx_export is None:
        return OnnxInfo(status="skipped")
    return OnnxInfo(status=onnx_export.status, error=onnx_export.error, opset=onnx_export.opset,
                    num_nodes=onnx_export.num_nodes, mapped_nodes=len(onnx_export.node_to_fx),
                    static_shape_outputs=onnx_export.static_shape_outputs,
                    num_outputs=onnx_export.num_outputs)


def _build(capture: Capture, onnx_export: OnnxExport | None) -> OpGraph:
    """Placeholders (parameters and inputs), then operator nodes, then outputs and notes."""
    dims = _BatchDims(batch=capture.batch_size, scaled_batch=capture.scaled_batch_size,
                      scaled=_shapes(capture.scaled) if capture.scaled is not None else None)
    found = _placeholders(capture, dims)
    built = _nodes(capture, found, dims, onnx_export)
    outputs = _graph_outputs(capture.exported, built)
    notes = _build_notes(capture, found, built, dims)
    return OpGraph(model_name=capture.model_file.name, batch_size=capture.batch_size,
                   on_meta=capture.on_meta, inputs=tuple(found.inputs), outputs=tuple(outputs),
                   params=tuple(found.params), nodes=tuple(built.nodes),
                   modules=tuple(built.modules.items()), onnx=_onnx_info(onnx_export),
                   notes=tuple(notes))


def _with_onnx(node: OpNode, more: list[str]) -> OpNode:
    return replace(node, onnx_nodes=tuple(node.onnx_nodes) + tuple(more))
