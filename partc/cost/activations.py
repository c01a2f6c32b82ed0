"""Saved activations: the bytes each OpGraph node keeps for backward, measured in torch.

`torch.autograd.graph.saved_tensors_hooks` sees every tensor autograd keeps for backward while
each node of the captured program runs (node by node, under partc.cost.torch_profiler's
interpreter). Each distinct storage is counted once, on the first node that saves it; parameters
and buffers are not activations and are left out. This runs on the meta device too (storages have
sizes but no data), so it needs no hardware and works for models of any size; `saved_activations`
fits the bytes of the captured B and 2B as a `Linear` of the micro-batch size. It also records
which nodes keep their own result (a ReLU's output, a fused attention kernel's): whether a
tensor's storage is counted on its producer or on a later node that saves it, which the memory
model needs where a stage boundary falls between the two (partc.solve.memory).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
import torch.fx
import torch.utils._pytree as pytree

from partc.cost.table import Linear, SavedActivations
from partc.cost.torch_profiler import (
    NodeRunner,
    allocation_events,
    buffers_restored,
    cpu_memory_profile,
    flat_inputs,
    node_owner,
    precision_autocast,
    program_module,
    storage_key,
)
from partc.frontend.attention_masks import sdpa_arguments
from partc.frontend.export import Capture, quiet_torch
from partc.frontend.model_file import Inputs, inputs_to_meta
from partc.options import Precision


def storage_bytes(tensors: list[Any]) -> int:
    """Bytes of the distinct storages among `tensors` (views of one storage count once). Keyed
    by the storage itself, not its data pointer: every meta tensor's pointer is 0, so a meta
    model's batch would count as its largest tensor alone."""
    storages = {storage_key(t): t.untyped_storage().nbytes()
                for t in tensors if isinstance(t, torch.Tensor)}
    return sum(storages.values())


_SDPA = torch.ops.aten.scaled_dot_product_attention.default
_DROPOUT = torch.ops.aten.dropout.default
_CPU_FLASH = 1  # torch._fused_sdp_choice's value for SDPBackend.FLASH_ATTENTION


def attention_kernel(device_kind: str, query: torch.Tensor, key: torch.Tensor,
                     attn_mask: torch.Tensor | None, dropout_p: float, is_causal: bool,
                     enable_gqa: bool) -> str:
    """The kernel scaled_dot_product_attention runs on a `device_kind` device for these inputs:
    "flash_cpu", "efficient" (CUDA's memory-efficient or flash kernels: both keep the inputs, the
    output and a log-sum-exp per row) or "math" (keeps the b*h*s*s probabilities). CPU asks
    torch's own dispatcher on small tensors of the same dtype, head size, mask and dropout; CUDA
    follows its documented constraints (head size a multiple of 8; 4 in float32)."""
    d = query.shape[-1]
    if device_kind == "cpu":
        def small(t: torch.Tensor) -> torch.Tensor:
            return torch.zeros((1,) * (t.dim() - 2) + (8, t.shape[-1]), dtype=t.dtype,
                               requires_grad=True)
        # a mask that needs a gradient (Swin's learned relative-position bias) rules out the
        # flash kernel: torch's dispatcher sees that on the stand-in too
        mask = None if attn_mask is None else torch.zeros(
            (1,) * (attn_mask.dim() - 2) + (8, 8), dtype=attn_mask.dtype,
            requires_grad=attn_mask.requires_grad and attn_mask.is_floating_point())
        q = small(query)
        k = small(key)
        choice = torch._fused_sdp_choice(q, k, k, mask, dropout_p, is_causal,
                                         enable_gqa=enable_gqa)
        return "flash_cpu" if choice == _CPU_FLASH else "math"
    if device_kind == "cuda" and not enable_gqa and query.dtype in (
            torch.float32, torch.float16, torch.bfloat16):
        return "efficient" if d % (4 if query.dtype == torch.float32 else 8) == 0 else "math"
    return "math"


def _target_attention(kind: str, args: tuple[object, ...],
                      kwargs: dict[str, object]) -> torch.Tensor:
    """Run the target's fused attention kernel on the given (meta) tensors, as autograd would."""
    q, k, v = (t for t in args[:3] if isinstance(t, torch.Tensor))
    named = sdpa_arguments(args, kwargs)
    mask = named["attn_mask"]
    dropout_p = float(named["dropout_p"] or 0.0)
    is_causal = bool(named["is_causal"])
    scale = named.get("scale")
    if isinstance(mask, torch.Tensor) and mask.dtype == torch.bool:
        # what SDPA does before a fused kernel: a boolean mask becomes an additive bias
        mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(
            mask.logical_not(), float("-inf"))
    aten = torch.ops.aten
    if kind == "flash_cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, dropout_p, is_causal, attn_mask=mask, scale=scale)[0]
    return aten._scaled_dot_product_efficient_attention(
        q, k, v, mask, True, dropout_p, is_causal, scale=scale)[0]


