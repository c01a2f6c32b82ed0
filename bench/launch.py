"""Runtime benchmark: `partc launch` vs single-process training and vs hand-written
torch.distributed.pipelining scripts with the same split, in two layouts: 2 pipeline stages
(2 processes) and 2 stages x 2 data-parallel replicas ("2x2", 4 processes).

All five runs train bench/models/mlp_stack.py (8 equal 1024-wide blocks + head) on the same
global batch (`--batch`, default 4096) with AdamW (lr 1e-3, weight decay 0.01) and the model
file's batches(), one thread per process (OMP_NUM_THREADS=1), from the same initial weights:

- single: the whole model in one process (forward, backward, step on the whole batch);
- partc, 2 stages: `partc compile -b B --stages 2 --replicas 1 --microbatches M --schedule 1f1b`
  on the `local` cluster (this machine's cores as gloo processes), then `partc launch --steps N
  --metrics FILE` (2 gloo processes); step times from the metrics file;
- hand-written, 2 stages: bench/handwritten_pipeline.py under torchrun (2 processes), eager
  modules cut at the block where that partc plan cuts (the first block of its stage 1),
  Schedule1F1B with the same M;
- partc, 2x2: `partc compile -b B --cluster cpu-4 --stages 2 --replicas 2 --microbatches M2
  --schedule 1f1b` (configs/clusters/cpu-4.yaml: 4 gloo processes on this machine), then
  `partc launch` (4 processes; partc wraps each stage in DDP over its replicas);
- hand-written, 2x2: bench/handwritten_pipeline.py `--replicas 2 --check-sync` under torchrun
  (4 processes), cut where the 2x2 plan cuts, ranks laid out as the plan's (its
  `training.placement`; partc's stage-major puts stage 0 on ranks 0, 1 and stage 1 on 2, 3),
  one process group per replica's pipeline, each replica on its contiguous half of the batch,
  each stage's gradients averaged over its replicas by one flat all_reduce after the schedule
  step, then AdamW; the script asserts the replicas' parameters agree after the last step.

Micro-batches: partc's count is per replica (plan.yaml: global_batch_size = replicas x
num_microbatches x microbatch_size), so the 2x2 runs use M2 (`--microbatches-2x2`, default M)
micro-batches per replica of B / (2 x M2) samples, half the 2-stage runs' B / M at the same
count; the hand-written runs use the plan's micro-batch size (checked). With fewer than 4 cores
the 2x2 runs oversubscribe them (4 single-thread processes on e.g. 2 cores): expected, and said
in the output; their step times include that contention, so they compare with the hand-written
2x2 run (same contention), not with the ideal 4-device speed-up.

Step time = median over the steps after two warm-up steps, data loading included. Each repeat
runs the five in turn (single, partc 2, hand 2, partc 2x2, hand 2x2); ratios are computed per
repeat and the table shows their medians; absolute step times are medians over repeats. stdout:
the markdown table (samples/s = B / step time; "vs single process": throughput multiple;
"vs hand-written, same layout": partc's step time relative to the hand-written run's, signed,
negative = partc faster). stderr: progress per repeat, with each run's loss at the first and
last step (the same data and weights, so the runs' losses agree closely). `--json PATH` also
writes machine, cpus, config, per-repeat step seconds (single_s, partc_2_s, hand_2_s,
partc_2x2_s, hand_2x2_s), their medians and the median ratios (`*_vs_single`: throughput
multiples single_s / run_s; `partc_*_vs_hand_*`: step-time ratios partc / hand-written).
`--quick` (1 repeat, 6 steps; overrides --repeats and --steps) is a smoke run.

    .venv/bin/python bench/launch.py [--repeats 3] [--steps 12] [--batch 4096] [--microbatches 16]
        [--microbatches-2x2 M2] [--json PATH] [--quick]
"""
from __future__ import annotations

import argparse
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
WARMUP = 2  # steps left out of every step-time median
RUNS = ("single", "partc_2", "hand_2", "partc_2x2", "hand_2x2")  # one repeat's order
Loss = tuple[float, float]  # loss at the first and the last step


def single_process(batch: int, steps: int) -> tuple[float, Loss]:
    """Median step time of plain training in this process (run with OMP_NUM_THREADS=1)."""
    import torch

    from partc.frontend.model_file import load_model_file

    torch.set_num_threads(1)
    mf = load_model_file(MODEL)
    assert mf.batches is not None and mf.loss_fn is not None
    model = mf.build().train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, foreach=True)
    data = iter(mf.batches(batch))
    times, losses = [], []
    for _ in range(steps):
        start = time.perf_counter()
        (x,), y = next(data)
        optimizer.zero_grad(set_to_none=True)
        loss = mf.loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())  # after the clock, as partc's loss report
    return statistics.median(times[WARMUP:]), (losses[0], losses[-1])


