"""The memory frontier: the largest model of the GPT and BERT ladders (bench/models/scale) partc
can plan at a fixed global batch on a cluster, with each set of memory levers, and what the plans
at the frontier predict. All numbers are partc's own model (analytic costs): "predicted".

Lever sets (the same search otherwise: every stage count, replica count, micro-batch count and
schedule):

- `none`: no lever (`--no-checkpointing --sharding none`): every stage keeps its activations and
  every replica all of its optimizer state;
- `checkpointing`: activation checkpointing where a stage needs it (`--sharding none`), which is
  at least what partc could do before per-stage levers (checkpointing every stage or none);
- `all`: every lever partc has, each stage using what its memory needs: checkpointing, and the
  optimizer state (ZeRO-1) or the optimizer state and the gradients (ZeRO-2) sharded over the
  stage's replicas.

For each (cluster, family, lever set) the ladder is walked upwards with `partc solve --costs
analytic` until a size does not fit (exit 2, "does not fit"); the largest size that fits is the
frontier. The frontier plan is then compiled (`partc compile`, a fresh process) for its wall time
and peak RSS: the minutes-not-hours bound of bench/compile_scale.py. Clusters: RaNNC's 4 x 8
V100-32GB and 8 x 8 H100-80GB. Global batches as compile_scale: GPT 128 sequences of 1024
tokens, BERT 256 of 512; fp32, AdamW.

    .venv/bin/python bench/frontier.py [--families gpt,bert] [--clusters 4x8xv100-32gb]
        [--levers none,checkpointing,all] [--no-compile] [--json bench/results/frontier.json]

About 1 hour on this 2-core machine (each 20B-100B solve takes 20-70 s).
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml
from process_stats import finish, last_line, run_measured

ROOT = Path(__file__).resolve().parent.parent
PARTC = str(Path(sys.executable).parent / "partc")
sys.path.insert(0, str(ROOT / "bench" / "models" / "scale"))
from scale_family import BERT_SHAPES, GPT_SHAPES  # noqa: E402

LADDERS = {"gpt": list(GPT_SHAPES), "bert": list(BERT_SHAPES)}
CLUSTERS = ("4x8xv100-32gb", "8x8xh100-80gb")
BATCH = {"gpt": 128, "bert": 256}
LEVERS = {"none": ["--no-checkpointing", "--sharding", "none"],
          "checkpointing": ["--sharding", "none"], "all": []}


def size_billions(size: str) -> float:
    return float(size.removesuffix("b").replace("p", "."))


def solve(family: str, size: str, cluster: str, levers: str, out: Path) -> dict[str, Any]:
    """One `partc solve`: whether the size fits, and the plan's prediction when it does."""
    model = ROOT / "bench" / "models" / "scale" / f"{family}_{size}.py"
    partition = out / f"{family}_{size}_{cluster}_{levers}.yaml"
    args = [PARTC, "solve", str(model), "-b", str(BATCH[family]), "--cluster", cluster,
            "--costs", "analytic", *LEVERS[levers], "-o", str(partition)]
    run = run_measured(args, cwd=ROOT, env={**os.environ, "PYTHONHASHSEED": "0"})
    row: dict[str, Any] = {"family": family, "size": size, "cluster": cluster, "levers": levers,
                           "solve_s": round(run.wall_s, 1), "fits": run.returncode == 0}
    if run.returncode != 0:
        error = last_line(run.stderr)
        if "does not fit" not in error:
            raise SystemExit(f"{' '.join(args)} failed: {error}")
        row["error"] = error
        return row
    plan = yaml.safe_load(partition.read_text())
    t = plan["training"]
    stages = plan["stages"]
    row.update(
        shape=f"{t['stages']}x{t['replicas']} M{t['num_microbatches']} m{t['microbatch_size']} "
              f"{t['schedule']}",
        samples_per_s=plan["predicted"]["samples_per_s"],
        iteration_s=plan["predicted"]["iteration_s"],
        peak_gib=max(m["total"] for m in plan["memory"]["ranks"]) / 2**30,
        checkpointing_stages=sum(1 for s in stages if s["activation_checkpointing"]),
        sharded_stages=sum(1 for s in stages if s["sharding"] != "none"),
        gradient_sharded_stages=sum(1 for s in stages if s["sharding"] == "gradients"),
        num_stages=len(stages))
    return row


