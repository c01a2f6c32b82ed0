"""ONNX export of the captured program, with every ONNX node mapped back to its FX node.

torch.onnx.export (dynamo) runs on the very ExportedProgram partc captured. It first decomposes
the program (batch_norm -> _native_batch_norm_legit_functional, reshape -> view, ...), which
renames and splits nodes, so the `pkg.torch.onnx.fx_node` metadata names nodes of the *decomposed*
program. partc follows each decomposed node's `from_node` provenance back to the node of the
captured program, which is the OpGraph node. The ONNX optimizer is off (`optimize=False`): it
cannot run on meta weights, and the nodes it creates carry no metadata; onnxruntime applies its own
graph optimisations at session time anyway.

The model is kept weightless: initializers become graph inputs with their shapes
(`keep_initializers_as_inputs=True`), which passes onnx.checker and shape inference, costs a few MB
even for billions of parameters, and lets the profiler feed random weights.
"""
from __future__ import annotations

import ast
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch.export import ExportedProgram

from partc.errors import summarize_exception
from partc.files import write_atomic
from partc.frontend.export import Capture, quiet_torch
from partc.progress import Progress

if TYPE_CHECKING:
    # Imported where a model is exported (`export_onnx`): onnx with ml_dtypes takes about 1.1 s
    # to import, which a compile, check or verify that never exports would pay.
    import onnx

_FX_NODE_NAME = re.compile(r"^%([^\s:]+)\s*:")
FX_NODE_KEY = "pkg.torch.onnx.fx_node"
NAME_SCOPES_KEY = "pkg.torch.onnx.name_scopes"


@dataclass
class OnnxExport:
    """Result of exporting a capture to ONNX: the weightless model and the node mapping."""

    status: str  # "ok" | "failed"
    error: str = ""
    model: onnx.ModelProto | None = None
    node_to_fx: dict[str, str] = field(default_factory=dict)  # ONNX node -> captured FX node
    opset: int = 0
    static_shape_outputs: int = 0
    num_outputs: int = 0

    @property
    def num_nodes(self) -> int:
        return len(self.model.graph.node) if self.model is not None else 0

    def save(self, path: str | Path) -> Path:
        """Write the weightless ONNX model (with inferred shapes) to `path`."""
        if self.model is None:
            raise ValueError("no ONNX model to save: the export failed")
        return write_atomic(path, self.model.SerializeToString())


def provenance_root(node: torch.fx.Node) -> str | None:
    """Name of the node of the originally captured program that `node` was derived from."""
    chain = node.meta.get("from_node")
    if not chain:
        return None
    source = chain[0]
    while source.from_node:
        source = source.from_node[0]
    return source.name


def name_scopes(node: onnx.NodeProto) -> list[str]:
    """Module path scopes of an ONNX node, from its `pkg.torch.onnx.name_scopes` metadata."""
    for prop in node.metadata_props:
        if prop.key == NAME_SCOPES_KEY:
            try:
                value = ast.literal_eval(prop.value)
            except (ValueError, SyntaxError):
                return []
            return [str(v) for v in value] if isinstance(value, list) else []
    return []


def map_onnx_nodes(model: onnx.ModelProto, decomposed: ExportedProgram,
                   captured: ExportedProgram) -> dict[str, str]:
    """ONNX node name -> name of the captured program's FX node it implements."""
    captured_names = {n.name for n in captured.graph.nodes if n.op == "call_function"}
    decomposed_nodes = {n.name: n for n in decomposed.graph.nodes}
    mapping: dict[str, str] = {}
    for node in model.graph.node:
        fx_text = next((p.value for p in node.metadata_props if p.key == FX_NODE_KEY), None)
        if fx_text is None:
            continue
        match = _FX_NODE_NAME.match(fx_text)
        if match is None:
            continue
        dnode = decomposed_nodes.get(match.group(1))
        if dnode is None:
            continue
        root = provenance_root(dnode)
        if root is None and dnode.name in captured_names:
            root = dnode.name  # untouched by decomposition: same node, same name
        if root is not None and root in captured_names:
            mapping[node.name] = root
    return mapping


def _static_outputs(model: onnx.ModelProto) -> tuple[int, int]:
    infos = {v.name: v for v in list(model.graph.value_info) + list(model.graph.output)}
    total = static = 0
    for node in model.graph.node:
        for out in node.output:
            if not out:
                continue
            total += 1
            info = infos.get(out)
            if info is None or not info.type.HasField("tensor_type"):
                continue
            shape = info.type.tensor_type.shape
            if shape is not None and all(d.HasField("dim_value") for d in shape.dim):
                static += 1
    return static, total


def export_onnx(capture: Capture, progress: Progress | None = None) -> OnnxExport:
    """Export the capture's program to ONNX. Failure is not fatal: partc still builds the OpGraph
    from FX and the cost model prices those nodes in torch, so the result says what went wrong."""
    import onnx

    progress = progress or Progress()
    try:
        with progress.step("exporting to ONNX (torch.onnx, dynamo)"):
            with quiet_torch():
                program = torch.onnx.export(capture.exported, dynamo=True, optimize=False,
                                            verbose=False, report=False)
            assert program is not None  # None only when export writes a file itself
            with tempfile.TemporaryDirectory(prefix="partc-onnx-") as tmp:
                file = Path(tmp) / "model.onnx"
                program.save(str(file), include_initializers=False,
                             keep_initializers_as_inputs=True)
                model = onnx.load_model(str(file))
    except Exception as exc:  # torch.onnx raises many types; all mean "no ONNX for this model"
        reason = summarize_exception(exc)
        progress.warn(f"ONNX export failed, continuing from the FX graph alone: {reason}")
        return OnnxExport(status="failed", error=reason)
    with progress.step("ONNX shape inference and FX mapping"):
        try:
            model = onnx.shape_inference.infer_shapes(model, strict_mode=False, data_prop=True)
        except Exception as exc:  # shape inference is an enrichment, not a requirement
            progress.warn(f"ONNX shape inference failed: {summarize_exception(exc)}")
        # dynamo=True records the program it decomposed
        assert program.exported_program is not None
        mapping = map_onnx_nodes(model, program.exported_program, capture.exported)
        static, total = _static_outputs(model)
        opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    return OnnxExport(status="ok", model=model, node_to_fx=mapping, opset=opset,
                      static_shape_outputs=static, num_outputs=total)
