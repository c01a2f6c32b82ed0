"""Per-node measurements in torch: forward and backward time of every OpGraph node.

The captured program is run node by node (`NodeRunner`, a torch.fx.Interpreter over
`ep.module()`), so every measurement lands on an OpGraph node by name (partc.cost.activations
measures saved bytes the same way).

The autograd nodes a forward node creates are found by walking `grad_fn` from its outputs to the
autograd nodes already claimed by earlier nodes (a parameter's AccumulateGrad belongs to the first
node that uses it). Two ways to time them:

- CPU (`_clock_once`): wall clock, or where the measuring process shares its core with a busy
  neighbour the thread's CPU time (CPU_CLOCK). The forward of each node is timed around its call,
  and each of its autograd nodes between a pre-hook and a hook (the engine runs a CPU backward on
  the calling thread, one autograd node at a time). The figures are the nodes' own times, medians
  over runs; the engine's time between autograd nodes (the whole backward minus their sum) is
  spread over the nodes by their autograd-node count. No profiler: its per-event cost is 10-100 us
  and uneven (measured here: a 17 us ReLU profiled at 26-117 us), which skewed the cuts. The
  shares are then rescaled to the whole program traced to TorchScript, as launch runs its stage
  files (the FX interpreter around each node costs a few microseconds more: measured 10-15% on the
  transformer examples' forwards).
- CUDA (`_profile_once`): torch.profiler with one `record_function` range per node gives its
  device time; the profiler's `autograd::engine::evaluate_function` events carry the autograd
  nodes' sequence numbers, which gives each node its backward. These figures are used as shares,
  rescaled to whole-model fwd/bwd times measured without the profiler (median of runs).
"""
from __future__ import annotations

import contextlib
import copy
import os
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch.export import ExportedProgram

from partc.frontend.export import quiet_torch
from partc.frontend.model_file import Inputs
from partc.hardware.local import keep_freed_memory
from partc.options import Precision

Clock = Callable[[], float]
"""Seconds from an arbitrary origin, read before and after what is timed."""
WALL_CLOCK: Clock = time.perf_counter
# Where the measuring process shares its core with a busy neighbour (devices oversubscribing the
# cores, as launch runs them) its wall time holds the neighbour's turns, which the simulator
# shares out itself; the thread's CPU time is the work alone, including what the sharing costs
# it (caches refilled after every switch: on this repository's 2-core VM the MLP's stages did
# 1.12-1.43x their alone-on-a-core work with a core-mate). CPU work runs on the calling thread
# (autograd's engine too, for CPU tensors). Launch times its stages' CPU work with it as well.
CPU_CLOCK: Clock = time.thread_time
CPU_CLOCK_NAME = "thread_time"  # how a profile's calibration names it (`clock`)

_NODE_RANGE = "partc::"
_BACKWARD_EVENT = "autograd::engine::evaluate_function: "


def storage_key(t: torch.Tensor) -> int:
    """A tensor's storage, as a key: views of one storage share it. Not its data pointer:
    every meta tensor's is 0."""
    return t.untyped_storage()._cdata


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


@contextlib.contextmanager
def kineto_silenced() -> Iterator[None]:
    """File descriptor 2 to /dev/null while a torch.profiler starts or stops: kineto prints a
    line on every start and stop straight to it, past Python's sys.stderr, which would
    interleave with partc's progress lines and reach the user as library noise."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


@contextlib.contextmanager
def device_profile(device: torch.device, memory: bool = False,
                   shapes: bool = False) -> Iterator[torch.profiler.profile]:
    """A torch.profiler over the block: host operators, and on CUDA the device's kernels (the
    device is synchronised before it stops, so the block's last kernels are in it); allocations
    and frees with `memory` (read them with `allocation_events` once the block has ended),
    operators' input shapes with `shapes`. Started and stopped with kineto's lines silenced
    (`kineto_silenced`)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    prof = torch.profiler.profile(activities=activities, record_shapes=shapes,
                                  profile_memory=memory)
    with kineto_silenced():
        prof.__enter__()
    try:
        yield prof
    finally:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        with kineto_silenced():
            prof.__exit__(None, None, None)


