"""Solver benchmark: cpsat vs chain-dp vs the uniform and params baselines, and BERT-large's compile
path.

For every example (mlp, transformer, bert, gpt2, resnet: on the `cpu` and `8xa100-80gb` clusters)
and the meta-device BERT-large and GPT-2 1.3B (on `8xa100-80gb`), the model is captured once
(torch.export, no ONNX), priced with the analytic roofline of the cluster's device, coarsened once
(128 blocks) and searched by every strategy on the same block graph (`compare_strategies`, as
`partc solve --strategy all`). Two settings per (model, cluster):

- free: stages, replicas, micro-batches, schedule and checkpointing all searched;
- pinned: a pipeline pinned so the strategies' cuts have to differ: `--stages 8 --replicas 1` for
  the large models on 8xa100, `--stages 2` on cpu (2 devices, so 1 replica), `--stages 4` for the
  small models on 8xa100 (replicas searched) when the model has at least 8 blocks.

One markdown row per (model, cluster, setting, strategy): the shape, the simulated iteration time,
the solver's objective, cpsat's gap (its bound for that shape) and search gap (any shape), whether
the plan fits (largest rank's exact memory vs usable memory), the bubble and the search's wall time
(capture, pricing and coarsening excluded). A summary table then gives cpsat's simulated iteration
time over the best baseline's (uniform, params) and over chain-dp's per case.

Finally BERT-large's whole compile path (imports, capture without ONNX, roofline pricing,
coarsening, cpsat search) is timed in a fresh process, with its peak RSS (goal: < 60 s).

    .venv/bin/python bench/solver.py [--quick] [--models mlp,bert_large_meta] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from partc.coarsen import coarsen  # noqa: E402
from partc.errors import PartcError  # noqa: E402
from partc.hardware import load_cluster  # noqa: E402
from partc.memory import TrainingConfig  # noqa: E402
from partc.partition import Partition  # noqa: E402
from partc.pipeline import capture_graph, plan_costs  # noqa: E402
from partc.search import STRATEGIES, SearchOptions, compare_strategies  # noqa: E402

SMALL = ("mlp", "transformer", "bert", "gpt2", "resnet")
LARGE = ("bert_large_meta", "gpt2_1p3b_meta")
CAPTURE_BATCH = 2  # `partc solve`'s default --capture-batch
BASELINES = ("uniform", "params")


@dataclass(frozen=True)
class Case:
    model: str
    cluster: str
    global_batch: int


# Global batches: BERT-large 256 (its phase-2 pre-training batch per 8 GPUs), GPT-2 1.3B 512
# (sequence 1024: 0.5M tokens per iteration); the small examples 32 on the 2-device cpu cluster
# and 64 on 8 A100s (8 samples per replica under pure data parallelism).
def cases(models: list[str]) -> list[Case]:
    out = []
    for m in models:
        if m in LARGE:
            out.append(Case(m, "8xa100-80gb", 256 if m == "bert_large_meta" else 512))
        else:
            out.append(Case(m, "cpu", 32))
            out.append(Case(m, "8xa100-80gb", 64))
    return out


def settings(case: Case, num_blocks: int) -> list[tuple[str, dict[str, int]]]:
    """(label, pinned SearchOptions fields) per setting (module docstring)."""
    out: list[tuple[str, dict[str, int]]] = [("free", {})]
    if case.model in LARGE:
        out.append(("S8 R1", {"stages": 8, "replicas": 1}))
    elif case.cluster == "cpu":
        out.append(("S2", {"stages": 2}))
    elif num_blocks >= 8:
        out.append(("S4", {"stages": 4}))
    return out


def run_case(case: Case, training: TrainingConfig, time_limit_s: float,
             captures: dict[str, Any]) -> list[dict[str, Any]]:
    if case.model not in captures:
        captures.clear()  # one model's capture alive at a time
        captures[case.model] = capture_graph(ROOT / "examples" / f"{case.model}.py",
                                             CAPTURE_BATCH, onnx=False)
    result = captures[case.model]
    cluster = load_cluster(case.cluster)
    table = plan_costs(result, cluster.device)
    blocks = coarsen(table, 128)
    rows = []
    for label, pinned in settings(case, len(blocks.blocks)):
        options = SearchOptions(time_limit_s=time_limit_s, **pinned)
        for strategy in STRATEGIES:
            t0 = time.perf_counter()
            out = compare_strategies(table, cluster, case.global_batch, training, options,
                                     strategies=(strategy,), blocks=blocks)[strategy]
            elapsed = time.perf_counter() - t0
            rows.append(row(case, label, strategy, out, elapsed, len(blocks.blocks),
                            blocks.is_chain))
            print(f"... {case.model} {case.cluster} {label} {strategy}: "
                  f"{rows[-1]['shape']} {elapsed:.1f} s", file=sys.stderr, flush=True)
    return rows


def row(case: Case, setting: str, strategy: str, out: Partition | PartcError, elapsed: float,
        num_blocks: int, is_chain: bool) -> dict[str, Any]:
    r: dict[str, Any] = {"model": case.model, "cluster": case.cluster,
                         "global_batch": case.global_batch, "setting": setting,
                         "strategy": strategy, "blocks": num_blocks, "chain": is_chain}
    if not isinstance(out, Partition):
        r.update(shape=None, error=getattr(out, "message", str(out)), solve_s=elapsed,
                 fits=False)
        return r
    s = out.solver
    peak = max(m.total for m in out.memory)
    r.update(shape=out.shape.label(), iteration_s=out.iteration_s, objective_s=s.objective_s,
             gap=s.gap, search_gap=s.search_gap, status=s.status, solve_s=s.wall_s,
             peak_bytes=peak, usable_bytes=out.usable_memory_bytes,
             fits=peak <= out.usable_memory_bytes, bubble=out.simulation.bubble_fraction,
             shapes=(s.shapes_evaluated, s.shapes_enumerated))
    return r


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.2f}%"


def markdown(rows: list[dict[str, Any]]) -> str:
    out = ["| model | cluster | batch | setting | strategy | shape | iteration ms (sim) "
           "| objective ms | gap | search gap | fits (peak / usable GiB) | bubble "
           "| shapes eval/enum | solve s |",
           "|---|---|---:|---|---|---|---:|---:|---:|---:|---|---:|---:|---:|"]
    for r in rows:
        head = (f"| {r['model']} | {r['cluster']} | {r['global_batch']} | {r['setting']} | "
                f"{r['strategy']} |")
        if r["shape"] is None:
            out.append(f"{head} no plan: {r['error'][:80]} | | | | | no | | | "
                       f"{r['solve_s']:.2f} |")
            continue
        gap = _pct(r["gap"]) if r["strategy"] == "cpsat" else "-"
        sgap = _pct(r["search_gap"]) if r["strategy"] == "cpsat" else "-"
        out.append(f"{head} {r['shape']} | {r['iteration_s'] * 1e3:.3f} | "
                   f"{r['objective_s'] * 1e3:.3f} | {gap} | {sgap} | "
                   f"{'yes' if r['fits'] else 'NO'} ({r['peak_bytes'] / 2**30:.2f} / "
                   f"{r['usable_bytes'] / 2**30:.2f}) | {100 * r['bubble']:.1f}% | "
                   f"{r['shapes'][0]}/{r['shapes'][1]} | {r['solve_s']:.2f} |")
    return "\n".join(out)


def summary(rows: list[dict[str, Any]]) -> str:
    """Per case: cpsat's simulated iteration over the best baseline's and over chain-dp's."""
    out = ["| model | cluster | setting | blocks (chain?) | cpsat ms | best baseline | "
           "cpsat / best baseline | chain-dp ms | cpsat / chain-dp | cpsat solve s |",
           "|---|---|---|---|---:|---|---:|---:|---:|---:|"]
    groups: dict[tuple[str, str, str], dict[str, dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["model"], r["cluster"], r["setting"]), {})[r["strategy"]] = r
    for (model, cluster, setting), g in groups.items():
        c = g.get("cpsat")
        if c is None:
            continue
        ok = {k: v for k, v in g.items() if v["shape"] is not None}
        base = [ok[k] for k in BASELINES if k in ok]
        best = min(base, key=lambda r: r["iteration_s"]) if base else None
        dp = ok.get("chain-dp")
        cms = f"{c['iteration_s'] * 1e3:.3f}" if c["shape"] else "no plan"
        bstr = (f"{best['strategy']} {best['iteration_s'] * 1e3:.3f}" if best else "no plan")
        ratio = f"{c['iteration_s'] / best['iteration_s']:.3f}" if c["shape"] and best else "-"
        dps = f"{dp['iteration_s'] * 1e3:.3f}" if dp else "no plan"
        dratio = f"{c['iteration_s'] / dp['iteration_s']:.3f}" if c["shape"] and dp else "-"
        blocks = f"{c['blocks']} ({'yes' if c['chain'] else 'no'})"
        out.append(f"| {model} | {cluster} | {setting} | {blocks} | {cms} | {bstr} | {ratio} | "
                   f"{dps} | {dratio} | {c['solve_s']:.2f} |")
    return "\n".join(out)


