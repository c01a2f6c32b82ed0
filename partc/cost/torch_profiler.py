"""Per-node measurements in torch: forward and backward time of every OpGraph node.

The captured program is run node by node (`NodeRunner`, a torch.fx.Interpreter over
`ep.module()`), so every measurement lands on an OpGraph node by name (partc.cost.activations
measures saved bytes the same way).

torch.profiler with one `record_function` range per node gives its forward time. The autograd nodes
a forward node creates are found by walking `grad_fn` from its outputs to the autograd nodes
already claimed by earlier nodes; the profiler's `autograd::engine::evaluate_function` events carry
the same sequence numbers, which gives each node its backward time. Profiling inflates small ops,
so the per-node figures are used as shares and rescaled to whole-model fwd/bwd times measured
without the profiler (median of runs).
"""
from __future__ import annotations

import contextlib
import copy
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch.export import ExportedProgram

from partc.frontend.export import quiet_torch
from partc.frontend.model_file import Inputs
from partc.options import Precision

_NODE_RANGE = "partc::"
_BACKWARD_EVENT = "autograd::engine::evaluate_function: "


def program_module(program: ExportedProgram) -> torch.fx.GraphModule:
    """The program as a runnable GraphModule (guards off: they break tracing/scripting later and
    the inputs are the captured ones anyway)."""
    with quiet_torch():
        return program.module(check_guards=False)


def flat_inputs(module: torch.fx.GraphModule, inputs: Inputs) -> list[Any]:
    """The (args, kwargs) of the model as the flat placeholder values the graph takes."""
    from torch.export._tree_utils import reorder_kwargs

    args, kwargs = inputs
    in_spec = getattr(module, "_in_spec", None)
    if in_spec is not None and kwargs:
        kwargs = reorder_kwargs(kwargs, in_spec)
    return pytree.tree_flatten((tuple(args), dict(kwargs)))[0]


# Export's runtime checks of a tensor's device and dtype: they compute nothing, they pin the
# capture's device (meta) and dtypes that autocast changes, and the stage files launch runs drop
# them too (partc.emit.stage_graph), so the measured program does the stages' work.
_METADATA_CHECKS = (torch.ops.aten._assert_tensor_metadata.default,)


def retarget_devices(module: torch.fx.GraphModule, device: torch.device) -> None:
    """Rewrite the devices the exported graph names (`to(device=cpu)`, factory calls) to `device`
    and drop export's metadata checks (`_assert_tensor_metadata(device=meta)`), in place: export
    bakes the capture's device into the program, so a model captured on meta or cpu could not run
    elsewhere otherwise. Sub-graphs of higher-order ops are rewritten too (a `torch.no_grad()`
    region, such as Hugging Face's rotary embedding, is one)."""

    def swap(value: Any) -> Any:
        return device if isinstance(value, torch.device) else value

    _own_subgraphs(module)
    for graph_module in [m for m in module.modules() if isinstance(m, torch.fx.GraphModule)]:
        changed = False
        for node in list(graph_module.graph.nodes):
            if node.op != "call_function":
                continue
            if node.target in _METADATA_CHECKS and not node.users:
                graph_module.graph.erase_node(node)
                changed = True
                continue
            args, kwargs = pytree.tree_map(swap, (node.args, node.kwargs))
            if args != node.args or kwargs != node.kwargs:
                node.args, node.kwargs = args, kwargs
                changed = True
        if changed:
            graph_module.recompile()


def _own_subgraphs(module: torch.fx.GraphModule) -> None:
    """Give `module` its own copy of every nested GraphModule: `ep.module()` shares the sub-graphs
    of higher-order ops with the ExportedProgram, which later passes still export and split, so
    rewriting them in place would change the program under them."""
    for name, sub in list(module.named_modules()):
        if not name or not isinstance(sub, torch.fx.GraphModule):
            continue
        path, _, leaf = name.rpartition(".")
        parent = module.get_submodule(path) if path else module
        setattr(parent, leaf, torch.fx.GraphModule(sub, copy.deepcopy(sub.graph),
                                                   class_name=type(sub).__name__))


