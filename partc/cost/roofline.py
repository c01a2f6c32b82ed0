"""The analytic CostTable: a roofline per node from a device config, without running anything.

Forward time of a node at micro-batch m is `op_overhead_s + max(flops / flops_per_s(dtype, class),
bytes / bytes_per_s())` on the device (partc.hardware.specs.DeviceSpec), in the dtypes the plan's
precision gives each operator (partc.cost.autocast); backward is the forward's work times the op
class's backward ratio plus the device's backward overhead; saved-for-backward bytes come from a
measurement on meta (partc.cost.activations) when given. docs/cost-model.md writes the model down.
"""
from __future__ import annotations

from partc.cost.autocast import (
    NodeCast,
    autocast_dtypes,
    compute_dtype,
    keeps_integers,
    weight_copies_bytes,
)
from partc.cost.op_classes import FREE_KINDS, op_class
from partc.cost.table import (
    NO_COST,
    CostSource,
    CostTable,
    Curve,
    Linear,
    NodeCost,
    SavedActivations,
    needs_backward,
    requires_grad_tensors,
)
from partc.graph.opgraph import FLOATING_DTYPES, OpGraph, OpNode, dtype_bytes
from partc.hardware.specs import DeviceSpec
from partc.options import Precision

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


def _lines(node: OpNode, graph: OpGraph, device: DeviceSpec,
           cast: NodeCast) -> tuple[Linear, Linear]:
    """(compute, memory) seconds of one node as lines in the micro-batch m, without overhead."""
    cls = op_class(node.kind)
    b = graph.batch_size
    rate = device.flops_per_s(cast.compute_dtype, cls)
    fixed_flops = max(0.0, float(node.flops - node.flops_per_sample * b))
    compute = Linear(fixed_flops / rate, node.flops_per_sample / rate) if (
        node.flops or node.flops_per_sample) else Linear(0.0, 0.0)
    fixed, per_sample = _node_bytes(node, graph)
    bw = device.bytes_per_s()
    memory = Linear(fixed * cast.scale / bw, per_sample * cast.scale / bw)
    return compute, memory


def roofline_s(node: OpNode, graph: OpGraph, device: DeviceSpec, m: float,
               cast: NodeCast | None = None) -> float:
    """Forward time of one node at micro-batch m: its roofline, max(compute, memory), with the
    host's dispatch (added on a CPU, overlapped on a GPU: `node_time`) and, under autocast, the
    cast kernels in front of it."""
    if node.is_view or node.kind in FREE_KINDS:
        return 0.0
    cast = cast or NodeCast(compute_dtype=compute_dtype(node))
    compute, memory = _lines(node, graph, device, cast)
    work = Linear(max(compute.at(m), memory.at(m)), 0.0)
    return node_time(work, device.op_overhead_s, cast, device).at(m)


def node_time(work: Linear, overhead_s: float, cast: NodeCast, device: DeviceSpec) -> Linear:
    """One pass of a node as a line in m, from its device work, the host's per-operator dispatch
    `overhead_s` and the autocast casts in front of it (each a whole-operand conversion kernel,
    dispatched like any operator; weights are converted once per micro-batch, as autocast's cache
    lives for one forward). A CPU runs dispatch and kernels in turn: their sum. A GPU queues
    kernels asynchronously, so the host's dispatch of the next operators overlaps the kernels
    already queued and an operator costs the larger of the two; the line
    `max(host, work fixed) + slope * m` is never below `max(host, work(m))`."""
    host = overhead_s * (1 + cast.cast_kernels)
    bw = device.bytes_per_s()
    device_fixed = work.fixed + cast.cast_bytes / bw
    per_sample = work.per_sample + cast.cast_bytes_per_sample / bw
    if device.kind == "cuda":
        return Linear(max(host, device_fixed), per_sample)
    return Linear(host + device_fixed, per_sample)


