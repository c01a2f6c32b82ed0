"""One rank of a `partc launch` run: the plan's stages trained with torch.distributed's own
pipeline x data parallelism (started by torchrun / the elastic agent, see partc.run.launch).

Per rank, in order:
1. the plan is validated (schema, stage-file hashes) and its layout checked against WORLD_SIZE;
2. the process group (NCCL with CUDA, gloo on CPU, as plan.yaml's cluster says) and a DeviceMesh
   ("pp", "dp") from partc.run.rank_layout; one extra group per tied parameter and replica;
3. the rank's stage file(s) are loaded (TorchScript) and get their weights by FQN
   (partc.emit.stage_weights.stage_state): the last checkpoint when resuming, else --init-from, else
   the stage file's own, else (meta plans) the model's own initialisation;
4. each stage is wrapped for the plan's precision (bf16 autocast) and activation checkpointing,
   then in DistributedDataParallel over the "dp" group when the plan has replicas, then in a
   PipelineStage with its input/output shapes from plan.yaml (no shape-inference round trip);
5. the plan's schedule (ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B) runs each step on
   the global batch; the loss (the model file's loss_fn on the last stage, the model's output
   structure rebuilt from the flat stage outputs) is averaged over micro-batches by the schedule's
   gradient scaling and over replicas by DDP;
6. gradients of tied parameters are summed over the stages holding them, then each stage's
   optimizer (the plan's) steps;
7. rank 0 gathers loss and per-stage times (one small reduce per step), shows progress, writes the
   metrics file and prints a summary; every --checkpoint-every steps each stage's replica 0 writes
   its checkpoint (partc.run.checkpoint).
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, TextIO

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)
from torch.distributed.pipelining.microbatch import TensorChunkSpec, _Replicate
from torch.nn.parallel import DistributedDataParallel

from partc.emit.stage_code import load_stage
from partc.emit.stage_graph import flatten_inputs
from partc.emit.stage_weights import load_state_dict_file, set_stage_tensors, stage_state
from partc.errors import LaunchError
from partc.options import TrainOptions
from partc.plans.plan import Plan, PlanStage, TensorRef, TiedParameter, load_plan
from partc.run.checkpoint import (
    Checkpoint,
    CheckpointError,
    checkpoint_at,
    choose_resume,
    save_stage,
    write_manifest,
)
from partc.run.rank_layout import RankLayout, rank_layout
from partc.run.training import (
    batched_flags,
    build_optimizer,
    check_inputs,
    global_batches,
    next_batch,
    output_spec,
    split_batch,
    step_seed,
)


@dataclass(frozen=True)
class RankEnv:
    """What torchrun tells a worker."""

    rank: int
    world_size: int
    local_rank: int
    restart_count: int


def rank_env() -> RankEnv:
    """The torchrun environment of this process; LaunchError outside torchrun."""
    try:
        return RankEnv(rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                       local_rank=int(os.environ["LOCAL_RANK"]),
                       restart_count=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
    except (KeyError, ValueError):
        raise LaunchError("this process was not started by torchrun (RANK/WORLD_SIZE/LOCAL_RANK "
                          "unset)", hint="use `partc launch PLAN` or `torchrun ... -m partc.launch "
                          "PLAN`") from None


class _TimedStage(PipelineStage):
    """A PipelineStage that adds up the time spent in its forwards and backwards (compute only:
    the schedule waits for receives outside these calls)."""

    forward_s = 0.0
    backward_s = 0.0

    def forward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return super().forward_one_chunk(*args, **kwargs)
        finally:
            self.forward_s += time.perf_counter() - start

    def backward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return super().backward_one_chunk(*args, **kwargs)
        finally:
            self.backward_s += time.perf_counter() - start


class _StageRunner(torch.nn.Module):
    """A stage module run under the plan's precision and activation checkpointing."""

    def __init__(self, stage: torch.nn.Module, device: torch.device, bf16: bool,
                 checkpointing: bool, last: bool) -> None:
        super().__init__()
        self.stage = stage
        self.device_type = device.type
        self.bf16 = bf16
        self.checkpointing = checkpointing
        self.last = last

    def forward(self, *args: torch.Tensor) -> Any:
        outputs = self._run(*args)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        if self.bf16:
            # bf16-mixed sends bf16 activations (as the memory model prices them; autocast
            # leaves some fp32, so cast every floating one) and computes the loss in fp32
            dtype = torch.float32 if self.last else torch.bfloat16
            outputs = tuple(o.to(dtype) if o.is_floating_point() else o for o in outputs)
        if not self.last:  # p2p sends need contiguous tensors (a cut after a transpose)
            outputs = tuple(o.contiguous() for o in outputs)
        return outputs

    def _run(self, *args: torch.Tensor) -> Any:
        cast = (torch.autocast(self.device_type, dtype=torch.bfloat16) if self.bf16
                else nullcontext())
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
class _LocalStage:
    """One of this rank's (virtual) stages."""

    spec: PlanStage
    module: torch.nn.Module  # the stage file's module, holding the weights under their FQNs
    optimizer: torch.optim.Optimizer | None
    optimized_names: list[str]  # parameter FQNs in the optimizer's order
    pipe: _TimedStage | None = None


