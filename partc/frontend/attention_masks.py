"""Pass: drop attention masks that a captured program computes from constants and that mask
nothing, or only the future.

Eagerly, HF models leave the mask out of `scaled_dot_product_attention` when nothing is masked
(no padding) and ask for `is_causal=True` when only the future is: attention then runs its flash
kernels (on CUDA, and the CPU's, which skip the masked half of a causal product). Under
torch.export HF cannot tell (it is compiling), so the program materialises the mask: a bool
(batch, 1, queries, keys) tensor built from `arange` and comparisons, all True for a bidirectional
encoder, lower-triangular for a decoder. With a mask, CUDA attention cannot take its flash kernel
(the memory-efficient one with a bias runs instead) and the CPU's computes every block: a stage file
cut from such a program is slower than the model it came from.

For every `aten.scaled_dot_product_attention` whose mask depends on no input, parameter, buffer or
lifted constant (only on literals: shapes are static in an exported program), this pass computes
the mask once on the CPU and rewrites the call when the mask is
- all True (bool) or all zeros (floating): no mask;
- the causal pattern, key j visible to query i exactly when j <= i, over as many keys as queries
  (bool True / floating 0 there, bool False / floating -inf elsewhere): no mask and `is_causal`,
  whose lower-left-aligned triangle is then the same one.
Anything else (padding, sliding windows, a mask from an input) is left as it is, as is a mask
whose values would take more than MAX_MASK_ELEMENTS elements to compute. The rewrite computes the
same attention: a masked-out key gets probability zero either way, and kept keys the same scores.
Mask nodes nothing uses any more are removed.

Pre: `exported` comes from torch.export (training IR, static shapes).
Post: the same program, with no `scaled_dot_product_attention` taking a mask this pass can prove
trivial or causal; every other node unchanged.
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch.export import ExportedProgram

SDPA = torch.ops.aten.scaled_dot_product_attention.default
MAX_MASK_ELEMENTS = 1 << 26  # 64 Mi elements: a 8k x 8k mask, computed once at capture


def simplify_attention_masks(exported: ExportedProgram) -> ExportedProgram:
    """Rewrite `exported` in place as the module docstring says, and return it."""
    graph = exported.graph
    dropped: list[torch.fx.Node] = []
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not SDPA:
            continue
        args = sdpa_arguments(node.args, node.kwargs)
        mask = args["attn_mask"]
        if not isinstance(mask, torch.fx.Node) or args["is_causal"]:
            continue
        value = _constant_value(mask)
        if value is None:
            continue
        kind = _mask_kind(value, node)
        if kind is None:
            continue
        args["attn_mask"] = None
        args["is_causal"] = kind == "causal"
        node.args = (args["query"], args["key"], args["value"], None, args["dropout_p"],
                     args["is_causal"])
        node.kwargs = {k: args[k] for k in ("scale", "enable_gqa") if k in args}
        dropped.append(mask)
    if dropped:
        _remove_unused(dropped)
        graph.lint()
        exported.graph_module.recompile()
    return exported


def _remove_unused(masks: list[torch.fx.Node]) -> None:
    """Erase the dropped masks' computations that nothing uses any more, and only those (a
    graph-wide dead-code pass could drop an unused random op and shift the random stream)."""
    stack = list(dict.fromkeys(masks))  # one mask is often every layer's
    erased: set[torch.fx.Node] = set()
    while stack:
        n = stack.pop()
        if n in erased or any(u.target not in _CHECKS for u in n.users):
            continue
        for check in list(n.users):  # export's checks of the mask's own dtypes, nothing else
            n.graph.erase_node(check)
        inputs = n.all_input_nodes
        n.graph.erase_node(n)
        erased.add(n)
        stack.extend(i for i in inputs if i.op == "call_function")


# Runtime checks torch.export inserts on tensors it computed (dtype, device): they go with the
# mask computation they check.
_CHECKS = frozenset({torch.ops.aten._assert_tensor_metadata.default})


_SCHEMA = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
_DEFAULTS: dict[str, Any] = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False}


def sdpa_arguments(args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The arguments of a `scaled_dot_product_attention` call (an FX node's, or a call's at
    run time) by name, positional or keyword, defaults filled in; `scale` and `enable_gqa` only
    where the call gives them."""
    named = dict(_DEFAULTS)
    named.update(zip(_SCHEMA, args, strict=False))
    named.update(kwargs)
    return named


def _constant_value(mask: torch.fx.Node) -> torch.Tensor | None:
    """The mask's value, computed on the CPU, when it depends on literals only (and stays within
    MAX_MASK_ELEMENTS at every step); None otherwise."""
    order: list[torch.fx.Node] = []
    seen: set[torch.fx.Node] = set()
    stack = [mask]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
            return None  # an input, parameter, buffer, constant, or a Python-level call
        val = n.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.numel() > MAX_MASK_ELEMENTS:
            return None
        if n.target._schema.is_mutable or "nondeterministic_seeded" in n.target.tags:
            return None  # random or in-place: not a constant
        seen.add(n)
        order.append(n)
        stack.extend(n.all_input_nodes)
    values: dict[torch.fx.Node, Any] = {}
    order.sort(key=_position(mask.graph))
    try:
        for n in order:
            op = n.target
            assert isinstance(op, torch._ops.OpOverload)  # checked above
            args, kwargs = torch.fx.node.map_arg((n.args, n.kwargs), lambda a: values[a])
            # (a meta model's `arange(..., device='meta')` runs on the CPU)
            args, kwargs = pytree.tree_map_only(torch.device, lambda _: torch.device("cpu"),
                                                (args, kwargs))
            values[n] = op(*args, **kwargs)
    except Exception:  # noqa: BLE001 - an op that will not run on CPU: leave the mask alone
        return None
    out = values[mask]
    return out if isinstance(out, torch.Tensor) else None


def _position(graph: torch.fx.Graph) -> Any:
    index = {n: i for i, n in enumerate(graph.nodes)}
    return index.__getitem__


def _mask_kind(mask: torch.Tensor, sdpa: torch.fx.Node) -> str | None:
    """"none" for a mask that masks nothing, "causal" for exactly the causal pattern over as many
    keys as queries (broadcast over batch and heads), None otherwise."""
    query = _shape(sdpa.args[0])
    key = _shape(sdpa.args[1])
    if query is None or key is None or mask.dim() < 2:
        return None
    queries, keys = query[-2], key[-2]
    if mask.shape[-1] not in (1, keys) or mask.shape[-2] not in (1, queries):
        return None
    if mask.dtype == torch.bool:
        visible = mask
    elif mask.is_floating_point():
        if not bool(torch.all((mask == 0) | (mask == -math.inf))):
            return None
        visible = mask == 0
    else:
        return None
    if bool(torch.all(visible)):
        return "none"
    if queries != keys:
        return None
    causal = torch.ones(queries, keys, dtype=torch.bool).tril()
    full = visible.expand(*visible.shape[:-2], queries, keys)
    return "causal" if bool(torch.all(full == causal)) else None


def _shape(value: Any) -> tuple[int, ...] | None:
    val = value.meta.get("val") if isinstance(value, torch.fx.Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None
