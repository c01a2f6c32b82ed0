"""Which dtype every tensor of an OpGraph has when the graph runs under a training precision.

The OpGraph is captured in the model's own dtypes (float32 for almost every model). Under
`bf16-mixed`, `partc launch` runs each stage under `torch.autocast(device, torch.bfloat16)`, which
changes operator by operator what runs in bfloat16 (PyTorch's autocast op lists,
https://pytorch.org/docs/stable/amp.html#autocast-op-reference):

- matrix operators (linear, matmul, bmm, conv, scaled_dot_product_attention, ...) cast their
  floating inputs, weights included, to bfloat16 and compute in bfloat16;
- numerically sensitive operators run in float32, casting bfloat16 inputs up: on CUDA norms,
  softmax, losses, exp/log/pow and sums; on a CPU only losses, a few reductions and linear
  algebra (`CPU_FLOAT32_KINDS`: its norms, softmax and pointwise ops keep their input's dtype);
- every other operator runs in the widest floating dtype of its inputs (type promotion), so a
  residual add of a float32 stream and a bfloat16 projection stays float32.

`autocast_dtypes` replays those rules over the graph in topological order. The roofline then
prices each node at its compute dtype and the bytes it moves in those dtypes, plus the cast
kernels autocast inserts in front of it. Torch-free: the op lists are names of aten overload
packets, the same `OpNode.kind` the OpGraph records.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Collection

from partc.graph.opgraph import FLOATING_DTYPES, OpGraph, OpNode, Param, TensorSpec, dtype_bytes
from partc.options import Precision

# Autocast's "lower precision" ops (CUDA and CPU lists, united: the captured kinds are the same
# aten packets on both). They compute in the autocast dtype.
LOWER_PRECISION_KINDS = frozenset({
    "mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "linear", "einsum", "addmv", "mv",
    "addr", "chain_matmul", "linalg_multi_dot", "linalg_vecdot", "prelu",
    "convolution", "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d",
    "conv_transpose2d", "conv_transpose3d",
    "scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_native_multi_head_attention",
})

# Autocast's float32 ops on CUDA: they run in float32 whatever their inputs are.
FLOAT32_KINDS = frozenset({
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
    "reciprocal", "rsqrt", "sinh", "tan", "pow", "softplus", "layer_norm", "native_layer_norm",
    "group_norm", "native_group_norm", "norm", "frobenius_norm", "nuclear_norm",
    "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
    "nll_loss_forward", "nll_loss2d_forward", "hinge_embedding_loss", "kl_div", "l1_loss",
    "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss", "multilabel_margin_loss",
    "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss", "cross_entropy",
    "cross_entropy_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm",
    "logsumexp", "softmax", "_softmax", "log_softmax", "_log_softmax", "softmin", "cumsum",
    "cumprod", "prod", "sum", "linalg_vector_norm",
})

# A CPU's float32 ops (AutocastCPU's fp32 policy; tests/cost/test_precision_and_kernels.py checks
# the list against torch's own dispatcher): losses, a few reductions, 3-D pooling, padding, FFTs
# and linear algebra. Pointwise ops, norms, softmax and sums are not among them: on a CPU they run
# in their input's dtype, so a GELU of a bfloat16 projection computes (and hands on) bfloat16.
# Composite kinds whose inner op is cast count as theirs (cross_entropy -> cross_entropy_loss).
CPU_FLOAT32_KINDS = frozenset({
    "prod", "cdist", "trace", "polar", "quantile", "nanquantile", "stft", "view_as_complex",
    "binary_cross_entropy", "binary_cross_entropy_with_logits", "cross_entropy",
    "cross_entropy_loss", "nll_loss", "nll_loss2d", "nll_loss_forward", "nll_loss2d_forward",
    "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "kl_div", "poisson_nll_loss",
    "cosine_embedding_loss", "hinge_embedding_loss", "margin_ranking_loss", "soft_margin_loss",
    "triplet_margin_loss", "multi_margin_loss", "multilabel_margin_loss",
    "multilabel_margin_loss_forward", "ctc_loss",
    "avg_pool3d", "max_pool3d", "adaptive_avg_pool3d", "adaptive_max_pool3d", "max_unpool2d",
    "max_unpool3d", "fractional_max_pool2d", "fractional_max_pool3d", "grid_sampler",
    "grid_sampler_2d", "grid_sampler_3d", "_grid_sampler_2d_cpu_fallback",
    "reflection_pad1d", "reflection_pad2d", "replication_pad1d", "replication_pad2d",
    "replication_pad3d",
    "fft_fft", "fft_ifft", "fft_fft2", "fft_ifft2", "fft_fftn", "fft_ifftn", "fft_rfft",
    "fft_irfft", "fft_rfft2", "fft_irfft2", "fft_rfftn", "fft_irfftn", "fft_hfft", "fft_ihfft",
    "cholesky", "cholesky_inverse", "cholesky_solve", "inverse", "lu_solve", "orgqr", "ormqr",
    "pinverse", "geqrf", "_lu_with_info", "qr", "svd", "triangular_solve",
    "fake_quantize_per_tensor_affine", "linalg_cond", "linalg_matrix_rank", "linalg_solve",
    "linalg_cholesky", "linalg_cholesky_ex", "linalg_svdvals", "linalg_eigvals",
    "linalg_eigvalsh", "linalg_eig", "linalg_eigh", "linalg_inv", "linalg_inv_ex",
    "linalg_householder_product", "linalg_tensorinv", "linalg_tensorsolve", "linalg_qr",
    "linalg_svd", "linalg_lstsq",
})


def float32_kinds(device_kind: str) -> frozenset[str]:
    """The kinds autocast runs in float32 on a `device_kind` device: a CPU's own list, else
    CUDA's (`FLOAT32_KINDS`)."""
    return CPU_FLOAT32_KINDS if device_kind == "cpu" else FLOAT32_KINDS