def cpu_memory_profile() -> contextlib.AbstractContextManager[torch.profiler.profile]:
    """`device_profile` of the CPU with allocations and frees."""
    return device_profile(torch.device("cpu"), memory=True)


def allocation_events(roots: Iterable[Any]) -> list[tuple[int, int, int]]:
    """Every allocation and free in the profiler event trees under `roots` (a stopped
    profile's `kineto_results.experimental_event_tree()`, or one event's children): (start
    ns, bytes, negative for a free, address), in time order."""
    from torch._C._profiler import _ExtraFields_Allocation

    found: list[tuple[int, int, int]] = []
    stack = list(roots)
    while stack:
        event = stack.pop()
        if isinstance(event.extra_fields, _ExtraFields_Allocation):
            found.append((event.start_time_ns, event.extra_fields.alloc_size,
                          event.extra_fields.ptr))
        stack.extend(event.children)
    found.sort()
    return found


@contextlib.contextmanager
def cpu_settings(device: torch.device) -> Iterator[None]:
    """The settings every partc process that measures or trains on a CPU computes under (on
    other devices nothing: their kernels ignore these host settings), so that a profile times
    what launch runs. The one definition: launch's ranks, single-process reference training, the
    profiler and its busy neighbours all run in it.

    - Denormal floats flushed to zero, torch's default (not flushed) again after. Why: an x86
      core takes a microcode assist on every denormal operand, and how many there are depends
      on the weights, which training moves. Measured on an Intel Xeon VM: the transformer
      example's initial logits leave 40% of its softmax probabilities denormal, and its
      cross-entropy ran 5x slower (1.13 ms against 0.22 ms forward at 8 samples); a profile of
      the initial weights priced the last stage's loss at 5x what the launched steps took, their
      weights having moved. Flushing changes only values below 1.2e-38 in float32 (TensorFlow
      runs CPUs this way by default).
    - Freed memory kept by the C allocator for the rest of the process
      (`partc.hardware.local.keep_freed_memory`): a step that frees many micro-batches'
      activations at once otherwise page-faults them in again every step, which an operator
      timed in a loop never does."""
    if device.type != "cpu":
        yield
        return
    keep_freed_memory()
    torch.set_flush_denormal(True)
    try:
        yield
    finally:
        torch.set_flush_denormal(False)


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


# A program ready to time (`time_interleaved`): the module and its (args, kwargs).
TimedProgram = tuple[torch.nn.Module, Inputs]


def _step_timer(module: torch.nn.Module, inputs: Inputs, device: torch.device,
                precision: Precision, cold: bool,
                clock: Clock) -> Callable[[], tuple[float, float]]:
    """One timed training step of the program (time_model's run): (forward, backward)."""
    args, kwargs = inputs

    def once() -> tuple[float, float]:
        _zero_grads(module)
        if cold:
            flush_cpu_caches()
        _sync(device)
        t0 = clock()
        with precision_autocast(precision, device.type):
            out = module(*args, **kwargs)
        _sync(device)
        t1 = clock()
        tensors, grads = _output_grads(out)
        if tensors:
            torch.autograd.backward(tensors, grads)
        _sync(device)
        t2 = clock()
        _zero_grads(module)  # a program's gradients are not kept while others run
        return t1 - t0, t2 - t1

    return once


def time_model(module: torch.nn.Module, inputs: Inputs, device: torch.device,
               warmup: int = 2, runs: int = 5, precision: Precision = "fp32",
               cold: bool = False, clock: Clock = WALL_CLOCK, budget_s: float = 0.0,
               max_runs: int = 0) -> tuple[float, float]:
    """Median (forward, backward) time of a whole training step of the program, without the
    loss: backward starts from all-ones output gradients, so only the model is timed. The forward
    runs under `precision_autocast`, as in launch. On CUDA every clock read follows a
    synchronize: kernels run asynchronously, so the clock alone would time their launch. `cold`:
    the CPU caches are flushed before each run (`flush_cpu_caches`). `clock`: WALL_CLOCK, or on a
    CPU whose core is shared CPU_CLOCK. `budget_s`: after `runs` timed runs, more until that much
    wall time has passed since the first timed one (whatever `clock` times), at most `max_runs`
    in all: a fixed cost in the user's time, the same whether the core is shared or not."""
    return time_interleaved([(module, inputs)], device, warmup, runs, precision, cold, clock,
                            budget_s, max_runs)[0]