def saved_activation_bytes(module: torch.fx.GraphModule, inputs: Inputs,
                           target_kind: str | None = None,
                           keeps_result: set[str] | None = None) -> dict[str, int]:
    """Bytes each node saves for backward in one training forward pass (see the module docstring).
    Works with meta tensors. Nodes that save nothing are absent.

    `target_kind` ("cpu" | "cuda"): the device the plan will train on, when it is not the device
    this runs on (meta, or a CPU pricing a GPU plan). Attention is then counted as the target's
    kernel keeps it (`attention_kernel`) rather than as this device's kernel does: meta runs
    SDPA's math path, which keeps b*h*s*s probabilities that CPU and CUDA fused kernels never
    store, and its output goes on in the layout the target's kernel gives it (where the model's
    transpose back to one row per token is then a view, nothing is copied for the next
    projection to save). For a CUDA target, dropout is counted as CUDA's fused kernel keeps it
    (a bool mask), not as a float noise tensor the size of its input.

    `keeps_result`: filled with the nodes among whose saved (first-counted) storages is their own
    result's: the producer, not a later consumer, holds that storage's bytes."""
    owner = node_owner(module)
    counted: dict[str, set[int]] = {}  # node -> the storages counted on it
    state = {storage_key(t) for t in [*module.parameters(), *module.buffers()]}
    seen: set[int] = set(state)
    keep: list[torch.Tensor] = []  # saved storages stay alive, so keys cannot be reused
    current: list[str] = [""]
    saved: dict[str, int] = {}
    # storages of stand-ins (meta copies) -> the storage they stand for, so a tensor counts once
    stands_for: dict[int, torch.Tensor] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        real = stands_for.get(storage_key(t), t)
        key = storage_key(real)
        if key not in seen:
            seen.add(key)
            keep.append(t)
            name = owner.get(current[0], current[0])
            saved[name] = saved.get(name, 0) + real.untyped_storage().nbytes()
            counted.setdefault(name, set()).add(key)
        return t

    def after(n: torch.fx.Node, result: object) -> None:
        if keeps_result is None:
            return
        name = owner.get(n.name, n.name)
        mine = counted.get(name)
        if not mine:
            return
        for t in pytree.tree_leaves(result):
            if isinstance(t, torch.Tensor) and \
                    storage_key(stands_for.get(storage_key(t), t)) in mine:
                keeps_result.add(name)

    @contextlib.contextmanager
    def around(n: torch.fx.Node) -> Iterator[None]:
        current[0] = n.name
        yield

    def attention(args: tuple[object, ...], kwargs: dict[str, object]) -> object | None:
        """Count the target kernel's saves of an SDPA call, or None to count this device's."""
        q, k = args[0], args[1]
        if target_kind is None or not isinstance(q, torch.Tensor) or \
                not isinstance(k, torch.Tensor):
            return None
        if not q.is_meta and q.device.type == target_kind:
            return None  # this device runs the target's kernels itself
        named = sdpa_arguments(args, kwargs)
        mask = named["attn_mask"]
        kind = attention_kernel(target_kind, q, k, mask if isinstance(mask, torch.Tensor)
                                else None, float(named["dropout_p"] or 0.0),
                                bool(named["is_causal"]), bool(named.get("enable_gqa", False)))
        if kind == "math":
            return None
        with torch.no_grad():
            # this device's kernel computes what flows on; what it would save (a math path's
            # b*h*s*s probabilities) is neither counted nor kept alive
            result = _SDPA(*args, **kwargs)
        if result.is_meta:
            stand_ins = list(args)
        else:
            stand_ins = [a.detach().to("meta").requires_grad_(a.requires_grad)
                         if isinstance(a, torch.Tensor) else a for a in args]
            for a, m in zip(args, stand_ins, strict=True):
                if isinstance(a, torch.Tensor) and isinstance(m, torch.Tensor):
                    keep.append(m)
                    stands_for[storage_key(m)] = a
        target_out = _target_attention(kind, tuple(stand_ins), kwargs)
        # What flows on is the target kernel's output: in its layout (CUDA's efficient kernel
        # writes batch, sequence, heads, dim, so the usual transpose back to one row per token
        # is a view there, where this device's math path output makes the reshape copy, which
        # the next projection would save), and counted as its storage when a later node saves it.
        if result.stride() == target_out.stride():
            flowing = result.detach()
        else:
            flowing = torch.empty_strided(target_out.shape, target_out.stride(),
                                          dtype=result.dtype, device=result.device)
            flowing.copy_(result)
        # a leaf that needs a gradient where the attention's output does, so later nodes save
        # what they would (the backward never runs here)
        flowing.requires_grad_(any(isinstance(a, torch.Tensor) and a.requires_grad
                                   for a in args))
        keep.append(flowing)
        stands_for[storage_key(flowing)] = target_out
        return flowing

    def dropout(args: tuple[object, ...], kwargs: dict[str, object]) -> object | None:
        """CUDA's dropout runs fused (native_dropout) and keeps a bool mask; elsewhere (a CPU,
        meta) dropout multiplies by a noise tensor of the input's dtype and keeps that."""
        x = args[0]
        p = float(args[1] if len(args) > 1 else kwargs.get("p", 0.5))  # type: ignore[arg-type]
        train = bool(args[2] if len(args) > 2 else kwargs.get("train", True))
        if target_kind != "cuda" or not isinstance(x, torch.Tensor) or x.device.type == "cuda" \
                or not train or not 0.0 < p < 1.0 or x.numel() == 0:
            return None
        return torch.ops.aten.native_dropout.default(x, p, train)[0]

    flat = flat_inputs(module, inputs)
    on_meta_device = any(t.is_meta for t in [*module.parameters(), *module.buffers()]) or \
        any(isinstance(t, torch.Tensor) and t.is_meta for t in flat)
    with (torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
          quiet_torch()):
        _KernelRunner(module, around, {_SDPA: attention, _DROPOUT: dropout},
                      devices_to_meta=on_meta_device, after=after).run(*flat)
    return saved


