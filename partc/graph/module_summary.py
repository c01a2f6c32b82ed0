"""Per-module summary of an OpGraph at a chosen depth of the module tree (`partc inspect`)."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from partc.graph.opgraph import OpGraph


@dataclass(frozen=True)
class ModuleRow:
    """One module at the summary depth (or a shallower one whose own ops sit above that depth)."""

    path: str  # module FQN; "" is the root module
    type: str  # class name
    parameters: int  # parameter elements owned (tied ones under their canonical FQN)
    parameter_bytes: int
    flops: int  # forward FLOPs at the graph's batch size
    output_bytes: int  # activation bytes leaving the module (consumed outside it or returned)
    ops: int  # OpGraph nodes


@dataclass(frozen=True)
class ModuleSummary:
    model_name: str
    batch_size: int
    depth: int
    on_meta: bool
    rows: tuple[ModuleRow, ...]
    total_parameters: int
    total_parameter_bytes: int
    total_flops: int
    total_ops: int
    input_bytes: int
    output_bytes: int
    tied: tuple[tuple[str, ...], ...]  # each: canonical FQN followed by its aliases
    graph_hash: str
    onnx_status: str
    onnx_nodes: int
    onnx_mapped: int
    notes: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def truncate(path: str, depth: int) -> str:
    """The ancestor of module `path` at `depth` (the path itself when it is shallower)."""
    if not path or depth <= 0:
        return ""
    return ".".join(path.split(".")[:depth])


def _param_module(fqn: str) -> str:
    return fqn.rpartition(".")[0]


def summarize_modules(graph: OpGraph, depth: int = 1) -> ModuleSummary:
    """Group the graph's ops and parameters by module at `depth` (1 = the root's children)."""
    row_of_node = {n.name: truncate(n.module, depth) for n in graph.nodes}
    order: list[str] = []
    for n in graph.nodes:
        if row_of_node[n.name] not in order:
            order.append(row_of_node[n.name])
    params: dict[str, int] = {}
    param_bytes: dict[str, int] = {}
    for p in graph.params:
        if p.kind != "parameter":
            continue
        row = truncate(_param_module(p.name), depth)
        if row not in order:
            order.append(row)
        params[row] = params.get(row, 0) + p.numel
        param_bytes[row] = param_bytes.get(row, 0) + p.nbytes

    flops: dict[str, int] = {}
    ops: dict[str, int] = {}
    for n in graph.nodes:
        row = row_of_node[n.name]
        flops[row] = flops.get(row, 0) + n.flops
        ops[row] = ops.get(row, 0) + 1

    # A tensor leaves its module's row when a node of another row reads it, or it is returned.
    leaving: dict[str, set[str]] = {}
    for edge in graph.edges():
        if edge.src == "<input>":
            continue
        src_row = row_of_node[edge.src]
        if row_of_node[edge.dst] != src_row:
            leaving.setdefault(src_row, set()).add(edge.tensor.name)
    for out in graph.outputs:
        producer = graph.producer(out.tensor)
        if producer is not None:
            leaving.setdefault(row_of_node[producer], set()).add(out.tensor)
    out_bytes = {row: sum(graph.tensor(t).nbytes for t in names) for row, names in leaving.items()}

    rows = tuple(ModuleRow(path=row, type=graph.module_type(row).rpartition(".")[2],
                           parameters=params.get(row, 0), parameter_bytes=param_bytes.get(row, 0),
                           flops=flops.get(row, 0), output_bytes=out_bytes.get(row, 0),
                           ops=ops.get(row, 0))
                 for row in order)
    return ModuleSummary(
        model_name=graph.model_name, batch_size=graph.batch_size, depth=depth,
        on_meta=graph.on_meta, rows=rows,
        total_parameters=graph.num_parameters, total_parameter_bytes=graph.parameter_bytes,
        total_flops=graph.total_flops, total_ops=len(graph.nodes),
        input_bytes=sum(t.nbytes for t in graph.inputs),
        output_bytes=sum(graph.tensor(o.tensor).nbytes for o in graph.outputs),
        tied=tuple((p.name, *p.aliases) for p in graph.tied_parameters),
        graph_hash=graph.content_hash(), onnx_status=graph.onnx.status,
        onnx_nodes=graph.onnx.num_nodes, onnx_mapped=graph.onnx.mapped_nodes, notes=graph.notes)


def human_count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(int(n))


def human_bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def format_table(summary: ModuleSummary) -> str:
    """A plain-text table of the summary, for terminals and logs."""
    header = ("module", "type", "params", "FLOPs", "out act.", "ops")
    body = [(r.path or "(root)", r.type, human_count(r.parameters), human_count(r.flops),
             human_bytes(r.output_bytes), str(r.ops)) for r in summary.rows]
    total = ("total", "", human_count(summary.total_parameters), human_count(summary.total_flops),
             human_bytes(summary.output_bytes), str(summary.total_ops))
    widths = [max(len(row[i]) for row in [header, total, *body]) for i in range(len(header))]

    def line(cells: tuple[str, ...]) -> str:
        return "  ".join(c.ljust(w) if i < 2 else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths, strict=True))).rstrip()

    rule = "  ".join("-" * w for w in widths)
    meta = " (meta device: not materialised)" if summary.on_meta else ""
    lines = [f"{summary.model_name}: batch size {summary.batch_size}, "
             f"module depth {summary.depth}{meta}",
             "", line(header), rule, *(line(r) for r in body), rule, line(total), ""]
    lines.append(f"parameters: {summary.total_parameters:,} "
                 f"({human_bytes(summary.total_parameter_bytes)})"
                 f"   forward FLOPs: {summary.total_flops:,}   ops: {summary.total_ops}")
    for group in summary.tied:
        lines.append(f"tied: {group[0]} = {', '.join(group[1:])}")
    if summary.onnx_status == "ok":
        lines.append(f"onnx: {summary.onnx_nodes} nodes, {summary.onnx_mapped} mapped to ops")
    elif summary.onnx_status == "failed":
        lines.append("onnx: export failed (the OpGraph is built from FX alone)")
    for note in summary.notes:
        lines.append(f"note: {note}")
    lines.append(f"graph hash: {summary.graph_hash}")
    return "\n".join(lines)