def time_interleaved(programs: Sequence[TimedProgram], device: torch.device,
                     warmup: int = 2, runs: int = 5, precision: Precision = "fp32",
                     cold: bool = False, clock: Clock = WALL_CLOCK, budget_s: float = 0.0,
                     max_runs: int = 0,
                     each_round: Callable[[], None] | None = None) -> list[tuple[float, float]]:
    """`time_model` of several programs at once, in rounds of one run each, so that whatever
    the machine does meanwhile (a shared VM's slower minute) falls on all of them alike: their
    ratios are taken in the same moments. A profile's micro-batch sizes are such programs, and
    the solver compares shapes through their ratios (measured on this repository's VM: the
    per-sample cost of an MLP at 1024 over 512 spread with a standard deviation of 0.02-0.04
    over eight profiles timed one size after the other, 0.010-0.012 timed in rounds).
    `budget_s` is per program: the rounds go on, after `runs`, until `budget_s` times the
    number of programs has passed. `each_round` runs after every timed round (a speed probe:
    partc.cost.speed_probe), outside the programs' times."""
    steps = [_step_timer(m, i, device, precision, cold, clock) for m, i in programs]
    for _ in range(warmup):
        for once in steps:
            once()
    times: list[list[tuple[float, float]]] = [[] for _ in steps]
    budget = budget_s * len(steps)
    started = WALL_CLOCK()
    while len(times[0]) < runs or (len(times[0]) < max_runs
                                   and WALL_CLOCK() - started < budget):
        for once, timed in zip(steps, times, strict=True):
            timed.append(once())
        if each_round is not None:
            each_round()
    return [(statistics.median(f for f, _ in timed), statistics.median(b for _, b in timed))
            for timed in times]


@dataclass(frozen=True)
class LossCost:
    """The model file's loss function on one micro-batch (`time_loss`)."""

    forward_s: float  # median
    backward_s: float  # median
    # what its autograd graph keeps between its forward and backward, beyond its own inputs (the
    # model's outputs as handed to it, and the target), which the runtime holds anyway:
    # cross-entropy's log-probabilities, a copy the function makes of a non-contiguous target
    saved_bytes: int


def time_loss(module: torch.fx.GraphModule, inputs: Inputs, loss_fn: Callable[[Any, Any], Any],
              target: Any, device: torch.device, warmup: int = 2, runs: int = 5,
              precision: Precision = "fp32", clock: Clock = WALL_CLOCK) -> LossCost:
    """Median (forward, backward) time (`clock`, as time_model's) of the loss function alone, as
    launch's last stage runs it: on the model's outputs (computed under `precision_autocast`,
    floating ones in fp32 as the last stage hands them over), outside autocast, its backward ending
    at the outputs' gradients; and the bytes it saves for its backward (one more, untimed pass
    under saved-tensor hooks). `target` is one batch's target at the inputs' batch size, on
    `device`."""
    args, kwargs = inputs
    with torch.no_grad(), precision_autocast(precision, device.type):
        out = module(*args, **kwargs)
    flat, spec = pytree.tree_flatten(out)

    def handed_over() -> tuple[Any, list[Any]]:
        leaves = [t.detach().float().requires_grad_(True)
                  if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in flat]
        return pytree.tree_unflatten(leaves, spec), leaves

    fwd: list[float] = []
    bwd: list[float] = []
    for i in range(warmup + runs):
        outputs, leaves = handed_over()
        _sync(device)
        t0 = clock()
        loss = loss_fn(outputs, target)
        _sync(device)
        t1 = clock()
        if isinstance(loss, torch.Tensor) and loss.requires_grad:
            loss.backward()
        _sync(device)
        t2 = clock()
        del loss, outputs, leaves
        if i >= warmup:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
    outputs, leaves = handed_over()
    held = {storage_key(t)
            for t in pytree.tree_leaves((leaves, target)) if isinstance(t, torch.Tensor)}
    saved: dict[int, int] = {}  # (the loss's graph keeps them alive: no key is reused)

    def pack(t: torch.Tensor) -> torch.Tensor:
        if (key := storage_key(t)) not in held:
            saved[key] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_fn(outputs, target)
    del loss, outputs, leaves
    return LossCost(statistics.median(fwd), statistics.median(bwd), sum(saved.values()))


