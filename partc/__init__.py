"""partc: an ahead-of-time partition compiler for training PyTorch models across devices.

The compiler is a pipeline of passes over typed data (see DESIGN.md):

    load_model_file -> capture -> export_onnx -> build_opgraph -> cost (CostTable) -> ...

`capture_graph` runs the front half in one call; `profile_model` measures a CostTable on a device
and `analytic_cost_table` computes one from a device config; `coarsen` and `partc.search.search`
turn a CostTable into a `Partition` for a cluster.
"""
from partc.capture import Capture, capture
from partc.cost_model import CostTable, Linear, NodeCost, analytic_cost_table
from partc.errors import CaptureError, GraphFileError, ModelFileError, PartcError
from partc.graph_builder import build_opgraph
from partc.model_file import ModelFile, load_model_file
from partc.onnx_export import OnnxExport, export_onnx
from partc.opgraph import Edge, GraphOutput, OpGraph, OpNode, Param, TensorSpec
from partc.measured_costs import ProfileOptions, profile_model
from partc.pipeline import CaptureResult, capture_graph, plan_costs
from partc.coarsen import BlockGraph, coarsen
from partc.partition import Partition
from partc.search import InfeasibleMemoryError, SearchOptions

__version__ = "0.1.0"

__all__ = [
    "Capture", "CaptureError", "CaptureResult", "CostTable", "Edge", "Linear", "NodeCost",
    "ProfileOptions", "analytic_cost_table", "profile_model", "GraphFileError", "GraphOutput",
    "ModelFile", "ModelFileError", "OnnxExport", "OpGraph", "OpNode", "Param", "PartcError",
    "TensorSpec", "build_opgraph", "capture", "capture_graph", "export_onnx", "load_model_file",
    "plan_costs", "BlockGraph", "coarsen", "Partition", "InfeasibleMemoryError", "SearchOptions",
]
