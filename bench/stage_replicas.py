"""Per-stage replica counts (RaNNC's 16/8/8): what they could gain over partc's plans, predicted.

partc's plans give every pipeline stage the same number of data-parallel replicas R, and balance
the stages by where they cut. RaNNC instead gives each stage its own replica count R_k, so that a
stage heavier than the others gets more devices. Would that pay on top of partc's cuts?

For each real-size model of the plan-quality zoo on each GPU cluster, cpsat's plan (analytic
costs; the zoo's free and pinned-8-stage settings as bench/plan_quality.py) is taken as it is, and
the same devices (S x R) are redistributed over its stages:

- `bound`: the most any per-stage counts could gain in the pipeline's steady state: the uniform
  plan's bottleneck stage time over the mean stage time (with R_k devices a stage's time per
  micro-batch is t_k R / R_k, and the devices' total work is fixed, so no allocation has a
  bottleneck below the mean);
- `best counts`: the integer counts R_k >= 1 with sum S x R whose per-replica batch splits
  evenly (each R_k divides the micro-batch size times R) with the smallest bottleneck (an exact
  dynamic program), and the plan with them simulated by partc's simulator: each stage's
  compute scaled by R / R_k, its gradient all-reduce over its R_k devices, transfers and optimizer
  as in the plan. That is an optimistic prediction: it charges nothing for routing micro-batches
  between stages of different widths, which torch.distributed.pipelining cannot do (a
  PipelineStage sends each micro-batch to exactly one peer).

    .venv/bin/python bench/stage_replicas.py [--models bert_large,gpt2_1p3b,resnet50]
        [--clusters 8xa100-80gb,4x8xv100-32gb,4x8xh100-80gb] [--json FILE]
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from plan_quality import CAPTURE_BATCH, ZOO, Case, global_batch, settings  # noqa: E402
from process_stats import finish  # noqa: E402

from partc.cost.plan_costs import plan_costs  # noqa: E402
from partc.errors import PartcError  # noqa: E402
from partc.frontend.capture import capture_graph  # noqa: E402
from partc.hardware.configs import load_cluster  # noqa: E402
from partc.options import SearchOptions, TrainingConfig  # noqa: E402
from partc.solve.coarsen import coarsen  # noqa: E402
from partc.solve.partition import Partition  # noqa: E402
from partc.solve.search import search  # noqa: E402
from partc.solve.simulator import simulate  # noqa: E402

MODELS = ("bert_base", "bert_large", "gpt2_small", "gpt2_medium", "gpt2_1p3b", "resnet50")
CLUSTERS = ("8xa100-80gb", "4x8xv100-32gb", "4x8xh100-80gb")


def stage_work(p: Partition) -> list[float]:
    """Per pipeline rank: compute per micro-batch (forward + backward of its stages)."""
    work = [0.0] * p.shape.stages
    for st in p.stages:
        work[st.rank] += st.forward_s + st.backward_s
    return work


def best_counts(work: list[float], devices: int, replicas: int,
                microbatch: int) -> list[int]:
    """The per-stage counts R_k >= 1, summing to `devices`, whose per-replica batch splits evenly
    (R_k divides the micro-batch's samples over all replicas), with the smallest bottleneck
    max_k work_k R / R_k (ties: fewer devices on the earlier stages): an exact dynamic program
    over (stage, devices used)."""
    S = len(work)
    samples = microbatch * replicas  # one micro-batch's samples over all replicas
    allowed = [r for r in range(1, devices + 1) if samples % r == 0]
    # best[d] = (bottleneck, counts) of the first k stages on exactly d devices
    best: dict[int, tuple[float, list[int]]] = {0: (0.0, [])}
    for k in range(S):
        nxt: dict[int, tuple[float, list[int]]] = {}
        for used, (neck, counts) in best.items():
            for r in allowed:
                d = used + r
                if d > devices - (S - 1 - k):
                    break
                cand = (max(neck, work[k] * replicas / r), counts + [r])
                if d not in nxt or cand < nxt[d]:
                    nxt[d] = cand
        best = nxt
    return best[devices][1] if devices in best else [replicas] * S


def with_counts(p: Partition, counts: list[int], cluster: Any) -> float:
    """The plan's simulated iteration with stage k on counts[k] replicas (module docstring)."""
    R = p.shape.replicas
    spec = p.pipeline
    stages = []
    for st, timing in zip(p.stages, spec.stages, strict=True):
        scale = R / counts[st.rank]
        stages.append(replace(timing, forward_s=timing.forward_s * scale,
                              backward_s=timing.backward_s * scale))
    allreduce = []
    every = [d for r in range(p.shape.stages) for d in p.shape.rank_devices(r)]
    for rank, c in enumerate(counts):
        if c == R:  # the plan's own all-reduce
            allreduce.append(spec.allreduce_s[rank] if spec.allreduce_s else 0.0)
            continue
        # its own replicas' devices first, then others: the links the plan's placement uses
        own = list(p.shape.rank_devices(rank))
        group = (own + [d for d in every if d not in own])[:c]
        grad_bytes = p.memory[rank].gradients
        allreduce.append(cluster.allreduce_s(grad_bytes, tuple(group)) if c > 1 else 0.0)
    return simulate(replace(spec, stages=tuple(stages), allreduce_s=tuple(allreduce))).iteration_s


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--clusters", default=",".join(CLUSTERS))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    start = time.perf_counter()
    rows: list[dict[str, Any]] = []
    print("| model | cluster | setting | plan | stage time max/mean (bound) | best counts | "
          "predicted iteration uniform -> per-stage counts | gain |")
    print("|---|---|---|---|---|---|---|---|")
    for model in args.models.split(","):
        result = capture_graph(ROOT / ZOO[model][0], CAPTURE_BATCH, onnx=False)
        for name in args.clusters.split(","):
            cluster = load_cluster(name)
            case = Case(model, name, global_batch(model, cluster.num_devices),
                        cluster.num_devices)
            table = plan_costs(result, cluster.device)
            blocks = coarsen(table, 128)
            for label, pinned in settings(case, len(blocks.blocks)):
                try:
                    p = search(table, cluster, case.global_batch, TrainingConfig(),
                               SearchOptions(**pinned), blocks=blocks)
                except PartcError as exc:
                    print(f"| {model} | {name} | {label} | no plan: {exc.message[:60]} |"
                          " | | | |")
                    continue
                work = stage_work(p)
                bound = max(work) / (sum(work) / len(work))
                S, R = p.shape.stages, p.shape.replicas
                counts = best_counts(work, S * R, R, p.shape.microbatch_size)
                uniform = p.iteration_s
                other = with_counts(p, counts, cluster)
                gain = uniform / other
                print(f"| {model} | {name} | {label} | {p.shape.label()} | {bound:.3f} | "
                      f"{'/'.join(map(str, counts))} | {uniform * 1e3:.1f} -> "
                      f"{other * 1e3:.1f} ms | {gain:.3f}x |", flush=True)
                rows.append({"model": model, "cluster": name, "setting": label,
                             "shape": p.shape.label(), "bound": bound, "counts": counts,
                             "uniform_s": uniform, "per_stage_s": other, "gain": gain})
    finish(start, args.json, {"rows": rows})


if __name__ == "__main__":
    main()