def _event_time_us(event: Any, device: torch.device) -> float:
    return float(event.device_time_total if device.type == "cuda" else event.cpu_time_total)


def _claim_autograd_nodes(result: Any, claimed: set[Any]) -> list[Any]:
    """The autograd nodes a graph node's `result` created that no earlier node claimed: walked
    from its tensors' grad_fns down to the leaves' AccumulateGrad, and now claimed (so each
    autograd node belongs to the FX node that created it)."""
    found = []
    # next_functions holds None where an input needs no gradient.
    stack: list[torch.autograd.graph.Node | None] = [
        t.grad_fn for t in pytree.tree_leaves(result)
        if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    while stack:
        fn = stack.pop()
        if fn is None or fn in claimed:
            continue
        claimed.add(fn)
        found.append(fn)
        if type(fn).__name__ != "AccumulateGrad":
            stack.extend(g for g, _ in fn.next_functions)
    return found


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
        for fn in _claim_autograd_nodes(result, claimed):
            if type(fn).__name__ != "AccumulateGrad":
                seq_owner[fn._sequence_nr()] = name

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


def _clock_once(module: torch.fx.GraphModule, flat: list[Any], device: torch.device,
                precision: Precision = "fp32", clock: Clock = WALL_CLOCK
                ) -> tuple[dict[str, float], dict[str, float], float, set[str], dict[str, int]]:
    """One fwd+bwd timed by `clock` on the CPU (module docstring): per-node forward and
    backward microseconds, the backward's unattributed microseconds (the engine between autograd
    nodes), the nodes with a backward and each one's autograd-node count."""
    owner = node_owner(module)
    claimed: set[Any] = set()
    fwd: dict[str, float] = {}
    bwd: dict[str, float] = {}
    counts: dict[str, int] = {}
    handles: list[Any] = []
    started: dict[int, float] = {}

    def timed(fn: Any, name: str) -> None:
        key = id(fn)

        def pre(*_: Any) -> None:
            started[key] = clock()

        def post(*_: Any) -> None:
            bwd[name] = bwd.get(name, 0.0) + (clock() - started.pop(key)) * 1e6

        handles.append(fn.register_prehook(pre))
        handles.append(fn.register_hook(post))
        counts[name] = counts.get(name, 0) + 1

    def after(n: torch.fx.Node, result: Any) -> None:
        name = owner.get(n.name, n.name)
        for fn in _claim_autograd_nodes(result, claimed):
            timed(fn, name)

    @contextlib.contextmanager
    def around(n: torch.fx.Node) -> Iterator[None]:
        start = clock()
        try:
            yield
        finally:
            name = owner.get(n.name, n.name)
            fwd[name] = fwd.get(name, 0.0) + (clock() - start) * 1e6

    _zero_grads(module)
    flush_cpu_caches()
    try:
        with precision_autocast(precision, device.type):
            out = NodeRunner(module, around, after).run(*flat)
        tensors, grads = _output_grads(out)
        start = clock()
        if tensors:
            torch.autograd.backward(tensors, grads)
        total = (clock() - start) * 1e6
    finally:
        for handle in handles:
            handle.remove()
    _zero_grads(module)
    unattributed = max(0.0, total - sum(bwd.values()))
    return fwd, bwd, unattributed, set(counts), counts


def time_nodes(module: torch.fx.GraphModule, inputs: Inputs, batch_size: int,
               device: torch.device, warmup: int = 3, runs: int = 5,
               precision: Precision = "fp32", clock: Clock = WALL_CLOCK) -> TorchTiming:
    """Per-node forward/backward times of the program on `device`, forward under
    `precision_autocast(precision)` (the module docstring says how, per device); on a CPU by
    `clock` (CPU_CLOCK where the core is shared). The whole-model times are the nodes' sums:
    the program's own totals are timed by `time_totals` (of `totals_program`), with the other
    sizes of a profile in the same rounds."""
    flat = flat_inputs(module, inputs)
    if device.type == "cpu":
        return _clocked_nodes(module, flat, batch_size, device, warmup, runs, precision, clock)
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
    model_fwd, model_bwd = sum(node_fwd.values()), sum(node_bwd.values())
    return TorchTiming(batch_size=batch_size, model_forward_s=model_fwd, model_backward_s=model_bwd,
                       node_forward_s={n: v for n, v in node_fwd.items() if v > 0},
                       node_backward_s={n: v for n, v in node_bwd.items() if v > 0},
                       unattributed_backward_s=median([u for _, _, u in per_run]),
                       differentiable=frozenset(differentiable), runs=runs)


def _clocked_nodes(module: torch.fx.GraphModule, flat: list[Any], batch_size: int,
                   device: torch.device, warmup: int, runs: int,
                   precision: Precision, clock: Clock = WALL_CLOCK) -> TorchTiming:
    """`time_nodes` on the CPU: `clock` medians per node (`_clock_once`), the engine's time
    between autograd nodes spread by autograd-node count; the model's times are their sums."""
    per_run: list[tuple[dict[str, float], dict[str, float], float]] = []
    differentiable: set[str] = set()
    counts: dict[str, int] = {}
    # the first runs are slow (allocator and interpreter paths)
    for i in range(warmup + runs):
        fwd, bwd, unattributed, with_backward, counts = _clock_once(module, flat, device,
                                                                    precision, clock)
        differentiable |= with_backward
        if i >= warmup:
            per_run.append((fwd, bwd, unattributed))
    names = sorted({n for f, b, _ in per_run for n in (*f, *b)})
    median = lambda vals: statistics.median(vals) * 1e-6  # noqa: E731  (us -> s)
    node_fwd = {n: median([f.get(n, 0.0) for f, _, _ in per_run]) for n in names}
    node_bwd = {n: median([b.get(n, 0.0) for _, b, _ in per_run]) for n in names}
    engine = median([u for _, _, u in per_run])
    autograd_nodes = sum(counts.values())
    if autograd_nodes:
        for n, count in counts.items():
            node_bwd[n] = node_bwd.get(n, 0.0) + engine * count / autograd_nodes
    node_fwd = {n: v for n, v in node_fwd.items() if v > 0}
    node_bwd = {n: v for n, v in node_bwd.items() if v > 0}
    return TorchTiming(batch_size=batch_size, model_forward_s=sum(node_fwd.values()),
                       model_backward_s=sum(node_bwd.values()), node_forward_s=node_fwd,
                       node_backward_s=node_bwd, unattributed_backward_s=0.0,
                       differentiable=frozenset(differentiable), runs=runs)


TOTALS_BUDGET_S = 1.0  # the wall time a CPU profile spends timing a size's totals
TOTALS_MAX_RUNS = 100


def totals_program(module: torch.fx.GraphModule, inputs: Inputs,
                   device: torch.device) -> TimedProgram | None:
    """What times a program's whole-model totals (`time_totals`): on a CPU the program as
    TorchScript, the form launch's stage files run in, on the flat inputs (None when it cannot
    be scripted: the caller keeps the per-node sums); elsewhere the program itself, on the
    model's own (args, kwargs)."""
    if device.type != "cpu":
        return module, inputs
    flat = flat_inputs(module, inputs)
    scripted = script_program(module, flat)
    return (scripted, (tuple(flat), {})) if scripted is not None else None


def time_totals(programs: Sequence[TimedProgram], device: torch.device,
                warmup: int, runs: int, precision: Precision,
                clock: Clock = WALL_CLOCK,
                budget_s: float = TOTALS_BUDGET_S,
                each_round: Callable[[], None] | None = None) -> list[tuple[float, float]]:
    """The whole-model (forward, backward) medians of `totals_program`s, timed in rounds
    (`time_interleaved`). On a CPU they decide every stage's time: each program is timed for
    `budget_s` (default TOTALS_BUDGET_S) of wall time (this VM's run-to-run spread is +-5-15%
    over a handful of runs; medians of many settle it), from cold caches as a stage's pass
    starts. Wall time, not `clock`'s: on a shared core CPU time passes at a fraction of the
    wall's, and a CPU-time budget doubled cpu-4 compiles (with the neighbours spinning
    throughout). `each_round`: time_interleaved's."""
    if device.type != "cpu":
        return time_interleaved(programs, device, warmup, runs, precision,
                                each_round=each_round)
    with torch.jit.optimized_execution(False):
        return time_interleaved(programs, device, warmup, runs, precision, cold=True,
                                clock=clock, budget_s=budget_s, max_runs=TOTALS_MAX_RUNS,
                                each_round=each_round)

_FLUSH: list[torch.Tensor] = []


def flush_cpu_caches() -> None:
    """Write a buffer twice the last-level cache (32 MiB when sysfs does not say): a pipeline
    stage's passes start cold, other micro-batches' work and transfers having run in between,
    while back-to-back timing runs find the previous run's data cached (measured on a BERT stage
    here: 5% slower forward from cold)."""
    if not _FLUSH:
        size = 32 << 20
        try:
            text = Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
            size = int(text[:-1]) << (10 if text.endswith("K") else 20 if text.endswith("M")
                                      else 0)
        except (OSError, ValueError):
            pass
        _FLUSH.append(torch.empty(min(2 * size, 1 << 30), dtype=torch.uint8))
    _FLUSH[0].add_(1)


@contextlib.contextmanager
def buffers_restored(module: torch.nn.Module) -> Iterator[None]:
    """Measurements run forward in training mode, which updates buffers in place (batch-norm
    statistics); those are the model's own state, which later passes (emit) save: put them back."""
    before = {n: t.detach().clone() for n, t in module.named_buffers() if not t.is_meta}
    try:
        yield
    finally:
        with torch.no_grad():
            for n, t in module.named_buffers():
                if n in before:
                    t.copy_(before[n])


def script_program(module: torch.fx.GraphModule,
                   flat: list[Any]) -> torch.jit.ScriptModule | None:
    """The program as TorchScript, traced from its graph at these flat inputs the way compile
    traces stage files (partc.emit.stage_code), or None when it cannot be (a non-tensor input,
    an op the tracer rejects): the caller then keeps the interpreter's times."""
    if not all(isinstance(t, torch.Tensor) for t in flat):
        return None
    with warnings.catch_warnings():
        # copying the graph copies its pytree specs: torch's own LeafSpec deprecation notice
        warnings.simplefilter("ignore", FutureWarning)
        graph = copy.deepcopy(module.graph)
    graph._codegen = torch.fx.graph.CodeGen()  # flat placeholders in, flat outputs out
    flat_module = torch.fx.GraphModule(module, graph)
    try:
        # tracing runs the program in training mode: its buffers (shared with `module`) are put
        # back, or a plan's batch-norm statistics would depend on whether its profile was cached
        with warnings.catch_warnings(), torch.jit.optimized_execution(False), \
                buffers_restored(flat_module):
            warnings.simplefilter("ignore")  # TracerWarnings on export graphs
            return torch.jit.trace(flat_module, tuple(flat), check_trace=False, strict=False)
    except Exception:  # tracing is an optimisation of the totals here, never a requirement
        return None