@dataclass
class RunSummary:
    """What rank 0 reports at the end (and the tests read)."""

    losses: dict[int, float] = field(default_factory=dict)  # step -> loss
    step_s: dict[int, float] = field(default_factory=dict)
    stage_forward_s: list[list[float]] = field(default_factory=list)  # [step][stage] per micro-batch
    stage_backward_s: list[list[float]] = field(default_factory=list)
    resumed_from: int | None = None


def run_rank(plan_path: str | Path, options: TrainOptions, out: TextIO = sys.stdout,
             err: TextIO = sys.stderr) -> RunSummary | None:
    """Train the plan on this rank (see the module docstring); rank 0 returns the summary."""
    env = rank_env()
    plan = load_plan(plan_path)
    plan.check_stage_files()
    layout = rank_layout(plan)
    if env.world_size != layout.world_size:
        raise LaunchError(f"the plan runs on {layout.world_size} processes, torchrun started "
                          f"{env.world_size}", hint=f"start {layout.world_size} processes in all "
                          "(--nnodes x --nproc-per-node), or use `partc launch PLAN`")
    backend = str(plan.cluster.backend)
    if backend == "nccl":
        if not torch.cuda.is_available() or torch.cuda.device_count() <= env.local_rank:
            raise LaunchError(f"the plan uses NCCL but local rank {env.local_rank} has no CUDA "
                              "device", hint="run on the plan's cluster, or compile the model for "
                              "this machine (partc compile --cluster local)")
        device = torch.device("cuda", env.local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group(backend=backend, rank=env.rank, world_size=env.world_size,
                            device_id=device if device.type == "cuda" else None)
    try:
        # Stages run as plain TorchScript graphs with eager autograd: the optimising executor's
        # profiling runs and differentiable subgraphs are slower on these graphs, make the first
        # steps slow, and recompute differently under activation checkpointing.
        with torch.jit.optimized_execution(False):
            return _train(plan, layout, env, device, options, out, err)
    finally:
        dist.destroy_process_group()


def _train(plan: Plan, layout: RankLayout, env: RankEnv, device: torch.device,
           options: TrainOptions, out: TextIO, err: TextIO) -> RunSummary | None:
    rank = env.rank
    mesh = DeviceMesh(device.type, torch.tensor(layout.mesh), mesh_dim_names=("pp", "dp"))
    pp_group, dp_group = mesh.get_group("pp"), mesh.get_group("dp")
    pipeline_rank, replica = layout.coordinates(rank)
    if dist.get_group_rank(pp_group, rank) != pipeline_rank:
        raise LaunchError(f"rank {rank} is rank {dist.get_group_rank(pp_group, rank)} of its "
                          f"pipeline group, the plan puts it at {pipeline_rank}",
                          hint="re-run partc compile (the plan's device order is inconsistent)")
    tied = _tied_groups(plan, layout, rank)  # collective: every rank creates every group
    model_file = plan.load_model_file()
    aliases = plan.model.aliases()
    mine = layout.stages_of(rank)
    V, R = layout.num_stages, layout.replicas
    M = plan.training.shape.num_microbatches

    resume = _resume_point(plan, options, env, device)
    init = None
    if resume is None and options.init_from is not None:
        init = load_state_dict_file(options.init_from)
    locals_: list[_LocalStage] = []
    for k in mine:
        spec = plan.stages[k]
        module = load_stage(plan.stage_path(spec), map_location=device)
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
        optimizer = build_optimizer(plan.training.config.optimizer, [params[n] for n in names],
                                    options.lr, options.weight_decay)
        if optimizer is not None and resume is not None:
            _load_optimizer_state(optimizer, names, opt_state, resume)
        locals_.append(_LocalStage(spec=spec, module=module, optimizer=optimizer,
                                   optimized_names=names))

    bf16 = plan.training.config.bf16
    checkpointing = plan.training.shape.activation_checkpointing
    for local in locals_:
        runner: torch.nn.Module = local.module
        is_last = local.spec.index == V - 1
        if bf16 or checkpointing or not is_last:
            runner = _StageRunner(local.module, device, bf16, checkpointing, last=is_last)
        if R > 1 and local.optimizer is not None:
            unused = _parameters_without_gradient(local.module, local.spec, device)
            runner = DistributedDataParallel(
                runner, process_group=dp_group, gradient_as_bucket_view=True,
                device_ids=[device.index] if device.type == "cuda" else None,
                find_unused_parameters=bool(unused),
                # buffers start equal (same init or checkpoint); re-broadcasting them before
                # every micro-batch's forward would cost M collectives per stage and step
                broadcast_buffers=False)
        k = local.spec.index
        boundary = torch.bfloat16 if bf16 else None
        local.pipe = _TimedStage(
            runner, k, V, device,
            input_args=_example(local.spec.inputs, device, grad=k > 0,
                                floating=boundary if k > 0 else None),
            output_args=_example(local.spec.outputs, device, grad=True,
                                 floating=boundary if k < V - 1 else None),
            group=pp_group)

    start = resume.step if resume is not None else 0
    first, last = 0 in mine, V - 1 in mine
    batch = plan.training.global_batch_size
    data = global_batches(model_file, plan) if (first or last) else None
    pending = None
    if data is not None:
        for step in range(start):  # a resumed run continues with the batches it would have had
            next_batch(data, options.seed, step)
        if start < options.steps:
            pending = next_batch(data, options.seed, start)
    in_spec = pytree.treespec_loads(plan.model.input_spec) if plan.model.input_spec else None
    batched: tuple[bool, ...] = ()
    chunk_spec = None
    if first and pending is not None:
        # which inputs carry the batch in dim 0, from real data: a shared [1, S] input at
        # micro-batch 1 looks batched in the plan's shapes
        batched = batched_flags(_flat_inputs(pending[0], in_spec), batch)
        chunk_spec = tuple(TensorChunkSpec(0) if b else _Replicate() for b in batched)
    loss_fn = _StageLoss(model_file.loss(), output_spec(plan, model_file)) if last else None
    run = _RankRun(plan=plan, options=options, device=device, rank=rank, replica=replica,
                   replicas=R, stages=locals_, tied=tied, loss_fn=loss_fn, data=data,
                   pending=pending, in_spec=in_spec, batched=batched, resume=resume,
                   schedule=_schedule(plan, [l.pipe for l in locals_ if l.pipe is not None], M,
                                      loss_fn if loss_fn is not None else _no_loss, chunk_spec))
    reporter = _Reporter(plan, options, start, out, err) if rank == 0 else None
    try:
        if reporter is not None:
            reporter.begin(layout, resume, data_source=(
                "the model file's batches()" if model_file.batches is not None
                else "synthetic batches (the model file defines no batches())"))
        return _loop(run, reporter)
    finally:
        if reporter is not None:
            reporter.close()


@dataclass
class _RankRun:
    """One rank's training, set up: what the step loop works with."""

    plan: Plan
    options: TrainOptions
    device: torch.device
    rank: int
    replica: int
    replicas: int
    stages: list[_LocalStage]
    tied: list[_TiedGroup]
    loss_fn: _StageLoss | None  # on the rank holding the last stage
    data: Any  # the batch iterator, on the first and last stage's ranks
    pending: Any  # the first batch, drawn during setup
    in_spec: pytree.TreeSpec | None
    batched: tuple[bool, ...]  # per flat model input, on the first stage's rank
    resume: Checkpoint | None
    schedule: Any

    @property
    def start(self) -> int:
        return self.resume.step if self.resume is not None else 0

    @property
    def num_stages(self) -> int:
        return self.plan.num_stages

    @property
    def is_first(self) -> bool:
        return any(l.spec.index == 0 for l in self.stages)

    @property
    def batch(self) -> int:
        return int(self.plan.training.global_batch_size)

    def next_inputs(self, step: int) -> tuple[list[torch.Tensor], Any]:
        """This rank's part of step's batch: first-stage inputs and last-stage target (the
        index target of `_StageLoss`)."""
        if self.data is None:
            return [], None
        batch, R = self.batch, self.replicas
        inputs, whole_target = self.pending if self.pending is not None else \
            next_batch(self.data, self.options.seed, step)
        self.pending = None
        args: list[torch.Tensor] = []
        target = None
        if self.is_first:
            flat = _flat_inputs(inputs, self.in_spec)
            check_inputs(flat, self.plan, self.batched)
            args = [t.to(self.device) for t in split_batch(flat, batch, R)[self.replica]]
        if self.loss_fn is not None:
            leaves = [t for t in pytree.tree_leaves(whole_target) if isinstance(t, torch.Tensor)]
            if not any(t.dim() and t.shape[0] == batch for t in leaves):
                raise LaunchError(f"no tensor of the batch's target has the global batch size "
                                  f"{batch} in dim 0", hint="batches(batch_size) must yield "
                                  "(inputs, target) with batch_size samples")
            mine = pytree.tree_map(lambda t: t.to(self.device) if isinstance(t, torch.Tensor)
                                   else t, split_batch(whole_target, batch, R)[self.replica])
            target = self.loss_fn.set_target(mine, batch // R)
        return args, target


def _no_loss(outputs: Any, target: Any) -> torch.Tensor:
    raise AssertionError("the loss runs on the last stage only")


def _flat_inputs(inputs: Any, in_spec: pytree.TreeSpec | None) -> list[Any]:
    if in_spec is not None:
        return flatten_inputs(inputs, in_spec)
    return [t for t in pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor)]


def _loop(run: _RankRun, reporter: "_Reporter | None") -> RunSummary | None:
    plan, options = run.plan, run.options
    V, R = run.num_stages, run.replicas
    M = plan.training.shape.num_microbatches
    start = run.start
    summary = RunSummary(resumed_from=start if run.resume is not None else None)
    for step in range(start, options.steps):
        torch.manual_seed(step_seed(options.seed, step, run.rank))
        for local in run.stages:
            if local.optimizer is not None:
                local.optimizer.zero_grad(set_to_none=True)
            assert local.pipe is not None
            local.pipe.forward_s = local.pipe.backward_s = 0.0
        began = time.perf_counter()
        args, target = run.next_inputs(step)
        losses: list[torch.Tensor] | None = [] if run.loss_fn is not None else None
        run.schedule.step(*args, target=target, losses=losses, return_outputs=False)
        _sum_tied_gradients(run.tied, run.stages)
        for local in run.stages:
            if local.optimizer is not None:
                local.optimizer.step()
        # loss: mean over micro-batches and replicas; times per micro-batch, mean over replicas
        row = torch.zeros(1 + 2 * V, dtype=torch.float64)
        if losses:
            row[0] = float(torch.stack([l.detach().float() for l in losses]).mean()) / R
        for local in run.stages:
            assert local.pipe is not None
            row[1 + local.spec.index] = local.pipe.forward_s / M / R
            row[1 + V + local.spec.index] = local.pipe.backward_s / M / R
        row = row.to(run.device)
        dist.reduce(row, dst=0)
        step_s = time.perf_counter() - began
        if reporter is not None:
            values = row.cpu().tolist()
            summary.losses[step] = values[0]
            summary.step_s[step] = step_s
            summary.stage_forward_s.append(values[1:1 + V])
            summary.stage_backward_s.append(values[1 + V:])
            reporter.step(step, values[0], step_s, values[1:1 + V], values[1 + V:])
        done = step + 1
        if options.checkpoint_dir is not None and (
                done == options.steps
                or (options.checkpoint_every and done % options.checkpoint_every == 0)):
            _save_checkpoint(plan, options, done, run.stages, run.replica, run.rank)
            if reporter is not None:
                reporter.note(f"checkpoint step {done} -> {options.checkpoint_dir}")
    if reporter is not None:
        reporter.finish(summary)
        return summary
    return None


# ---- setup ----------------------------------------------------------------------------------

def _resume_point(plan: Plan, options: TrainOptions, env: RankEnv,
                  device: torch.device) -> Checkpoint | None:
    """The checkpoint to continue from, the same on every rank: rank 0 chooses
    (checkpoint.choose_resume) and broadcasts the step; every rank must see that checkpoint (the
    directory is shared across nodes)."""
    root = options.checkpoint_dir
    if root is None:
        return None
    decision: list[Any] = [None]
    if env.rank == 0:
        try:
            found = choose_resume(root, resume=options.resume, restarted=env.restart_count > 0,
                                  steps=options.steps, optimizer=plan.training.config.optimizer,
                                  global_batch_size=plan.training.global_batch_size)
            decision[0] = ("step", found.step) if found is not None else None
        except CheckpointError as exc:
            decision[0] = ("error", exc.message, exc.hint)
    dist.broadcast_object_list(decision, src=0, device=device)
    if decision[0] is None:
        return None
    if decision[0][0] == "error":
        raise CheckpointError(decision[0][1], hint=decision[0][2])
    found = checkpoint_at(root, decision[0][1])
    if found is None:
        raise CheckpointError(f"rank {env.rank} cannot see the checkpoint of step "
                              f"{decision[0][1]} in {root} that rank 0 resumes from",
                              hint="the checkpoint directory must be one shared filesystem path "
                                   "for all nodes")
    return found


def _example(refs: tuple[TensorRef, ...], device: torch.device, grad: bool,
             floating: torch.dtype | None = None) -> tuple[torch.Tensor, ...]:
    """Tensors with the shapes and dtypes plan.yaml gives a stage boundary (static pipeline
    metadata; `floating` overrides the floating dtypes: bf16-mixed boundaries); floating ones
    require grad where gradients flow."""
    out = []
    for ref in refs:
        dtype = getattr(torch, ref.dtype)
        if floating is not None and dtype.is_floating_point:
            dtype = floating
        t = torch.empty(ref.shape, dtype=dtype, device=device)
        out.append(t.requires_grad_(grad and dtype.is_floating_point))
    return tuple(out)


def _parameters_without_gradient(module: torch.nn.Module, spec: PlanStage,
                                 device: torch.device) -> list[str]:
    """Parameters a backward through the stage leaves without gradient (DDP must then look for
    unused parameters). One micro-batch of placeholder inputs; buffers and grads restored."""
    saved = {n: b.detach().clone() for n, b in module.named_buffers()}
    inputs = []
    for ref in spec.inputs:
        dtype = getattr(torch, ref.dtype)
        t = (torch.randn(ref.shape, device=device, dtype=dtype).requires_grad_(True)
             if dtype.is_floating_point else torch.zeros(ref.shape, device=device, dtype=dtype))
        inputs.append(t)
    outputs = module(*inputs)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    total = sum((o.float().sum() for o in outputs if isinstance(o, torch.Tensor)
                 and o.requires_grad), torch.zeros((), device=device))
    if total.requires_grad:
        total.backward()
    unused = [n for n, p in module.named_parameters() if p.requires_grad and p.grad is None]
    for p in module.parameters():
        p.grad = None
    with torch.no_grad():
        for n, b in module.named_buffers():
            b.copy_(saved[n])
    return unused


class _StageLoss:
    """loss_fn on the last stage's flat outputs, rebuilt into the model's output structure.

    The schedule splits `target` along dim 0 into micro-batches but only if it is one tensor; a
    model's target may be any structure (BERT's is a pair). So the schedule gets the sample
    indices [0, batch) as its target, and each micro-batch's loss slices the real target (every
    tensor whose dim 0 is the batch) with its contiguous chunk of indices.
    """

    def __init__(self, loss_fn: Callable[[Any, Any], torch.Tensor], spec: pytree.TreeSpec) -> None:
        self.loss_fn = loss_fn
        self.spec = spec
        self.target: Any = None  # this replica's target of the current step
        self.batch = 0

    def set_target(self, target: Any, batch: int) -> torch.Tensor:
        """Remember this step's target; returns the index tensor to hand the schedule."""
        self.target, self.batch = target, batch
        return torch.arange(batch)

    def __call__(self, outputs: Any, index: torch.Tensor) -> torch.Tensor:
        lo, hi = int(index[0]), int(index[-1]) + 1
        target = pytree.tree_map(
            lambda t: t[lo:hi] if isinstance(t, torch.Tensor) and t.dim() and
            t.shape[0] == self.batch else t, self.target)
        flat = list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]
        return self.loss_fn(pytree.tree_unflatten(flat, self.spec), target)


