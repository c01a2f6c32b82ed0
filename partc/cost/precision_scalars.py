"""Scalars a bfloat16 tensor cannot hold, saturated to its range, for a program run under
bf16-mixed.

A model captured in float32 bakes the captured dtype's sentinels into its graph: Hugging Face
fills masked attention scores with `torch.finfo(scores.dtype).min`, -3.4028e38 in float32
(DeBERTa-v2's `masked_fill`). Under bf16-mixed's autocast those scores are bfloat16, whose
largest finite value is 3.3895e38, and torch refuses to convert the scalar ("value cannot be
converted to type c10::BFloat16 without overflow"). Eagerly under autocast the model would have
read `finfo(bfloat16).min`: `saturate_scalars` rewrites every such scalar to the bfloat16 limit
of the same sign, which is that value. On a tensor that stays float32 the rewritten scalar is
still a sentinel of the same sign, 0.4% smaller.

Only operators that convert a scalar argument to their tensor's dtype, and so fail on it, are
rewritten: `masked_fill`, `fill`, `clamp`, `clamp_min`, `clamp_max`, `full_like`. Arithmetic
(`mul`, `add`) promotes instead and gives an infinity, as it would eagerly.

Pre: an FX GraphModule of aten operators (an exported program's module, or a stage's).
Post: the same module, recompiled, every listed scalar within the bfloat16 range; the count of
rewritten arguments is returned. fp32 programs are left alone.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.fx

from partc.options import Precision

aten = torch.ops.aten

# operator -> (position, keyword) of every scalar it converts to its tensor's dtype
_CONVERTED_SCALARS: dict[Any, tuple[tuple[int, str], ...]] = {
    aten.masked_fill.Scalar: ((2, "value"),),
    aten.masked_fill_.Scalar: ((2, "value"),),
    aten.fill.Scalar: ((1, "value"),),
    aten.fill_.Scalar: ((1, "value"),),
    aten.clamp.default: ((1, "min"), (2, "max")),
    aten.clamp_min.default: ((1, "min"),),
    aten.clamp_max.default: ((1, "max"),),
    aten.full_like.default: ((1, "fill_value"),),
}


def saturate_scalars(module: torch.fx.GraphModule, precision: Precision) -> int:
    """Rewrite `module` in place for `precision` (module docstring); the number of scalars
    rewritten (0 for fp32, and for programs with no out-of-range scalar)."""
    if precision != "bf16-mixed":
        return 0
    limit = torch.finfo(torch.bfloat16).max
    changed = 0
    for node in module.graph.nodes:
        spots = _CONVERTED_SCALARS.get(node.target) if node.op == "call_function" else None
        if not spots:
            continue
        args, kwargs = list(node.args), dict(node.kwargs)
        for index, name in spots:
            if index < len(args) and _beyond(args[index], limit):
                args[index] = math.copysign(limit, args[index])
                changed += 1
            elif name in kwargs and _beyond(kwargs[name], limit):
                kwargs[name] = math.copysign(limit, kwargs[name])
                changed += 1
        node.args, node.kwargs = tuple(args), kwargs
    if changed:
        module.recompile()
    return changed


def _beyond(value: Any, limit: float) -> bool:
    return isinstance(value, float) and math.isfinite(value) and abs(value) > limit
