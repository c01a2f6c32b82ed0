"""partc: an ahead-of-time partition compiler for training PyTorch models across devices.

The compiler is a pipeline of passes over typed data, one subpackage per pass family, with
dependencies pointing one way (docs/architecture.md):

    frontend   model file -> torch.export capture -> ONNX -> OpGraph (partc.graph)
    hardware   device and cluster configs -> DeviceSpec, ClusterSpec
    cost       OpGraph + device -> CostTable (analytic roofline, or measured: `partc profile`)
    solve      CostTable + cluster + batch -> Partition (coarsen, search, CP-SAT, simulate)
    plans      Partition -> Plan (plan.yaml), and the tools that read plans (check, diff, show)
    emit       capture + Partition -> plan directory (TorchScript stage files + plan.yaml)
    run        plan directory -> training on torch.distributed (`partc launch`)

`import partc` is cheap: the names below are loaded on first use, so reading a plan (`partc show`,
`partc diff`) never imports torch.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from partc.version import __version__

# Public name -> the module that defines it.
_EXPORTS: dict[str, str] = {
    "PartcError": "partc.errors", "ModelFileError": "partc.errors",
    "CaptureError": "partc.errors", "GraphFileError": "partc.errors",
    "TrainingConfig": "partc.solve.memory", "SearchOptions": "partc.solve.search",
    "TrainOptions": "partc.run.training",
    "ModelFile": "partc.frontend.model_file", "load_model_file": "partc.frontend.model_file",
    "Capture": "partc.frontend.export", "capture": "partc.frontend.export",
    "OnnxExport": "partc.frontend.onnx_export", "export_onnx": "partc.frontend.onnx_export",
    "build_opgraph": "partc.frontend.graph_builder",
    "CaptureResult": "partc.frontend.capture", "capture_graph": "partc.frontend.capture",
    "OpGraph": "partc.graph.opgraph", "OpNode": "partc.graph.opgraph",
    "Edge": "partc.graph.opgraph", "GraphOutput": "partc.graph.opgraph",
    "Param": "partc.graph.opgraph", "TensorSpec": "partc.graph.opgraph",
    "DeviceSpec": "partc.hardware.specs", "ClusterSpec": "partc.hardware.specs",
    "load_device": "partc.hardware.configs", "load_cluster": "partc.hardware.configs",
    "CostTable": "partc.cost.table", "Linear": "partc.cost.table", "NodeCost": "partc.cost.table",
    "analytic_cost_table": "partc.cost.roofline", "plan_costs": "partc.cost.plan_costs",
    "ProfileOptions": "partc.cost.measured", "profile_model": "partc.cost.measured",
    "BlockGraph": "partc.solve.coarsen", "coarsen": "partc.solve.coarsen",
    "search": "partc.solve.search", "InfeasibleMemoryError": "partc.solve.search",
    "Partition": "partc.solve.partition",
    "Plan": "partc.plans.plan", "load_plan": "partc.plans.plan",
    "compile_model": "partc.emit.compile", "CompileOptions": "partc.emit.compile",
    "verify_plan": "partc.emit.verify",
}

__all__ = ["BlockGraph", "Capture", "CaptureError", "CaptureResult", "ClusterSpec",
    "CompileOptions", "CostTable", "DeviceSpec", "Edge", "GraphFileError", "GraphOutput",
    "InfeasibleMemoryError", "Linear", "ModelFile", "ModelFileError", "NodeCost", "OnnxExport",
    "OpGraph", "OpNode", "Param", "PartcError", "Partition", "Plan", "ProfileOptions",
    "SearchOptions", "TensorSpec", "TrainOptions", "TrainingConfig", "analytic_cost_table",
    "build_opgraph", "capture", "capture_graph", "coarsen", "compile_model", "export_onnx",
    "load_cluster", "load_device", "load_model_file", "load_plan", "plan_costs", "profile_model",
    "search", "verify_plan", "__version__"]

if TYPE_CHECKING:
    from partc.cost.measured import ProfileOptions, profile_model
    from partc.cost.plan_costs import plan_costs
    from partc.cost.roofline import analytic_cost_table
    from partc.cost.table import CostTable, Linear, NodeCost
    from partc.emit.compile import CompileOptions, compile_model
    from partc.emit.verify import verify_plan
    from partc.errors import CaptureError, GraphFileError, ModelFileError, PartcError
    from partc.frontend.capture import CaptureResult, capture_graph
    from partc.frontend.export import Capture, capture
    from partc.frontend.graph_builder import build_opgraph
    from partc.frontend.model_file import ModelFile, load_model_file
    from partc.frontend.onnx_export import OnnxExport, export_onnx
    from partc.graph.opgraph import Edge, GraphOutput, OpGraph, OpNode, Param, TensorSpec
    from partc.hardware.configs import load_cluster, load_device
    from partc.hardware.specs import ClusterSpec, DeviceSpec
    from partc.options import SearchOptions, TrainingConfig, TrainOptions
    from partc.plans.plan import Plan, load_plan
    from partc.solve.coarsen import BlockGraph, coarsen
    from partc.solve.partition import Partition
    from partc.solve.search import InfeasibleMemoryError, search


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'partc' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next access skips this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