def _schedule(plan: Plan, pipes: list[_TimedStage], M: int, loss_fn: Callable[..., Any],
              chunk_spec: tuple[Any, ...] | None) -> Any:
    name = plan.training.shape.schedule
    if name == "interleaved-1f1b":
        return ScheduleInterleaved1F1B(pipes, M, loss_fn=loss_fn, args_chunk_spec=chunk_spec)
    if len(pipes) != 1:
        raise LaunchError(f"schedule {name} runs one stage per rank, the plan gives this rank "
                          f"{len(pipes)}", hint="re-run partc compile")
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}.get(name)
    if cls is None:
        raise LaunchError(f"unknown schedule {name!r} in the plan",
                          hint="use a plan written by this partc")
    return cls(pipes[0], M, loss_fn=loss_fn, args_chunk_spec=chunk_spec)


# ---- tied parameters ------------------------------------------------------------------------

@dataclass(frozen=True)
class _TiedGroup:
    parameter: TiedParameter
    group: Any  # the process group of this replica's ranks holding it; None: all on this rank


def _tied_groups(plan: Plan, layout: RankLayout, rank: int) -> list[_TiedGroup]:
    """This rank's tied parameters with the groups their gradients are summed over. Every rank
    creates every group, in the same order (new_group is collective)."""
    created: dict[tuple[int, ...], Any] = {}
    mine = []
    for tied in plan.tied_parameters:
        for r in range(layout.replicas):
            ranks = tuple(sorted({layout.rank_of(k, r) for k in tied.stages}))
            if len(ranks) > 1 and ranks not in created:
                created[ranks] = dist.new_group(list(ranks))
            if rank in ranks:
                mine.append(_TiedGroup(tied, created.get(ranks)))
    return mine


