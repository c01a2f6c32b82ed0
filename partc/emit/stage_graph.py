"""Split an exported program into pipeline stages: one FX GraphModule per (virtual) stage.

Input: the ExportedProgram of the model at the micro-batch size and the stage of every OpGraph node
(the Partition). Output: `SplitProgram`, one `StageGraph` per stage whose forward takes exactly the
tensors the previous stage returns (stage 0: the model's flat inputs) and returns exactly the
tensors the next stage takes (the last stage: the model's flat outputs). That is the contract of
torch.distributed.pipelining, where a stage only talks to its neighbours, so a tensor produced in
stage i and read in stage j > i + 1 is relayed: every stage in between takes it and returns it
unchanged (the cost model already counts those hops, see partc.solve.stage_problem).

Why not `torch.fx.passes.split_module` alone: in torch 2.13 it leaves parameters in the parent
module (they reach submodules as inputs) and wires skip connections straight from producer to
consumer in the parent graph, so its submodules are neither self-contained nor neighbour-only.
Building each stage graph directly from the unlifted program does what split_module does (copy each
partition's nodes, turn values from outside into placeholders) plus the two things pipelining needs:
parameters and buffers registered inside the stage under their original FQNs (so a normal
state_dict maps onto stages), and relays.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch.export import ExportedProgram

from partc.errors import PartcError
from partc.frontend.export import output_paths
from partc.frontend.graph_builder import dtype_name
from partc.frontend.model_file import Inputs

MODEL_INPUT = -1  # `StageTensor.source` of a model input

# Runtime assertions of export that pin a tensor's device: dropped from stages so that one stage
# file runs on any device (they check metadata, they compute nothing).
_DROPPED_TARGETS = (torch.ops.aten._assert_tensor_metadata.default,)


class SplitError(PartcError):
    """The partition cannot be turned into stage code (a node order the stages cannot follow)."""


@dataclass(frozen=True)
class StageTensor:
    """A tensor that crosses at least one stage boundary (or a model input or output)."""

    name: str  # the FX node name in the exported program
    shape: tuple[int, ...]
    dtype: str
    source: int  # stage that produces it; MODEL_INPUT for the model's inputs
    consumers: tuple[int, ...]  # stages that read it; num_stages stands for the loss (model output)
    # its dims in memory order, outermost first, where that is not the logical order (a
    # transposed query); () = contiguous (`memory_order`)
    memory_order: tuple[int, ...] = ()


@dataclass
class StageGraph:
    """One stage's code: a GraphModule holding the stage's parameters under their original FQNs."""

    index: int
    module: torch.fx.GraphModule
    inputs: tuple[str, ...]  # StageTensor names, in forward() argument order
    outputs: tuple[str, ...]  # StageTensor names, in the order forward() returns them
    parameters: tuple[str, ...]  # FQNs of the nn.Parameters it holds
    buffers: tuple[str, ...]  # FQNs of the buffers it holds that are in the model's state_dict
    constants: tuple[str, ...]  # tensors it holds that a state_dict does not (non-persistent
    #                             buffers such as position ids, constants lifted by export)
    nodes: tuple[str, ...]  # FX nodes it computes

    @property
    def relayed(self) -> tuple[str, ...]:
        """Inputs returned unchanged: tensors passing through on their way to a later stage."""
        return tuple(t for t in self.outputs if t in set(self.inputs))


@dataclass
class SplitProgram:
    """The stages of a model and the tensors between them."""

    stages: list[StageGraph]
    tensors: dict[str, StageTensor]
    inputs: tuple[str, ...]  # the model's flat inputs (stage 0's forward arguments)
    input_paths: tuple[str, ...]  # where each flat input sits in (args, kwargs), pytree key strings
    outputs: tuple[str, ...]  # the model's flat outputs (the last stage's returns)
    output_paths: tuple[str, ...]  # where each sits in the model's output structure
    in_spec: pytree.TreeSpec
    out_spec: pytree.TreeSpec


def flatten_inputs(inputs: Inputs, in_spec: pytree.TreeSpec) -> list[torch.Tensor]:
    """The model's (args, kwargs) as the flat tensor list stage 0 takes, in the exported program's
    order (keyword arguments in the order they were captured with, whatever order they come in).
    Non-tensor leaves are dropped: export baked their captured values into the program."""
    args, kwargs = inputs
    if in_spec.num_children == 2 and in_spec.child(1).type is dict:
        order = in_spec.child(1).context
        if set(order) != set(kwargs):
            raise SplitError(f"inputs have keyword arguments {sorted(kwargs)}, the plan was "
                             f"compiled with {sorted(order)}",
                             hint="pass the same inputs as the model file's example_inputs")
        kwargs = {k: kwargs[k] for k in order}
    flat, spec = pytree.tree_flatten((tuple(args), kwargs))
    if spec != in_spec:
        raise SplitError(f"inputs do not have the structure the plan was compiled with: {spec} "
                         f"vs {in_spec}",
                         hint="pass the same inputs as the model file's example_inputs")
    # non-tensor inputs (None, ints) were specialised into the program by export
    return [t for t in flat if isinstance(t, torch.Tensor)]


def _input_paths(in_spec: pytree.TreeSpec) -> tuple[str, ...]:
    placeholder = pytree.tree_unflatten(list(range(in_spec.num_leaves)), in_spec)
    return tuple(pytree.keystr(path) for path, _ in pytree.tree_flatten_with_path(placeholder)[0])


def _stage_of_nodes(gm: torch.fx.GraphModule, stage_of: Mapping[str, int],
                    clamp: bool) -> dict[torch.fx.Node, int]:
    """Every computing node's stage: the partition's, getitems of tuple results with their producer,
    and (for nodes the OpGraph does not have) the latest stage among their inputs. With `clamp`
    (the partition was matched to this program approximately), a node assigned before one of its
    inputs moves to that input's stage instead of failing."""
    stages: dict[torch.fx.Node, int] = {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        earliest = max((stages.get(a, 0) for a in node.all_input_nodes if a.op != "get_attr"),
                       default=0)
        src = node.args[0] if node.target is operator.getitem and node.args else None
        if isinstance(src, torch.fx.Node) and src in stages and \
                not isinstance(src.meta.get("val"), torch.Tensor):
            # an element of a tuple/list result: taken where the result is (only tensors travel)
            stage = stages[src]
        elif node.name in stage_of:
            stage = stage_of[node.name]
        else:
            stage = earliest
        if stage < earliest and clamp:
            stage = earliest
        if stage < earliest:
            raise SplitError(f"node {node.name} is assigned to stage {stage} but reads a value of "
                             f"stage {earliest}",
                             hint="the partition does not follow the graph's data flow; "
                                  "re-solve it (partc compile) for this model")
        stages[node] = stage
    return stages


def _tensor_meta(node: torch.fx.Node) -> tuple[tuple[int, ...], str, tuple[int, ...]]:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        raise SplitError(f"value {node.name} crosses a stage boundary but is a "
                         f"{type(val).__name__}, not a tensor",
                         hint="only tensors can pass between pipeline stages; move the cut "
                              "(pin --stages differently) or report the model")
    return tuple(int(d) for d in val.shape), dtype_name(val.dtype), memory_order(val)


def memory_order(t: torch.Tensor) -> tuple[int, ...]:
    """`t`'s dims in the order its strides lay them out in memory, outermost first (ties in
    logical order; a size-1 dim, which takes no room, right after its logical predecessor);
    () when that is the logical order. The pipeline runtime sends a boundary tensor in this
    order, so the next stage receives the layout the unsplit model had (docs/launch.md,
    "Boundary layouts")."""
    if t.is_contiguous():
        return ()

    def key(d: int) -> tuple[int, ...]:
        if t.shape[d] > 1:
            return (-int(t.stride(d)), d)
        before = [e for e in range(d) if t.shape[e] > 1]
        return (-int(t.stride(before[-1])), before[-1], d) if before else (-(1 << 62), -1, d)

    order = tuple(sorted(range(t.dim()), key=key))
    return () if order == tuple(range(t.dim())) else order


def split_program(exported: ExportedProgram, stage_of: Mapping[str, int],
                  num_stages: int, clamp: bool = False) -> SplitProgram:
    """Cut `exported` into `num_stages` stage graphs; `stage_of` maps the program's FX node names
    (the OpGraph's node names) to stage indices (see the module docstring; `clamp`: see
    `_stage_of_nodes`)."""
    gm = exported.module(check_guards=False)  # the default adds a _guards_fn call jit cannot take
    graph = gm.graph
    node_stage = _stage_of_nodes(gm, stage_of, clamp)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    # Non-tensor inputs (None, ints, flags) are baked into the program by export: not passed on.
    tensor_inputs = [n for n in placeholders if isinstance(n.meta.get("val"), torch.Tensor)]
    out_node = next(n for n in graph.nodes if n.op == "output")
    flat_outputs = [a for a in pytree.tree_leaves(out_node.args[0])]
    for a in flat_outputs:
        if not isinstance(a, torch.fx.Node):
            raise SplitError(f"the model returns a constant ({a!r}), not a tensor",
                             hint="return only tensors computed from the inputs")
    order = {n: i for i, n in enumerate(graph.nodes)}
    _check_mutated_attributes(gm, node_stage)

    # Which stages read each value; the loss (stage num_stages) reads the outputs. Attributes
    # (parameters, buffers) never travel: each stage that reads one holds it.
    consumers: dict[torch.fx.Node, set[int]] = {}
    for node, stage in node_stage.items():
        if node.target in _DROPPED_TARGETS:
            continue
        for a in node.all_input_nodes:
            if a.op not in ("get_attr", "placeholder") or a in tensor_inputs:
                consumers.setdefault(a, set()).add(stage)
    for a in flat_outputs:
        if a.op != "get_attr":
            consumers.setdefault(a, set()).add(num_stages)
    source = {n: MODEL_INPUT for n in tensor_inputs} | dict(node_stage)

    tensors: dict[str, StageTensor] = {}
    live: list[list[torch.fx.Node]] = []  # live[k]: values stage k returns (k < num_stages - 1)
    for k in range(num_stages - 1):
        values = sorted((v for v, readers in consumers.items()
                         if source[v] <= k < max(readers)), key=order.__getitem__)
        live.append(values)
    crossing = {v for values in live for v in values} | set(tensor_inputs) | set(flat_outputs)
    for v in sorted(crossing, key=order.__getitem__):
        if v.op == "get_attr":  # a parameter or buffer returned as a model output
            value = _attribute(gm, str(v.target))
            assert isinstance(value, torch.Tensor)
            tensors[v.name] = StageTensor(name=v.name, shape=tuple(value.shape),
                                          dtype=dtype_name(value.dtype), source=num_stages - 1,
                                          consumers=(num_stages,))
            continue
        shape, dtype, in_memory = _tensor_meta(v)
        tensors[v.name] = StageTensor(name=v.name, shape=shape, dtype=dtype, source=source[v],
                                      consumers=tuple(sorted(consumers.get(v, ()))),
                                      memory_order=in_memory)

    stages = []
    for k in range(num_stages):
        stage_inputs = tensor_inputs if k == 0 else live[k - 1]
        stage_outputs = flat_outputs if k == num_stages - 1 else live[k]
        members = [n for n in graph.nodes if node_stage.get(n) == k]
        stages.append(_build_stage(gm, k, stage_inputs, stage_outputs, members))

    mask = [isinstance(n.meta.get("val"), torch.Tensor) for n in placeholders]
    paths = _input_paths(exported.call_spec.in_spec)
    return SplitProgram(stages=stages, tensors=tensors, inputs=tuple(n.name for n in tensor_inputs),
                        input_paths=tuple(p for p, keep in zip(paths, mask, strict=True) if keep),
                        outputs=tuple(n.name for n in flat_outputs),
                        output_paths=tuple(output_paths(exported)),
                        in_spec=exported.call_spec.in_spec, out_spec=exported.call_spec.out_spec)


def _attribute(gm: torch.nn.Module, target: str) -> torch.Tensor | torch.nn.Module:
    """What a get_attr `target` names: a parameter, buffer or constant, or a sub-graph module."""
    path, _, leaf = target.rpartition(".")
    return getattr(gm.get_submodule(path) if path else gm, leaf)


def _writes(node: torch.fx.Node, arg: torch.fx.Node) -> bool:
    """Whether `node` writes to its argument `arg` in place (per the operator's schema)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return False
    for i, formal in enumerate(schema.arguments):
        actual = node.args[i] if i < len(node.args) else node.kwargs.get(formal.name)
        if actual is arg and formal.alias_info is not None and formal.alias_info.is_write:
            return True
    return False


def _check_mutated_attributes(gm: torch.fx.GraphModule,
                              node_stage: Mapping[torch.fx.Node, int]) -> None:
    """Each stage holds its own copy of an attribute, so a buffer updated in place (running
    statistics, a step counter) must be read and written in one stage only."""
    for attr in (n for n in gm.graph.nodes if n.op == "get_attr"):
        users = [u for u in attr.users if u in node_stage and u.target not in _DROPPED_TARGETS]
        stages = {node_stage[u] for u in users}
        if len(stages) > 1 and any(_writes(u, attr) for u in users):
            raise SplitError(f"buffer {attr.target} is updated in place in one stage and read in "
                             f"another (stages {sorted(stages)}): the stages would hold diverging "
                             "copies",
                             hint="pin a different --stages count or --strategy so the module "
                                  "owning it stays in one stage, or report the model")


_GRAD_MODE_REGION = getattr(torch.ops.higher_order, "wrap_with_set_grad_enabled", None)


def _build_stage(gm: torch.fx.GraphModule, index: int, inputs: list[torch.fx.Node],
                 outputs: list[torch.fx.Node], members: list[torch.fx.Node]) -> StageGraph:
    root = torch.nn.Module()
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, Any] = {}
    for v in inputs:
        env[v] = graph.placeholder(v.name)
        env[v].meta = dict(v.meta)
    params: list[str] = []
    buffers: list[str] = []
    constants: list[str] = []
    kinds = {"parameter": params, "buffer": buffers, "constant": constants}

    def attr(owner: torch.nn.Module, target: str, key: Any, meta: dict[str, Any]) -> torch.fx.Node:
        if key not in env:
            kinds[_register(root, owner, target)].append(target)
            with graph.inserting_after(_last_attr(graph)):
                env[key] = graph.get_attr(target)
            env[key].meta = dict(meta)
        return env[key]

    def value(arg: torch.fx.Node) -> Any:
        if arg.op == "get_attr":
            return attr(gm, str(arg.target), arg, arg.meta)
        if arg.op == "placeholder" and arg not in env:
            return arg.meta.get("val")  # a non-tensor input, specialised by export
        if arg not in env:
            raise SplitError(f"stage {index} reads {arg.name}, which no earlier stage passes on",
                             hint="report this model: the stage boundaries are inconsistent")
        return env[arg]

    computed: list[str] = []
    for node in members:
        if node.target in _DROPPED_TARGETS:
            continue
        if _GRAD_MODE_REGION is not None and node.target is _GRAD_MODE_REGION:
            env[node] = _inline_grad_region(graph, gm, node, value, attr)
        elif (node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node)
              and isinstance(env.get(node.args[0]), tuple)):
            env[node] = env[node.args[0]][node.args[1]]
        elif node.op == "call_function" and any(
                a.op == "get_attr" and isinstance(_attribute(gm, str(a.target)), torch.nn.Module)
                for a in node.all_input_nodes):
            raise SplitError(f"operator {node.target} (node {node.name}) runs a sub-graph, which "
                             "stage tracing does not support",
                             hint="remove torch.autocast / torch.cond regions from forward() "
                                  "(use --precision bf16-mixed for mixed precision)")
        else:
            env[node] = graph.node_copy(node, value)
        computed.append(node.name)
    graph.output(tuple(env[v] if v in env else value(v) for v in outputs))
    module = torch.fx.GraphModule(root, graph, class_name=f"Stage{index}")
    return StageGraph(index=index, module=module, inputs=tuple(v.name for v in inputs),
                      outputs=tuple(v.name for v in outputs), parameters=tuple(params),
                      buffers=tuple(buffers), constants=tuple(constants),
                      nodes=tuple(computed))


def _inline_grad_region(graph: torch.fx.Graph, gm: torch.fx.GraphModule, node: torch.fx.Node,
                        value: Any, attr: Any) -> tuple[torch.fx.Node, ...]:
    """Copy a `with torch.no_grad()` / `set_grad_enabled` region's sub-graph into the stage.
    jit.trace does not record grad mode, so a no-grad region's results are detached instead,
    which is what no_grad means for everything downstream."""
    enabled, sub_node, *operands = node.args
    assert isinstance(sub_node, torch.fx.Node)  # the get_attr of the region's sub-graph
    sub = _attribute(gm, str(sub_node.target))
    assert isinstance(sub, torch.fx.GraphModule)
    local: dict[torch.fx.Node, Any] = {}
    sub_inputs = iter(operands)
    results: tuple[Any, ...] = ()
    for inner in sub.graph.nodes:
        if inner.op == "placeholder":
            outer = next(sub_inputs)
            local[inner] = value(outer) if isinstance(outer, torch.fx.Node) else outer
        elif inner.op == "get_attr":
            local[inner] = attr(sub, str(inner.target), (sub_node, inner.target), inner.meta)
        elif inner.op == "output":
            results = tuple(local[a] if isinstance(a, torch.fx.Node) else a
                            for a in pytree.tree_leaves(inner.args[0]))
        else:
            local[inner] = graph.node_copy(inner, lambda a: local[a])
    if not enabled:
        results = tuple(graph.call_function(torch.ops.aten.detach.default, (r,))
                        if isinstance(r, torch.fx.Node) else r for r in results)
    return results


def _last_attr(graph: torch.fx.Graph) -> torch.fx.Node:
    """Insertion point for get_attr nodes: after the placeholders and earlier get_attrs, so every
    use comes later in the graph."""
    last = graph._root
    for n in graph.nodes:
        if n.op not in ("placeholder", "get_attr"):
            break
        last = n
    return last


def _register(root: torch.nn.Module, owner_root: torch.nn.Module, target: str) -> str:
    """Put `owner_root`'s attribute `target` (a parameter, buffer or constant) into `root` under
    the same dotted name, creating plain container modules on the way. Returns its kind:
    "parameter", "buffer" (in the model's state_dict) or "constant" (not in it)."""
    path, _, leaf = target.rpartition(".")
    owner = owner_root.get_submodule(path) if path else owner_root
    value: Any = getattr(owner, leaf)
    module = root
    for part in path.split(".") if path else []:
        if not hasattr(module, part):
            module.add_module(part, torch.nn.Module())
        module = getattr(module, part)
    if isinstance(value, torch.nn.Parameter):
        module.register_parameter(leaf, value)
        return "parameter"
    if isinstance(value, torch.Tensor):
        persistent = leaf in owner._buffers and \
            leaf not in getattr(owner, "_non_persistent_buffers_set", ())
        module.register_buffer(leaf, value, persistent=persistent)
        return "buffer" if persistent else "constant"
    raise SplitError(f"attribute {target} of the exported program is a {type(value).__name__}",
                     hint="only tensor attributes (parameters, buffers, constants) can be staged")
