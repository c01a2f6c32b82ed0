"""FLOP counting with torch.utils.flop_counter, completed for ops its registry misses.

torch 2.13's registry prices the CUDA attention kernels but not the CPU flash-attention kernel
(`_scaled_dot_product_flash_attention_for_cpu`, which sdpa without an explicit mask dispatches to
for CPU tensors, real or fake), so attention would count 0 FLOPs there. (On meta tensors sdpa takes
the math path, two bmm's, which torch counts the same way.) partc maps those ops to
torch's own sdpa formulas (`sdpa_flop_count`, `sdpa_backward_flop_count`): same convention as on
CUDA (full S x S, causal masking not discounted).

Nor does it price grouped matrix multiplications, the experts of mixture-of-experts layers:
`aten._grouped_mm` (what `torch.nn.functional.grouped_mm` runs) and Hugging Face's
`transformers::grouped_mm_fallback` (a torch.library operator its MoE layers call where
grouped_mm cannot run, under torch.export in fp32 among others), so an MoE model's expert
FLOPs, most of its compute, would count 0. `_grouped_mm_flops` counts them from the shapes.
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


def _grouped_mm_flops(a_shape: Any, b_shape: Any, *args: Any, out_shape: Any = None,
                      **kwargs: Any) -> int:
    """2 x multiply-adds of a grouped matmul, every layout `torch._grouped_mm` takes: (S, K) rows
    by G (K, N) weights (each row multiplies its group's: 2 S K N, the MoE forward), G (M, K) by
    G (K, N) (batched), (M, K_total) by (K_total, N) grouped along K, and (G, M, K) by
    (K, N_total) grouped along N (2 M K_total N and 2 M K N_total: the weight gradients)."""
    a, b = tuple(a_shape), tuple(b_shape)
    if len(a) == 2 and len(b) == 3:
        return 2 * a[0] * a[1] * b[2]
    if len(a) == 3 and len(b) == 3:
        return 2 * a[0] * a[1] * a[2] * b[2]
    if len(a) == 2 and len(b) == 2:
        return 2 * a[0] * a[1] * b[1]
    if len(a) == 3 and len(b) == 2:
        return 2 * a[1] * a[2] * b[1]
    return 0


def _registered(namespace: str, name: str) -> Any:
    """The operator packet torch.ops.<namespace>.<name>, or None where no imported library
    registered it (transformers' operators exist once its MoE integration is imported)."""
    try:
        return getattr(getattr(torch.ops, namespace), name)
    except (AttributeError, RuntimeError):
        return None


def extra_formulas() -> dict[Any, Any]:
    """Formulas for ops missing from torch's flop registry (only those still missing, and
    only operators registered in this process)."""
    extra: dict[Any, Any] = {}
    for op, formula in ((aten._scaled_dot_product_flash_attention_for_cpu, _sdpa_cpu),
                        (aten._scaled_dot_product_flash_attention_for_cpu_backward,
                         _sdpa_cpu_backward),
                        (_registered("aten", "_grouped_mm"), _grouped_mm_flops),
                        (_registered("transformers", "grouped_mm_fallback"), _grouped_mm_flops)):
        if op is not None and op not in flop_counter.flop_registry:
            extra[op] = formula
    return extra


def flop_counter_mode() -> flop_counter.FlopCounterMode:
    """A silent FlopCounterMode that also prices CPU flash attention."""
    return flop_counter.FlopCounterMode(display=False, custom_mapping=extra_formulas())
