"""The memory model: peak bytes per device of one pipeline stage during training.

A stage is a set of OpGraph nodes run on one device (one data-parallel replica of it). Its peak is
the sum of the terms of `StageMemory`, each a formula of the CostTable's per-node numbers, the
stage's boundary tensors, the micro-batch size and count, the schedule and the `TrainingConfig`
(optimizer, precision, activation checkpointing). docs/memory-model.md writes every formula down
and compares the total with torch's measured peak on the example models.

The model follows what torch actually allocates: torch.optim's foreach implementations (the CUDA
default) for the optimizer step, and torch.distributed.pipelining's PipelineStage and schedules for
the buffers between stages (it preallocates one receive buffer per micro-batch, not per in-flight
one). It assumes gradients stay allocated for the whole step (DDP with gradient_as_bucket_view, or
zero_grad(set_to_none=False)) and that the last stage's outputs are not returned to the caller
(schedule.step(..., return_outputs=False)). It uses no torch itself, so the solver can call it in
its inner loop (about 2 ms per call on a 1000-node graph).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any, Collection, Sequence

from partc.cost.autocast import cast_params, kept_copies
from partc.cost.op_classes import FREE_KINDS, held_params, op_class
from partc.cost.table import CostTable, needs_backward
from partc.errors import MemoryConfigError
from partc.graph.opgraph import FLOATING_DTYPES, OpGraph, OpNode, Param, dtype_bytes
from partc.hardware.specs import DEFAULT_CPU_VECTOR_BYTES
from partc.options import SCHEDULES, Precision, Schedule, TrainingConfig, check_choice

_BF16 = 2
_FP32 = 4
_INDEX_BYTES = 8  # int64
# torch's CPU generator state (mt19937 and its cached normal samples), as
# torch.get_rng_state() returns it; tests/solve/test_memory.py checks it against torch
CPU_RNG_STATE_BYTES = 5056


def in_flight_microbatches(schedule: Schedule, stage_index: int, num_stages: int,
                           num_microbatches: int, chunks: int = 1) -> int:
    """Micro-batches whose activations a stage holds at its peak.

    gpipe: all M forwards run before any backward, so M. 1f1b: stage i runs num_stages - i
    warm-up forwards before its first backward (torch's Schedule1F1B), then one forward per
    backward, so min(num_stages - i, M). interleaved-1f1b: `stage_index` is the device's rank in
    the pipeline, `num_stages` the number of ranks and `chunks` the virtual stages per rank; the
    count is in (micro-batch, virtual stage) pairs, each holding about 1/chunks of the device's
    activations. torch's ScheduleInterleaved1F1B runs
    warmup = (chunks - 1) * per_round + 2 * (num_stages - 1 - rank) forwards before its first
    backward, with rounds = max(1, M // num_stages) and per_round = M // rounds, then alternates;
    so the peak is min(warmup + 1, M * chunks).
    """
    check_choice("schedule", schedule, SCHEDULES, MemoryConfigError)
    for name, value, low in (("num_stages", num_stages, 1),
                             ("num_microbatches", num_microbatches, 1),
                             ("chunks", chunks, 1), ("stage_index", stage_index, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise MemoryConfigError(f"{name} must be an integer >= {low}, got {value!r}",
                                    hint="check the pipeline shape passed to the memory model")
    if stage_index >= num_stages:
        raise MemoryConfigError(f"stage_index {stage_index} is out of range for {num_stages} "
                                "stages", hint=f"stages are numbered 0 .. {num_stages - 1}")
    if schedule != "interleaved-1f1b" and chunks != 1:
        raise MemoryConfigError(f"schedule {schedule} has one stage per device, got "
                                f"chunks={chunks}",
                                hint="use chunks > 1 only with interleaved-1f1b")
    m = num_microbatches
    if schedule == "gpipe":
        return m
    if schedule == "1f1b":
        return min(num_stages - stage_index, m)
    rounds = max(1, m // num_stages)
    if m % rounds:
        raise MemoryConfigError(
            f"interleaved-1f1b needs the micro-batch count to be a multiple of its rounds "
            f"({rounds}), got {m}", hint=f"use a multiple of {num_stages} micro-batches")
    per_round = m // rounds
    warmup = (chunks - 1) * per_round + 2 * (num_stages - 1 - stage_index)
    return min(warmup + 1, m * chunks)


@dataclass(frozen=True)
class StageMemory:
    """Peak bytes per device of one stage, by what holds them; `total` is the peak.

    parameters: weights (and buffers) the stage owns; gradients: their gradients; optimizer_state:
    optimizer states (and fp32 master weights under bf16-mixed); activations: tensors saved for
    backward by the in-flight micro-batches; recompute: one micro-batch's recomputed activations
    under checkpointing; communication: the pipeline runtime's receive/send buffers and the input
    micro-batches; workspace: the transient peak on top of all that (backward gradient buffers or
    the optimizer step's temporaries, whichever is larger).
    """

    parameters: int
    gradients: int
    optimizer_state: int
    activations: int
    recompute: int
    communication: int
    workspace: int

    @property
    def total(self) -> int:
        return (self.parameters + self.gradients + self.optimizer_state + self.activations
                + self.recompute + self.communication + self.workspace)

    def to_dict(self) -> dict[str, int]:
        """The terms and the total, in bytes (for plan.yaml and reports)."""
        return {**asdict(self), "total": self.total}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "StageMemory":
        """Read `to_dict`'s output back; ValueError when its total is not the sum of its terms."""
        memory = cls(**{f.name: int(d[f.name]) for f in fields(cls)})
        if "total" in d and d["total"] != memory.total:
            raise ValueError(f"memory total {d['total']} is not the sum of its terms "
                             f"({memory.total})")
        return memory

    @property
    def static(self) -> int:
        """Bytes held for the whole step: weights, gradients and optimizer state."""
        return self.parameters + self.gradients + self.optimizer_state


def stage_boundary(graph: OpGraph, nodes: Collection[str]) -> tuple[list[str], list[str]]:
    """Tensors a stage receives and sends.

    Receives: every input of a node in `nodes` that is produced outside it (graph inputs
    included), in order of first use. Sends: every output of a node in `nodes` that a node outside
    it consumes or that is a graph output, in graph order. Run-time metadata checks
    (`_assert_tensor_metadata` and the like, which cost nothing) neither send nor receive: a stage
    does not ship a tensor only to check its shape.
    """
    receives, sends, _ = _boundary(graph, set(nodes))
    return receives, sends


def _has_node(graph: OpGraph, name: str) -> bool:
    try:
        graph.node(name)
    except KeyError:
        return False
    return True


def _boundary(graph: OpGraph, inside: set[str]) -> tuple[list[str], list[str], set[str]]:
    """stage_boundary's lists, and the stage's outputs that other stages consume."""
    unknown = [name for name in inside if not _has_node(graph, name)]
    if unknown:
        raise MemoryConfigError(f"stage names nodes the graph does not have: "
                                f"{', '.join(sorted(unknown)[:3])}",
                                hint="pass OpGraph node names of this model")
    to_stages: set[str] = set()
    receives: list[str] = []
    seen: set[str] = set()
    for n in graph.nodes:
        if n.kind in FREE_KINDS:
            continue
        if n.name in inside:
            for t in n.inputs:
                if t not in seen and graph.producer(t) not in inside:
                    seen.add(t)
                    receives.append(t)
        else:
            to_stages.update(t for t in n.inputs if graph.producer(t) in inside)
    outputs = {o.tensor for o in graph.outputs}
    sends = [t.name for n in graph.nodes if n.name in inside for t in n.outputs
             if t.name in to_stages or t.name in outputs]
    return receives, sends, to_stages


def usable_memory(device_memory_bytes: int, config: TrainingConfig) -> int:
    """Device memory a stage may plan to fill: the device's bytes minus the config's margin."""
    if isinstance(device_memory_bytes, bool) or not isinstance(device_memory_bytes, int) \
            or device_memory_bytes <= 0:
        raise MemoryConfigError(f"device memory must be a positive number of bytes, got "
                                f"{device_memory_bytes!r}", hint="see the device's memory_bytes")
    return int(device_memory_bytes * (1.0 - config.memory_margin))


# ---- what autograd keeps ----------------------------------------------------------------------
# Ops whose backward keeps their result (derivatives.yaml uses `result`), and ops whose backward
# keeps their floating inputs. Used only to tell whether a boundary tensor's storage is already
# among a stage's saved bytes (the measurement counts each storage once, at its first saver).
# Kinds in neither set are assumed to keep nothing of the tensor: the conservative side, since
# a boundary tensor not found saved is counted as held by the pipeline runtime instead.
_SAVES_RESULT = frozenset({
    "relu", "relu_", "sigmoid", "sigmoid_", "tanh", "tanh_", "exp", "exp_", "exp2", "expm1",
    "sqrt", "rsqrt", "reciprocal", "softmax", "_softmax", "log_softmax", "_log_softmax"})
_SAVES_INPUTS = frozenset({
    "linear", "addmm", "mm", "bmm", "baddbmm", "addbmm", "matmul", "einsum", "mul", "mul_", "div",
    "div_", "layer_norm", "native_layer_norm", "batch_norm", "native_batch_norm",
    "_native_batch_norm_legit", "_native_batch_norm_legit_functional", "group_norm",
    "native_group_norm", "instance_norm", "rms_norm", "_fused_rms_norm", "gelu", "silu", "mish",
    "softplus", "leaky_relu", "hardtanh", "hardswish", "hardsigmoid", "elu", "selu", "celu",
    "conv1d", "conv2d", "conv3d", "convolution", "_convolution", "conv_transpose1d",
    "conv_transpose2d", "conv_transpose3d", "pow", "max_pool1d", "max_pool2d", "max_pool3d",
    "max_pool2d_with_indices", "avg_pool1d", "avg_pool2d", "avg_pool3d", "adaptive_avg_pool1d",
    "adaptive_avg_pool2d", "adaptive_avg_pool3d", "scaled_dot_product_attention", "embedding",
    "log", "sin", "cos", "abs", "clamp", "erf", "square"})


def _graph_cache(graph: OpGraph) -> dict[str, object]:
    """This module's per-graph lookups, stored on the (frozen) graph the way OpGraph caches its
    own indexes."""
    cache = graph.__dict__.get("_memory_cache")
    if cache is None:
        cache = {}
        graph.__dict__["_memory_cache"] = cache
    return cache


def _positions(graph: OpGraph) -> dict[str, int]:
    """Each node's index in the graph's execution order (cached on the graph)."""
    cache = _graph_cache(graph)
    if "position" not in cache:
        cache["position"] = {n.name: i for i, n in enumerate(graph.nodes)}
    return cache["position"]  # type: ignore[return-value]


def _in_order(graph: OpGraph, nodes: Collection[str]) -> list[str]:
    """`nodes` in the graph's execution order."""
    return sorted(nodes, key=_positions(graph).__getitem__)


def differentiable_tensors(graph: OpGraph) -> frozenset[str]:
    """Names of the floating tensors autograd tracks (outputs of nodes that have a backward): the
    ones whose gradient crosses a stage boundary backwards."""
    return _requires_grad(graph)


def _requires_grad(graph: OpGraph) -> frozenset[str]:
    """Floating tensors autograd tracks: outputs of nodes that have a backward."""
    cache = _graph_cache(graph)
    if "requires" not in cache:
        differentiable = needs_backward(graph)
        cache["differentiable"] = frozenset(differentiable)
        cache["requires"] = frozenset(t.name for n in graph.nodes if n.name in differentiable
                                      for t in n.outputs if t.dtype in FLOATING_DTYPES)
    return cache["requires"]  # type: ignore[return-value]


def _kept_as_is(table: CostTable, tensor: str, saver: str, bf16: bool) -> bool:
    """Whether the storage `saver` keeps of `tensor` is the tensor itself (a stage's receive
    buffer, or an output it sends), rather than a copy that a profile counts among its saved
    bytes, beside the receive buffer or the sent output:

    - under bf16-mixed, a tensor of another floating dtype than the one `saver` computes in:
      autocast casts it and the node keeps the cast copy. Measured: GPT-2's `params` stage 1
      received the MLP activation in float32 (1 MiB, the wire dtype of a plan that priced the
      GELU's `pow` in float32 as CUDA's autocast runs it) and the projection kept a 512 KiB
      bfloat16 copy; taking the buffer for the saved tensor put the stage's peak 1 MiB below
      the measured one (a residual stream, float32 + bfloat16, is such a tensor everywhere);
    - an attention input whose kernel keeps a copy (`_attention_keeps_inputs`). Measured: BERT
      cut between its query and key projections, stage 1 receives the query; the CPU's math
      path keeps its scaled copy, and the stage peaked 256 KiB above a model that took the
      receive buffer for it;
    - likewise a sent float32 output that a bfloat16 projection in the stage consumes: the
      projection keeps its bfloat16 copy, and the output itself is held by the send alone.
      Measured: BERT's bf16 `cpsat` stage 0 sends layer 2's normalised input (float32) and
      computes its query projection from it; the model that took the projection's saved copy
      for the sent tensor put the stage's peak 261,632 bytes below the measured one."""
    node = table.graph.node(saver)
    if node.kind == "scaled_dot_product_attention" and not _attention_keeps_inputs(
            table, node, "bf16-mixed" if bf16 else "fp32"):
        return False
    if not bf16:
        return True
    cast = table.autocast("bf16-mixed").nodes.get(saver)
    dtype = table.runtime_dtype(tensor, "bf16-mixed")
    return cast is None or dtype not in FLOATING_DTYPES or cast.compute_dtype == dtype


def _attention_keeps_inputs(table: CostTable, node: OpNode, precision: Precision) -> bool:
    """Whether scaled_dot_product_attention keeps its query, key and value themselves for
    backward: a fused kernel does (CUDA's flash and memory-efficient kernels; a CPU's flash
    kernel, which runs only without dropout), the math path keeps the scaled query and key and
    the heads its matmuls reshape into copies (checked with torch's saved tensors). A fused
    kernel also keeps its own result, which the math path never does, so a table's record of
    which nodes keep their result (`CostTable.keeps_result`) tells which ran where the kernel
    was real: a measured profile, or a CPU's (whose analytic table asks torch's own dispatcher
    with the graph's dropout, partc.cost.activations.attention_kernel). Otherwise it goes by
    the device: CUDA's documented constraints (head size a multiple of 8; 4 in float32), in the
    dtype the attention runs in under the plan's precision, and on a CPU without the record the
    math path (dropout is not in the OpGraph): at worst one input's bytes per micro-batch too
    many where the flash kernel runs."""
    if not node.inputs:
        return False
    if table.keeps_result is not None and (table.source.kind == "measured"
                                           or table.source.device_kind == "cpu"):
        return node.name in table.keeps_result
    if table.source.device_kind != "cuda":
        return False
    query = node.inputs[0]
    head = table.graph.tensor(query).shape[-1:] or (0,)
    return head[0] % (4 if table.runtime_dtype(query, precision) == "float32" else 8) == 0


def _storage_root(graph: OpGraph, tensor: str) -> str:
    """The tensor whose storage `tensor` is: back through the views that made it (a reshape of
    an attention's output that its kernel's layout makes a view)."""
    while (producer := graph.producer(tensor)) is not None:
        node = graph.node(producer)
        if not node.is_view or not node.inputs:
            break
        tensor = node.inputs[0]
    return tensor


def _first_saver(table: CostTable, tensor: str) -> str | None:
    """The node whose saved bytes hold `tensor`'s storage (a profile counts a storage once, on
    the first node that saves it): the first in execution order among the producer of the
    storage (`_storage_root`) if it keeps its result, and the nodes that keep it as an input,
    through views; None if nothing keeps it for backward. Which producers keep their result is
    the table's record (`CostTable.keeps_result`: a fused attention keeps its output, the math
    path does not), or, for a profile without one, the operator's kind."""
    graph = table.graph
    cache = _graph_cache(graph)
    if "consumers" not in cache:
        _requires_grad(graph)
        consumers: dict[str, list[str]] = {}
        for n in graph.nodes:
            for t in dict.fromkeys(n.inputs):
                consumers.setdefault(t, []).append(n.name)
        cache["consumers"] = consumers
        cache["savers"] = {}
    savers: dict[tuple[str, frozenset[str] | None], str | None] = \
        cache["savers"]  # type: ignore[assignment]
    key = (tensor, table.keeps_result)
    if key in savers:
        return savers[key]
    consumers = cache["consumers"]  # type: ignore[assignment]
    position = _positions(graph)
    differentiable: frozenset[str] = cache["differentiable"]  # type: ignore[assignment]
    found: list[str] = []
    root = _storage_root(graph, tensor)
    producer = graph.producer(root)
    if producer is not None and producer in differentiable and (
            producer in table.keeps_result if table.keeps_result is not None
            else graph.node(producer).kind in _SAVES_RESULT):
        found.append(producer)
    stack = [root]
    while stack:
        reaching = stack.pop()
        for name in consumers.get(reaching, ()):
            node = graph.node(name)
            if node.is_view:
                stack.extend(t.name for t in node.outputs)
            elif node.kind in _SAVES_INPUTS and name in differentiable \
                    and not _converted_before_saving(graph, node, reaching):
                found.append(name)
    saver = min(found, key=position.__getitem__) if found else None
    savers[key] = saver
    return saver


def _converted_before_saving(graph: OpGraph, node: OpNode, tensor: str) -> bool:
    """Whether `node` keeps a converted copy of its input `tensor` rather than the tensor itself:
    scaled_dot_product_attention turns a boolean mask into an additive float mask before any
    kernel runs, and it is that copy it keeps (which a measured profile counts in the
    attention's saved bytes). Any boolean input of an attention is its mask (query, key and
    value are floating), wherever it sits among the node's deduplicated inputs. Measured on
    this repository's BERT: its (b, 1, s, s) boolean mask, sent on to the next stage, is held
    per micro-batch in flight by the runtime alone."""
    return node.kind == "scaled_dot_product_attention" and graph.tensor(tensor).dtype == "bool"


# ---- the terms ---------------------------------------------------------------------------------
def _saved_bytes(table: CostTable, nodes: Collection[str], m: float) -> float:
    """Bytes saved for backward by one micro-batch, at the table's precision (a measured profile
    took them under the plan's autocast; the roofline converts its fp32 count)."""
    return table.sum_saved_bytes(nodes, m)


def _tensor_bytes(table: CostTable, tensor: str, m: float, bf16: bool) -> float:
    """Bytes of a tensor at micro-batch m in the dtype it has under the precision's autocast
    (`CostTable.runtime_bytes`; its gradient has the same): a bf16-mixed residual stream stays
    float32, a projection's output is bfloat16, graph inputs (the data) keep their dtype."""
    return table.runtime_bytes(tensor, m, "bf16-mixed" if bf16 else "fp32")


def loss_saved_bytes(table: CostTable, m: float) -> float:
    """What the loss function keeps for its backward per micro-batch of m samples on the last
    stage (`CostTable.loss`), or 0 for a model without floating outputs (no loss to train)."""
    graph = table.graph
    if not any(graph.tensor(o.tensor).dtype in FLOATING_DTYPES for o in graph.outputs):
        return 0.0
    return table.loss.saved.at(m)


def _float32_bytes(table: CostTable, tensor: str, m: float) -> float:
    """Bytes of a floating tensor at micro-batch m cast to float32."""
    return table.tensor_bytes(tensor, m) * _FP32 / dtype_bytes(table.graph.tensor(tensor).dtype)


def _static_bytes(table: CostTable, nodes: Collection[str], config: TrainingConfig,
                  kept_whole: Collection[str] = ()) -> tuple[int, int, int, int]:
    """(parameters, gradients, optimizer state, optimizer-step temporaries) of the stage's
    distinct parameters (tied ones once) and buffers. With the optimizer state sharded
    (`TrainingConfig.optimizer_shards` > 1) the state and temporaries are those of the replica
    whose share (`optimizer_partition`) is the largest: it sets the stage's peak. With the
    gradients sharded too (`TrainingConfig.gradient_shards` > 1) that replica's gradients are
    those of the parameters it owns, of `kept_whole` (parameters other pipeline ranks hold too:
    their copies' gradients are summed across stages) and the others' it holds while their
    buckets fill (`gradient_window`)."""
    graph = table.graph
    params = {}
    for n in nodes:
        for name in held_params(graph.node(n)):
            p = graph.param(name)
            params[p.name] = p
    weights = grads = 0
    # (elements, gradient, state, temporaries, kept whole) of the optimized ones, in graph order
    per_param: list[tuple[int, int, int, int, bool]] = []
    unsharded_state = unsharded_temps = 0
    for p in params.values():
        w, g, s, t = param_memory(p, config)
        weights, grads = weights + w, grads + g
        if g:
            per_param.append((p.numel, g, s, t, p.name in kept_whole))
        unsharded_state, unsharded_temps = unsharded_state + s, unsharded_temps + t
    scalars = config.optimizer_spec.step_scalar_bytes if per_param else 0
    shards = config.optimizer_shards
    if shards == 1 or not per_param:
        return weights, grads, unsharded_state, unsharded_temps + scalars
    owned = optimizer_partition([x[0] for x in per_param], shards)
    sharded_grads = config.gradient_shards > 1
    owner = partition_owners(owned, len(per_param))
    # backward order: the gradients of the stage's last parameters form first
    order = [i for i in reversed(range(len(per_param))) if not per_param[i][4]]
    windows = gradient_window([per_param[i][1] for i in order], [owner[i] for i in order],
                              shards) if sharded_grads else [0] * shards
    kept = sum(x[1] for x in per_param if x[4])  # every replica holds these whole
    best: tuple[int, int, int] | None = None
    for r, part in enumerate(owned):
        state = sum(per_param[i][2] for i in part)
        temps = sum(per_param[i][3] for i in part)
        held = grads if not sharded_grads else windows[r] + kept + sum(
            per_param[i][1] for i in part if not per_param[i][4])
        if best is None or (held + state + temps, state) > (sum(best), best[1]):
            best = (held, state, temps)
    assert best is not None
    return weights, best[0], best[1], best[2] + scalars


# Sharded gradients (partc.run.gradient_sharding) are reduced in buckets, one collective per
# bucket and micro-batch; a replica holds at most one filling bucket per other owner besides the
# gradients it owns. A bucket is about 1/8 of a replica's share of the stage's gradients, so the
# buckets in flight stay near 1/8 of the gradients at any replica count, within bounds that keep
# a collective from being all latency (small) or the window from being large (big).
GRADIENT_BUCKET_SHARE = 8
GRADIENT_BUCKET_MIN_BYTES = 64 << 10
GRADIENT_BUCKET_MAX_BYTES = 32 << 20


def gradient_bucket_bytes(sharded_bytes: int, replicas: int) -> int:
    """The bucket size of a stage whose sharded gradients total `sharded_bytes` over `replicas`
    replicas (see GRADIENT_BUCKET_SHARE)."""
    share = sharded_bytes // max(1, replicas * GRADIENT_BUCKET_SHARE)
    return max(GRADIENT_BUCKET_MIN_BYTES, min(GRADIENT_BUCKET_MAX_BYTES, share))


def gradient_buckets(sizes: Sequence[int], owners: Sequence[int],
                     replicas: int) -> list[list[int]]:
    """The buckets sharded gradients are reduced in: `sizes` (bytes) and `owners` (replica) of
    the parameters in the order their gradients form; each owner's parameters in that order,
    packed into buckets of at most `gradient_bucket_bytes` (a larger parameter is a bucket of
    its own). Buckets in the order they complete (their last member's position); each is a
    list of indices into `sizes`."""
    if len(sizes) != len(owners):
        raise ValueError(f"{len(sizes)} sizes for {len(owners)} owners")
    cap = gradient_bucket_bytes(sum(sizes), replicas)
    open_: dict[int, list[int]] = {}
    filled: dict[int, int] = {}
    buckets: list[list[int]] = []
    for i, (nbytes, r) in enumerate(zip(sizes, owners, strict=True)):
        if r in open_ and filled[r] + nbytes > cap:
            buckets.append(open_.pop(r))
        if r not in open_:
            open_[r], filled[r] = [], 0
        open_[r].append(i)
        filled[r] += nbytes
    buckets += open_.values()
    return sorted(buckets, key=lambda b: b[-1])


def gradient_window(sizes: Sequence[int], owners: Sequence[int], replicas: int) -> list[int]:
    """Per replica, the most bytes of gradients it does not own that it holds at once during a
    backward (`gradient_buckets`' order): those of the other owners' filling buckets, and the
    flat copy a bucket of several parameters is reduced from. A bucket still open when the
    backward ends is reduced then, like one that fills."""
    buckets = gradient_buckets(sizes, owners, replicas)
    complete_at = {b[-1]: b for b in buckets}
    peaks = [0] * replicas
    pending = [0] * replicas  # per owner: bytes of its filling bucket formed so far
    for i, (nbytes, r) in enumerate(zip(sizes, owners, strict=True)):
        pending[r] += nbytes
        bucket = complete_at.get(i)
        if bucket is None:
            continue
        flat = sum(sizes[j] for j in bucket) if len(bucket) > 1 else 0
        pending_total = sum(pending)  # once per bucket, not per replica: R^2 at 512 replicas
        for me in range(replicas):
            peaks[me] = max(peaks[me], pending_total - pending[me] + flat)
        pending[r] -= sum(sizes[j] for j in bucket)
    return peaks


def optimizer_partition(numels: Sequence[int], shards: int) -> list[list[int]]:
    """How torch's ZeroRedundancyOptimizer splits one parameter group over `shards` replicas:
    parameters largest first (equal sizes in their order), each to the replica owning the fewest
    elements so far (the lowest such replica). Per replica, the indices into `numels` it owns
    and steps (its optimizer state lives there alone)."""
    if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
        raise MemoryConfigError(f"shards must be an integer >= 1, got {shards!r}",
                                hint="the replicas the optimizer state is split over")
    owned: list[list[int]] = [[] for _ in range(shards)]
    sizes = [0] * shards
    for i in sorted(range(len(numels)), key=lambda j: -numels[j]):
        r = sizes.index(min(sizes))
        owned[r].append(i)
        sizes[r] += numels[i]
    return owned


def partition_owners(owned: Sequence[Sequence[int]], count: int) -> list[int]:
    """Per index 0..count-1, the replica owning it in `optimizer_partition`'s output."""
    owners = [0] * count
    for r, part in enumerate(owned):
        for i in part:
            owners[i] = r
    return owners


def param_memory(p: Param, config: TrainingConfig) -> tuple[int, int, int, int]:
    """(weights, gradients, optimizer state, optimizer-step temporaries) bytes of one parameter,
    buffer or constant under `config`."""
    bf16 = config.bf16
    spec = config.optimizer_spec
    if p.kind != "parameter":
        return p.nbytes, 0, 0, 0  # buffers and constants: static, no gradient
    if not p.trainable:
        return p.nbytes, 0, 0, 0
    # fp32: everything in the parameter's own dtype. bf16-mixed as launch runs it (torch
    # autocast): the parameters stay float32 and so do their gradients and optimizer state; the
    # bfloat16 copies autocast makes for each micro-batch's forward are saved by its backward,
    # among the saved activations (measured under autocast, or added by the roofline).
    elem = _FP32 if bf16 else dtype_bytes(p.dtype)
    weights = p.numel * elem
    grads = p.numel * elem
    state = p.numel * elem * spec.states + spec.step_counter_bytes
    temps = p.numel * elem if spec.step_temporary else 0
    return weights, grads, state, temps


# Views whose backward is a view of the incoming gradient (a reshape of it), not a new tensor
# (slice, select and expand backwards allocate the input's size).
_GRADIENT_VIEWS = frozenset({
    "view", "_unsafe_view", "reshape", "_reshape_alias", "view_as", "alias", "transpose", "t",
    "permute", "movedim", "swapaxes", "unsqueeze", "squeeze", "flatten", "unflatten"})
# Ops whose backward returns the incoming gradient itself for a same-shaped input: AddBackward0
# hands `grad` to both operands (alpha 1, as `+` and residual connections have it).
_GRADIENT_PASSED = frozenset({"add", "add_"})


def _forwarded_inputs(table: CostTable, node: OpNode, m: float, bf16: bool,
                      requires: frozenset[str]) -> frozenset[str]:
    """The inputs of `node` whose gradient its backward hands on as the incoming one's storage:
    a residual add's operands, a reshape's input; not one broadcast to the output's shape, cast
    to its dtype, or given twice (autograd sums that with itself)."""
    if not (node.kind in _GRADIENT_PASSED or (node.is_view and node.kind in _GRADIENT_VIEWS)) \
            or len(node.outputs) != 1:
        return frozenset()
    out = node.outputs[0]
    graph = table.graph
    numel = math.prod(out.shape)
    nbytes = _tensor_bytes(table, out.name, m, bf16)
    return frozenset(
        t for t in node.inputs
        if t in requires and node.inputs.count(t) == 1
        and (graph.tensor(t).shape == out.shape if node.kind in _GRADIENT_PASSED
             else math.prod(graph.tensor(t).shape) == numel)
        and _tensor_bytes(table, t, m, bf16) == nbytes)


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Half-open index ranges, overlapping or touching ones joined."""
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(r for r in ranges if r[1] > r[0]):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _gradient_storages(graph: OpGraph, ordered: list[str], uses: dict[str, list[int]],
                       produced_at: dict[str, int], forwarded: list[frozenset[str]],
                       preallocated: set[str], made: set[str]) -> dict[str, list[tuple[int, int]]]:
    """The gradient storages of one micro-batch's backward and the node index ranges (forward
    order, half-open) each is alive over. `uses`: node indices reading each tensor, len(ordered)
    for the send of one also sent; `forwarded`: per node, the inputs whose gradient is its
    output's storage (`_forwarded_inputs`); `preallocated`: sent tensors, whose gradient arrives
    in a receive buffer (no storage here); `made`: the tensors the nodes produce that need one."""
    covers: dict[str, list[tuple[int, int]]] = {}
    storage_at_producer: dict[str, str | None] = {}
    # latest producer first: a forwarded gradient is its output's storage, decided before
    for t in sorted(set(uses) | made, key=lambda t: (-produced_at.get(t, -1), t)):
        at = produced_at.get(t, -1)
        u = uses.get(t)
        if not u:  # an output with no use here: its gradient arrives (from the loss, or sent)
            storage_at_producer[t] = None if t in preallocated else t
            if t not in preallocated:
                covers.setdefault(t, []).append((at, at + 1))
            continue
        final = u[-1]  # in forward order: the first backward to form its gradient
        # until a second use's gradient is summed in (after that use's backward), the first
        # one's storage; from then on, the sum
        switch = u[-2] if len(u) >= 2 else max(at, 0)
        first_storage: str | None
        if final == len(ordered):
            # sent and used here: the receive buffer until the last local use's backward, whose
            # gradient (counted at that node, among what it makes) autograd then sums the
            # received one into, in place; a gradient the use hands on (an add's) is the
            # incoming one, held elsewhere too, so the sum is a fresh buffer from there on.
            # Measured: BERT's 4-stage first stage sends its attention block's output and feeds
            # it to the intermediate projection, whose backward peaked with one such gradient
            # (counting the sum there too put the stage 262,144 B over)
            first_storage = None
        elif t in forwarded[final]:
            first_storage = storage_at_producer.get(graph.node(ordered[final]).outputs[0].name,
                                                    t)
        else:
            first_storage = t
        if first_storage is not None:
            covers.setdefault(first_storage, []).append((switch, final))
        if len(u) >= 2:
            covers.setdefault(t, []).append((max(at, 0), switch))
        storage_at_producer[t] = first_storage if len(u) == 1 else t
    return covers


def _backward_transient(table: CostTable, nodes: list[str], m: float, bf16: bool,
                        requires: frozenset[str], pinned: dict[str, float],
                        preallocated: set[str], fresh: bool = False,
                        threads: int = 1) -> tuple[float, float]:
    """Peak of one micro-batch's backward above its saved activations, and of that the
    parameters' `.grad` bytes (0 unless `fresh`).

    While node n's backward runs, the micro-batch still holds what the nodes before n saved (the
    later ones have freed theirs), plus the gradient arriving for n's outputs, the ones n makes for
    its inputs and its parameters (a fresh gradient is added into the resident one afterwards), and
    the gradients autograd is summing for every tensor and parameter used both after n and at or
    before n (residual streams, tied or reused weights). `pinned`: saved bytes (by saving node)
    that the pipeline runtime keeps referenced until the micro-batch's backward ends (its sent
    outputs), so they are not freed on the way; `preallocated`: outputs whose gradient arrives in a
    receive buffer that already exists. The largest such sum, minus the micro-batch's saved bytes,
    is what the backward adds on top. `fresh`: the step's first backward when gradients are freed
    between steps: a parameter's `.grad` is allocated when the backward has passed all its uses,
    so it counts from there on, not before.
    """
    graph = table.graph
    ordered = _in_order(graph, nodes)
    # Fresh parameter gradients per node, and each parameter's first and last use in the stage.
    own: list[float] = []
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    grad_size: dict[str, float] = {}
    for i, name in enumerate(ordered):
        total = 0.0
        for pname in dict.fromkeys(graph.param(p).name for p in held_params(graph.node(name))):
            p = graph.param(pname)
            if p.kind != "parameter" or not p.trainable:
                continue
            grad_size[pname] = p.numel * (_BF16 if bf16 else dtype_bytes(p.dtype))
            total += grad_size[pname]
            first.setdefault(pname, i)
            last[pname] = i
        own.append(total)
    # A tensor's gradient lives from its last use's backward to its producer's (to the end of the
    # backward for a received tensor: it accumulates in the input's .grad): through the backward
    # of every node in between, those of the other branches of a fork (the other projections of
    # an attention, a residual block's shortcut) and, for a tensor used by several nodes (a
    # residual stream), while autograd sums it. Some backwards hand the incoming gradient on
    # as it is (`_forwarded_inputs`: an add's, a reshape's): their inputs' gradients are that
    # storage itself until another use's gradient is summed into it, so it counts once, and not
    # at all where it is a receive buffer (the communication term has it).
    produced_at = {t.name: i for i, name in enumerate(ordered) for t in graph.node(name).outputs}
    uses: dict[str, list[int]] = {}
    for i, name in enumerate(ordered):
        for t in dict.fromkeys(graph.node(name).inputs):
            if t in requires:
                uses.setdefault(t, []).append(i)
    # An output both sent and used here: its gradient is the received one plus the local uses',
    # summed by autograd into a fresh buffer (the receive buffer is kept), as if the send were
    # one more use after every node.
    for t in preallocated:
        if t in uses:
            uses[t].append(len(ordered))
    forwarded = [_forwarded_inputs(table, graph.node(name), m, bf16, requires)
                 for name in ordered]
    covers = _gradient_storages(graph, ordered, uses, produced_at, forwarded, preallocated,
                                made={t for t in produced_at if t in requires})
    spans = [(lo, last[p], grad_size[p]) for p, lo in first.items()]
    for storage, ranges in covers.items():
        nbytes = _tensor_bytes(table, storage, m, bf16)
        for lo, hi in _merged(ranges):
            spans.append((lo, hi, nbytes))
    pending = [0.0] * (len(ordered) + 1)  # difference array over [first index, last index)
    for lo, hi, nbytes in spans:
        if hi > lo:
            pending[lo] += nbytes
            pending[hi] -= nbytes
    # `.grad` bytes the step's first backward has allocated once it reaches node i: parameters
    # all of whose uses come after i (in the parameter's own dtype; bf16-mixed: float32)
    allocated = [0.0] * (len(ordered) + 1)
    if fresh:
        for pname, lo in first.items():
            p = graph.param(pname)
            allocated[lo] += p.numel * (_FP32 if bf16 else dtype_bytes(p.dtype))
        for i in range(len(ordered) - 1, -1, -1):
            allocated[i] += allocated[i + 1]
    prefix = held = peak = 0.0
    grads_at_peak = 0.0
    still_pinned = sum(pinned.values())
    for i, name in enumerate(ordered):
        node = graph.node(name)
        held += pending[i]
        still_pinned -= pinned.get(name, 0.0)
        saved = table.saved_bytes(name, m)
        if saved:
            prefix += saved
        made = [t for t in set(node.inputs) if t in requires and t not in forwarded[i]]
        if node.is_view or (not made and forwarded[i]):
            continue  # its backward allocates nothing: the incoming gradient is passed on
        grads = sum(_tensor_bytes(table, t, m, bf16) for t in made)
        grads += kernel_scratch(table, node, m, bf16, requires, threads)
        here = prefix + still_pinned + grads + own[i] + held + allocated[i + 1]
        if here > peak:
            peak, grads_at_peak = here, allocated[i + 1]
    return max(0.0, peak - prefix), grads_at_peak


# oneDNN's CPU convolution backward reorders its operands into blocked layouts and keeps the
# copies while it runs, besides the gradients it returns (measured with torch.profiler on this
# CPU over 20 convolutions, 1x1 to 7x7, 3 to 128 channels, strides 1 and 2; docs/memory-model.md):
# a blocked copy of the input and one of the output gradient (input + output bytes); when it also
# forms the input gradient of a strided convolution, that gradient is formed at full input size
# too (2 x input bytes, which is at least input + output); and the input's channels are padded to
# the vector block, a register of floats (16 on AVX-512, 8 on AVX2: measured on both), when its
# gradient is formed (`conv_channel_block`). Where the weights outweigh the activations (small
# images, small micro-batches) it is a weight-sized copy instead.
def conv_channel_block(table: CostTable) -> int:
    """Channels oneDNN's CPU convolution blocks its input by: float32 lanes of the table's CPU
    (`CostTable.cpu_vector_bytes`)."""
    return (table.cpu_vector_bytes or DEFAULT_CPU_VECTOR_BYTES) // _FP32


def _attention_operands(graph: OpGraph, node: OpNode) -> tuple[str, str, str, str | None] | None:
    """(query, key, value, mask) of a scaled_dot_product_attention node, from its distinct tensor
    inputs in argument order: query, key and value where they differ (the key is the second
    distinct floating input, the query itself when all three are one), then the mask (boolean,
    or a fourth floating input); None without a floating input."""
    floating = [t for t in node.inputs if graph.tensor(t).dtype in FLOATING_DTYPES]
    if not floating:
        return None
    booleans = [t for t in node.inputs if graph.tensor(t).dtype == "bool"]
    query = floating[0]
    key = floating[1] if len(floating) > 1 else query
    value = floating[2] if len(floating) > 2 else key
    mask = booleans[0] if booleans else floating[3] if len(floating) > 3 else None
    return query, key, value, mask


def _cpu_attention_scratch(table: CostTable, node: OpNode, bf16: bool, threads: int) -> float:
    """What torch's CPU flash-attention backward (FlashAttentionKernel.cpp) allocates besides
    the gradients it returns. It works through the sequence in blocks of qSplit queries x kvSplit
    keys and allocates, per intra-op thread (`threads`), a float32 buffer for one block's
    attention and its gradient (and a copy of both in a 16-bit computing precision) and a row
    sum of qSplit floats; qSplit is 32, 64 or 256 as the query length passes 192 and 768,
    kvSplit 512 (neither above the length). Independent of the batch. Measured with
    torch.profiler in fp32 (tests/solve/test_memory.py), exact from 8 to 1,000 positions at one
    thread (at two, one row sum over: the threads' row sums need not be alive together), with
    q, k, v and the output's gradient laid out as attention layers make them (transposes of
    (batch, positions, heads, head size)); a gradient arriving in another layout is first copied
    (not counted), and the 16-bit copies are the kernel source's, not measured here. The query
    length is the output's; the key length that of the key, the node's second distinct floating
    input (its first when query, key and value are one)."""
    graph = table.graph
    operands = _attention_operands(graph, node)
    if operands is None or not node.outputs:
        return 0.0
    q_shape = node.outputs[0].shape
    kv_shape = graph.tensor(operands[1]).shape
    if len(q_shape) < 2 or len(kv_shape) < 2:
        return 0.0
    q_len, kv_len = q_shape[-2], kv_shape[-2]
    q_split = min(256 if q_len >= 768 else 64 if q_len >= 192 else 32, q_len)
    kv_split = min(512, kv_len)
    block = 2 * q_split * kv_split
    per_thread = block * _FP32 + (block * _BF16 if bf16 else 0) + q_split * _FP32
    return max(1, threads) * per_thread


# x ** scalar: its backward's temporaries (kernel_scratch); a tensor exponent is another formula
_POW_KINDS = frozenset({"pow"})


def kernel_scratch(table: CostTable, node: OpNode, m: float, bf16: bool,
                   requires: Collection[str] = (), threads: int = 1) -> float:
    """Bytes a node's backward kernel allocates besides the gradients it forms, on the table's
    device: the CPU's convolution backward (see `conv_channel_block`), its flash-attention
    backward (`_cpu_attention_scratch`) and its matrix multiplies' working buffers (measured:
    `CostTable.gemm_scratch_bytes`), per intra-op thread where the kernel keeps one per thread
    (`threads`, what launch gives each process, `ClusterSpec.threads_per_device`). `requires`:
    the tensors that get a gradient (whether the convolution forms its input's). On every
    device: the temporaries of autograd formulas that compose several ops (`_POW_KINDS`)."""
    if node.kind in _POW_KINDS and len(set(node.inputs)) == 1 and node.inputs[0] in requires:
        # pow_backward is grad * (exponent * self.pow(exponent - 1)): both factors, the size of
        # the result, are alive while the product forms (traced on HF GPT-2's tanh GELU,
        # x + 0.044715 * x**3, whose stage peaked there 1 MiB above the model)
        return 2.0 * sum(_tensor_bytes(table, t.name, m, bf16) for t in node.outputs)
    if table.source.device_kind != "cpu" or not node.inputs:
        return 0.0
    if node.kind == "scaled_dot_product_attention":
        return _cpu_attention_scratch(table, node, bf16, threads)
    if op_class(node.kind) == "matmul":
        # the largest working buffer any GEMM call of the model took, measured at one thread
        # (oneDNN keeps one per thread); 0 where the table did not measure it
        return float(table.gemm_scratch_bytes * threads)
    if op_class(node.kind) != "conv":
        return 0.0
    graph = table.graph
    x = node.inputs[0]
    x_spec = graph.tensor(x)
    out_bytes = sum(_tensor_bytes(table, t.name, m, bf16) for t in node.outputs)
    in_bytes = _tensor_bytes(table, x, m, bf16)
    if x not in requires:
        return max(in_bytes + out_bytes, trainable_weight_bytes(graph, node, bf16))
    channels = x_spec.shape[1] if len(x_spec.shape) > 1 else 1
    block = conv_channel_block(table)
    if 0 < channels < block:
        in_bytes *= block / channels
    out_spec = node.outputs[0] if node.outputs else None
    strided = out_spec is not None and math.prod(out_spec.shape[2:]) < math.prod(x_spec.shape[2:])
    scratch = max(in_bytes + out_bytes, 2.0 * in_bytes) if strided else in_bytes + out_bytes
    return max(scratch, trainable_weight_bytes(graph, node, bf16))


def _cpu_math_attention_forward(table: CostTable, node: OpNode, m: float, bf16: bool) -> float:
    """What torch's math-path scaled_dot_product_attention (a CPU's, under dropout) holds at its
    forward's end besides what it saves for backward and its output: the scaled query, whose
    contiguous copy its matmul saves instead, and the mask as an additive float tensor (a boolean
    mask converted; a causal one made, the query length x the key length; the OpGraph does not
    record `is_causal`, so an attention without a mask input is priced as causal, at most that
    many bytes over). Under bf16-mixed the CPU's math path computes in float32: float32 copies of
    query, key and value, its float32 result before the cast back, and the probabilities cast to
    bfloat16 for the product with the value; the mask it converts in bfloat16 (a float mask too,
    as autocast casts it), and autocast's bfloat16 copies of float32 inputs. Measured with
    torch.profiler against saved_tensors_hooks (tests/solve/test_memory.py), exact over
    query/key lengths, head sizes, masks and both precisions."""
    graph = table.graph
    operands = _attention_operands(graph, node)
    if operands is None or not node.outputs:
        return 0.0
    query, key, value, mask = operands
    out = node.outputs[0].name
    q_shape, k_shape = graph.tensor(query).shape, graph.tensor(key).shape
    if len(q_shape) < 2 or len(k_shape) < 2:
        return 0.0

    def elements(tensor: str) -> float:  # at micro-batch m, whatever its dtype
        return table.tensor_bytes(tensor, m) / dtype_bytes(graph.tensor(tensor).dtype)

    q_len, k_len = q_shape[-2], k_shape[-2]
    # the probabilities: (batch, heads, queries, keys), as many rows as the query has vectors
    probabilities = elements(query) / q_shape[-1] * k_len
    mask_bytes = _BF16 if bf16 else _FP32
    made: float
    if mask is None:
        made = q_len * k_len * _FP32
    elif graph.tensor(mask).dtype == "bool" or bf16:
        made = elements(mask) * mask_bytes
    else:
        made = 0.0
    if not bf16:
        return _FP32 * elements(query) + made
    upcast = _FP32 * (elements(query) + elements(key) + elements(value))
    # autocast's bfloat16 copies of the inputs that reach the attention in float32
    upcast += _BF16 * sum(elements(t) for t in (query, key, value, mask) if t is not None
                          and table.runtime_dtype(t, "bf16-mixed") == "float32")
    return upcast + _FP32 * elements(query) + _FP32 * elements(out) \
        + _BF16 * probabilities + made


def forward_scratch(table: CostTable, node: OpNode, m: float, bf16: bool) -> float:
    """Bytes a node's forward holds at its peak besides what it saves for backward and its
    outputs, on the table's device: a CPU's math-path attention (`_cpu_math_attention_forward`),
    where the attention did not run a fused kernel (`_attention_keeps_inputs`). Other kernels'
    forward scratch is not modelled (a CPU's flash attention holds about 8-20 KB per thread)."""
    if node.kind != "scaled_dot_product_attention" or table.source.device_kind != "cpu":
        return 0.0
    if _attention_keeps_inputs(table, node, "bf16-mixed" if bf16 else "fp32"):
        return 0.0
    return _cpu_math_attention_forward(table, node, m, bf16)


def _forward_transient(table: CostTable, nodes: list[str], m: float, bf16: bool,
                       held: Collection[str]) -> float:
    """Peak of one micro-batch's forward above what it holds when the forward ends (its saved
    bytes and `held`: the outputs the pipeline runtime keeps, which the stage makes), or 0.

    While node n runs, the micro-batch holds what the nodes up to n saved, every tensor made
    before n that a later node reads and nothing keeps yet (an attention's query, key and value
    on the math path, which keeps copies; a residual stream until the add), n's outputs, and
    n's forward scratch (`forward_scratch`). A tensor a node keeps as it is counts among that
    node's saved bytes from there on; a received tensor is a receive buffer (communication)."""
    graph = table.graph
    ordered = _in_order(graph, nodes)
    index = {name: i for i, name in enumerate(ordered)}
    last_use: dict[str, int] = {}
    for i, name in enumerate(ordered):
        for t in graph.node(name).inputs:
            last_use[_storage_root(graph, t)] = i
    kept_to_end = {_storage_root(graph, t) for t in held}
    live = [0.0] * (len(ordered) + 1)  # difference array: storages made by the nodes
    at_end = 0.0
    for i, name in enumerate(ordered):
        node = graph.node(name)
        if node.is_view or (node.kind.endswith("_") and not node.kind.startswith("_")):
            continue  # a view, or an in-place op: the input's storage
        for spec in node.outputs:
            nbytes = _tensor_bytes(table, spec.name, m, bf16)
            if spec.name in kept_to_end:
                end = len(ordered)
                at_end += nbytes
            else:
                saver = _first_saver(table, spec.name)
                kept_at = index.get(saver) if saver is not None else None
                if saver is not None and kept_at is not None and kept_at >= i and (
                        saver == name or _kept_as_is(table, spec.name, saver, bf16)):
                    end = kept_at  # from there on among the saver's saved bytes
                else:
                    end = last_use.get(spec.name, i) + 1
            if end > i:
                live[i] += nbytes
                live[end] -= nbytes
    cached = _cast_cache_only(graph, ordered, bf16)
    prefix = current = peak = 0.0
    for i, name in enumerate(ordered):
        node = graph.node(name)
        prefix += table.saved_bytes(name, m)
        current += live[i] + cached[i]
        peak = max(peak, prefix + current + forward_scratch(table, node, m, bf16))
    return max(0.0, peak - prefix - at_end)


def _cast_cache_only(graph: OpGraph, ordered: list[str], bf16: bool) -> list[float]:
    """Per node of a stage's forward (in `ordered`), the bytes of autocast's cast cache it adds
    and that no backward keeps: under bf16-mixed each trainable float32 parameter a matrix op
    casts (`cast_params`) is cached from its first cast until the forward's autocast region ends
    (torch caches casts of leaves that require grad), and the copies the backward keeps are
    saved bytes already (`kept_copies`); what is left, biases and the weights of nodes
    whose inputs need no gradient, is freed when the forward ends. Measured: BERT's and GPT-2's
    bf16 4-stage plans peaked 6,144 B over the model in a middle stage's forward, its eight
    256-element and one 1024-element bias copies."""
    out = [0.0] * len(ordered)
    if not bf16:
        return out
    requires = _requires_grad(graph)
    kept: set[str] = set()
    first: dict[str, tuple[int, Param]] = {}
    for i, name in enumerate(ordered):
        node = graph.node(name)
        for p in cast_params(node, graph, "bf16-mixed"):
            first.setdefault(p.name, (i, p))
        kept.update(p.name for p in kept_copies(node, graph, "bf16-mixed", requires))
    for name, (i, p) in first.items():
        if name not in kept:
            out[i] += p.numel * _BF16
    return out


def trainable_weight_bytes(graph: OpGraph, node: OpNode, bf16: bool) -> float:
    """Bytes of a node's distinct trainable weights in the dtype its kernel runs them (and its
    fresh weight gradients are formed in): bfloat16 under bf16-mixed autocast."""
    total = 0.0
    for name in dict.fromkeys(graph.param(q).name for q in held_params(node)):
        p = graph.param(name)
        if p.kind == "parameter" and p.trainable:
            total += p.numel * (_BF16 if bf16 else dtype_bytes(p.dtype))
    return total


def stage_memory(table: CostTable, nodes: Collection[str], *, microbatch_size: int,
                 num_microbatches: int, stage_index: int, num_stages: int, config: TrainingConfig,
                 chunks: int = 1, host_data: float = 0.0,
                 relayed: Collection[str] = (), gradients_resident: bool = True,
                 kept_whole: Collection[str] = (), threads: int = 1) -> StageMemory:
    """Peak memory per device of the stage `nodes` (docs/memory-model.md has every formula).

    `stage_index`/`num_stages`: the device's position in the pipeline; with interleaved-1f1b,
    `nodes` are all the nodes the device runs (its `chunks` virtual stages together) and
    `num_stages` is the number of devices in the pipeline. `host_data`: bytes of the step's data
    the device's process holds besides its input micro-batches, where the device's memory is
    the host's (`host_data_bytes`); counted with the communication buffers. `relayed`: the
    tensors the device passes on from an earlier stage to a later one (once per virtual stage
    that relays it), which the runtime receives, and whose gradients it receives and sends back,
    like any boundary tensor. `gradients_resident`: whether the parameters' gradients stay
    allocated between steps (a DDP bucket holds them, or zero_grad(set_to_none=False)); launch
    frees them on a stage with one replica, where the `gradients` term is then the gradient
    bytes live at the peak (none when the peak comes before the step's first backward formed
    them). `kept_whole`: parameters whose gradients stay whole when the gradients are sharded
    (those other pipeline ranks hold too, `_static_bytes`). `threads`: intra-op threads of the
    device's process (kernels with per-thread scratch, `kernel_scratch`).
    """
    if isinstance(microbatch_size, bool) or not isinstance(microbatch_size, int) \
            or microbatch_size < 1:
        raise MemoryConfigError(f"microbatch_size must be an integer >= 1, got {microbatch_size!r}",
                                hint="the micro-batch size is the global batch / (replicas x M)")
    in_flight = in_flight_microbatches(config.schedule, stage_index, num_stages, num_microbatches,
                                       chunks)
    graph = table.graph
    nodes = list(dict.fromkeys(nodes))
    inside = set(nodes)
    m = microbatch_size
    M = num_microbatches
    bf16 = config.bf16
    ckpt = config.activation_checkpointing
    weights, grads, state, step_temps = _static_bytes(table, nodes, config, kept_whole)
    requires = _requires_grad(graph)

    def size(tensor: str) -> float:
        return _tensor_bytes(table, tensor, m, bf16)

    receives, sends, sent_on = _boundary(graph, inside)
    graph_outputs = {o.tensor for o in graph.outputs}
    to_stages = [t for t in sends if t in sent_on]
    from_stages = [t for t in receives if graph.producer(t) is not None]

    # -- communication: what torch.distributed.pipelining's PipelineStage holds --------------------
    # One receive buffer per micro-batch for every input (M of them, allocated once, not per
    # in-flight micro-batch); on the first stage the M input micro-batches are the data itself.
    communication = M * sum(size(t) for t in receives)
    # One buffer per micro-batch for the gradient of every output sent to another stage.
    communication += M * sum(size(t) for t in to_stages if t in requires)
    # Outputs stay referenced (fwd_cache, send works) until their micro-batch's backward; those the
    # stage also saves for backward are among its activations already (not under checkpointing,
    # which frees them after the forward).
    # A relayed tensor: a receive buffer per micro-batch where the stage does not read it itself
    # (else it shares the one above), and one for its gradient, arriving from the later stage.
    # The stage returns the received tensor itself, so it keeps nothing more in the forward.
    consumed = set(receives)
    communication += M * sum(size(t) for t in relayed if t not in consumed)
    communication += M * sum(size(t) for t in relayed if t in requires)
    last_rank = stage_index == num_stages - 1
    # Under bf16-mixed the last stage hands the loss float32 copies of the model's floating
    # outputs (launch's StageRunner): those copies are what the runtime keeps, whether the stage
    # made the output or received it.
    float_outputs = list(dict.fromkeys(
        o.tensor for o in graph.outputs if graph.tensor(o.tensor).dtype in FLOATING_DTYPES)) \
        if bf16 and last_rank else []
    def keeper(t: str) -> str | None:  # the node of the stage keeping t as is for backward
        saver = _first_saver(table, t)
        if saver is None or saver not in inside:
            return None
        # a producer that keeps its result keeps the tensor itself, in the dtype it made it
        if saver == graph.producer(_storage_root(graph, t)):
            return saver
        return saver if _kept_as_is(table, t, saver, bf16) else None

    kept = [t for t in sends if t not in float_outputs and (ckpt or keeper(t) is None)]
    kept_bytes = sum(size(t) for t in kept) \
        + sum(_float32_bytes(table, t, m) for t in float_outputs)
    communication += in_flight * kept_bytes / chunks
    if last_rank and any(t in graph_outputs for t in sends):
        # the step's M loss values the schedule keeps, and the loss backward's seed: scalars
        communication += (M + 1) * _FP32
    if config.schedule == "1f1b" and in_flight >= 2 and M >= 2 * in_flight - 1:
        # Schedule1F1B keeps the works of its last early warm-up send (micro-batch W - 2 of W
        # warm-up forwards), and so that micro-batch's outputs, to the end of the step: past its
        # backward, which is W - 1 backwards into the steady state. It adds to the peak where W
        # micro-batches are in flight again after that backward, i.e. where a forward of
        # micro-batch 2W - 2 follows it (M >= 2W - 1); else fewer are in flight from then on.
        # Measured (tests/solve/test_memory.py): stage 0 of 3 at M = 4 holds none of it at its
        # peak; stage 0 of 2 and stage 1 of 3 at M = 4 hold it.
        communication += sum(size(t) for t in to_stages)

    # -- activations -------------------------------------------------------------------------------
    # Received tensors the stage saves for backward are the receive buffers above: not twice.
    resaved = sum(size(t) for t in receives if keeper(t) is not None)
    saved = max(0.0, _saved_bytes(table, nodes, m) - resaved)
    # A stage that produces graph outputs computes the loss, which keeps what its autograd graph
    # saves per micro-batch (`CostTable.loss`: measured on the model file's loss function, e.g.
    # cross-entropy's log-probabilities and a copy of a non-contiguous target; analytic, one fp32
    # copy of the floating outputs). Its backward makes gradients the size of the fp32 outputs.
    outputs_fp32 = sum(_float32_bytes(table, t, m) for t in sends
                       if t in graph_outputs and graph.tensor(t).dtype in FLOATING_DTYPES)
    loss = loss_saved_bytes(table, m) if outputs_fp32 else 0.0
    if ckpt:
        # Checkpointing keeps the stage inputs, which are the receive buffers above, and recomputes
        # one micro-batch's activations at a time. The recompute runs the whole forward again
        # (launch turns early stop off), so it also remakes the stage's outputs that nothing in it
        # saves (the logits of an LM head), beside the kept originals until it ends: measured on
        # the transformer example's last stage, 2 MiB of logits twice at its peak.
        per_microbatch = loss / chunks
        remade = sum(size(t) for t in sends if keeper(t) is None)
        recompute = (saved + remade) / chunks
    else:
        per_microbatch = (saved + loss) / chunks
        recompute = 0.0
    activations = in_flight * per_microbatch
    if ckpt and table.source.device_kind == "cpu":
        # torch.utils.checkpoint keeps the CPU generator's state per checkpointed forward, to
        # replay dropout in the recompute: host memory, which is the device's only on a CPU
        activations += in_flight * CPU_RNG_STATE_BYTES

    # Input gradients a backward sends to the previous stage stay referenced by the send. 1F1B:
    # the latest one, through the next forward (steady state) or the next backward (cool-down).
    # GPipe: all of them to the end, in place of the activations the backwards free; they add
    # only where they are larger, as under checkpointing.
    input_grads = sum(size(t) for t in from_stages if t in requires)
    # (a relayed tensor's gradient is sent back too: autograd copies the received one into the
    # input's .grad, since the receive buffer is still referenced)
    input_grads += sum(size(t) for t in relayed if t in requires and t not in consumed)
    # What a micro-batch whose backward is done still holds: its input gradients (above), and under
    # GPipe the outputs it sent that the stage saved (counted among its activations until then):
    # ScheduleGPipe keeps every forward send's work, and so its tensor, to the step's end.
    finished = input_grads
    if config.schedule == "gpipe":
        finished += sum(size(t) for t in to_stages if not ckpt and keeper(t) is not None)
        communication += (M - 1) * max(0.0, finished - per_microbatch)
    elif M > in_flight:
        communication += input_grads
    else:
        communication += max(0.0, input_grads - per_microbatch)

    # -- workspace ---------------------------------------------------------------------------------
    # One micro-batch's backward at a time. Through the stage's nodes its loss tensors are already
    # freed; the loss's own backward holds two output-sized gradients (of the log-softmax and of
    # the outputs) while all the micro-batch's activations are still there, or, under
    # checkpointing, before the recompute brings them back.
    pinned: dict[str, float] = {}  # saved outputs that stay referenced through the backward
    for t in sends:
        if (saver := keeper(t)) is not None and not ckpt:
            pinned[saver] = pinned.get(saver, 0.0) + size(t)
    preallocated = {t for t in to_stages if t in requires}
    through_nodes = _backward_transient(table, nodes, m, bf16, requires, pinned,
                                        preallocated, threads=threads)[0] - loss
    through_loss = 2.0 * outputs_fp32 - (recompute if ckpt else 0.0)
    # A forward holds the micro-batches in flight before it and its own, which can peak above
    # what it keeps (`_forward_transient`): where that is more than a backward's workspace the
    # stage peaks in a forward (measured: a stage ending in a math-path attention, whose query,
    # key and value it reads without keeping). Under checkpointing the recompute is such a
    # forward, inside the backward.
    through_forward = _forward_transient(table, nodes, m, bf16, [*kept, *float_outputs])
    communication = _ceil(communication + host_data)
    if gradients_resident or chunks > 1:
        # The optimizer step runs after the last backward, when activations are gone.
        workspace = max(through_nodes, through_loss, through_forward,
                        step_temps - activations - recompute)
        return StageMemory(parameters=weights, gradients=grads, optimizer_state=state,
                           activations=_ceil(activations), recompute=_ceil(recompute),
                           communication=communication, workspace=_ceil(workspace))
    # Gradients freed between steps (launch's zero_grad(set_to_none=True) without a DDP bucket):
    # the step's first backward runs with every in-flight micro-batch's activations and only the
    # gradients it has formed so far; later backwards with all gradients and the micro-batches
    # still in flight then (one fewer where no forward comes between two backwards: GPipe, or
    # 1F1B with M <= in-flight); the optimizer step with all gradients and no activations.
    fresh, fresh_grads = _backward_transient(table, nodes, m, bf16, requires, pinned,
                                             preallocated, fresh=True, threads=threads)
    fresh -= loss
    # (with the gradients sharded, what a replica keeps of them is at most its sharded share:
    # the others' are reduced away as their buckets fill)
    first_ws, first_grads = (fresh - fresh_grads, min(fresh_grads, float(grads))) \
        if fresh >= through_loss else (through_loss, 0.0)
    if ckpt:
        first_ws = max(first_ws, through_forward)
    # the forwards: before the step's first backward no gradient exists; 1F1B's steady state
    # runs forwards after backwards, with every gradient formed
    forwards_after_backward = config.schedule != "gpipe" and M > in_flight
    phases = [StageMemory(parameters=weights, gradients=_ceil(first_grads),
                          optimizer_state=state, activations=_ceil(activations),
                          recompute=_ceil(recompute), communication=communication,
                          workspace=_ceil(first_ws)),
              StageMemory(parameters=weights, gradients=grads if forwards_after_backward else 0,
                          optimizer_state=state, activations=_ceil(activations), recompute=0,
                          communication=communication, workspace=_ceil(through_forward))]
    after = (in_flight if M > in_flight else in_flight - 1) if M > 1 else 0
    later = after * per_microbatch
    later_recompute = recompute if M > 1 else 0.0
    later_ws = max(through_nodes if M > 1 else 0.0, through_loss if M > 1 else 0.0,
                   through_forward if ckpt and M > 1 else 0.0,
                   step_temps - later - later_recompute)
    # From the second backward on, what the finished micro-batches hold (`finished`) is still there
    # where no forward comes between two backwards (GPipe; 1F1B with M <= in-flight): the
    # communication term counts it only beyond the activations it replaces (the step's end), so
    # the second backward, with one finished and M - 1 micro-batches' activations, adds the rest.
    # Measured: GPT-2's second stage at 4 processes (GPipe, M = 8), its input gradient (524,288 B);
    # the MLP's first of 2 (tests/solve/test_memory.py), its sent ReLU output.
    later_comm = communication
    if M > 1 and (config.schedule == "gpipe" or (config.schedule == "1f1b" and M <= in_flight)):
        later_comm += _ceil(min(finished, per_microbatch))
    phases.append(StageMemory(parameters=weights, gradients=grads, optimizer_state=state,
                              activations=_ceil(later), recompute=_ceil(later_recompute),
                              communication=later_comm, workspace=_ceil(later_ws)))
    return max(phases, key=lambda phase: phase.total)


# launch's per-step metrics (partc.run.runtime): every process fills a float64 row of
# METRICS_RANK_FIELDS values and METRICS_STAGE_FIELDS per stage of the plan, allocated once for
# the run; the first process also holds the gather's copy of every process's row. The gather of
# a step runs during the next one and is waited before the row is filled again, so one set of
# buffers serves (gloo's flat copy of the rows on the first process, during the gather, is
# never alive inside a measured step: launch waits for it before one).
METRICS_RANK_FIELDS = 7
METRICS_STAGE_FIELDS = 8
_FP64 = 8


def metrics_row_bytes(num_stages: int) -> int:
    """Bytes of one process's metrics row in a run of a plan of `num_stages` stages."""
    return _FP64 * (METRICS_RANK_FIELDS + METRICS_STAGE_FIELDS * num_stages)


def host_data_bytes(table: CostTable, device_kind: str, global_batch: int, microbatch_size: int,
                    num_microbatches: int, num_ranks: int, *, num_stages: int,
                    processes: int) -> tuple[float, ...]:
    """Per pipeline rank, the bytes of the step's data its process holds besides the input
    micro-batches of the first stage (which the communication term counts), where a device's
    memory is the host's (a CPU device; a GPU rank's batch sits in host memory, not the GPU's),
    and launch's metrics buffers (`metrics_row_bytes`: every process's row, and on the first
    rank the gathered rows of all `processes`; `num_stages`: the plan's stages, virtual ones
    included).

    launch draws the whole global batch (every replica's) on the ranks of the first and the last
    stage, from the model file's batches(): the first needs the inputs, the last the target, and
    the generator keeps the batch it last yielded (`CostTable.batch_bytes`). The first rank's
    input micro-batches are views of that batch. The last rank also holds the int64 sample index
    of its replica's batch that it hands the schedule as the loss's target (`StageLoss`)."""
    held = [0.0] * num_ranks
    if device_kind != "cpu":
        return tuple(held)
    batch = table.batch_bytes.at(global_batch)
    inputs = num_microbatches * sum(table.tensor_bytes(t.name, microbatch_size)
                                    for t in table.graph.inputs)
    held[0] = max(0.0, batch - inputs)
    if num_ranks > 1:
        held[-1] = batch
    held[-1] += _INDEX_BYTES * microbatch_size * num_microbatches
    row = metrics_row_bytes(num_stages)
    held = [x + row for x in held]
    held[0] += processes * row
    # torch.distributed.pipelining's module-level loss reducer, a float32 scalar in every process
    return tuple(x + _FP32 for x in held)


def _ceil(x: float) -> int:
    return int(math.ceil(x)) if x > 0 else 0
