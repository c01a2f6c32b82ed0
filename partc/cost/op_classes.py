"""Operator classes: which kind of work an operator kind is, for pricing it.

The class picks the device efficiency (configs/devices/*.yaml gives one per class) and the default
backward/forward ratio of the analytic model; `FREE_KINDS` are run-time metadata checks that cost
nothing and move nothing.
"""
from __future__ import annotations

from partc.graph.opgraph import OpNode

# Operator kind -> class; the class picks the device efficiency and the default backward ratio.
_OP_CLASS_KINDS: dict[str, tuple[str, ...]] = {
    "matmul": ("mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "linear", "einsum", "_int_mm",
               "addmv", "mv", "dot", "bilinear",
               # grouped (mixture-of-experts) matmuls; transformers' fallback for them
               "_grouped_mm", "grouped_mm", "grouped_mm_fallback"),
    "conv": ("convolution", "_convolution", "conv1d", "conv2d", "conv3d", "conv_transpose1d",
             "conv_transpose2d", "conv_transpose3d", "cudnn_convolution", "mkldnn_convolution"),
    "attention": ("scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
                  "_scaled_dot_product_flash_attention_for_cpu",
                  "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention"),
    "norm": ("layer_norm", "native_layer_norm", "batch_norm", "native_batch_norm",
             "_native_batch_norm_legit", "_native_batch_norm_legit_functional",
             "_native_batch_norm_legit_no_training", "group_norm", "native_group_norm",
             "instance_norm", "rms_norm", "_fused_rms_norm"),
    "reduction": ("sum", "mean", "amax", "amin", "max", "min", "argmax", "argmin", "var", "std",
                  "var_mean", "softmax", "_softmax", "log_softmax", "_log_softmax", "logsumexp",
                  "cumsum", "cumprod", "norm", "linalg_vector_norm", "prod", "any", "all",
                  "adaptive_avg_pool2d", "avg_pool2d", "max_pool2d", "max_pool2d_with_indices",
                  "adaptive_avg_pool1d", "avg_pool1d", "max_pool1d"),
    "gather": ("embedding", "embedding_bag", "_embedding_bag", "index_select", "gather", "index",
               "take", "scatter", "scatter_add", "index_put", "index_put_", "index_add"),
    "copy": ("clone", "_to_copy", "copy", "copy_", "contiguous", "cat", "stack", "repeat",
             "constant_pad_nd", "pad", "roll", "flip", "tril", "triu", "new_ones", "new_zeros",
             "zeros", "ones", "full", "arange", "zeros_like", "ones_like", "full_like",
             "slice_scatter", "select_scatter", "masked_scatter"),
}
OP_CLASS: dict[str, str] = {kind: cls for cls, kinds in _OP_CLASS_KINDS.items() for kind in kinds}

# Ops that only check metadata at run time: no kernel, no time.
FREE_KINDS = frozenset({"_assert_tensor_metadata", "_assert_scalar", "sym_size", "sym_numel",
                        "_assert_async", "sym_constrain_range_for_size"})


def held_params(node: OpNode) -> tuple[str, ...]:
    """The parameters and buffers `node` computes with, which its stage holds: none for a
    run-time metadata check. Stage files drop those checks (partc.emit.stage_graph), so a
    check of a weight placed on another stage than the weight's user (export checks the
    dtype of an HF RMSNorm's `weight.float()`; nothing ties the check to a stage) holds
    nothing there."""
    return () if node.kind in FREE_KINDS else node.params


def op_class(kind: str) -> str:
    """The cost class of an operator kind ('linear' -> 'matmul'); pointwise ops -> 'elementwise'."""
    cls = OP_CLASS.get(kind)
    if cls is not None:
        return cls
    return "elementwise" if kind not in FREE_KINDS else "other"