_Kernel = Callable[[tuple[object, ...], dict[str, object]], object | None]


class _KernelRunner(NodeRunner):
    """NodeRunner whose calls of the ops in `kernels` go through their function first, which
    runs the target device's kernel or returns None to run this device's
    (saved_activation_bytes)."""

    def __init__(self, module: torch.fx.GraphModule,
                 around: Callable[[torch.fx.Node], contextlib.AbstractContextManager[Any]],
                 kernels: dict[Any, _Kernel], devices_to_meta: bool = False,
                 after: Callable[[torch.fx.Node, Any], None] | None = None) -> None:
        super().__init__(module, around, after)
        self._kernels = kernels
        self._devices_to_meta = devices_to_meta

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        if self._devices_to_meta:
            # a program captured with real weights names their device (`.to(cpu)`, factories'
            # device=cpu); run on meta copies, every tensor it makes goes to meta too
            args, kwargs = pytree.tree_map_only(torch.device, lambda _: torch.device("meta"),
                                                (args, kwargs))
        kernel = self._kernels.get(target)
        if kernel is not None:
            result = kernel(tuple(args), dict(kwargs))
            if result is not None:
                return result
        return super().call_function(target, args, kwargs)


def saved_activations(capture: Capture, target_kind: str | None = None) -> SavedActivations:
    """Bytes each node saves for backward, fitted over the captured B and 2B, counted as the
    `target_kind` device's kernels keep them (saved_activation_bytes). Runs on the meta device
    (no memory, no device needed): a meta model as it is, a model with real weights on a meta
    copy (`on_meta`), so pricing a large model for a cluster holds none of its activations here;
    where the meta copy cannot run the program (an op whose output shape depends on values), it
    runs where the model lives."""
    points: dict[str, list[tuple[float, float]]] = {}
    keepers: set[str] = set()
    programs = [(capture.batch_size, capture.exported)]
    if capture.scaled is not None:
        programs.append((capture.scaled_batch_size, capture.scaled))
    for b, program in programs:
        module = program_module(program)
        inputs = capture.model_file.inputs(b)
        saved: dict[str, int] | None = None
        found: set[str] = set()
        if capture.on_meta:
            saved = saved_activation_bytes(module, inputs_to_meta(inputs), target_kind, found)
        else:
            # counted for the target, else for the device the model lives on (not meta's kernels)
            lives_on = next((t.device.type for t in module.parameters()), "cpu")
            try:
                saved = saved_activation_bytes(on_meta(module), inputs_to_meta(inputs),
                                               target_kind or lives_on, found)
            except Exception:  # noqa: BLE001 - any op meta cannot run: measure where it lives
                saved = None
            if saved is None:
                found.clear()
                module = program_module(program)  # its own tensors, not the meta copies
                with buffers_restored(module):
                    saved = saved_activation_bytes(module, inputs, target_kind, found)
        keepers |= found
        for name in {n.name for n in program.graph.nodes} | set(saved):
            points.setdefault(name, []).append((float(b), float(saved.get(name, 0))))
        del module
    return SavedActivations(
        bytes={name: Linear.fit(p) for name, p in points.items() if any(v for _, v in p)},
        keeps_result=frozenset(keepers))


