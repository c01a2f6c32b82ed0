"""The hand-written baseline of the runtime benchmark: what a user writes with
torch.distributed.pipelining directly, without partc. Two eager nn.Modules cut from the model by
hand at the same block boundary as the partc plan (`--split`: the first block of stage 1),
PipelineStage + Schedule1F1B with the plan's micro-batches, AdamW, the model file's batches().
Rank 0 prints the median step time (data loading included, as partc's) as JSON.

    torchrun --standalone --nproc-per-node 2 bench/handwritten_pipeline.py --split 8 \
        --batch 1024 --microbatches 16 --steps 30
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--split", type=int, required=True)
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--microbatches", type=int, required=True)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    spec = importlib.util.spec_from_file_location("mlp_stack", HERE / "models" / "mlp_stack.py")
    model_file = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(model_file)

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = model_file.build_model()
    blocks = list(model.blocks)
    if rank == 0:
        part: nn.Module = nn.Sequential(*blocks[:args.split])
    else:
        part = nn.Sequential(*blocks[args.split:], model.head)
    micro = args.batch // args.microbatches
    # static shapes (no inference round trip); activations crossing the cut carry gradients
    example = torch.empty(micro, model_file.WIDTH)
    stage = PipelineStage(part, rank, 2, torch.device("cpu"),
                          input_args=(example.requires_grad_(rank > 0),),
                          output_args=(torch.empty(micro, model_file.WIDTH, requires_grad=True),))
    schedule = Schedule1F1B(stage, args.microbatches, loss_fn=model_file.loss_fn)
    optimizer = torch.optim.AdamW(part.parameters(), lr=1e-3, weight_decay=0.01, foreach=True)
    data = model_file.batches(args.batch)
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        (x,), y = next(data)
        optimizer.zero_grad(set_to_none=True)
        if rank == 0:
            schedule.step(x)
        else:
            losses: list[torch.Tensor] = []
            schedule.step(target=y, losses=losses, return_outputs=False)
        optimizer.step()
        dist.barrier()
        times.append(time.perf_counter() - start)
    if rank == 0:
        print(json.dumps({"step_s": statistics.median(times[2:]),
                          "threads": torch.get_num_threads(),
                          "omp": os.environ.get("OMP_NUM_THREADS")}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