AUTOCAST_DTYPE: dict[str, str] = {"bf16-mixed": "bfloat16"}

# Ops outside both lists whose kernels take float32 parameters beside a lower-precision input and
# give the input's dtype (mixed-type batch norm), where type promotion would say float32.
INPUT_DTYPE_KINDS = frozenset({
    "batch_norm", "native_batch_norm", "_native_batch_norm_legit",
    "_native_batch_norm_legit_no_training", "_native_batch_norm_legit_functional",
    "cudnn_batch_norm", "miopen_batch_norm", "instance_norm",
})

# Ops whose saved tensors are not floating point whatever the compute dtype: dropout keeps a bool
# mask. (Ops with no floating input, such as embedding lookups, keep integer indices.)
# Dropouts that save a bool mask, by the device kind that runs them: native_dropout everywhere,
# and dropout on CUDA, which runs it fused as native_dropout. Elsewhere dropout (and feature or
# alpha dropout everywhere) multiplies by a noise tensor of its input's dtype and saves that.
BOOL_MASK_KINDS: dict[str, frozenset[str]] = {
    "cuda": frozenset({"native_dropout", "dropout"}),
    "cpu": frozenset({"native_dropout"}),
}


def keeps_integers(node: OpNode, graph: OpGraph, device_kind: str) -> bool:
    """Whether what the node saves for backward on a `device_kind` device keeps its size under
    bf16 compute: masks and indices, not floating activations (nor a dropout's noise)."""
    if node.kind in BOOL_MASK_KINDS.get(device_kind, BOOL_MASK_KINDS["cpu"]):
        return True
    return not any(graph.tensor(t).dtype in FLOATING_DTYPES for t in node.inputs)


# Matrix ops with an additive bias operand (linear's and addmm's bias, a convolution's): the bias
# enters the output's sum, so its backward needs no copy of it (its gradient is a reduction of
# the output's). Told apart from the weight by rank: a 1-D parameter beside a 2-D or higher one.
BIASED_KINDS = frozenset({
    "linear", "addmm", "addmv", "addbmm", "baddbmm", "addr",
    "convolution", "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc",
    "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
})


def cast_params(node: OpNode, graph: OpGraph, precision: Precision) -> list[Param]:
    """The node's distinct trainable floating parameters that `precision`'s autocast casts to
    its low dtype when the node runs (a matrix op's operands): autocast caches each such cast of
    a leaf that requires grad until the forward's autocast region ends, whether or not the
    backward keeps it (`weight_copies_bytes`)."""
    low = AUTOCAST_DTYPE.get(precision)
    if low is None or node.kind not in LOWER_PRECISION_KINDS:
        return []
    params = [graph.param(name) for name in dict.fromkeys(node.params)]
    return [p for p in params if p.kind == "parameter" and p.trainable
            and p.dtype in FLOATING_DTYPES and p.dtype != low]


def is_bias(node: OpNode, graph: OpGraph, param: Param) -> bool:
    """Whether `param` is `node`'s additive bias (BIASED_KINDS: 1-D beside a weight of rank 2 or
    more), which the node's backward does not keep."""
    if node.kind not in BIASED_KINDS or len(param.shape) != 1:
        return False
    return any(len(graph.param(q).shape) >= 2 for q in node.params)


def kept_copies(node: OpNode, graph: OpGraph, precision: Precision,
                requires: Collection[str]) -> list[Param]:
    """The `cast_params` whose low-precision copies the node's backward keeps: a matrix op's
    weights, to form its input's gradient; none when no activation input needs a gradient
    (`requires`: the tensors that do), as on the first layer over the data, and never an
    additive bias (`is_bias`), whose cached copy is gone when the forward ends."""
    if not any(t in requires for t in node.inputs):
        return []
    return [p for p in cast_params(node, graph, precision) if not is_bias(node, graph, p)]


def weight_copies_bytes(node: OpNode, graph: OpGraph, precision: Precision,
                        requires: set[str]) -> float:
    """Bytes of the low-precision copies of trainable floating weights a node saves for its
    backward under `precision`'s autocast (`kept_copies`), kept until the micro-batch's backward
    (a fresh copy per micro-batch: autocast's cast cache lives for one forward)."""
    low = AUTOCAST_DTYPE.get(precision)
    if low is None:
        return 0.0
    return float(sum(p.numel * dtype_bytes(low)
                     for p in kept_copies(node, graph, precision, requires)))


