"""The hand-written baseline of the runtime benchmark: what a user writes with
torch.distributed.pipelining directly, without partc. Two eager nn.Modules cut from the model by
hand at the same block boundary as the partc plan (`--split`: the first block of stage 1),
PipelineStage + Schedule1F1B with the plan's micro-batches, AdamW, the model file's batches().
Rank 0 prints the median step time (data loading included, as partc's) as JSON, with the loss
of the first and the last step (mean over micro-batches and replicas).

`--replicas R` (default 1: one 2-stage pipeline on ranks 0, 1, exactly the original baseline)
runs R data-parallel copies of that pipeline on 2 * R processes:

- rank layout as partc's plans: `--placement stage-major` (partc's usual choice, plan.yaml
  `training.placement`) puts stage s of replica k on rank s * R + k (stage 0 on ranks 0..R-1),
  `pipeline-major` on rank k * 2 + s (each replica's two stages adjacent);
- each replica's pipeline is its own process group (dist.new_group), passed to PipelineStage as
  `group=`, so its P2P sends stay inside the replica;
- replica k trains on its contiguous 1/R slice of the global batch (tensor_split, as partc's
  split_batch), cut into `--microbatches` micro-batches: the micro-batch count is per replica, so
  the micro-batch size is batch / (R * M), as in a partc plan;
- after the schedule step, each stage's gradients are averaged over the R ranks holding that
  stage (one dist.new_group per stage): one flat SUM all_reduce of all the stage's gradients
  copied into one contiguous buffer, divided by R and copied back; no overlap with the backward
  (partc wraps each stage in DDP, whose bucketed all-reduce can overlap the last backward);
- then optimizer.step(). `--check-sync` asserts after the last step that the replicas of each
  stage hold bit-identical parameters (a broadcast from replica 0, untimed).

    torchrun --standalone --nproc-per-node 2 bench/handwritten_pipeline.py --split 8 \
        --batch 1024 --microbatches 16 --steps 30
    torchrun --standalone --nproc-per-node 4 bench/handwritten_pipeline.py --split 5 \
        --batch 1024 --microbatches 8 --steps 30 --replicas 2 --check-sync
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import cast

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

from partc.frontend.model_file import load_model_file

HERE = Path(__file__).resolve().parent
STAGES = 2


def rank_of(stage: int, replica: int, replicas: int, placement: str) -> int:
    """Global rank of `stage` in `replica` (partc's rank_layout mesh[stage][replica])."""
    if placement == "stage-major":
        return stage * replicas + replica
    return replica * STAGES + stage


def average_gradients(params: list[nn.Parameter], replicas: int, group: dist.ProcessGroup) -> None:
    """Mean of the stage's gradients over its replicas: one collective on a flat buffer (fewer,
    bigger gloo messages than one all_reduce per parameter)."""
    grads = [p.grad for p in params if p.grad is not None]
    assert len(grads) == len(params), "every parameter of a stage gets a gradient"
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=group)
    flat.div_(replicas)
    for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
        g.copy_(synced)


def check_sync(part: nn.Module, src: int, group: dist.ProcessGroup) -> None:
    """Assert this rank's parameters equal those of the stage's replica 0 (global rank src)."""
    mine = _flatten_dense_tensors([p.detach() for p in part.parameters()])
    theirs = mine.clone()
    dist.broadcast(theirs, src=src, group=group)
    if not torch.equal(mine, theirs):
        diff = (mine - theirs).abs().max().item()
        raise AssertionError(f"rank {dist.get_rank()}: parameters differ from rank {src}'s "
                             f"(max abs difference {diff:g}): gradients were not all-reduced")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--split", type=int, required=True)
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--microbatches", type=int, required=True,
                        help="micro-batches per replica per step")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--placement", choices=("stage-major", "pipeline-major"),
                        default="stage-major")
    parser.add_argument("--check-sync", action="store_true")
    args = parser.parse_args()
    R = args.replicas
    if args.batch % (R * args.microbatches):
        raise SystemExit(f"--batch {args.batch} is not divisible by replicas x micro-batches "
                         f"({R} x {args.microbatches})")
    model_file = load_model_file(HERE / "models" / "mlp_stack.py")
    assert model_file.batches is not None and model_file.loss_fn is not None
    width = int(model_file.module.WIDTH)

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if dist.get_world_size() != STAGES * R:
        raise SystemExit(f"--replicas {R} needs {STAGES * R} processes, torchrun started "
                         f"{dist.get_world_size()}")
    where = {rank_of(s, k, R, args.placement): (s, k) for s in range(STAGES) for k in range(R)}
    stage_index, replica = where[rank]
    pp_group: dist.ProcessGroup | None = None  # None: the default group (R == 1, as before)
    dp_group: dist.ProcessGroup | None = None
    if R > 1:
        # new_group is collective: every rank creates every group, in the same order
        for k in range(R):
            g = dist.new_group([rank_of(s, k, R, args.placement) for s in range(STAGES)])
            if k == replica:
                pp_group = g
        for s in range(STAGES):
            g = dist.new_group([rank_of(s, k, R, args.placement) for k in range(R)])
            if s == stage_index:
                dp_group = g

    model = model_file.build()  # same seed on every rank: replicas start equal
    blocks = list(cast(nn.ModuleList, model.blocks))
    if stage_index == 0:
        part: nn.Module = nn.Sequential(*blocks[:args.split])
    else:
        part = nn.Sequential(*blocks[args.split:], cast(nn.Module, model.head))
    micro = args.batch // R // args.microbatches
    # static shapes (no inference round trip); activations crossing the cut carry gradients
    example = torch.empty(micro, width)
    stage = PipelineStage(part, stage_index, STAGES, torch.device("cpu"),
                          input_args=(example.requires_grad_(stage_index > 0),),
                          output_args=(torch.empty(micro, width, requires_grad=True),),
                          group=pp_group)
    schedule = Schedule1F1B(stage, args.microbatches, loss_fn=model_file.loss_fn)
    params = list(part.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, foreach=True)
    data = iter(model_file.batches(args.batch))
    times = []
    step_losses = torch.zeros(args.steps, dtype=torch.float64)
    for i in range(args.steps):
        start = time.perf_counter()
        (x,), y = next(data)
        if R > 1:  # this replica's contiguous slice of the global batch (as partc)
            x, y = x.tensor_split(R)[replica], y.tensor_split(R)[replica]
        optimizer.zero_grad(set_to_none=True)
        if stage_index == 0:
            schedule.step(x)
        else:
            losses: list[torch.Tensor] = []
            schedule.step(target=y, losses=losses, return_outputs=False)
            step_losses[i] = float(torch.stack([loss.detach() for loss in losses]).mean()) / R
        if dp_group is not None:
            average_gradients(params, R, dp_group)
        optimizer.step()
        dist.barrier()
        times.append(time.perf_counter() - start)
    # untimed: the loss (on the last stage's ranks) to rank 0, and the replicas' agreement
    dist.all_reduce(step_losses)
    if args.check_sync and dp_group is not None:
        check_sync(part, rank_of(stage_index, 0, R, args.placement), dp_group)
    if rank == 0:
        print(json.dumps({"step_s": statistics.median(times[2:]),
                          "loss": [step_losses[0].item(), step_losses[-1].item()],
                          "replicas": R, "placement": args.placement, "microbatch_size": micro,
                          "sync_checked": bool(args.check_sync and dp_group is not None),
                          "threads": torch.get_num_threads(),
                          "omp": os.environ.get("OMP_NUM_THREADS")}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
