"""This rank's stages: loaded from their stage files with their weights, wrapped for the plan's
precision, activation checkpointing, data parallelism and pipelining, and checkpointed by FQN.

Weights come from the last checkpoint when resuming, else --init-from, else the stage file's own,
else (meta plans) the model's own initialisation (partc.emit.stage_weights.stage_state). Each
stage runs under bf16 autocast for bf16-mixed and under activation checkpointing when the plan
says so (`StageRunner`), in DistributedDataParallel over the "dp" group when the plan has
replicas, and in a PipelineStage with its boundary shapes from plan.yaml (no shape-inference round
trip) that times its own forwards and backwards (`TimedStage`).
"""
from __future__ import annotations

import time
import warnings
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.pipelining import PipelineStage
from torch.nn.parallel import DistributedDataParallel

from partc.cost.torch_profiler import CPU_CLOCK, precision_autocast
from partc.emit.stage_code import load_stage
from partc.emit.stage_weights import (
    check_stage_tensors,
    plan_weights,
    set_stage_tensors,
    stage_state,
)
from partc.errors import LaunchError, PartcError
from partc.frontend.model_file import ModelFile
from partc.options import TrainOptions
from partc.plans.plan import Plan, PlanStage, TensorRef
from partc.run.checkpoint import (
    Checkpoint,
    CheckpointError,
    StageFile,
    discard_step,
    newest_good_checkpoint,
    save_stage,
    write_manifest,
)
from partc.run.gradient_sharding import GradientSharder
from partc.run.rank_setup import TiedGroup
from partc.run.training import build_optimizer