def on_meta(module: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """`module` with every parameter, buffer and tensor constant replaced by a meta tensor of its
    shape, dtype and requires_grad, in place (a tensor held under several names, a tied weight,
    stays one tensor); the tensors it held are left as they were (a program's module shares them
    with the exported program, which later passes still need)."""
    stand_ins: dict[int, torch.Tensor] = {}

    def stand_in(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in stand_ins:
            meta = torch.empty_like(t, device="meta")
            stand_ins[id(t)] = torch.nn.Parameter(meta, requires_grad=t.requires_grad) \
                if isinstance(t, torch.nn.Parameter) else meta
        return stand_ins[id(t)]

    names = [n for n, _ in module.named_parameters(remove_duplicate=False)]
    names += [n for n, _ in module.named_buffers(remove_duplicate=False)]
    # tensor constants the graph reads (lifted by export)
    names += [str(n.target) for n in module.graph.nodes if n.op == "get_attr"]
    for name in dict.fromkeys(names):
        owner, _, attr = name.rpartition(".")
        holder = module.get_submodule(owner)
        value = getattr(holder, attr, None)
        if isinstance(value, torch.Tensor) and not value.is_meta:
            setattr(holder, attr, stand_in(value))
    return module


# the matrix-multiply kernels (torch.profiler's names), whatever op dispatched them (linear,
# matmul, an autograd node's backward)
_GEMM_OPS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addbmm"})


def gemm_scratch_bytes(module: torch.fx.GraphModule, inputs: Inputs, device: torch.device,
                       precision: Precision) -> int:
    """The most one matrix-multiply call allocates and frees again before it returns, over a
    training forward (under `precision_autocast`) and backward of the program on a CPU; 0 on
    other devices. The memory model's transients count what a node returns, not its kernels'
    working buffers: CPU bf16 GEMMs (oneDNN) pack blocks of their operands, measured on an Intel
    Xeon with avx512_bf16 at 11 KiB to 1.7 MiB by shape and layout, saturating with the blocks
    (a BERT stage peaked 225 KiB above its prediction inside a weight-gradient GEMM). One
    untimed run first, so first-call allocations (oneDNN's primitive cache) are not counted."""
    if device.type != "cpu":
        return 0
    args, kwargs = inputs

    def step() -> None:
        with precision_autocast(precision, device.type):
            out = module(*args, **kwargs)
        leaves = [t for t in pytree.tree_leaves(out)
                  if isinstance(t, torch.Tensor) and t.requires_grad]
        if leaves:
            torch.autograd.backward(leaves, [torch.ones_like(t) for t in leaves])
        for p in module.parameters():
            p.grad = None

    step()
    with quiet_torch(), cpu_memory_profile() as prof:
        step()
    assert prof.profiler is not None and prof.profiler.kineto_results is not None
    most = 0
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        if event.name not in _GEMM_OPS:
            stack.extend(event.children)
            continue
        allocations = allocation_events(event.children)  # inside this call, in time order
        # each free matched to the allocation of its address open before it: a working buffer
        # (what the call returns is never freed in it; a free of an older block matches none)
        open_at: dict[int, int] = {}
        working: set[int] = set()  # indices of allocations freed within the call
        for i, (_, size, ptr) in enumerate(allocations):
            if size > 0:
                open_at[ptr] = i
            elif ptr in open_at:
                working.add(open_at.pop(ptr))
                working.add(i)
        live = peak = 0
        for i, (_, size, _) in enumerate(allocations):
            if i in working:
                live += size
                peak = max(peak, live)
        most = max(most, peak)
    return most