def _sum_tied_gradients(tied: list[_TiedGroup], locals_: list[_LocalStage]) -> None:
    """Each copy of a tied parameter gets the sum of all copies' gradients, so the copies take
    the same optimizer step and stay equal."""
    for entry in tied:
        name = entry.parameter.name
        copies = [dict(l.module.named_parameters())[name] for l in locals_
                  if l.spec.index in entry.parameter.stages]
        total = torch.zeros_like(copies[0])
        for p in copies:
            if p.grad is not None:
                total += p.grad
        if entry.group is not None:
            dist.all_reduce(total, group=entry.group)
        for p in copies:
            if p.grad is None:
                p.grad = total.clone()
            else:
                p.grad.copy_(total)


# ---- checkpoints ----------------------------------------------------------------------------

def _optimizer_state_by_name(optimizer: torch.optim.Optimizer | None, names: list[str]
                             ) -> dict[str, dict[str, Any]]:
    if optimizer is None:
        return {}
    state = optimizer.state_dict()["state"]
    return {names[i]: s for i, s in state.items()}


def _load_optimizer_state(optimizer: torch.optim.Optimizer, names: list[str],
                          by_name: dict[str, dict[str, Any]], checkpoint: Checkpoint) -> None:
    missing = [n for n in names if n not in by_name]
    if missing and len(missing) != len(names):
        raise CheckpointError(f"checkpoint {checkpoint.directory} has no optimizer state for "
                              f"{', '.join(missing[:3])}",
                              hint="resume with the optimizer the checkpoint was written with")
    if missing:  # a checkpoint written before the first optimizer step has no state at all
        return
    current = optimizer.state_dict()
    optimizer.load_state_dict({"state": {i: by_name[n] for i, n in enumerate(names)},
                               "param_groups": current["param_groups"]})


