"""The analytic CostTable: a roofline per node from a device config, without running anything.

Forward time of a node at micro-batch m is `op_overhead_s + max(flops / flops_per_s(dtype, class),
bytes / bytes_per_s())` on the device (partc.hardware.specs.DeviceSpec); backward is forward times
the op class's backward ratio; saved-for-backward bytes come from a measurement on meta
(partc.cost.activations) when given. docs/cost-model.md writes the model down.
"""
from __future__ import annotations

from partc.cost.op_classes import FREE_KINDS, op_class
from partc.cost.table import CostSource, CostTable, Linear, NodeCost, needs_backward
from partc.graph.opgraph import INTEGER_DTYPES, OpGraph, OpNode
from partc.hardware.specs import DeviceSpec

# Backward time / forward time by op class, for nodes that need a backward. Matmuls and convs
# compute two products (input and weight gradients); the other classes are memory-bound and read
# about twice what their forward read. The measured CPU profiles of the examples
# (docs/cost-model.md) give matmul 1.9-2.4, conv 1.8-2.3, norm 1.3-2.6, elementwise 0.8-1.6: these
# are rounded medians.
DEFAULT_BACKWARD_RATIOS: dict[str, float] = {
    "matmul": 2.0, "conv": 2.0, "attention": 2.5, "norm": 2.0, "elementwise": 1.2,
    "reduction": 1.5, "gather": 1.5, "copy": 1.0, "other": 1.0,
}



def _node_bytes(node: OpNode, graph: OpGraph) -> tuple[float, float]:
    """(fixed, per-sample) bytes a node moves: batch-carrying tensors scale, the rest is fixed."""
    if node.is_view:
        return 0.0, 0.0
    total = node.bytes_read + node.bytes_written
    batch = 0.0
    for name in node.inputs:
        spec = graph.tensor(name)
        if spec.batch_dim is not None:
            batch += spec.nbytes
    for spec in node.outputs:
        if spec.batch_dim is not None:
            batch += spec.nbytes
    batch = min(batch, float(total))
    return total - batch, batch / graph.batch_size


def _compute_dtype(node: OpNode) -> str:
    for t in node.outputs:
        if t.dtype not in INTEGER_DTYPES:
            return t.dtype
    return "float32"


def roofline_s(node: OpNode, graph: OpGraph, device: DeviceSpec, m: float) -> float:
    """Forward time of one node at micro-batch m: max(compute, memory) + per-op overhead."""
    if node.is_view or node.kind in FREE_KINDS:
        return 0.0
    cls = op_class(node.kind)
    flops = max(0.0, node.flops + node.flops_per_sample * (m - graph.batch_size))
    fixed, per_sample = _node_bytes(node, graph)
    nbytes = fixed + per_sample * m
    compute = flops / device.flops_per_s(_compute_dtype(node), cls) if flops else 0.0
    memory = nbytes / device.bytes_per_s()
    return max(compute, memory) + device.op_overhead_s


def analytic_cost_table(graph: OpGraph, device: DeviceSpec,
                        saved: dict[str, Linear] | None = None,
                        backward_ratios: dict[str, float] | None = None) -> CostTable:
    """Roofline costs of every node on `device`, without running anything.

    Forward: `roofline_s` evaluated at the captured batch size B and 2B and joined by a line (the
    roofline is piecewise linear in m; the chord is exact where one side dominates). Backward:
    forward x the op class's backward ratio, for nodes that need a backward. Saved bytes: `saved`
    (from partc.cost.torch_profiler.saved_activation_bytes, which runs on meta) or, without it,
    every differentiable non-view node's outputs (an upper bound).
    """
    ratios = {**DEFAULT_BACKWARD_RATIOS, **(backward_ratios or {})}
    differentiable = needs_backward(graph)
    b1, b2 = graph.batch_size, 2 * graph.batch_size
    nodes: dict[str, NodeCost] = {}
    for node in graph.nodes:
        t1, t2 = roofline_s(node, graph, device, b1), roofline_s(node, graph, device, b2)
        slope = (t2 - t1) / (b2 - b1)
        forward = Linear(t1 - slope * b1, slope)
        ratio = ratios[op_class(node.kind)] if node.name in differentiable else 0.0
        backward = Linear(forward.fixed * ratio, forward.per_sample * ratio)
        if saved is not None:
            saved_cost = saved.get(node.name, Linear(0.0, 0.0))
        elif node.name in differentiable and not node.is_view:
            saved_cost = _output_bytes(node, graph)
        else:
            saved_cost = Linear(0.0, 0.0)
        method = "none" if node.is_view or node.kind in FREE_KINDS else "analytic"
        nodes[node.name] = NodeCost(forward, backward, saved_cost, method)
    source = CostSource(kind="analytic", device=device.name, device_kind=device.kind, provider="",
                        threads=0, graph_hash=graph.content_hash(), model=graph.model_name,
                        batch_sizes=(b1, b2),
                        calibration={"backward_ratios": dict(sorted(ratios.items())),
                                     "saved_bytes": "measured on meta" if saved is not None
                                     else "upper bound: outputs of differentiable nodes"})
    return CostTable(graph=graph, source=source, nodes=nodes)


def _output_bytes(node: OpNode, graph: OpGraph) -> Linear:
    fixed = float(sum(t.nbytes for t in node.outputs if t.batch_dim is None))
    per_sample = sum(t.nbytes for t in node.outputs if t.batch_dim is not None) / graph.batch_size
    return Linear(fixed, per_sample)