def run(cmd: list[str]) -> str:
    """Run a step of the benchmark; on failure show its output's tail (captured, so the table
    stays clean) instead of a bare CalledProcessError."""
    out = subprocess.run(cmd, env=ENV, cwd=ROOT, capture_output=True, text=True)
    if out.returncode:
        tail = "\n".join((out.stdout + out.stderr).splitlines()[-30:])
        raise SystemExit(f"failed ({out.returncode}): {' '.join(cmd)}\n{tail}")
    return out.stdout


def load_plan(plan_path: Path) -> dict:
    import yaml

    return yaml.safe_load(plan_path.read_text())


def split_block(plan: dict) -> int:
    """The first block of stage 1 in the partc plan (the hand-written script cuts there)."""
    names = plan["stages"][1]["parameter_names"]
    blocks = sorted(int(n.split(".")[1]) for n in names if n.startswith("blocks."))
    if not blocks:
        raise SystemExit("the partc plan puts no block in stage 1: not a split a hand-written "
                         "script would use")
    return blocks[0]


def placement(plan: dict) -> str:
    """The plan's rank layout as handwritten_pipeline.py's --placement: global rank g is the
    g-th of the plan's devices (partc.run.rank_layout), checked against the script's formula."""
    stages, replicas = plan["stages"], int(plan["training"]["replicas"])
    devices = sorted({d for st in stages for d in st["devices"]})
    mesh = [[devices.index(d) for d in st["devices"]] for st in stages]  # [stage][replica]
    layouts = {"stage-major": [[s * replicas + k for k in range(replicas)]
                               for s in range(len(stages))],
               "pipeline-major": [[k * len(stages) + s for k in range(replicas)]
                                  for s in range(len(stages))]}
    for name, expected in layouts.items():
        if mesh == expected:
            return name
    raise SystemExit(f"the 2x2 plan's rank layout {mesh} is neither stage- nor pipeline-major")


def compile_plan(out: Path, batch: int, m: int, cluster: str, replicas: int) -> dict:
    run([str(BIN / "partc"), "compile", str(MODEL), "-b", str(batch), "--cluster", cluster,
         "--stages", "2", "--replicas", str(replicas), "--microbatches", str(m),
         "--schedule", "1f1b", "-o", str(out)])
    plan = load_plan(out / "plan.yaml")
    t = plan["training"]
    if (int(t["stages"]), int(t["replicas"]), int(t["num_microbatches"])) != (2, replicas, m):
        raise SystemExit(f"{out}/plan.yaml is not the pinned 2 x {replicas}, {m} micro-batches")
    if int(t["microbatch_size"]) * replicas * m != batch:
        raise SystemExit(f"{out}/plan.yaml: micro-batch {t['microbatch_size']} x {replicas} "
                         f"replicas x {m} != batch {batch}")
    return plan


def run_partc(plan: Path, steps: int, tmp: Path) -> tuple[float, Loss]:
    metrics = tmp / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    run([str(BIN / "partc"), "launch", str(plan), "--steps", str(steps),
         "--metrics", str(metrics)])
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    return (statistics.median(r["step_s"] for r in rows[WARMUP:]),
            (rows[0]["loss"], rows[-1]["loss"]))


