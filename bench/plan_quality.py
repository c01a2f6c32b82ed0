"""Plan quality: cpsat vs chain-dp vs the uniform and params baselines, over a model zoo x clusters.

For every model of the zoo on every cluster (`cpu`: this machine's 2 gloo processes,
`8xa100-80gb`, `4x8xv100-32gb`, `4x8xh100-80gb`) the model is captured once (torch.export, no
ONNX; the large models on the meta device, never materialised), priced with the analytic roofline
of the cluster's device, coarsened once (128 blocks) and searched by every strategy on the same
block graph (`compare_strategies`, as `partc solve --strategy all`):

- uniform: Megatron-style equal layer counts per stage; params: DeepSpeed-style balanced
  parameters; chain-dp: the exact dynamic program over contiguous cuts; cpsat: partc's solver.

Two settings per (model, cluster):

- free: stages, replicas, micro-batches, schedule and checkpointing all searched;
- pinned: a pipeline pinned so the strategies' cuts have to differ (`settings()`): 2 stages on
  `cpu`, 4 stages for the small examples elsewhere, 8 stages for the zoo's large models (1 replica
  on 8 GPUs, replicas searched on 32).

One markdown row per (model, cluster, setting, strategy): the shape, the simulated iteration time,
the solver's objective, cpsat's proven gap to its bound for that shape and its search gap (any
shape), whether the plan fits (largest rank's exact memory vs usable memory; a strategy with no
plan that fits says why), the bubble and the search's wall time (capture, pricing and coarsening
excluded). A summary table then gives cpsat's simulated iteration time over the best baseline's
(uniform, params) and over chain-dp's per case.

    .venv/bin/python bench/plan_quality.py [--quick] [--models mlp,bert_large]
        [--clusters cpu,8xa100-80gb] [--json bench/results/plan_quality.json]
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

# E402: partc is imported from the checkout, after the sys.path insert above.
from partc.cost.plan_costs import plan_costs  # noqa: E402
from partc.errors import PartcError  # noqa: E402
from partc.frontend.capture import capture_graph  # noqa: E402
from partc.hardware.configs import load_cluster  # noqa: E402
from partc.options import STRATEGIES, SearchOptions, TrainingConfig  # noqa: E402
from partc.solve.coarsen import coarsen  # noqa: E402
from partc.solve.partition import Partition  # noqa: E402
from partc.solve.search import compare_strategies  # noqa: E402

# name -> (model file, global batch on GPU clusters). The small examples' batches scale with the
# cluster instead (`global_batch()`).
ZOO: dict[str, tuple[str, int | None]] = {
    "mlp": ("examples/mlp.py", None),
    "transformer": ("examples/transformer.py", None),
    "bert": ("examples/bert.py", None),
    "gpt2": ("examples/gpt2.py", None),
    "resnet": ("examples/resnet.py", None),
    # BERT phase-2-style batches of 256; GPT-2 at 512 x 1024 tokens (0.5M per iteration);
    # ResNet-50 at ImageNet's standard 256.
    "bert_base": ("bench/models/bert_base.py", 256),
    "bert_large": ("examples/bert_large_meta.py", 256),
    "gpt2_small": ("bench/models/scale/gpt_0p1b.py", 512),
    "gpt2_medium": ("bench/models/scale/gpt_0p35b.py", 512),
    "gpt2_1p3b": ("examples/gpt2_1p3b_meta.py", 512),
    "resnet50": ("bench/models/resnet50_meta.py", 256),
}
SMALL = ("mlp", "transformer", "bert", "gpt2", "resnet")
CLUSTERS = ("cpu", "8xa100-80gb", "4x8xv100-32gb", "4x8xh100-80gb")
CAPTURE_BATCH = 2  # `partc solve`'s default --capture-batch
BASELINES = ("uniform", "params")


@dataclass(frozen=True)
class Case:
    model: str
    cluster: str
    global_batch: int
    devices: int


def global_batch(model: str, devices: int) -> int:
    """The small examples get 16 samples per device (32 on this machine's 2 processes, 512 on 32
    GPUs); the zoo's real-size models their usual training batch whatever the cluster."""
    fixed = ZOO[model][1]
    return fixed if fixed is not None else 16 * devices


def cases(models: list[str], clusters: list[str]) -> list[Case]:
    out = []
    for m in models:
        for c in clusters:
            n = load_cluster(c).num_devices
            out.append(Case(m, c, global_batch(m, n), n))
    return out


def settings(case: Case, num_blocks: int) -> list[tuple[str, dict[str, Any]]]:
    """(label, pinned SearchOptions fields) per setting (module docstring)."""
    out: list[tuple[str, dict[str, int]]] = [("free", {})]
    if case.devices == 2:
        out.append(("S2", {"stages": 2}))
    elif case.model in SMALL:
        if num_blocks >= 8:
            out.append(("S4", {"stages": 4}))
    elif case.devices == 8:
        out.append(("S8 R1", {"stages": 8, "replicas": 1}))
    else:
        out.append(("S8", {"stages": 8}))
    return out


def run_case(case: Case, training: TrainingConfig, time_limit_s: float,
             captures: dict[str, Any]) -> list[dict[str, Any]]:
    if case.model not in captures:
        captures.clear()  # one model's capture alive at a time
        captures[case.model] = capture_graph(ROOT / ZOO[case.model][0], CAPTURE_BATCH,
                                             onnx=False)
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
    parser.add_argument("--models", default=",".join(ZOO), help="comma-separated zoo names")
    parser.add_argument("--clusters", default=",".join(CLUSTERS))
    parser.add_argument("--quick", action="store_true",
                        help="bert and bert_large on cpu and 8xa100-80gb (the `make bench` set)")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16-mixed"])
    parser.add_argument("--time-limit", type=float, default=10.0,
                        help="CP-SAT deterministic seconds per refined shape (partc's default)")
    parser.add_argument("--json", type=Path, help="write the raw rows here")
    args = parser.parse_args()
    models = args.models.split(",")
    clusters = args.clusters.split(",")
    if args.quick:
        models, clusters = ["bert", "bert_large"], ["cpu", "8xa100-80gb"]
    unknown = [m for m in models if m not in ZOO]
    if unknown:
        raise SystemExit(f"unknown model(s) {unknown}; the zoo has {', '.join(ZOO)}")
    training = TrainingConfig(optimizer="adamw", precision=args.precision, memory_margin=0.1)
    start = time.perf_counter()
    command = " ".join([".venv/bin/python", "bench/plan_quality.py"] + sys.argv[1:])
    machine = (f"{platform.machine()}, {platform.python_implementation()} "
               f"{platform.python_version()}")
    print(f"partc at {_revision()}")
    print(f"command: `{command}`; {machine}; AdamW, {args.precision}, 10% memory margin, analytic "
          f"costs, capture batch {CAPTURE_BATCH}, 128 blocks, CP-SAT limit {args.time_limit} "
          f"deterministic s, refine 1\n")
    rows: list[dict[str, Any]] = []
    captures: dict[str, Any] = {}
    for case in cases(models, clusters):
        rows += run_case(case, training, args.time_limit, captures)
    captures.clear()
    print(markdown(rows))
    print()
    print(summary(rows))
    total = time.perf_counter() - start
    print(f"\nbench wall time: {total:.0f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"rows": rows, "wall_s": total, "command": command,
                                         "revision": _revision(), "machine": machine},
                                        indent=2, sort_keys=True, default=str) + "\n")


if __name__ == "__main__":
    main()
