"""One rank of a `partc launch` run: the plan's stages trained with torch.distributed's own
pipeline x data parallelism (started by torchrun / the elastic agent, see partc.run.launch).

Per rank, in order:
1. the plan is validated (schema, stage-file hashes) and its layout checked against WORLD_SIZE;
2. the process group (NCCL with CUDA, gloo on CPU, as plan.yaml's cluster says) and a DeviceMesh
   ("pp", "dp") from partc.run.rank_layout; one extra group per tied parameter and replica
   (partc.run.rank_setup);
3. the rank's stage file(s) are loaded (TorchScript) and get their weights by FQN: the last
   checkpoint when resuming, else --init-from, else the stage file's own, else (meta plans) the
   model's own initialisation (partc.run.stage_runner);
4. each stage is wrapped for the plan's precision (bf16 autocast) and activation checkpointing,
   then in DistributedDataParallel over the "dp" group when the plan has replicas, then in a
   PipelineStage with its input/output shapes from plan.yaml (no shape-inference round trip);
5. the plan's schedule (ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B) runs each step on
   the global batch; the loss (the model file's loss_fn on the last stage, the model's output
   structure rebuilt from the flat stage outputs) is averaged over micro-batches by the schedule's
   gradient scaling and over replicas by DDP (partc.run.schedule);
6. gradients of tied parameters are summed over the stages holding them, then each stage's
   optimizer (the plan's) steps;
7. rank 0 gathers loss and per-stage times (one small reduce per step), shows progress, writes the
   metrics file and prints a summary (partc.run.reporting); every --checkpoint-every steps each
   stage's replica 0 writes its checkpoint (partc.run.checkpoint).
"""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TextIO

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch.distributed.pipelining.microbatch import TensorChunkSpec, _Replicate

from partc.errors import LaunchError
from partc.frontend.model_file import ModelFile
from partc.options import TrainOptions
from partc.plans.plan import Plan, load_plan
from partc.run.rank_layout import RankLayout, rank_layout
from partc.run.rank_setup import (
    RankEnv,
    init_process_group,
    pipeline_groups,
    rank_env,
    resume_point,
    tied_groups,
)
from partc.run.reporting import Reporter, RunSummary
from partc.run.schedule import RankRun, StageLoss, build_schedule, flat_model_inputs, no_loss
from partc.run.stage_runner import (
    load_local_stages,
    save_checkpoint,
    sum_tied_gradients,
    wrap_for_pipeline,
)
from partc.run.training import batched_flags, global_batches, next_batch, output_spec, step_seed


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
    device = init_process_group(plan, env)
    try:
        # Stages run as plain TorchScript graphs with eager autograd: the optimising executor's
        # profiling runs and differentiable subgraphs are slower on these graphs, make the first
        # steps slow, and recompute differently under activation checkpointing.
        with torch.jit.optimized_execution(False):
            run = _set_up(plan, layout, env, device, options)
            reporter = Reporter(plan, options, run.start, out, err) if env.rank == 0 else None
            try:
                if reporter is not None:
                    reporter.begin(layout, run.resume, data_source=_data_source(run.model_file))
                return _train(run, reporter)
            finally:
                if reporter is not None:
                    reporter.close()
    finally:
        dist.destroy_process_group()


def _set_up(plan: Plan, layout: RankLayout, env: RankEnv, device: torch.device,
            options: TrainOptions) -> RankRun:
    """Steps 2-5 of the module docstring: everything the step loop needs, on this rank."""
    rank = env.rank
    pp_group, dp_group = pipeline_groups(layout, device, rank)
    tied = tied_groups(plan, layout, rank)  # collective: every rank creates every group
    model_file = plan.load_model_file()
    resume = resume_point(plan, options, env, device)
    stages = load_local_stages(plan, layout.stages_of(rank), device, options, resume, model_file)
    wrap_for_pipeline(plan, stages, device, pp_group, dp_group)

    start = resume.step if resume is not None else 0
    first = any(s.spec.index == 0 for s in stages)
    last = any(s.spec.index == plan.num_stages - 1 for s in stages)
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
        batched = batched_flags(flat_model_inputs(pending[0], in_spec),
                                plan.training.global_batch_size)
        chunk_spec = tuple(TensorChunkSpec(0) if b else _Replicate() for b in batched)
    loss_fn = StageLoss(model_file.loss(), output_spec(plan, model_file)) if last else None
    pipes = [s.pipe for s in stages if s.pipe is not None]
    schedule = build_schedule(plan, pipes, plan.training.shape.num_microbatches,
                              loss_fn if loss_fn is not None else no_loss, chunk_spec)
    _, replica = layout.coordinates(rank)
    return RankRun(plan=plan, options=options, device=device, rank=rank, replica=replica,
                   replicas=layout.replicas, stages=stages, tied=tied, loss_fn=loss_fn,
                   data=data, pending=pending, in_spec=in_spec, batched=batched, resume=resume,
                   schedule=schedule, model_file=model_file)


