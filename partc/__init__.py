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

`import partc` is cheap: the names below are loaded from their modules on first use, so reading a
plan (`partc show`, `partc diff`) never imports torch. Code that wants static types imports them
from the defining module (`from partc.frontend.capture import capture_graph`).
"""
from __future__ import annotations

import importlib
from typing import Any

from partc.version import __version__

# Public name -> the module that defines it.
_EXPORTS: dict[str, str] = {
    "PartcError": "partc.errors", "ModelFileError": "partc.errors",
    "CaptureError": "partc.errors", "GraphFileError": "partc.errors",
    "TrainingConfig": "partc.options", "SearchOptions": "partc.options",
    "TrainOptions": "partc.options",
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

__all__ = [*sorted(_EXPORTS), "__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'partc' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next access skips this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