def precision_autocast(precision: Precision,
                       device_type: str) -> contextlib.AbstractContextManager[Any]:
    """The context a forward pass runs in for `precision`: bf16 autocast for bf16-mixed, nothing
    for fp32. The one definition: launch's stages (partc.run.stage_runner) and the profiler both
    use it, so a bf16-mixed profile times what launch runs. Backward runs outside it (autograd runs
    each backward op in the dtype its forward op used)."""
    if precision == "bf16-mixed":
        return torch.autocast(device_type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def to_device(module: torch.fx.GraphModule, device: torch.device, seed: int = 0) -> None:
    """Move a program to `device`, in place. A meta-device program gets real storage: floating
    tensors small random values, integer tensors zeros (safe as indices), booleans True; timing and
    memory depend on shapes, not values."""
    retarget_devices(module, device)
    on_meta = any(t.is_meta for t in [*module.parameters(), *module.buffers()])
    if not on_meta:
        module.to(device)
        return
    module.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            if t.is_floating_point():
                t.normal_(0.0, 0.02, generator=gen)
            elif t.dtype == torch.bool:
                t.fill_(True)
            else:
                t.zero_()


def inputs_on(inputs: Inputs, device: torch.device) -> Inputs:
    """The model inputs moved to `device` (meta inputs become zeros / small random values)."""

    def move(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        if t.is_meta:
            real = torch.zeros(t.shape, dtype=t.dtype, device=device)
            return real.normal_(0.0, 1.0) if real.is_floating_point() else real
        return t.to(device)

    args, kwargs = inputs
    return tuple(pytree.tree_map(move, list(args))), pytree.tree_map(move, kwargs)


class NodeRunner(torch.fx.Interpreter):
    """Runs a GraphModule node by node, wrapping each call_function node in `around(node)` and
    reporting its result to `after(node, result)`."""

    def __init__(self, module: torch.fx.GraphModule,
                 around: Callable[[torch.fx.Node], contextlib.AbstractContextManager[Any]],
                 after: Callable[[torch.fx.Node, Any], None] | None = None) -> None:
        super().__init__(module)
        self._around = around
        self._after = after

    def run_node(self, n: torch.fx.Node) -> Any:
        if n.op != "call_function":
            return super().run_node(n)
        with self._around(n):
            result = super().run_node(n)
        if self._after is not None:
            self._after(n, result)
        return result


def node_owner(module: torch.fx.GraphModule) -> dict[str, str]:
    """FX node name -> the OpGraph node it belongs to (tuple getitems fold into their producer,
    as in partc.frontend.graph_builder)."""
    import operator

    owner: dict[str, str] = {}
    for n in module.graph.nodes:
        if n.op != "call_function":
            continue
        if (n.target is operator.getitem and isinstance(n.args[0], torch.fx.Node)
                and isinstance(n.args[1], int) and n.args[0].name in owner):
            owner[n.name] = owner[n.args[0].name]
        else:
            owner[n.name] = n.name
    return owner


@dataclass(frozen=True)
class TorchTiming:
    """Forward/backward time of a program in torch at one batch size.

    `node_forward_s`/`node_backward_s` are the profiler's per-node figures (medians over runs);
    `model_forward_s`/`model_backward_s` are whole-model wall times without the profiler
    (medians); the per-node figures are shares of those.
    """

    batch_size: int
    model_forward_s: float
    model_backward_s: float
    node_forward_s: dict[str, float]
    node_backward_s: dict[str, float]
    unattributed_backward_s: float  # profiler backward time on no node (AccumulateGrad, ...)
    differentiable: frozenset[str]  # nodes that created autograd nodes
    runs: int


def _output_grads(outputs: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    tensors = [t for t in pytree.tree_leaves(outputs)
               if isinstance(t, torch.Tensor) and t.requires_grad]
    return tensors, [torch.ones_like(t) for t in tensors]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _zero_grads(module: torch.nn.Module) -> None:
    for p in module.parameters():
        p.grad = None


def time_model(module: torch.fx.GraphModule, inputs: Inputs, device: torch.device,
               warmup: int = 2, runs: int = 5,
               precision: Precision = "fp32") -> tuple[float, float]:
    """Median (forward, backward) wall time of a whole training step of the program, without the
    loss: backward starts from all-ones output gradients, so only the model is timed. The forward
    runs under `precision_autocast`, as in launch. On CUDA every clock read follows a
    synchronize: kernels run asynchronously, so the clock alone would time their launch."""
    args, kwargs = inputs
    fwd: list[float] = []
    bwd: list[float] = []
    for i in range(warmup + runs):
        _zero_grads(module)
        _sync(device)
        t0 = time.perf_counter()
        with precision_autocast(precision, device.type):
            out = module(*args, **kwargs)
        _sync(device)
        t1 = time.perf_counter()
        tensors, grads = _output_grads(out)
        if tensors:
            torch.autograd.backward(tensors, grads)
        _sync(device)
        t2 = time.perf_counter()
        del out, tensors, grads
        if i >= warmup:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
    _zero_grads(module)
    return statistics.median(fwd), statistics.median(bwd)


def _event_time_us(event: Any, device: torch.device) -> float:
    return float(event.device_time_total if device.type == "cuda" else event.cpu_time_total)


def _profile_once(module: torch.fx.GraphModule, flat: list[Any], device: torch.device,
                  precision: Precision = "fp32"
                  ) -> tuple[dict[str, float], dict[str, float], float, set[str]]:
    """One profiled fwd+bwd: per-node forward and backward microseconds, unattributed backward
    microseconds, and the nodes that created autograd nodes (have a backward)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    owner = node_owner(module)
    claimed: set[Any] = set()
    seq_owner: dict[int, str] = {}

    def after(n: torch.fx.Node, result: Any) -> None:
        name = owner.get(n.name, n.name)
        # next_functions holds None where an input needs no gradient.
        stack: list[torch.autograd.graph.Node | None] = [
            t.grad_fn for t in pytree.tree_leaves(result)
            if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        while stack:
            fn = stack.pop()
            if fn is None or fn in claimed:
                continue
            claimed.add(fn)
            if type(fn).__name__ == "AccumulateGrad":
                continue
            seq_owner[fn._sequence_nr()] = name
            stack.extend(g for g, _ in fn.next_functions)

    def around(n: torch.fx.Node) -> contextlib.AbstractContextManager[Any]:
        return record_function(_NODE_RANGE + owner.get(n.name, n.name))

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    _zero_grads(module)
    with quiet_torch(), profile(activities=activities) as prof:
        with precision_autocast(precision, device.type):
            out = NodeRunner(module, around, after).run(*flat)
        tensors, grads = _output_grads(out)
        if tensors:
            torch.autograd.backward(tensors, grads)
        _sync(device)
    fwd: dict[str, float] = {}
    bwd: dict[str, float] = {}
    unattributed = 0.0
    for event in prof.events():
        name = event.name
        if name.startswith(_NODE_RANGE):
            node = name[len(_NODE_RANGE):]
            fwd[node] = fwd.get(node, 0.0) + _event_time_us(event, device)
        elif name.startswith(_BACKWARD_EVENT):
            node = seq_owner.get(event.sequence_nr) if event.sequence_nr >= 0 else None
            if node is None:
                unattributed += _event_time_us(event, device)
            else:
                bwd[node] = bwd.get(node, 0.0) + _event_time_us(event, device)
    _zero_grads(module)
    return fwd, bwd, unattributed, set(seq_owner.values())


def time_nodes(module: torch.fx.GraphModule, inputs: Inputs, batch_size: int,
               device: torch.device, warmup: int = 3, runs: int = 5,
               precision: Precision = "fp32") -> TorchTiming:
    """Whole-model and per-node forward/backward times of the program on `device`, forward under
    `precision_autocast(precision)`."""
    model_fwd, model_bwd = time_model(module, inputs, device, warmup, runs, precision)
    flat = flat_inputs(module, inputs)
    per_run: list[tuple[dict[str, float], dict[str, float], float]] = []
    differentiable: set[str] = set()
    # Profiled runs need their own warm-up: the first few are slow again (allocator and
    # interpreter paths), measured up to 3x on backward.
    for i in range(warmup + runs):
        fwd, bwd, unattributed, with_backward = _profile_once(module, flat, device, precision)
        differentiable |= with_backward
        if i >= warmup:
            per_run.append((fwd, bwd, unattributed))
    names = sorted({n for f, b, _ in per_run for n in (*f, *b)})
    median = lambda vals: statistics.median(vals) * 1e-6  # noqa: E731  (us -> s)
    node_fwd = {n: median([f.get(n, 0.0) for f, _, _ in per_run]) for n in names}
    node_bwd = {n: median([b.get(n, 0.0) for _, b, _ in per_run]) for n in names}
    return TorchTiming(batch_size=batch_size, model_forward_s=model_fwd, model_backward_s=model_bwd,
                       node_forward_s={n: v for n, v in node_fwd.items() if v > 0},
                       node_backward_s={n: v for n, v in node_bwd.items() if v > 0},
                       unattributed_backward_s=median([u for _, _, u in per_run]),
                       differentiable=frozenset(differentiable), runs=runs)