def run_handwritten(split: int, batch: int, m: int, steps: int, replicas: int = 1,
                    layout: str = "stage-major") -> tuple[float, Loss]:
    cmd = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", str(2 * replicas),
           str(ROOT / "bench" / "handwritten_pipeline.py"), "--split", str(split),
           "--batch", str(batch), "--microbatches", str(m), "--steps", str(steps)]
    if replicas > 1:  # the 2-stage command stays exactly as before
        cmd += ["--replicas", str(replicas), "--placement", layout, "--check-sync"]
    line = [ln for ln in run(cmd).splitlines() if ln.startswith("{")][-1]
    result = json.loads(line)
    return float(result["step_s"]), tuple(result["loss"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--microbatches", type=int, default=16,
                        help="micro-batches of the 2-stage runs")
    parser.add_argument("--microbatches-2x2", type=int, default=None,
                        help="micro-batches per replica of the 2x2 runs (default: --microbatches)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 repeat, 6 steps")
    parser.add_argument("--single", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.single:
        step_s, loss = single_process(args.batch, args.steps)
        print(json.dumps({"step_s": step_s, "loss": loss}))
        return
    if args.quick:
        args.repeats, args.steps = 1, 6
    if args.steps <= WARMUP or args.repeats < 1:
        raise SystemExit(f"need --repeats >= 1 and --steps > {WARMUP} (the warm-up steps)")
    m2 = args.microbatches_2x2 or args.microbatches
    cpus = os.cpu_count() or 1
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        plan2, plan22 = tmp / "plan2" / "plan.yaml", tmp / "plan2x2" / "plan.yaml"
        p2 = compile_plan(plan2.parent, args.batch, args.microbatches, "local", 1)
        p22 = compile_plan(plan22.parent, args.batch, m2, "cpu-4", 2)
        split2, split22, layout22 = split_block(p2), split_block(p22), placement(p22)
        micro2, micro22 = (int(p["training"]["microbatch_size"]) for p in (p2, p22))
        rows: list[dict[str, float]] = []
        for i in range(args.repeats):
            out = json.loads(run([sys.executable, __file__, "--single", "--batch",
                                  str(args.batch), "--steps", str(args.steps)]))
            res: dict[str, tuple[float, Loss]] = {"single": (out["step_s"], tuple(out["loss"]))}
            res["partc_2"] = run_partc(plan2, args.steps, tmp)
            res["hand_2"] = run_handwritten(split2, args.batch, args.microbatches, args.steps)
            res["partc_2x2"] = run_partc(plan22, args.steps, tmp)
            res["hand_2x2"] = run_handwritten(split22, args.batch, m2, args.steps, 2, layout22)
            rows.append({f"{k}_s": res[k][0] for k in RUNS})
            print(f"repeat {i + 1}/{args.repeats}: " + "  ".join(
                f"{k} {s * 1e3:.1f} ms (loss {a:.6f} -> {b:.6f})"
                for k, (s, (a, b)) in res.items()), file=sys.stderr)

    med = statistics.median
    median = {k: med(r[k] for r in rows) for k in rows[0]}
    ratios = {f"{k}_vs_single": med(r["single_s"] / r[f"{k}_s"] for r in rows)
              for k in RUNS[1:]}
    for layout in ("2", "2x2"):
        ratios[f"partc_{layout}_vs_hand_{layout}"] = med(
            r[f"partc_{layout}_s"] / r[f"hand_{layout}_s"] for r in rows)
    machine = platform.processor() or platform.machine()
    print(f"machine: {machine}, {cpus} cpus; model mlp_stack (8 x 1024 blocks), batch "
          f"{args.batch}; 2 stages: {args.microbatches} micro-batches of {micro2}, split at "
          f"block {split2}; 2x2: {m2} micro-batches of {micro22} per replica, split at block "
          f"{split22}, {layout22} ranks; {args.repeats} repeats x {args.steps} steps "
          f"({WARMUP} warm-up)")
    if 4 > cpus:
        print(f"note: the 2x2 runs put 4 single-thread processes on {cpus} cpus "
              f"(oversubscribed, as cluster cpu-4 says): expected; compare them with each "
              f"other, not with a 4-device speed-up")
    print("| run | processes | step (median) | samples/s | vs single process "
          "| vs hand-written, same layout |")
    print("|---|---|---|---|---|---|")
    table = [("single process", "single", 1, None),
             ("partc launch, 2 stages", "partc_2", 2, "partc_2_vs_hand_2"),
             ("hand-written, 2 stages", "hand_2", 2, None),
             ("partc launch, 2x2", "partc_2x2", 4, "partc_2x2_vs_hand_2x2"),
             ("hand-written, 2x2", "hand_2x2", 4, None)]
    for label, key, procs, vs_hand in table:
        step = median[f"{key}_s"]
        vs_single = ratios.get(f"{key}_vs_single", 1.0)
        hand = f"{ratios[vs_hand] - 1:+.1%} step time" if vs_hand else "-"
        print(f"| {label} | {procs} | {step * 1e3:.1f} ms | {args.batch / step:,.0f} | "
              f"{vs_single:.2f}x | {hand} |")
    print("ratios: medians of per-repeat ratios; step times: medians over repeats")
    if args.json is not None:
        args.json.write_text(json.dumps({
            "machine": machine, "cpus": cpus,
            "config": {"model": "bench/models/mlp_stack.py", "batch": args.batch,
                       "microbatches": {"2": args.microbatches, "2x2": m2},
                       "microbatch_size": {"2": micro2, "2x2": micro22},
                       "steps": args.steps, "warmup_steps": WARMUP, "repeats": args.repeats,
                       "split": {"2": split2, "2x2": split22}, "placement_2x2": layout22,
                       "clusters": {"2": "local", "2x2": "cpu-4"}, "omp_num_threads": 1,
                       "processes": {"single": 1, "partc_2": 2, "hand_2": 2, "partc_2x2": 4,
                                     "hand_2x2": 4}},
            "repeats": rows, "median": median, "ratios": ratios}, indent=2) + "\n")


if __name__ == "__main__":
    main()