@dataclass(frozen=True)
class NodeCast:
    """One node under autocast: the dtype it computes in, the bytes it moves at the dtypes its
    tensors have (`scale` = those bytes / the captured ones), and the cast kernels autocast runs
    in front of it (elements converted, bytes moved, kernels)."""

    compute_dtype: str
    scale: float = 1.0
    cast_bytes: float = 0.0  # converting batch-independent operands (weights): per micro-batch
    cast_bytes_per_sample: float = 0.0  # converting batch-carrying operands (activations)
    cast_kernels: int = 0


@dataclass(frozen=True)
class AutocastDtypes:
    """Every tensor's dtype and every node's `NodeCast` under one precision."""

    precision: Precision
    tensors: dict[str, str] = field(default_factory=dict)
    nodes: dict[str, NodeCast] = field(default_factory=dict)


def _widest(dtypes: list[str]) -> str | None:
    floats = [d for d in dtypes if d in FLOATING_DTYPES]
    if not floats:
        return None
    return max(floats, key=lambda d: (dtype_bytes(d), d != "float16"))


def autocast_dtypes(graph: OpGraph, precision: Precision, device_kind: str) -> AutocastDtypes:
    """Replay autocast's rules (module docstring) over `graph` for `precision` on a
    `device_kind` device (its float32 list, `float32_kinds`). Under fp32 every tensor keeps its
    captured dtype and every node's scale is 1."""
    low = AUTOCAST_DTYPE.get(precision)
    to_float32 = float32_kinds(device_kind)
    dtypes: dict[str, str] = {t.name: t.dtype for t in graph.inputs}
    for p in graph.params:
        dtypes[p.name] = p.dtype
        for alias in p.aliases:
            dtypes[alias] = p.dtype
    nodes: dict[str, NodeCast] = {}
    for node in graph.nodes:
        specs: list[TensorSpec | Param] = [graph.tensor(t) for t in node.inputs]
        specs += [graph.param(p) for p in node.params]
        operands = [(s.numel, s.dtype, dtypes.get(s.name, s.dtype)) for s in specs]
        batched = [isinstance(s, TensorSpec) and s.batch_dim is not None for s in specs]
        if low is None:
            for t in node.outputs:
                dtypes[t.name] = t.dtype
            nodes[node.name] = NodeCast(compute_dtype=compute_dtype(node))
            continue
        target: str | None
        if node.kind in LOWER_PRECISION_KINDS:
            target = low
        elif node.kind in to_float32:
            target = "float32"
        else:
            target = None  # promotion: no casts, the widest floating input wins
        cast_bytes = cast_per_sample = 0.0
        cast_kernels = 0
        used: list[str] = []
        for (numel, captured, current), per_sample in zip(operands, batched, strict=True):
            if target is not None and current in FLOATING_DTYPES and current != target \
                    and captured in FLOATING_DTYPES:
                moved = numel * (dtype_bytes(current) + dtype_bytes(target))
                if per_sample:
                    cast_per_sample += moved / graph.batch_size
                else:
                    cast_bytes += moved
                cast_kernels += 1
                used.append(target)
            else:
                used.append(current)
        widest = _widest(used)
        if target is None and node.kind in INPUT_DTYPE_KINDS:
            # the activation's dtype (the first input), whatever the parameters' are
            widest = _widest(used[:1]) or widest
        out_dtype = target or widest
        captured_widest = _widest([c for _, c, _ in operands])
        captured_out = _widest([t.dtype for t in node.outputs])
        if target is None and captured_out is not None and captured_out != captured_widest:
            out_dtype = None  # an explicit cast or a creation op: its output dtype is its own
        read_old = sum(n * dtype_bytes(c) for n, c, _ in operands)
        read_new = sum(n * dtype_bytes(u) for (n, _, _), u in zip(operands, used, strict=True))
        write_old = write_new = 0
        for t in node.outputs:
            new = out_dtype if out_dtype is not None and t.dtype in FLOATING_DTYPES else t.dtype
            dtypes[t.name] = new
            write_old += t.numel * dtype_bytes(t.dtype)
            write_new += t.numel * dtype_bytes(new)
        old, new_total = read_old + write_old, read_new + write_new
        compute = low if target == low else compute_dtype(node, dtypes)
        nodes[node.name] = NodeCast(compute_dtype=compute,
                                    scale=new_total / old if old else 1.0,
                                    cast_bytes=cast_bytes, cast_bytes_per_sample=cast_per_sample,
                                    cast_kernels=cast_kernels)
    return AutocastDtypes(precision=precision, tensors=dtypes, nodes=nodes)


def compute_dtype(node: OpNode, dtypes: dict[str, str] | None = None) -> str:
    """The dtype a node computes in: its first floating output's, as `dtypes` (a replay of
    autocast) gives it, else as captured."""
    for t in node.outputs:
        dtype = (dtypes or {}).get(t.name, t.dtype)
        if dtype in FLOATING_DTYPES:
            return dtype
    return "float32"