# ---- BERT-large's compile path in a fresh process -------------------------------------------
COMPILE_CHILD = r"""
import json, resource, sys, time
t0 = time.perf_counter()
steps = {}
def mark(name, since):
    now = time.perf_counter(); steps[name] = now - since; return now
from partc.coarsen import coarsen
from partc.hardware import load_cluster
from partc.memory import TrainingConfig
from partc.pipeline import capture_graph, plan_costs
from partc.search import SearchOptions, search
t = mark("imports", t0)
result = capture_graph(sys.argv[1], 2, onnx=False)
t = mark("capture", t)
cluster = load_cluster(sys.argv[2])
table = plan_costs(result, cluster.device)
t = mark("plan_costs", t)
blocks = coarsen(table, 128)
t = mark("coarsen", t)
pinned = json.loads(sys.argv[4])
p = search(table, cluster, int(sys.argv[3]), TrainingConfig(precision=sys.argv[5]),
           SearchOptions(strategy="cpsat", time_limit_s=float(sys.argv[6]), **pinned),
           blocks=blocks)
t = mark("search", t)
print(json.dumps({"total_s": time.perf_counter() - t0, "steps": steps, "shape": p.shape.label(),
                  "iteration_s": p.iteration_s, "status": p.solver.status,
                  "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def compile_path(setting: str, pinned: dict[str, int], precision: str,
                 time_limit_s: float) -> dict[str, Any]:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", COMPILE_CHILD,
                           str(ROOT / "examples" / "bert_large_meta.py"), "8xa100-80gb", "256",
                           json.dumps(pinned), precision, str(time_limit_s)],
                          capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"compile path: {proc.stderr[-2000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out.update(setting=setting, process_wall_s=wall)
    return out


def compile_markdown(runs: list[dict[str, Any]]) -> str:
    out = ["| setting | imports s | capture s | plan_costs s | coarsen s | cpsat search s "
           "| in-process total s | process wall s | peak RSS MiB | plan |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in runs:
        s = r["steps"]
        out.append(f"| {r['setting']} | {s['imports']:.1f} | {s['capture']:.1f} | "
                   f"{s['plan_costs']:.1f} | {s['coarsen']:.1f} | {s['search']:.1f} | "
                   f"{r['total_s']:.1f} | {r['process_wall_s']:.1f} | {r['rss_mib']:.0f} | "
                   f"{r['shape']} ({r['status']}) |")
    return "\n".join(out)


def _revision() -> str:
    """HEAD's short hash, and the partc/ files that differ from it (numbers depend on them)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=ROOT, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "partc"],
                               capture_output=True, text=True, cwd=ROOT, check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        return "unknown revision"
    changed = [f for f in dirty if f.startswith("partc/")]
    return head + (f" + uncommitted changes to {', '.join(changed)}" if changed else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(SMALL + LARGE),
                        help="comma-separated example names")
    parser.add_argument("--quick", action="store_true",
                        help="mlp and bert_large_meta only (a smoke run, not for the docs)")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16-mixed"])
    parser.add_argument("--time-limit", type=float, default=10.0,
                        help="CP-SAT deterministic seconds per refined shape (partc's default)")
    parser.add_argument("--no-compile-path", action="store_true",
                        help="skip the BERT-large compile-path subprocess")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    models = ["mlp", "bert_large_meta"] if args.quick else args.models.split(",")
    training = TrainingConfig(optimizer="adamw", precision=args.precision, memory_margin=0.1)
    start = time.perf_counter()
    command = " ".join(["python", "bench/solver.py"] + sys.argv[1:])
    print(f"partc at {_revision()}")
    print(f"command: `{command}`; {platform.machine()}, {platform.python_implementation()} "
          f"{platform.python_version()}; AdamW, {args.precision}, 10% memory margin, analytic "
          f"costs, capture batch {CAPTURE_BATCH}, 128 blocks, CP-SAT limit {args.time_limit} "
          f"deterministic s, refine 1\n")
    rows: list[dict[str, Any]] = []
    captures: dict[str, Any] = {}
    for case in cases(models):
        rows += run_case(case, training, args.time_limit, captures)
    captures.clear()
    print(markdown(rows))
    print()
    print(summary(rows))
    runs = []
    if not args.no_compile_path:
        for setting, pinned in (("free", {}), ("S8 R1", {"stages": 8, "replicas": 1})):
            print(f"... compile path {setting}", file=sys.stderr, flush=True)
            runs.append(compile_path(setting, pinned, args.precision, args.time_limit))
        print()
        print("BERT-large compile path (fresh process; 8xa100-80gb, global batch 256, cpsat):\n")
        print(compile_markdown(runs))
    total = time.perf_counter() - start
    print(f"\nbench wall time: {total:.0f} s")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "compile_path": runs, "wall_s": total},
                                        indent=2, sort_keys=True, default=str) + "\n")


if __name__ == "__main__":
    main()
