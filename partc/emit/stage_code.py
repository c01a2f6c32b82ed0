"""Stage code: trace a StageGraph to TorchScript, save it deterministically, load it back.

A stage file (`stage_<k>.pt`) is a TorchScript archive of one stage traced with torch.jit.trace at
the plan's micro-batch shape (export graphs are shape-specialised; torch.jit.script cannot compile
aten overloads, see the toolchain probe). Three things make it a reviewable artifact:

- Device-portable: tracing records every device argument (arange(..., device='cpu'), to(...)) as a
  constant. `_portable_devices` rewrites each such constant into `prim::device` of the stage's first
  tensor input, so a stage traced here on CPU (or on meta) runs on whatever device launch puts its
  inputs on.
- Byte-identical: each stage is traced into a fresh TorchScript compilation unit (no process-global
  name mangling), traced inputs are not stored, and the archive is rewritten with fixed entry order,
  no `.debug_pkl` source maps (they hold absolute paths of the Python files that ran) and a
  serialization id derived from the content instead of a random one.
- Weights: a stage of a real model carries its parameters. A stage of a meta-device model carries
  code and parameter shapes only (meta tensors, a few KB); launch fills them by FQN from a
  checkpoint or from the model's own initialisation (`partc.emit.stage_weights`).
"""
from __future__ import annotations

import copy
import hashlib
import io
import re
import warnings
import zipfile
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.fx
import torch.jit._state

from partc.emit.stage_graph import StageGraph
from partc.emit.stage_weights import set_stage_tensors, stage_tensors
from partc.errors import StageFileError


def trace_stage(stage: StageGraph,
                example_inputs: Sequence[torch.Tensor]) -> torch.jit.ScriptModule:
    """torch.jit.trace of one stage at the example inputs' shapes, device-portable.

    A meta-device stage whose operators have meta kernels written in Python (convolution) cannot
    be traced on meta: under the tracer those kernels read sizes as traced tensors and fail. It is
    traced on CPU stand-ins instead (uninitialised tensors of the same shapes: the stage's size
    in host memory while it traces, nothing computed is kept), and its tensors are put back on
    meta, so the stage file still holds shapes only."""
    try:
        return _trace(stage.module, example_inputs)
    except TypeError:
        tensors = stage_tensors(stage.module)
        on_meta = [t for t in [*tensors.values(), *example_inputs]
                   if isinstance(t, torch.Tensor) and t.is_meta]
        if not on_meta:
            raise
    # zeros, not garbage: integer inputs index embeddings, and integer buffers computed at
    # build time (Swin's relative_position_index, meta here) index tables
    stand_ins = {n: torch.zeros_like(t, device="cpu") for n, t in tensors.items()}
    set_stage_tensors(stage.module, stand_ins)
    try:
        traced = _trace(_on_cpu(stage.module), [torch.zeros_like(t, device="cpu")
                                                if isinstance(t, torch.Tensor) else t
                                                for t in example_inputs])
    finally:
        set_stage_tensors(stage.module, tensors)
    set_stage_tensors(traced, tensors)
    return traced


def _on_cpu(module: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """`module` (sharing its tensors) with the meta device of every operator argument made
    cpu: a model captured on meta creates tensors on meta in forward (HF Swin's shifted-window
    mask, `zeros(..., device=meta)`), which beside the cpu stand-ins would not trace. Tracing
    records cpu there, which `_portable_devices` then makes the stage's input device."""
    def cpu(arg: Any) -> Any:
        return torch.device("cpu") if isinstance(arg, torch.device) and arg.type == "meta" else arg

    graph = copy.deepcopy(module.graph)
    for node in graph.nodes:
        if node.op == "call_function":
            node.args, node.kwargs = torch.fx.node.map_aggregate((node.args, node.kwargs), cpu)
    return torch.fx.GraphModule(module, graph, class_name=type(module).__name__)


def _trace(module: torch.nn.Module,
           example_inputs: Sequence[torch.Tensor]) -> torch.jit.ScriptModule:
    previous = torch.jit._state._python_cu
    torch.jit._state._python_cu = torch._C.CompilationUnit()  # names do not depend on history
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # jit deprecation and TracerWarnings on export graphs
            traced = torch.jit.trace(module, tuple(example_inputs), check_trace=False,
                                     strict=False, _store_inputs=False)
    finally:
        torch.jit._state._python_cu = previous
    _portable_devices(traced, example_inputs)
    return traced


def _portable_devices(traced: torch.jit.ScriptModule,
                      example_inputs: Sequence[torch.Tensor]) -> None:
    """Replace constant devices in the traced graph by the device of the first tensor input."""
    graph = traced.graph
    inputs = list(graph.inputs())[1:]  # [0] is self
    anchor = next((v for v, t in zip(inputs, example_inputs, strict=True)
                   if isinstance(t, torch.Tensor)), None)
    constants = [n for n in graph.nodes()
                 if n.kind() == "prim::Constant" and n.output().type().kind() == "DeviceObjType"]
    if anchor is None or not constants:
        return
    device = graph.create("prim::device", [anchor], 1)
    device.output().setType(torch._C.DeviceObjType.get())
    device.insertBefore(next(iter(graph.nodes())))
    for const in constants:
        const.output().replaceAllUsesWith(device.output())
        const.destroy()


def stage_bytes(traced: torch.jit.ScriptModule) -> bytes:
    """The stage's TorchScript archive, normalised so the same stage gives the same bytes."""
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.jit.save(traced, buf)
    return _normalise_archive(buf.getvalue())


def _normalise_archive(data: bytes) -> bytes:
    src = zipfile.ZipFile(io.BytesIO(data))
    entries = [(i, src.read(i.filename)) for i in src.infolist()
               if not i.filename.endswith(".debug_pkl")]
    digest = hashlib.sha256()
    for info, payload in entries:
        if not info.filename.endswith("serialization_id"):
            digest.update(info.filename.encode())
            digest.update(payload)
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as dst:
        for info, payload in entries:
            if info.filename.endswith("serialization_id"):
                # torch writes a random 40-digit id here; a content-derived one of the same form
                payload = str(int(digest.hexdigest(), 16))[:40].rjust(40, "0").encode()
            fixed = zipfile.ZipInfo(info.filename, date_time=(1980, 1, 1, 0, 0, 0))
            fixed.compress_type = info.compress_type
            fixed.external_attr = 0o644 << 16
            dst.writestr(fixed, payload)
    return out.getvalue()


_UNKNOWN_OP = re.compile(r"Unknown builtin op: (\w+::\w+)")


def load_stage(source: str | Path | bytes,
               map_location: str | torch.device | None = None) -> torch.jit.ScriptModule:
    """torch.jit.load of a stage file or of its bytes (the caller checks the hash first).

    A stage calls a custom operator (torch.library; Hugging Face's MoE layers call
    `transformers::grouped_mm_fallback`) by name, so whoever loads it imports the model file
    first, which registers the operator as the model's own imports do; StageFileError when
    the operator is still unknown."""
    f = io.BytesIO(source) if isinstance(source, bytes) else str(source)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return torch.jit.load(f, map_location=map_location)
        except RuntimeError as exc:
            unknown = _UNKNOWN_OP.search(str(exc))
            if unknown is None:
                raise
            raise StageFileError(
                f"a stage file calls the operator {unknown.group(1)}, which no library "
                "imported in this process registers",
                hint="the model file must import (at its top level) the library that registers "
                     "it with torch.library, as the model's forward did when it was "
                     "compiled") from None