def _data_source(model_file: ModelFile) -> str:
    return ("the model file's batches()" if model_file.batches is not None
            else "synthetic batches (the model file defines no batches())")


def _train(run: RankRun, reporter: Reporter | None) -> RunSummary | None:
    """The step loop: steps from the resume point to --steps, checkpoints on the way."""
    options = run.options
    summary = RunSummary(resumed_from=run.start if run.resume is not None else None)
    for step in range(run.start, options.steps):
        began = time.perf_counter()
        metrics = _step(run, step)
        step_s = time.perf_counter() - began
        if reporter is not None:
            _record(summary, reporter, run.num_stages, step, step_s, metrics)
        done = step + 1
        if options.checkpoint_dir is not None and (
                done == options.steps
                or (options.checkpoint_every and done % options.checkpoint_every == 0)):
            save_checkpoint(run.plan, options, done, run.stages, run.replica, run.rank)
            if reporter is not None:
                reporter.note(f"checkpoint step {done} -> {options.checkpoint_dir}")
    if reporter is not None:
        reporter.finish(summary)
        return summary
    return None


def _step(run: RankRun, step: int) -> torch.Tensor:
    """One training step on this rank (steps 5-6); returns what rank 0 reports of it, reduced
    over all ranks (see `_metrics`)."""
    torch.manual_seed(step_seed(run.options.seed, step, run.rank))
    for local in run.stages:
        if local.optimizer is not None:
            local.optimizer.zero_grad(set_to_none=True)
        assert local.pipe is not None
        local.pipe.forward_s = local.pipe.backward_s = 0.0
    args, target = run.next_inputs(step)
    losses: list[torch.Tensor] | None = [] if run.loss_fn is not None else None
    run.schedule.step(*args, target=target, losses=losses, return_outputs=False)
    sum_tied_gradients(run.tied, run.stages)
    for local in run.stages:
        if local.optimizer is not None:
            local.optimizer.step()
    return _metrics(run, losses or [])


def _metrics(run: RankRun, losses: list[torch.Tensor]) -> torch.Tensor:
    """[loss, forward s per stage..., backward s per stage...], summed over ranks onto rank 0:
    the loss is the mean over micro-batches and replicas, times are per micro-batch, the mean
    over replicas (each rank contributes its share)."""
    V, R = run.num_stages, run.replicas
    M = run.plan.training.shape.num_microbatches
    row = torch.zeros(1 + 2 * V, dtype=torch.float64)
    if losses:
        row[0] = float(torch.stack([loss.detach().float() for loss in losses]).mean()) / R
    for local in run.stages:
        assert local.pipe is not None
        row[1 + local.spec.index] = local.pipe.forward_s / M / R
        row[1 + V + local.spec.index] = local.pipe.backward_s / M / R
    row = row.to(run.device)
    dist.reduce(row, dst=0)
    return row


def _record(summary: RunSummary, reporter: Reporter, num_stages: int, step: int, step_s: float,
            metrics: torch.Tensor) -> None:
    values = metrics.cpu().tolist()
    V = num_stages
    summary.losses[step] = values[0]
    summary.step_s[step] = step_s
    summary.stage_forward_s.append(values[1:1 + V])
    summary.stage_backward_s.append(values[1 + V:])
    reporter.step(step, values[0], step_s, values[1:1 + V], values[1 + V:])
