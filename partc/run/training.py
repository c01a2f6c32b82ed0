"""What a training run of a plan is, independent of how it is distributed: options, optimizer,
data, seeds, and the single-process reference run that `partc launch` must reproduce.

`partc launch` (partc.run.runtime, one process per device) and `train_single_process` (the whole
model in one process) build their optimizer, draw their batches and seed their steps through the
same functions here, so "the distributed run equals single-process training" is a comparison of
two executions of one definition.
"""
from __future__ import annotations

import zlib
from typing import Any, Iterable, Iterator

import torch
import torch.utils._pytree as pytree

from partc.errors import LaunchError
from partc.frontend.model_file import Inputs, ModelFile
from partc.options import OPTIMIZER_SPECS, Optimizer
from partc.plans.plan import Plan


def build_optimizer(name: Optimizer, params: Iterable[torch.nn.Parameter],
                    lr: float | None = None, weight_decay: float | None = None,
                    shard_group: Any = None) -> torch.optim.Optimizer | None:
    """The optimizer `name` over the `params` that require grad (None when there are none: a stage
    without weights), with the defaults of OPTIMIZER_SPECS unless `lr`/`weight_decay` are given.
    foreach kernels, the implementation torch picks by default on CUDA, which the memory model
    prices. Launch, the single-process reference and the memory measurement all build it here.

    `shard_group`: the process group of a stage's data-parallel replicas when its optimizer state
    is sharded over them (sharding "optimizer", ZeRO-1): torch's ZeroRedundancyOptimizer of the
    same optimizer, each replica stepping the parameters it owns and broadcasting them (its
    parameters are moved into one flat bucket per owner, `parameters_as_bucket_view`, so the
    broadcast is one collective per replica, not one per parameter). The update is the
    optimizer's own, so training is the unsharded run's."""
    trainable = [p for p in params if p.requires_grad]
    if not trainable:
        return None
    cls, kwargs = optimizer_class(name, lr, weight_decay)
    if shard_group is not None:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(trainable, optimizer_class=cls, process_group=shard_group,
                                       parameters_as_bucket_view=True, **kwargs)
    return cls(trainable, **kwargs)


def optimizer_class(name: Optimizer, lr: float | None = None, weight_decay: float | None = None
                    ) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """The torch optimizer class of `name` and its keyword arguments (OPTIMIZER_SPECS' defaults
    unless `lr`/`weight_decay` are given; foreach kernels)."""
    spec = OPTIMIZER_SPECS[name]
    lr = spec.lr if lr is None else lr
    wd = spec.weight_decay if weight_decay is None else weight_decay
    if name in ("sgd", "sgd-momentum"):
        return torch.optim.SGD, {"lr": lr, "momentum": spec.momentum, "weight_decay": wd,
                                 "foreach": True}
    if name == "adam":
        return torch.optim.Adam, {"lr": lr, "weight_decay": wd, "foreach": True}
    return torch.optim.AdamW, {"lr": lr, "weight_decay": wd, "foreach": True}


def step_seed(seed: int, step: int, rank: int) -> int:
    """The RNG seed of one step on one rank (dropout): a function of the step, so a resumed run
    draws what the uninterrupted one drew without saving RNG state."""
    return zlib.crc32(f"{seed}:{step}:{rank}".encode()) & 0x7FFFFFFF


def global_batches(model_file: ModelFile, plan: Plan) -> Iterator[tuple[Inputs, Any]]:
    """The run's batches of global_batch_size samples, from the model file's batches() or
    synthetic ones (`ModelFile.data`). Draw them with `next_batch`."""
    batch = plan.training.global_batch_size
    m = plan.microbatch_size
    first = tuple(plan.model.outputs[0].shape)
    shape = (batch, *first[1:]) if first and first[0] == m else first
    return iter(model_file.data(batch, output_shape=shape))


def next_batch(data: Iterator[tuple[Inputs, Any]], seed: int, step: int) -> tuple[Inputs, Any]:
    """Step `step`'s batch. Drawn under an RNG seeded by (seed, step) alone and restored after,
    so a batches() that uses torch's global RNG gives every rank (the first stage's inputs, the
    last stage's targets) the same samples, and a resumed run the same batches."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(step_seed(seed, step, -1))
        try:
            return next(data)
        except StopIteration:
            raise LaunchError(f"the model file's batches() ran out at step {step + 1}",
                              hint="make batches() yield at least --steps batches (e.g. loop "
                                   "over epochs)") from None


def batched_flags(flat: list[Any], batch: int) -> tuple[bool, ...]:
    """Per flat model input: does it carry the batch in dim 0? Others (a shared mask, a table)
    go whole to every replica and micro-batch."""
    return tuple(isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == batch
                 for t in flat)


def check_inputs(flat: list[Any], plan: Plan, batched: tuple[bool, ...]) -> None:
    """The model file's batch must have the plan's input shapes (at the global batch size)."""
    batch = plan.training.global_batch_size
    if len(flat) != len(plan.model.inputs):
        raise LaunchError(f"the model file's batches give {len(flat)} input tensors, the plan "
                          f"has {len(plan.model.inputs)}", hint="re-run partc compile")
    for t, ref, b in zip(flat, plan.model.inputs, batched, strict=True):
        want = (batch, *ref.shape[1:]) if b else tuple(ref.shape)
        if tuple(t.shape) != want or str(t.dtype).removeprefix("torch.") != ref.dtype:
            raise LaunchError(f"input {ref.path or ref.name} of a batch is {tuple(t.shape)} "
                              f"{str(t.dtype).removeprefix('torch.')}, the plan needs {want} "
                              f"{ref.dtype}", hint="batches(batch_size) must yield full batches "
                              "shaped like example_inputs(batch_size)")


def output_spec(plan: Plan, model_file: ModelFile) -> pytree.TreeSpec:
    """The model's output structure, to rebuild the last stage's flat outputs for loss_fn."""
    if plan.model.output_spec:
        return pytree.treespec_loads(plan.model.output_spec)
    from partc.frontend.model_file import inputs_to_meta

    with torch.device("meta"):  # never materialise the model for its output structure
        model = model_file.build().to("meta").train()
    args, kwargs = inputs_to_meta(model_file.inputs(plan.microbatch_size))
    with torch.no_grad():
        return pytree.tree_flatten(model(*args, **kwargs))[1]


def split_batch(value: Any, batch: int, chunks: int) -> list[Any]:
    """Split inputs or a target (any structure) into `chunks` equal parts along dim 0 of every
    tensor that has the batch there; the rest go whole to each part (as in `batched_flags`).
    Replicas and micro-batches are cut this way."""
    if chunks == 1:
        return [value]
    leaves, spec = pytree.tree_flatten(value)
    out = []
    for c in range(chunks):
        pieces = [torch.tensor_split(x, chunks)[c]
                  if isinstance(x, torch.Tensor) and x.dim() and x.shape[0] == batch else x
                  for x in leaves]
        out.append(pytree.tree_unflatten(pieces, spec))
    return out