def synced_clock(device: torch.device) -> float:
    """time.perf_counter() once the device has finished its queued work: CUDA runs kernels
    asynchronously, so reading the clock without synchronising times the launches, not the work
    (a ~140 ms forward read as 8.9 ms)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class TimedStage(PipelineStage):
    """A PipelineStage that adds up the time spent in its forwards and backwards (compute only:
    the schedule waits for receives outside these calls), synchronising a CUDA device around
    each (`synced_clock`), and the CPU time of those calls (CPU_CLOCK: the computing thread's,
    which leaves out gloo's copies on its IO thread; where processes share a core, the work
    without the core-mates' turns, as partc.plans.report.replay_measured replays it)."""

    forward_s = 0.0
    backward_s = 0.0
    forward_cpu_s = 0.0
    backward_cpu_s = 0.0

    def reset_times(self) -> None:
        """Zero the step's sums."""
        self.forward_s = self.backward_s = self.forward_cpu_s = self.backward_cpu_s = 0.0

    def forward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        start, cpu = synced_clock(self.device), CPU_CLOCK()
        try:
            return super().forward_one_chunk(*args, **kwargs)
        finally:
            self.forward_s += synced_clock(self.device) - start
            self.forward_cpu_s += CPU_CLOCK() - cpu

    def backward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        start, cpu = synced_clock(self.device), CPU_CLOCK()
        try:
            return super().backward_one_chunk(*args, **kwargs)
        finally:
            self.backward_s += synced_clock(self.device) - start
            self.backward_cpu_s += CPU_CLOCK() - cpu


def cpu_between_passes(step_cpu_s: float, stages: Iterable[TimedStage], loss_cpu_s: float,
                       p2p_cpu_s: float, passes: int) -> float:
    """The computing thread's CPU per pass that a step spent outside its stages' passes, its
    loss and its p2p posts and waits (the schedule loop, the step's setup): what the pipelining
    runtime costs a CPU core beyond the passes and the link. `step_cpu_s`: CPU_CLOCK over the
    schedule's step; `p2p_cpu_s`: the step's CPU in the posts and waits (P2PTimer.cpu_seconds:
    gloo copies a send's bytes there, which the link's price holds); `passes`: the forwards and
    backwards the step ran on this process. The calibration (partc.run.overhead) and launch's
    metrics take it the same way, so a replay adds what the price holds."""
    inside = sum(s.forward_cpu_s + s.backward_cpu_s for s in stages) + loss_cpu_s + p2p_cpu_s
    return max(0.0, step_cpu_s - inside) / passes


class GradSyncTimer:
    """DDP's gradient all-reduce, as a communication hook that times it: from the first bucket
    posted to the last one reduced, per step (it overlaps the last micro-batch's backward, which
    DDP ends by waiting for it). The reduction is DDP's default (divide by the group size, then
    sum), so the numbers are unchanged.

    gloo completes a bucket's future when the reduction is done, so the CPU clock times it; NCCL
    completes futures on the stream, so on CUDA the span comes from CUDA events read at the end of
    the step."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.reset()

    def reset(self) -> None:
        self.first: float | None = None
        self.last = 0.0
        self.events: list[tuple[Any, Any]] = []

    def hook(self, group: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """The comm hook (`DistributedDataParallel.register_comm_hook(None, timer.hook)`)."""
        group = group if group is not None else dist.group.WORLD
        tensor = bucket.buffer().div_(dist.get_world_size(group))
        if self.first is None:
            self.first = time.perf_counter()
        start = end = None
        if self.device.type == "cuda":
            start, end = (torch.cuda.Event(enable_timing=True),
                          torch.cuda.Event(enable_timing=True))
            start.record()
            self.events.append((start, end))
        fut = dist.all_reduce(tensor, group=group, async_op=True).get_future()

        def done(f: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
            if end is not None:
                end.record()  # on the stream the reduced value is ready on
            self.last = time.perf_counter()
            return f.value()[0]

        return fut.then(done)

    def seconds(self) -> float:
        """This step's all-reduce span (call after the step; then `reset`)."""
        if self.events:
            torch.cuda.synchronize(self.device)
            return max(self.events[0][0].elapsed_time(e) for _, e in self.events) / 1e3
        return max(self.last - self.first, 0.0) if self.first is not None else 0.0


# DDP checks a hook's annotations against the real types; this module's are strings (PEP 563)
GradSyncTimer.hook.__annotations__.update(
    bucket=dist.GradBucket, **{"return": torch.futures.Future[torch.Tensor]})


class StageRunner(torch.nn.Module):
    """A stage module run under the plan's precision and activation checkpointing.

    Under bf16-mixed a stage's outputs go on in the dtypes autocast gave them, as in the unsplit
    model (a residual stream stays float32: casting it to bfloat16 at a boundary would change
    the numerics and slow the next stage's elementwise work), which are the dtypes plan.yaml
    records for the boundary (`wire_dtypes`, casts only where autocast disagreed with the
    compile's replay of it); the last stage's go to the loss in float32.

    Between stages a tensor travels contiguous (a p2p send needs it so) in the memory order of
    its dims in the unsplit model (`TensorRef.wire_order`): a stage sends `t.permute(order)`
    made contiguous, and the next one views what it received back in the logical order. So a
    transposed query cut from its projection arrives laid out as it was, the kernels after it
    make the layouts they made unsplit (no copy where a reshape was a view), and its gradient
    flows back into the view chain in that layout (no copy in the backward's reshapes either).
    A contiguous tensor's order is the identity: nothing is permuted."""

    def __init__(self, stage: torch.nn.Module, device: torch.device, bf16: bool,
                 checkpointing: bool, last: bool,
                 wire_dtypes: tuple[torch.dtype, ...] = (),
                 input_orders: tuple[tuple[int, ...], ...] = (),
                 output_orders: tuple[tuple[int, ...], ...] = ()) -> None:
        super().__init__()
        self.stage = stage
        self.device_type = device.type
        self.bf16 = bf16
        self.checkpointing = checkpointing
        self.last = last
        self.wire_dtypes = wire_dtypes
        # per input: the permutation that views a received tensor back in logical order
        self.input_views = tuple(_inverse(order) if order else () for order in input_orders)
        self.output_orders = output_orders

    @classmethod
    def for_stage(cls, plan: Plan, stage: torch.nn.Module, index: int,
                  device: torch.device) -> "StageRunner":
        """The runner of plan stage `index` (its loaded `stage` module) as launch runs it: the
        plan's precision, the stage's checkpointing, plan.yaml's boundary dtypes and layouts."""
        spec = plan.stages[index]
        return cls(stage, device, plan.training.config.bf16, spec.activation_checkpointing,
                   last=index == plan.num_stages - 1,
                   wire_dtypes=tuple(getattr(torch, ref.runtime_dtype) for ref in spec.outputs),
                   input_orders=tuple(ref.wire_order for ref in spec.inputs),
                   output_orders=tuple(ref.wire_order for ref in spec.outputs))

    def forward(self, *args: torch.Tensor) -> Any:
        if self.input_views:
            args = tuple(a.permute(view) if view else a
                         for a, view in zip(args, self.input_views, strict=True))
        outputs = self._run(*args)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        if self.bf16 and self.last:
            outputs = tuple(o.float() if o.is_floating_point() else o for o in outputs)
        elif self.bf16:
            outputs = tuple(o.to(dtype) if o.is_floating_point() and o.dtype != dtype else o
                            for o, dtype in zip(outputs, self.wire_dtypes, strict=True))
        if not self.last:  # p2p sends need contiguous tensors
            if self.output_orders:
                outputs = tuple(o.permute(order) if order else o
                                for o, order in zip(outputs, self.output_orders, strict=True))
            outputs = tuple(o.contiguous() for o in outputs)
        return outputs

    def _run(self, *args: torch.Tensor) -> Any:
        cast = precision_autocast("bf16-mixed" if self.bf16 else "fp32", self.device_type)
        with cast:
            if self.checkpointing:
                from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

                # Early stop ends the recomputation by raising from a saved-tensor hook, which
                # the TorchScript interpreter turns into a RuntimeError: recompute it all.
                # Non-reentrant, so a stage whose inputs need no grad (token ids) still gets
                # parameter gradients.
                with set_checkpoint_early_stop(False):
                    return checkpoint(self.stage, *args, use_reentrant=False)
            return self.stage(*args)


@dataclass
class LocalStage:
    """One of this rank's (virtual) stages."""

    spec: PlanStage
    module: torch.nn.Module  # the stage file's module, holding the weights under their FQNs
    optimizer: torch.optim.Optimizer | None
    optimized_names: list[str]  # parameter FQNs in the optimizer's order
    pipe: TimedStage | None = None
    # times DDP's all-reduce when the plan has replicas, or reduces sharded gradients
    grad_sync: GradSyncTimer | GradientSharder | None = None
    optimizer_s: float = 0.0  # this step's optimizer step
    optimizer_cpu_s: float = 0.0  # its CPU time (CPU_CLOCK)


def load_local_stages(plan: Plan, stages: Sequence[int], device: torch.device,
                      options: TrainOptions, resume: Checkpoint | None,
                      model_file: ModelFile, dp_group: Any = None) -> list[LocalStage]:
    """This rank's `stages`, loaded with their weights and optimizers (module docstring). A
    stage whose plan entry shards the optimizer state gets a ZeroRedundancyOptimizer over its
    replicas (`dp_group`)."""
    aliases = plan.model.aliases()
    init = None
    if resume is None and options.init_from is not None:
        init = plan_weights(options.init_from, plan).state
    loaded: list[LocalStage] = []
    for k in stages:
        spec = plan.stages[k]
        module = load_stage(plan.stage_bytes(spec), map_location=device)
        check_stage_tensors(module, spec)
        source = init
        where = str(options.init_from) if options.init_from else f"stage {k}"
        opt_state: dict[str, dict[str, Any]] = {}
        if resume is not None:
            source, opt_state = resume.load(set(spec.parameter_names) | set(spec.buffer_names),
                                            aliases)
            where = f"checkpoint {resume.directory}"
        values = stage_state(module, spec.parameter_names, spec.buffer_names, checkpoint=source,
                             aliases=aliases, model_file=model_file, device=device,
                             seed=options.seed, where=where)
        set_stage_tensors(module, values)
        module.train()
        names = [n for n, p in module.named_parameters() if p.requires_grad]
        params = dict(module.named_parameters())
        sharded = spec.sharding != "none" and plan.training.shape.replicas > 1
        try:
            optimizer = build_optimizer(plan.training.config.optimizer,
                                        [params[n] for n in names], options.lr,
                                        options.weight_decay,
                                        shard_group=dp_group if sharded else None)
        except (ValueError, TypeError) as exc:  # torch's refusals: mixed dtypes, sparse, ...
            raise LaunchError(f"stage {k}'s optimizer cannot be built: {exc}",
                              hint="recompile with --sharding none" if sharded else
                              "check the model's parameters") from None
        if optimizer is not None and resume is not None:
            load_optimizer_state(optimizer, names, opt_state, resume)
        loaded.append(LocalStage(spec=spec, module=module, optimizer=optimizer,
                                 optimized_names=names))
    return loaded


def needs_runner(plan: Plan, spec: PlanStage) -> bool:
    """Whether launch runs the stage in a StageRunner: under bf16-mixed or checkpointing, when it
    sends to a later stage (contiguous, in memory order), or when it receives a tensor in
    another memory order than its dims' (viewed back before its module runs; the last stage
    too). Otherwise the module runs as it is."""
    return (plan.training.config.bf16 or spec.activation_checkpointing
            or spec.index < plan.num_stages - 1 or any(ref.wire_order for ref in spec.inputs))


def wrap_for_pipeline(plan: Plan, stages: list[LocalStage], device: torch.device,
                      pp_group: Any, dp_group: Any) -> None:
    """Give each stage its `pipe`: the module under the plan's precision and checkpointing, in
    DDP when the plan has replicas (or, where the stage shards its gradients, with a
    GradientSharder on its parameters), in a PipelineStage with plan.yaml's boundary shapes."""
    V, R = plan.num_stages, plan.training.shape.replicas
    for local in stages:
        runner: torch.nn.Module = local.module
        if needs_runner(plan, local.spec):
            runner = StageRunner.for_stage(plan, local.module, local.spec.index, device)
        if R > 1 and isinstance(local.optimizer, ZeroRedundancyOptimizer) \
                and local.spec.sharding == "gradients":
            # tied parameters stay whole: sum_tied_gradients adds their copies across stages
            kept_whole = {t.name for t in plan.tied_parameters if local.spec.index in t.stages}
            local.grad_sync = GradientSharder(
                local.module, local.optimizer, gradient_order(local.module, local.spec, device),
                kept_whole, dp_group, device)
        elif R > 1 and local.optimizer is not None:
            formed = set(gradient_order(local.module, local.spec, device))
            unused = [n for n, p in local.module.named_parameters()
                      if p.requires_grad and n not in formed]
            with warnings.catch_warnings():
                # torch 2.13 deprecates broadcast_buffers for forward_sync_buffers, which older
                # torch (2.11 on the GPU machines) lacks: the notice is nothing a user can act on
                warnings.filterwarnings("ignore", message=".*broadcast_buffers.* is deprecated",
                                        category=FutureWarning)
                runner = DistributedDataParallel(
                    runner, process_group=dp_group, gradient_as_bucket_view=True,
                    device_ids=[device.index] if device.type == "cuda" else None,
                    find_unused_parameters=bool(unused),
                    # buffers start equal (same init or checkpoint); re-broadcasting them before
                    # every micro-batch's forward would cost M collectives per stage and step
                    broadcast_buffers=False)
            timer = GradSyncTimer(device)
            runner.register_comm_hook(dp_group, timer.hook)
            local.grad_sync = timer
        k = local.spec.index
        local.pipe = TimedStage(
            runner, k, V, device,
            input_args=boundary_tensors(local.spec.inputs, device, grad=k > 0),
            output_args=boundary_tensors(local.spec.outputs, device, grad=True),
            group=pp_group)


def boundary_tensors(refs: tuple[TensorRef, ...], device: torch.device,
                     grad: bool) -> tuple[torch.Tensor, ...]:
    """Tensors with the shapes and dtypes plan.yaml gives a stage boundary (static pipeline
    metadata: the shapes and dtypes they cross in, `TensorRef.wire_shape` and `runtime_dtype`;
    what the loss gets keeps its dtype); floating ones require grad where gradients flow."""
    out = []
    for ref in refs:
        dtype = getattr(torch, ref.runtime_dtype)
        t = torch.empty(ref.wire_shape, dtype=dtype, device=device)
        out.append(t.requires_grad_(grad and dtype.is_floating_point))
    return tuple(out)


def _inverse(order: tuple[int, ...]) -> tuple[int, ...]:
    """The permutation that undoes `order` (`t.permute(order).permute(_inverse(order))` is t)."""
    inverse = [0] * len(order)
    for i, d in enumerate(order):
        inverse[d] = i
    return tuple(inverse)


def gradient_order(module: torch.nn.Module, spec: PlanStage,
                   device: torch.device) -> list[str]:
    """The trainable parameters a backward through the stage gives a gradient, in the order
    their gradients form (the others are unused: DDP must then look for them; sharded gradients
    are bucketed in this order). One micro-batch of placeholder inputs; buffers and grads
    restored."""
    saved = {n: b.detach().clone() for n, b in module.named_buffers()}
    inputs = []
    for ref in spec.inputs:
        dtype = getattr(torch, ref.dtype)
        t = (torch.randn(ref.shape, device=device, dtype=dtype).requires_grad_(True)
             if dtype.is_floating_point else torch.zeros(ref.shape, device=device, dtype=dtype))
        inputs.append(t)
    formed: list[str] = []
    handles = [p.register_post_accumulate_grad_hook(
        lambda _p, name=name: formed.append(name))
        for name, p in module.named_parameters() if p.requires_grad]
    try:
        outputs = module(*inputs)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        total = sum((o.float().sum() for o in outputs if isinstance(o, torch.Tensor)
                     and o.requires_grad), torch.zeros((), device=device))
        if total.requires_grad:
            total.backward()
    finally:
        for handle in handles:
            handle.remove()
    for p in module.parameters():
        p.grad = None
    with torch.no_grad():
        for n, b in module.named_buffers():
            b.copy_(saved[n])
    return list(dict.fromkeys(formed))


def sum_tied_gradients(tied: list[TiedGroup], locals_: list[LocalStage]) -> None:
    """Each copy of a tied parameter gets the sum of all copies' gradients, so the copies take
    the same optimizer step and stay equal."""
    for entry in tied:
        name = entry.parameter.name
        copies = [dict(local.module.named_parameters())[name] for local in locals_
                  if local.spec.index in entry.parameter.stages]
        # Summed in place in the first copy's gradient. A separate sum buffer would be a
        # parameter-sized transient the memory model does not have; worse, gloo's thread can
        # hold the last reference to it and free it there, a free torch's CPU profiler never
        # sees, so a measured peak counted it live through the optimizer step (a 2 x 2 BERT
        # launch's last stage: +1 MiB in some runs, not in others).
        first = copies[0]
        if first.grad is None:
            first.grad = torch.zeros_like(first)
        total = first.grad
        for p in copies[1:]:
            if p.grad is not None:
                total += p.grad
        if entry.group is not None:
            dist.all_reduce(total, group=entry.group)
        for p in copies[1:]:
            if p.grad is None:
                p.grad = total.clone()
            else:
                p.grad.copy_(total)


def is_sharded(optimizer: torch.optim.Optimizer | None) -> bool:
    """Whether the optimizer's state is sharded over replicas (ZeroRedundancyOptimizer)."""
    return isinstance(optimizer, ZeroRedundancyOptimizer)


def optimizer_state_by_name(optimizer: torch.optim.Optimizer | None, names: list[str]
                             ) -> dict[str, dict[str, Any]]:
    """The optimizer's state per parameter FQN, whole (a checkpoint holds it by name, so any
    plan, sharded or not, can resume from it). A sharded optimizer must have been consolidated
    onto this replica first (`consolidate_optimizers`)."""
    if optimizer is None:
        return {}
    state = optimizer.state_dict()["state"]
    return {names[i]: s for i, s in state.items()}


def consolidate_optimizers(locals_: list[LocalStage]) -> None:
    """Gather every sharded optimizer's state onto its replica 0 (a collective over each
    stage's replicas: every replica calls it, before replica 0 saves). Release it with
    `release_consolidated` once saved."""
    for local in locals_:
        if is_sharded(local.optimizer):
            local.optimizer.consolidate_state_dict(to=0)  # type: ignore[union-attr]


def release_consolidated(locals_: list[LocalStage]) -> None:
    """Drop the whole state `consolidate_optimizers` gathered onto replica 0: torch keeps it
    until the next consolidation, which would leave replica 0 holding the whole optimizer state
    that sharding splits, for the rest of the run."""
    for local in locals_:
        if is_sharded(local.optimizer):
            local.optimizer._all_state_dicts = []  # type: ignore[union-attr]


def load_optimizer_state(optimizer: torch.optim.Optimizer, names: list[str],
                          by_name: dict[str, dict[str, Any]], checkpoint: Checkpoint) -> None:
    """Give the optimizer the checkpoint's state of its parameters, by FQN. A sharded one is
    handed the whole state and keeps the share it owns (ZeroRedundancyOptimizer.load_state_dict),
    so a checkpoint of any plan resumes under any other."""
    missing = [n for n in names if n not in by_name]
    if missing and len(missing) != len(names):
        raise CheckpointError(f"checkpoint {checkpoint.directory} has no optimizer state for "
                              f"{', '.join(missing[:3])}",
                              hint="resume with the optimizer the checkpoint was written with")
    if missing:  # a checkpoint written before the first optimizer step has no state at all
        return
    # One parameter group, the parameters in `names` order: state_dict's indices 0..n-1.
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": list(range(len(names)))}
              for g in optimizer.param_groups]
    optimizer.load_state_dict({"state": {i: by_name[n] for i, n in enumerate(names)},
                               "param_groups": groups})
    if is_sharded(optimizer):
        # ZeroRedundancyOptimizer.load_state_dict puts the share this replica owns into its local
        # optimizer, then hands the same state to Optimizer.load_state_dict, which keeps a second
        # copy on the device in the wrapper's own `state` (never read: the local optimizer steps,
        # and state_dict() rebuilds from consolidated shares). On a GPU that doubled the share.
        optimizer.state = defaultdict(dict)


