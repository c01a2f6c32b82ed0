"""Runtime benchmark: `partc launch` of a balanced 2-stage plan vs single-process training and
vs a hand-written torch.distributed.pipelining script with the same split.

All three train bench/models/mlp_stack.py (8 equal 1024-wide blocks) on the same global batch
with AdamW and the model file's batches(), one thread per process (OMP_NUM_THREADS=1):

- single: the whole model in one process (forward, backward, step on the whole batch);
- partc: `partc compile --stages 2 --replicas 1 --microbatches M` on the local cluster, then
  `partc launch --steps N --metrics FILE` (2 gloo processes); step times from the metrics file;
- hand-written: bench/handwritten_pipeline.py under torchrun, eager modules cut at the block
  where the partc plan cuts, Schedule1F1B with the same M.

Step time = median over the steps after two warm-up steps, data loading included. Each repeat
runs the three in turn; ratios are per repeat, the table shows their medians.

    .venv/bin/python bench/launch.py [--repeats 3] [--steps 12] [--batch 4096] [--microbatches 16]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
MODEL = ROOT / "bench" / "models" / "mlp_stack.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def single_process(batch: int, steps: int) -> float:
    """Median step time of plain training in this process (run with OMP_NUM_THREADS=1)."""
    import torch

    torch.set_num_threads(1)
    spec = importlib.util.spec_from_file_location("mlp_stack", MODEL)
    mf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mf)
    model = mf.build_model().train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, foreach=True)
    data = mf.batches(batch)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        (x,), y = next(data)
        optimizer.zero_grad(set_to_none=True)
        mf.loss_fn(model(x), y).backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:])


def split_block(plan_path: Path) -> int:
    """The first block of stage 1 in the partc plan (the hand-written script cuts there)."""
    import yaml

    plan = yaml.safe_load(plan_path.read_text())
    names = plan["stages"][1]["parameter_names"]
    blocks = sorted(int(n.split(".")[1]) for n in names if n.startswith("blocks."))
    if not blocks:
        raise SystemExit("the partc plan puts no block in stage 1: not a split a hand-written "
                         "script would use")
    return blocks[0]


def run_partc(plan: Path, steps: int, tmp: Path) -> float:
    metrics = tmp / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    subprocess.run([str(BIN / "partc"), "launch", str(plan), "--steps", str(steps),
                    "--metrics", str(metrics)], check=True, env=ENV, capture_output=True)
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    return statistics.median(r["step_s"] for r in rows[2:])


def run_handwritten(split: int, batch: int, m: int, steps: int) -> float:
    out = subprocess.run([str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2",
                          str(ROOT / "bench" / "handwritten_pipeline.py"), "--split", str(split),
                          "--batch", str(batch), "--microbatches", str(m), "--steps", str(steps)],
                         check=True, env=ENV, capture_output=True, text=True)
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("{")][-1]
    return float(json.loads(line)["step_s"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--microbatches", type=int, default=16)
    parser.add_argument("--single", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.single:
        print(json.dumps({"step_s": single_process(args.batch, args.steps)}))
        return
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        plan = tmp / "plan" / "plan.yaml"
        subprocess.run([str(BIN / "partc"), "compile", str(MODEL), "-b", str(args.batch),
                        "--stages", "2", "--replicas", "1", "--microbatches",
                        str(args.microbatches), "--schedule", "1f1b", "-o", str(plan.parent)],
                       check=True, env=ENV, capture_output=True)
        split = split_block(plan)
        rows = []
        for _ in range(args.repeats):
            single = json.loads(subprocess.run(
                [sys.executable, __file__, "--single", "--batch", str(args.batch), "--steps",
                 str(args.steps)], check=True, env=ENV, capture_output=True,
                text=True).stdout)["step_s"]
            partc = run_partc(plan, args.steps, tmp)
            hand = run_handwritten(split, args.batch, args.microbatches, args.steps)
            rows.append((single, partc, hand))
            print(f"single {single * 1e3:.1f} ms  partc {partc * 1e3:.1f} ms  hand-written "
                  f"{hand * 1e3:.1f} ms", file=sys.stderr)
    med = lambda xs: statistics.median(xs)  # noqa: E731
    single, partc, hand = (med([r[i] for r in rows]) for i in range(3))
    speedup = med([r[0] / r[1] for r in rows])
    overhead = med([r[1] / r[2] - 1 for r in rows])
    samples = args.batch
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cpus; "
          f"model mlp_stack (8 x 1024 blocks), batch {args.batch}, "
          f"{args.microbatches} micro-batches, split at block {split}, {args.repeats} repeats "
          f"x {args.steps} steps")
    print("| run | processes | step (median) | samples/s | vs single process |")
    print("|---|---|---|---|---|")
    print(f"| single process | 1 | {single * 1e3:.1f} ms | {samples / single:,.0f} | 1.00x |")
    print(f"| partc launch, 2 stages | 2 | {partc * 1e3:.1f} ms | {samples / partc:,.0f} | "
          f"{speedup:.2f}x |")
    print(f"| hand-written pipelining, same split | 2 | {hand * 1e3:.1f} ms | "
          f"{samples / hand:,.0f} | {single / hand:.2f}x |")
    print(f"partc vs hand-written: {overhead:+.1%} step time (median of per-repeat ratios)")


if __name__ == "__main__":
    main()