def analytic_cost_table(graph: OpGraph, device: DeviceSpec,
                        saved: SavedActivations | None = None,
                        backward_ratios: dict[str, float] | None = None,
                        precision: Precision = "fp32") -> CostTable:
    """Roofline costs of every node on `device` under `precision`, without running anything.

    Forward: the upper envelope of the node's roofline, `overhead + max(compute, memory)` bounded
    by `overhead + max(compute fixed, memory fixed) + max(compute slope, memory slope) * m`: a
    line that is exact where one side dominates at both ends and never below the roofline at any
    micro-batch (a chord through two batch sizes under-prices every size beyond them).
    Under bf16-mixed each node computes and moves bytes in the dtypes autocast gives it
    (partc.cost.autocast), plus the casts it inserts. Backward: the forward's work x the op
    class's backward ratio, plus the device's per-operator backward overhead, for nodes that need
    a backward. Saved bytes: `saved` (partc.cost.activations.saved_activations) or, without it,
    every differentiable non-view node's outputs (an upper bound).
    """
    ratios = {**DEFAULT_BACKWARD_RATIOS, **(backward_ratios or {})}
    differentiable = needs_backward(graph)
    requires = requires_grad_tensors(graph)
    casts = autocast_dtypes(graph, precision, device.kind).nodes
    b1 = graph.batch_size
    nodes: dict[str, NodeCost] = {}
    for node in graph.nodes:
        free = node.is_view or node.kind in FREE_KINDS
        if free:
            forward = backward = Linear(0.0, 0.0)
        else:
            cast = casts[node.name]
            compute, memory = _lines(node, graph, device, cast)
            work = Linear(max(compute.fixed, memory.fixed),
                          max(compute.per_sample, memory.per_sample))
            forward = node_time(work, device.op_overhead_s, cast, device)
            if node.name in differentiable:
                # the casts' backward casts each operand's gradient back: the same traffic
                ratio = ratios[op_class(node.kind)]
                backward = node_time(Linear(work.fixed * ratio, work.per_sample * ratio),
                                     device.backward_overhead_s(), cast, device)
            else:
                backward = Linear(0.0, 0.0)
        if saved is not None:
            saved_cost = saved.bytes.get(node.name, Linear(0.0, 0.0))
        elif node.name in differentiable and not node.is_view:
            saved_cost = _output_bytes(node, graph)
        else:
            saved_cost = Linear(0.0, 0.0)
        if precision != "fp32" and node.name in differentiable:
            saved_cost = _saved_under(precision, saved_cost, node, graph, casts[node.name],
                                      requires, device.kind)
        nodes[node.name] = NodeCost(forward.curve(), backward.curve(), saved_cost.curve(),
                                    "none" if free else "analytic")
    loss = analytic_loss(graph, device)
    source = CostSource(kind="analytic", device=device.name, device_kind=device.kind, provider="",
                        threads=0, graph_hash=graph.content_hash(), model=graph.model_name,
                        batch_sizes=(b1, 2 * b1), precision=precision,
                        calibration={"backward_ratios": dict(sorted(ratios.items())),
                                     "forward": "upper envelope of the roofline",
                                     "saved_bytes": "measured on meta" if saved is not None
                                     else "upper bound: outputs of differentiable nodes",
                                     "loss": f"{LOSS_PASSES} fp32 passes over the floating "
                                             "outputs each way"})
    inputs = [float(sum(t.nbytes * (b / b1 if t.batch_dim is not None else 1.0)
                        for t in graph.inputs)) for b in (b1, 2 * b1)]
    return CostTable(graph=graph, source=source, nodes=nodes, loss=loss,
                     keeps_result=None if saved is None else saved.keeps_result,
                     cpu_vector_bytes=device.vector_bytes if device.kind == "cpu" else 0,
                     batch_bytes=Curve.through(list(zip((b1, 2 * b1), inputs, strict=True))))


# The loss function is the model file's code, outside the graph: priced as a cross-entropy-like
# reduction of the floating outputs in fp32 (autocast runs losses in fp32): forward a max, a sum
# of exponentials, the normalised log-probabilities written and the targets' entries read; the
# backward as many passes to form the gradient. Two operators each way.
LOSS_PASSES = 4
LOSS_OPERATORS = 2


def analytic_loss(graph: OpGraph, device: DeviceSpec) -> NodeCost:
    """The loss function's forward and backward on `device` as bandwidth over the model's
    floating outputs (see LOSS_PASSES), keeping one fp32 copy of them for its backward
    (cross-entropy's log-probabilities, MSE's difference). A measured profile runs the model
    file's own loss function instead (`partc.cost.torch_profiler.time_loss`)."""
    fixed = per_sample = 0.0
    for out in graph.outputs:
        spec = graph.tensor(out.tensor)
        if spec.dtype not in FLOATING_DTYPES:
            continue
        fp32 = spec.nbytes / dtype_bytes(spec.dtype) * 4
        if spec.batch_dim is None:
            fixed += fp32
        else:
            per_sample += fp32 / graph.batch_size
    if not fixed and not per_sample:
        return NO_COST
    bw = device.bytes_per_s()
    host = device.op_overhead_s * LOSS_OPERATORS
    back = device.backward_overhead_s() * LOSS_OPERATORS
    passes = LOSS_PASSES / bw
    if device.kind == "cuda":  # dispatch overlaps the queued kernels (`node_time`)
        forward = Linear(max(host, fixed * passes), per_sample * passes)
        backward = Linear(max(back, fixed * passes), per_sample * passes)
    else:
        forward = Linear(host + fixed * passes, per_sample * passes)
        backward = Linear(back + fixed * passes, per_sample * passes)
    return NodeCost(forward.curve(), backward.curve(), Linear(fixed, per_sample).curve(),
                    "analytic")


def _saved_under(precision: Precision, fp32: Linear, node: OpNode, graph: OpGraph,
                 cast: NodeCast, requires: set[str], device_kind: str) -> Linear:
    """A node's saved bytes, counted at the model's dtype, under `precision`'s autocast: its
    floating tensors in the dtypes autocast gives them (`cast.scale`: a matrix op's bf16 copies,
    a norm's float32; masks and indices keep their size), plus the copies of its weights
    autocast keeps for the backward (the tables' saved bytes are at their own precision, as a
    profile measured under autocast gives them)."""
    scale = 1.0 if keeps_integers(node, graph, device_kind) else cast.scale
    return Linear(fp32.fixed * scale + weight_copies_bytes(node, graph, precision, requires),
                  fp32.per_sample * scale)


def _output_bytes(node: OpNode, graph: OpGraph) -> Linear:
    fixed = float(sum(t.nbytes for t in node.outputs if t.batch_dim is None))
    per_sample = sum(t.nbytes for t in node.outputs if t.batch_dim is not None) / graph.batch_size
    return Linear(fixed, per_sample)