def _save_checkpoint(plan: Plan, options: TrainOptions, step: int, locals_: list[_LocalStage],
                     replica: int, rank: int) -> None:
    """Replica 0 of each stage writes it; after a barrier rank 0 writes the manifest."""
    root = options.checkpoint_dir
    assert root is not None
    if replica == 0:
        for local in locals_:
            keep = set(local.spec.parameter_names) | set(local.spec.buffer_names)
            tensors = {n: t for n, t in {**dict(local.module.named_parameters()),
                                         **dict(local.module.named_buffers())}.items()
                       if n in keep}
            save_stage(root, step, local.spec.index, tensors,
                       _optimizer_state_by_name(local.optimizer, local.optimized_names))
    dist.barrier()
    if rank == 0:
        info = {"model": plan.model.name, "graph_hash": plan.model.graph_hash,
                "stages": plan.num_stages, "optimizer": plan.training.config.optimizer,
                "plan_stage_sha256": [s.sha256 for s in plan.stages],
                "global_batch_size": plan.training.global_batch_size}
        write_manifest(root, step, plan.num_stages, info, options.keep_checkpoints)
    dist.barrier()


# ---- reporting (rank 0) ---------------------------------------------------------------------

class _Reporter:
    """Progress on stderr (a bar on a terminal, lines otherwise), metrics as JSON lines, and the
    final summary on stdout."""

    def __init__(self, plan: Plan, options: TrainOptions, start: int, out: TextIO,
                 err: TextIO) -> None:
        self.plan = plan
        self.options = options
        self.start = start
        self.out = out
        self.err = err
        self.tty = bool(getattr(err, "isatty", lambda: False)())
        self.samples = plan.training.global_batch_size
        self.metrics = None
        if options.metrics is not None:
            options.metrics.parent.mkdir(parents=True, exist_ok=True)
            self.metrics = open(options.metrics, "a")

    def begin(self, layout: RankLayout, resume: Checkpoint | None, data_source: str) -> None:
        s = self.plan.training.shape
        self.err.write(f"partc launch: {self.plan.model.name}, {layout.num_stages} stage(s) on "
                       f"{layout.pipeline_size} pipeline rank(s) x {layout.replicas} replica(s), "
                       f"{s.schedule}, {s.num_microbatches} micro-batches of "
                       f"{s.microbatch_size}, {self.plan.training.config.optimizer}, "
                       f"{self.plan.cluster.backend}\n")
        self.err.write(f"partc launch: data: {data_source}\n")
        if resume is not None:
            self.err.write(f"partc launch: resuming from {resume.directory} (step {resume.step})\n")
        self.err.flush()

    def note(self, text: str) -> None:
        if self.tty:
            self.err.write("\r\033[K")
        self.err.write(f"partc launch: {text}\n")
        self.err.flush()

    def step(self, step: int, loss: float, step_s: float, fwd: list[float],
             bwd: list[float]) -> None:
        done, total = step + 1, self.options.steps
        rate = self.samples / step_s if step_s > 0 else 0.0
        stages = " ".join(f"{k}:{f * 1e3:.1f}/{b * 1e3:.1f}"
                          for k, (f, b) in enumerate(zip(fwd, bwd)))
        if self.metrics is not None:
            self.metrics.write(json.dumps({"step": done, "loss": loss, "step_s": step_s,
                                           "samples_per_s": rate,
                                           "stage_forward_s": fwd, "stage_backward_s": bwd},
                                          sort_keys=True) + "\n")
            self.metrics.flush()
        text = (f"step {done}/{total}  loss {loss:.6g}  {rate:,.1f} samples/s  "
                f"fwd/bwd ms per micro-batch {stages}")
        if self.tty:
            width = 24
            filled = int(width * done / total)
            self.err.write(f"\r\033[K[{'#' * filled}{'.' * (width - filled)}] {text}")
            if done == total:
                self.err.write("\n")
        elif done % self.options.log_every == 0 or done == total:
            self.err.write(text + "\n")
        self.err.flush()

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None

    def finish(self, summary: RunSummary) -> None:
        steps = sorted(summary.step_s)
        if not steps:
            self.out.write("partc launch: nothing to do (the checkpoint is at --steps)\n")
            return
        # the first step includes TorchScript's profiling runs: leave it out of the rates
        timed = [summary.step_s[s] for s in steps[1:]] or [summary.step_s[steps[0]]]
        median = statistics.median(timed)
        predicted = self.plan.predicted
        resumed = (f" (resumed from the checkpoint of step {summary.resumed_from})"
                   if summary.resumed_from is not None else "")
        lines = [f"trained steps {steps[0] + 1}..{steps[-1] + 1}{resumed}: loss "
                 f"{summary.losses[steps[0]]:.6g} -> {summary.losses[steps[-1]]:.6g}",
                 f"iteration {median * 1e3:.1f} ms (median), {self.samples / median:,.1f} "
                 f"samples/s; predicted {predicted.iteration_s * 1e3:.1f} ms, "
                 f"{predicted.samples_per_s:,.1f} samples/s",
                 f"{'stage':>5} {'fwd ms':>9} {'predicted':>9} {'bwd ms':>9} {'predicted':>9}"]
        rows = summary.stage_forward_s[1:] or summary.stage_forward_s
        brows = summary.stage_backward_s[1:] or summary.stage_backward_s
        for k, st in enumerate(self.plan.stages):
            f = statistics.median(r[k] for r in rows)
            b = statistics.median(r[k] for r in brows)
            lines.append(f"{k:>5} {f * 1e3:>9.3f} {st.forward_s * 1e3:>9.3f} {b * 1e3:>9.3f} "
                         f"{st.backward_s * 1e3:>9.3f}")
        self.out.write("\n".join(lines) + "\n")
        self.out.flush()