def compile_time(family: str, size: str, cluster: str, levers: str) -> dict[str, Any]:
    """Wall time and peak RSS of `partc compile` of the frontier plan, in a fresh process."""
    model = ROOT / "bench" / "models" / "scale" / f"{family}_{size}.py"
    with tempfile.TemporaryDirectory() as tmp:
        args = [PARTC, "compile", str(model), "-b", str(BATCH[family]), "--cluster", cluster,
                "--costs", "analytic", *LEVERS[levers], "-o", str(Path(tmp) / "plan")]
        run = run_measured(args, cwd=ROOT, env={**os.environ, "PYTHONHASHSEED": "0"})
    if run.returncode != 0:
        return {"compile_error": last_line(run.stderr)}
    return {"compile_s": round(run.wall_s, 1), "compile_rss_mib": round(run.rss_mib)}



def frontier(family: str, cluster: str, levers: str, out: Path, rows: list[dict[str, Any]],
             start: str | None = None) -> dict[str, Any] | None:
    """Walk the ladder upwards from `start` (a size known to fit with fewer levers, so with
    these too; default the smallest); the largest size that fits (its row), or None."""
    best = None
    ladder = LADDERS[family]
    for size in ladder[ladder.index(start) if start else 0:]:
        row = solve(family, size, cluster, levers, out)
        rows.append(row)
        print(f"  {family} {size:>5} {cluster} {levers:<13} "
              + (f"fits: {row['shape']}, {row['samples_per_s']:.2f} samples/s predicted, "
                 f"{row['checkpointing_stages']}/{row['num_stages']} checkpoint, "
                 f"{row['sharded_stages']}/{row['num_stages']} shard"
                 if row["fits"] else "does not fit") + f" ({row['solve_s']} s)", flush=True)
        if not row["fits"]:
            break
        best = row
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--families", default="gpt,bert")
    parser.add_argument("--clusters", default=",".join(CLUSTERS))
    parser.add_argument("--levers", default=",".join(LEVERS))
    parser.add_argument("--no-compile", action="store_true",
                        help="skip timing the compile of each frontier plan")
    parser.add_argument("--json", type=Path, help="write the raw rows here")
    args = parser.parse_args()
    start = time.perf_counter()
    rows: list[dict[str, Any]] = []
    table: list[dict[str, Any]] = []
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, load "
          f"{os.getloadavg()[0]:.1f}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for cluster in args.clusters.split(","):
            for family in args.families.split(","):
                walk_from = None
                # each lever set allows what the one before it does (LEVERS' order), so its
                # frontier is at least that one's: the walk starts there
                for levers in [v for v in LEVERS if v in args.levers.split(",")]:
                    best = frontier(family, cluster, levers, Path(tmp), rows, walk_from)
                    walk_from = best["size"] if best is not None else walk_from
                    entry: dict[str, Any] = {"cluster": cluster, "family": family,
                                             "levers": levers, "frontier": best}
                    if best is not None and not args.no_compile:
                        entry.update(compile_time(family, best["size"], cluster, levers))
                    table.append(entry)
    print()
    print("| cluster | family | levers | largest that fits | params | shape | predicted "
          "samples/s | stages checkpointing / sharded | peak GiB | compile s | RSS MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for e in table:
        b = e["frontier"]
        if b is None:
            print(f"| {e['cluster']} | {e['family']} | {e['levers']} | none | | | | | | | |")
            continue
        print(f"| {e['cluster']} | {e['family']} | {e['levers']} | {b['size']} | "
              f"{size_billions(b['size']):g}B | {b['shape']} | {b['samples_per_s']:.2f} | "
              f"{b['checkpointing_stages']} / {b['sharded_stages']} "
              f"({b.get('gradient_sharded_stages', 0)} with gradients) of {b['num_stages']} | "
              f"{b['peak_gib']:.1f} | {e.get('compile_s', '-')} | "
              f"{e.get('compile_rss_mib', '-')} |")
    finish(start, args.json, {"rows": rows, "table": table})


if __name__ == "__main__":
    main()
