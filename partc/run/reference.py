"""Single-process reference runs of a plan's training: what the distributed run is checked
against.

`train_single_process` trains the whole model in one process the way `partc launch` trains the
plan (same initial weights, optimizer, batches, seeds and loss), so "the distributed run equals
single-process training" is a comparison of two executions of one definition (partc.run.training).
`measure_training_peak` measures the peak memory of one training step of the captured program on
CPU, the ground truth the memory model (partc.solve.memory) is tested against.
"""
from __future__ import annotations

import gc
import warnings
from typing import Any

import torch
import torch.utils._pytree as pytree

from partc.cost.activations import storage_bytes
from partc.cost.torch_profiler import (
    allocation_events,
    cpu_memory_profile,
    cpu_settings,
    program_module,
)
from partc.emit.stage_code import load_stage
from partc.emit.stage_weights import plan_weights, whole_model_weights
from partc.frontend.export import Capture
from partc.options import Optimizer, TrainOptions
from partc.plans.plan import Plan
from partc.run.training import (
    build_optimizer,
    global_batches,
    next_batch,
    split_batch,
    step_seed,
)


def train_single_process(plan: Plan, options: TrainOptions, chunks: int = 1,
                         device: str = "cpu") -> list[float]:
    """Train the whole model in this process for options.steps steps, the way the plan's run
    does (same initial weights, optimizer, batches, loss); returns the loss per step.

    chunks > 1 runs each batch as that many equal micro-batches with gradient accumulation (the
    mean of their losses), which is what a pipeline x data-parallel run computes; equal to one
    whole batch for models without batch-coupled layers (batch norm)."""
    plan.check_stage_files()
    model_file = plan.load_model_file()
    dev = torch.device(device)
    model = model_file.build().train()
    stages = [] if plan.model.on_meta else [load_stage(plan.stage_bytes(s), map_location=dev)
                                            for s in plan.stages]
    checkpoint = plan_weights(options.init_from, plan).state if options.init_from else None
    whole_model_weights(model, model_file, plan.model.on_meta, stages, plan.model.aliases(),
                        dev, options.seed, checkpoint=checkpoint)
    optimizer = build_optimizer(plan.training.config.optimizer, model.parameters(), options.lr,
                                options.weight_decay)
    loss_fn = model_file.loss()
    batch = plan.training.global_batch_size
    losses = []
    data = global_batches(model_file, plan)
    def on_device(t: Any) -> Any:
        return t.to(dev) if isinstance(t, torch.Tensor) else t

    # denormals flushed and freed memory kept, as launch's ranks compute (`cpu_settings`)
    with cpu_settings(dev):
        for step in range(options.steps):
            (args, kwargs), target = next_batch(data, options.seed, step)
            torch.manual_seed(step_seed(options.seed, step, 0))
            if optimizer is not None:
                optimizer.zero_grad(set_to_none=True)
            total = 0.0
            for piece, tgt in zip(split_batch((args, kwargs), batch, chunks),
                                  split_batch(target, batch, chunks), strict=True):
                a, k = pytree.tree_map(on_device, piece)
                tgt = pytree.tree_map(on_device, tgt)
                loss = loss_fn(model(*a, **k), tgt) / chunks
                loss.backward()
                total += float(loss.detach())
            if optimizer is not None:
                optimizer.step()
            losses.append(total)
    return losses


def live_tensor_bytes() -> int:
    """Bytes of every tensor storage alive in this process (the garbage collector's view; a
    DTensor counts its local shard). With `peak_above_start` of a profile started right after,
    a step's peak on CPU: torch.profiler never reports the free of memory allocated before it
    started."""
    with warnings.catch_warnings():  # isinstance on torch's deprecated aliases warns
        warnings.simplefilter("ignore")
        tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    return storage_bytes([getattr(t, "_local_tensor", t) for t in tensors])


def peak_above_start(prof: torch.profiler.profile) -> int:
    """Highest running sum of the allocations and frees the profiler saw."""
    # both are set once the profile has stopped, which is when callers ask
    assert prof.profiler is not None and prof.profiler.kineto_results is not None
    live = peak = 0
    for _, size, _ in allocation_events(prof.profiler.kineto_results.experimental_event_tree()):
        live += size
        peak = max(peak, live)
    return peak


def measure_training_peak(capture: Capture, microbatch_size: int, num_microbatches: int,
                          optimizer: Optimizer, checkpointing: bool = False) -> int:
    """Peak bytes of one GPipe-ordered training step of the captured program on CPU: all
    micro-batches' forwards (and losses), then their backwards, then the optimizer step.

    It is the second step (optimizer state and gradients exist, as in steady training; gradients
    are zeroed in place, not freed: they stay resident as under DDP). Peak = bytes live before the
    step (parameters, buffers, gradients, optimizer state, the batch) + the profiler's peak above
    that.
    """
    model_file = capture.model_file
    module = program_module(capture.exported)
    params = [p for p in module.parameters() if p.requires_grad]
    opt = build_optimizer(optimizer, params)
    loss_fn = model_file.loss()
    (args, kwargs), target = next(model_file.data(microbatch_size * num_microbatches))
    microbatches = split_batch((args, kwargs, target), microbatch_size * num_microbatches,
                               num_microbatches)

    def forward(a: tuple[Any, ...], k: dict[str, Any]) -> Any:
        if checkpointing:
            # recomputed whole, as launch's stages recompute (partc.run.stage_runner: TorchScript
            # cannot stop early), so the outputs nothing saves are remade at the peak too
            with torch.utils.checkpoint.set_checkpoint_early_stop(False):
                return torch.utils.checkpoint.checkpoint(module, *a, use_reentrant=False, **k)
        return module(*a, **k)

    def step() -> None:
        outputs: list[Any] = []
        losses: list[Any] = []
        for a, k, t in microbatches:
            outputs.append(forward(a, k))
            losses.append(loss_fn(outputs[-1], t))
        for i in range(num_microbatches):
            losses[i].backward()
            # The pipeline drops a micro-batch's outputs once its backward ran.
            losses[i] = outputs[i] = None
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=False)

    step()
    states = opt.state.values() if opt is not None else ()
    live = storage_bytes([*module.parameters(), *module.buffers(),
                           *(p.grad for p in params),
                           *(v for state in states for v in state.values()),
                           *pytree.tree_leaves((args, kwargs, target))])
    with cpu_memory_profile() as prof:
        step()
    return live + peak_above_start(prof)
