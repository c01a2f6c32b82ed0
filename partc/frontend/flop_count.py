"""FLOP counting with torch.utils.flop_counter, completed for ops its registry misses.

torch 2.13's registry prices the CUDA attention kernels but not the CPU flash-attention kernel
(`_scaled_dot_product_flash_attention_for_cpu`, which sdpa without an explicit mask dispatches to
for CPU tensors, real or fake), so attention would count 0 FLOPs there. (On meta tensors sdpa takes
the math path, two bmm's, which torch counts the same way.) partc maps those ops to
torch's own sdpa formulas (`sdpa_flop_count`, `sdpa_backward_flop_count`): same convention as on
CUDA (full S x S, causal masking not discounted).
"""
from __future__ import annotations

from typing import Any

import torch
from torch.utils import flop_counter

aten = torch.ops.aten


def _sdpa_cpu(query_shape: Any, key_shape: Any, value_shape: Any, *args: Any,
              out_shape: Any = None, **kwargs: Any) -> int:
    return flop_counter.sdpa_flop_count(query_shape, key_shape, value_shape)


def _sdpa_cpu_backward(grad_out_shape: Any, query_shape: Any, key_shape: Any, value_shape: Any,
                       *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    return flop_counter.sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape,
                                                 value_shape)


def extra_formulas() -> dict[Any, Any]:
    """Formulas for ops missing from torch's flop registry (only those still missing)."""
    extra: dict[Any, Any] = {}
    for op, formula in ((aten._scaled_dot_product_flash_attention_for_cpu, _sdpa_cpu),
                        (aten._scaled_dot_product_flash_attention_for_cpu_backward,
                         _sdpa_cpu_backward)):
        if op not in flop_counter.flop_registry:
            extra[op] = formula
    return extra


def flop_counter_mode() -> flop_counter.FlopCounterMode:
    """A silent FlopCounterMode that also prices CPU flash attention."""
    return flop_counter.FlopCounterMode(display=False, custom_mapping=extra_formulas())