def save_checkpoint(plan: Plan, options: TrainOptions, step: int, locals_: list[LocalStage],
                     replica: int, rank: int, stop: PartcError | None = None) -> None:
    """Replica 0 of each stage writes it (its SHA-256 taken as it is written); rank 0 gathers
    every rank's files and failures, writes the manifest, reads the checkpoint back and prunes.
    A failure anywhere (a read-only directory, a full disk, a file size limit) removes the
    step's half-written directory, keeps the previous checkpoint, and every rank raises the same
    one-line CheckpointError (no rank is left waiting in a collective). A rank's `stop` (the
    run must end at this step: a NaN loss) is such a failure, raised as itself on every rank."""
    root = options.checkpoint_dir
    assert root is not None
    written: dict[int, StageFile] = {}
    failure: tuple[str, str] | None = None
    if stop is not None:
        failure = (stop.message, stop.hint)
    consolidate_optimizers(locals_)
    if replica == 0 and stop is None:
        try:
            for local in locals_:
                keep = set(local.spec.parameter_names) | set(local.spec.buffer_names)
                tensors = {n: t for n, t in {**dict(local.module.named_parameters()),
                                             **dict(local.module.named_buffers())}.items()
                           if n in keep}
                written[local.spec.index] = save_stage(
                    root, step, local.spec.index, tensors,
                    optimizer_state_by_name(local.optimizer, local.optimized_names))
        except CheckpointError as exc:
            failure = (exc.message, exc.hint)
    release_consolidated(locals_)
    gathered: list[Any] | None = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object((written, failure, stop is not None), gathered, dst=0)
    outcome: list[Any] = [None]
    if rank == 0:
        assert gathered is not None
        stopped = next((f for _, f, s in gathered if s), None)
        try:
            failed = stopped or next((f for _, f, _ in gathered if f is not None), None)
            if failed is not None:
                raise CheckpointError(failed[0], hint=failed[1])
            files = {k: f for w, _, _ in gathered for k, f in w.items()}
            info = {"model": plan.model.name, "graph_hash": plan.model.graph_hash,
                    "stages": plan.num_stages, "optimizer": plan.training.config.optimizer,
                    "plan_stage_sha256": [s.sha256 for s in plan.stages],
                    "global_batch_size": plan.training.global_batch_size}
            write_manifest(root, step, plan.num_stages, files, info, options.keep_checkpoints)
        except CheckpointError as exc:
            discard_step(root, step)
            kept, _ = newest_good_checkpoint(root)
            outcome[0] = ((exc.message if stopped else
                           f"the checkpoint of step {step} failed: {exc.message}"),
                          f"{exc.hint}; " + ("no earlier checkpoint" if kept is None else
                                             f"the checkpoint of step {kept.step} is kept"))
    dist.broadcast_object_list(outcome, src=0)
    if outcome[0] is not None:
        raise CheckpointError(outcome[0][0], hint=outcome[0][1])
