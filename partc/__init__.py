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

# The module that defines each public name.
_DEFINED_IN: dict[str, tuple[str, ...]] = {
    "partc.errors": ("PartcError", "ModelFileError", "CaptureError", "GraphFileError"),
    "partc.options": ("TrainingConfig", "SearchOptions", "TrainOptions"),
    "partc.frontend.model_file": ("ModelFile", "load_model_file"),
    "partc.frontend.export": ("Capture", "capture"),
    "partc.frontend.onnx_export": ("OnnxExport", "export_onnx"),
    "partc.frontend.graph_builder": ("build_opgraph",),
    "partc.frontend.capture": ("CaptureResult", "capture_graph"),
    "partc.graph.opgraph": ("OpGraph", "OpNode", "Edge", "GraphOutput", "Param", "TensorSpec"),
    "partc.hardware.specs": ("DeviceSpec", "ClusterSpec"),
    "partc.hardware.configs": ("load_device", "load_cluster"),
    "partc.cost.table": ("CostTable", "Curve", "Linear", "NodeCost"),
    "partc.cost.roofline": ("analytic_cost_table",),
    "partc.cost.plan_costs": ("plan_costs",),
    "partc.cost.measured": ("ProfileOptions", "profile_model"),
    "partc.solve.coarsen": ("BlockGraph", "coarsen"),
    "partc.solve.search": ("search", "InfeasibleMemoryError"),
    "partc.solve.partition": ("Partition",),
    "partc.plans.plan": ("Plan", "load_plan"),
    "partc.emit.compile": ("compile_model", "CompileOptions"),
    "partc.emit.verify": ("verify_plan",),
}
_EXPORTS: dict[str, str] = {name: module for module, names in _DEFINED_IN.items()
                             for name in names}

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
