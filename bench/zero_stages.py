"""ZeRO-2 and ZeRO-3 on a pipeline stage, measured: what FSDP2 saves and costs when
torch.distributed.pipelining runs the stage, beside partc's levers (DDP, ZeRO-1).

partc shards optimizer state (ZeRO-1, ZeroRedundancyOptimizer) but not gradients or parameters.
This bench measures what those would give on torch's own runtime, with a stage held as partc
holds one (a TorchScript module, here traced from a stack of MLP blocks, inside an nn.Module):
R gloo processes are the data-parallel replicas of one stage; each runs torch.distributed.pipelining
(a one-stage PipelineStage per process, ScheduleGPipe over M micro-batches, so all M micro-batches'
activations are in flight, where ZeRO-3's resharding after forward pays most) with:

- `ddp`: DistributedDataParallel + AdamW (partc's `sharding: none`);
- `zero1`: DDP + ZeroRedundancyOptimizer(AdamW) (partc's `sharding: optimizer`);
- `zero2`: FSDP2 `fully_shard(reshard_after_forward=False)` + AdamW, as torch's pipelining runs
  an FSDP stage: every micro-batch's backward without gradient sync, one reduce-scatter after
  the last (`PipelineStage.perform_reduce_grad`);
- `zero2-rs-each`: the same, reduce-scattering every micro-batch's gradients (a PipelineStage
  subclass; what a ZeRO-2 that frees the gradients would need);
- `zero3`: `fully_shard(reshard_after_forward=True)`, pipelining's handling;
- `zero3-rs-each`: that, resharding parameters and reduce-scattering after every backward.

Per variant: each rank's peak memory over one step, measured two ways: tensors alive at the
step's start + torch's CPU profiler's peak above that (as `partc launch --metrics` measures it),
and the same live tensors + the rise of the resident set's peak (VmHWM, reset at the step's
start) with every allocation of 64 KiB or more mapped on its own (MALLOC_MMAP_THRESHOLD_), which
counts frees on every thread; the step time (median over the steps after four warm-up and
measuring steps, with the spread, from a second run with the default allocator); and the losses,
which must equal the DDP run's (the same seed, data and AdamW; fp tolerance).

    .venv/bin/python bench/zero_stages.py [--replicas 2] [--layers 4] [--width 512]
        [--microbatches 4] [--steps 8] [--json bench/results/zero_stages.json]

About 3 minutes with the defaults.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

VARIANTS = ("ddp", "zero1", "zero2", "zero2-rs-each", "zero3", "zero3-rs-each")
WARMUP = 2
SEQ = 64
MICROBATCH = 2
LOSS_RTOL = 1e-4


def worker(variant: str, args: argparse.Namespace, out: Path) -> None:
    """One replica of the stage (run under torchrun)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    from partc.run.reference import live_tensor_bytes, peak_above_start

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")
    H, L, M = args.width, args.layers, args.microbatches

    torch.manual_seed(0)
    blocks = []
    for _ in range(L):
        blocks += [torch.nn.Linear(H, 4 * H), torch.nn.GELU(), torch.nn.Linear(4 * H, H),
                   torch.nn.LayerNorm(H)]
    traced = torch.jit.trace(torch.nn.Sequential(*blocks), torch.randn(MICROBATCH, SEQ, H))

    class Holder(torch.nn.Module):
        """How a stage would hold its TorchScript module to be wrapped."""

        def __init__(self, stage: torch.nn.Module) -> None:
            super().__init__()
            self.stage = stage

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.stage(x)

    module: torch.nn.Module = Holder(traced)
    params = list(module.parameters())
    stage_cls: type[PipelineStage] = PipelineStage
    if variant in ("ddp", "zero1"):
        from torch.nn.parallel import DistributedDataParallel

        module = DistributedDataParallel(module, gradient_as_bucket_view=True,
                                         broadcast_buffers=False)
        if variant == "zero1":
            from torch.distributed.optim import ZeroRedundancyOptimizer

            optimizer: torch.optim.Optimizer = ZeroRedundancyOptimizer(
                params, optimizer_class=torch.optim.AdamW, parameters_as_bucket_view=True,
                lr=1e-3)
        else:
            optimizer = torch.optim.AdamW(params, lr=1e-3)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import FSDPModule, fully_shard

        mesh = init_device_mesh("cpu", (world,))
        reshard = variant.startswith("zero3")
        fully_shard(module, mesh=mesh, reshard_after_forward=reshard)
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
        if variant.endswith("rs-each"):
            class SyncEveryBackward(PipelineStage):
                """A stage that reduce-scatters after every micro-batch's backward (and, under
                ZeRO-3, reshards), instead of once after the last."""

                def backward_maybe_with_nosync(self, backward_type: str, bwd_kwargs: dict,
                                               last_backward: bool = False) -> Any:
                    from torch.distributed.pipelining._backward import stage_backward

                    submod = self.submod
                    assert isinstance(submod, FSDPModule) and backward_type == "full"
                    submod.set_is_last_backward(True)
                    submod.set_reshard_after_backward(reshard)
                    submod.set_requires_gradient_sync(True)
                    grads = stage_backward(bwd_kwargs["stage_output"], bwd_kwargs["output_grads"],
                                           bwd_kwargs["input_values"])
                    # what perform_reduce_grad does once per step: the stage's inputs need no
                    # gradient, so FSDP's own post-backward hooks never run
                    state = fully_shard.state(submod)  # type: ignore[attr-defined]
                    for each in state._state_ctx.all_states:
                        for group in each._fsdp_param_groups:
                            group.post_backward()
                    state._root_post_backward_final_callback()
                    return grads, None

            stage_cls = SyncEveryBackward

    # each replica's pipeline: one stage (new_group is collective: every process makes every
    # group, in the same order)
    own = [dist.new_group([r]) for r in range(world)][rank]
    # static boundary shapes, as partc gives them: without, the stage infers them by running a
    # real forward and backward, which a DDP reducer counts as a step's backward
    boundary = torch.empty(MICROBATCH, SEQ, H)
    stage = stage_cls(module, 0, 1, device, input_args=(boundary,), output_args=(boundary,),
                      group=own)

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(output, target)

    schedule = ScheduleGPipe(stage, M, loss_fn=loss_fn)
    gen = torch.Generator().manual_seed(1000 + rank)
    losses, times, peak, peak_rss = [], [], 0, 0
    for step in range(args.steps):
        x = torch.randn(M * MICROBATCH, SEQ, H, generator=gen)
        y = torch.randn(M * MICROBATCH, SEQ, H, generator=gen)
        optimizer.zero_grad(set_to_none=variant not in ("ddp", "zero1"))
        watch, watch_rss = step == WARMUP, step == WARMUP + 1
        prof = None
        if watch or watch_rss:
            gc.collect()
            live = live_tensor_bytes()
        if watch:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                          profile_memory=True)
            prof.__enter__()
        if watch_rss:
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
            rss_start = _status_bytes("VmRSS")
        dist.barrier()
        began = time.perf_counter()
        step_losses: list[torch.Tensor] = []
        schedule.step(x, target=y, losses=step_losses)
        optimizer.step()
        dist.barrier()
        elapsed = time.perf_counter() - began
        if prof is not None:
            prof.__exit__(None, None, None)
            peak = live + peak_above_start(prof)
        if watch_rss:
            peak_rss = live + _status_bytes("VmHWM") - rss_start
        loss = torch.stack([v.detach() for v in step_losses]).mean()
        dist.all_reduce(loss)
        losses.append(float(loss) / world)
        if step >= WARMUP + 2:
            times.append(elapsed)
    peaks = [torch.zeros(2, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(peaks, torch.tensor([float(peak), float(peak_rss)], dtype=torch.float64))
    if rank == 0:
        out.write_text(json.dumps({
            "variant": variant, "losses": losses, "step_s": times,
            "peaks": [int(p[0].item()) for p in peaks],
            "peaks_rss": [int(p[1].item()) for p in peaks],
            "parameter_bytes": sum(p.numel() * p.element_size() for p in params)}))
    dist.destroy_process_group()


def _status_bytes(field: str) -> int:
    """A /proc/self/status memory field (kB) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise SystemExit(f"no {field} in /proc/self/status")


def run_variant(variant: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """Two runs of the variant: one for memory (allocations mapped one by one, which slows
    them), one for time (the default allocator)."""
    memory = _run(variant, args, tmp / f"{variant}-memory.json", mapped=True)
    if "error" in memory:
        return memory
    timed = _run(variant, args, tmp / f"{variant}-time.json", mapped=False)
    if "error" in timed:
        return timed
    return {**memory, "step_s": timed["step_s"], "losses_timed_run": timed["losses"]}


def _run(variant: str, args: argparse.Namespace, out: Path, mapped: bool) -> dict[str, Any]:
    torchrun = str(Path(sys.executable).parent / "torchrun")
    cmd = [torchrun, "--standalone", "--nproc-per-node", str(args.replicas), __file__,
           "--worker", variant, "--out", str(out), "--layers", str(args.layers),
           "--width", str(args.width), "--microbatches", str(args.microbatches),
           "--steps", str(args.steps)]
    # every allocation of 64 KiB or more its own mapping, unmapped when freed, so the resident
    # set's peak follows the tensors' (glibc would otherwise raise the threshold as it goes)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if mapped:
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    if proc.returncode != 0 or not out.exists():
        tail = proc.stderr.strip().splitlines()[-1:]
        errors = [line for line in proc.stderr.splitlines() if "Error" in line]
        return {"variant": variant, "error": (errors or tail or ["no output"])[0].strip()}
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--json", type=Path)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args, args.out)
        return

    print(f"load average at start: {os.getloadavg()[0]:.1f}")
    started = time.time()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for variant in args.variants.split(","):
            rows.append(run_variant(variant, args, Path(tmp)))
            print(f"{variant} done ({(time.time() - started) / 60:.1f} min)", flush=True)
    base = next((r for r in rows if r["variant"] == "ddp" and "error" not in r), None)
    mib = 2 ** 20
    print(f"\nOne stage of {args.layers} MLP blocks of width {args.width} (TorchScript), "
          f"{args.replicas} replicas (gloo), GPipe over {args.microbatches} micro-batches of "
          f"{MICROBATCH}x{SEQ}; parameters "
          f"{(base or rows[0]).get('parameter_bytes', 0) / mib:.1f} MiB per replica unsharded.\n")
    print("| variant | peak MiB per rank: profiler | resident set | vs ddp (resident) | "
          "step ms (median, spread) | vs ddp | losses = ddp's |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['variant']} | failed: {r['error'][:200]} | | | | |")
            continue
        step = statistics.median(r["step_s"])
        spread = f"{min(r['step_s']) * 1e3:.0f}-{max(r['step_s']) * 1e3:.0f}"
        same = "-"
        if base is not None:
            same = "yes" if all(abs(a - b) <= LOSS_RTOL * abs(b) for a, b in
                                zip(r["losses"], base["losses"], strict=True)) else "no"
        rss = max(r["peaks_rss"])
        vs_peak = f"{rss / max(base['peaks_rss']):.3f}x" if base else "-"
        vs_step = f"{step / statistics.median(base['step_s']):.2f}x" if base else "-"
        print(f"| {r['variant']} | {', '.join(f'{p / mib:.1f}' for p in r['peaks'])} | "
              f"{', '.join(f'{p / mib:.1f}' for p in r['peaks_rss'])} | {vs_peak} | "
              f"{step * 1e3:.0f} ({spread}) | {vs_step} | {same} |")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: v for k, v in vars(args).items()
                                                  if k not in ("json", "worker", "out")},
                                         "rows": rows}, indent=1, sort_keys=True) + "\n")
    print(f"\ntotal {(time.time() - started) / 60:.1f} min")


if __name__ == "__main__":
    main()
