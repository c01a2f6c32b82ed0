"""Compile scaling: wall time, peak RSS and per-step time of `partc compile` (analytic costs) for
GPT and BERT families from 0.1B to 100B parameters, on 32 x V100-32GB and 64 x H100-80GB.

Models: bench/models/scale/{gpt,bert}_{0p1b,1b,4p9b,20b,100b}.py (shapes in scale_family.py; all
on the meta device, so no weights are materialised at any size). `bert_4p9b` is the RaNNC paper's
enlarged BERT (hidden 2048, intermediate 8192, 96 layers, 32 heads), which RaNNC took 4 hours to
partition on 32 V100s.

Each case is one `partc compile MODEL -b B --cluster C -o DIR` in a fresh process, imports
included, as a user runs it: fp32, AdamW, every shape searched (stages, replicas, micro-batches,
schedule, checkpointing), CP-SAT on the best shape. Global batches: BERT 256 sequences of 512
tokens; GPT 128 sequences of 1024 tokens (at 256 or more, 100B does not fit 64 H100-80GB in fp32:
torch's pipelining keeps a receive buffer per micro-batch, see docs/benchmarks.md). A case whose
model fits no shape reports the time partc took to prove that (exit code 2, one-line error).

Step times come from the compile's own progress lines: load (import the file, build the model),
export (torch.export at B and 2B), opgraph (shapes, FLOPs, parameters per node), cost (roofline
pricing and saved activations measured on meta), coarsen, solve (shape search, chain DP, CP-SAT,
simulation), emit (re-export at the micro-batch size, split, jit.trace per stage, write). A
compile with analytic costs does not export ONNX; `onnx` is measured separately, per model, by
`partc inspect MODEL -b 2` (torch.onnx dynamo export + shape inference + FX mapping), which is
what `partc profile` pays before measuring. Peak RSS is the process's (getrusage of a wrapper).

    .venv/bin/python bench/compile_scale.py [--families gpt,bert] [--sizes 0p1b,1b]
        [--clusters 4x8xv100-32gb,8x8xh100-80gb] [--repeats 3] [--repeats-large 1]
        [--json bench/results/compile_scale.json]

Cases below 2B parameters run `--repeats` times (median wall time and steps, largest RSS), the
larger ones `--repeats-large` times: one run of the whole table takes about 20 minutes here.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml
from process_stats import run_measured

ROOT = Path(__file__).resolve().parent.parent
PARTC = str(Path(sys.executable).parent / "partc")
SIZES = ("0p1b", "1b", "4p9b", "20b", "100b")
FAMILIES = ("gpt", "bert")
CLUSTERS = ("4x8xv100-32gb", "8x8xh100-80gb")
BATCH = {"gpt": 128, "bert": 256}
STEPS = ("load", "export", "opgraph", "cost", "coarsen", "solve", "emit")



def step_of(label: str) -> str | None:
    """Which benchmark step a progress line belongs to (module docstring)."""
    rules = (("loading profile", None), ("loading", "load"), ("building the model", "load"),
             ("capturing with torch.export", "export"), ("to find batch dimensions", "export"),
             ("building the OpGraph", "opgraph"), ("pricing", "cost"), ("coarsen", "coarsen"),
             ("exporting to ONNX", "onnx"), ("ONNX shape inference", "onnx"),
             ("search", "solve"), ("cpsat:", "solve"), ("chain-dp:", "solve"),
             ("capturing at the micro-batch size", "emit"), ("splitting", "emit"),
             ("tracing stage", "emit"), ("writing", "emit"))
    for needle, step in rules:
        if needle in label:
            return step
    return None


def measure(args: list[str]) -> tuple[int, float, float, dict[str, float], str]:
    """(exit code, wall s, peak RSS MiB, seconds per step, last error line) of one command."""
    run = run_measured(args, cwd=ROOT, env={**os.environ, "PYTHONHASHSEED": "0"})
    steps: dict[str, float] = {}
    for label, secs in run.steps():
        step = step_of(label)
        if step is not None:
            steps[step] = steps.get(step, 0.0) + secs
    errors = [ln for ln in run.stderr.splitlines() if ln.startswith("partc: error:")]
    if run.returncode not in (0, 2) or (run.returncode == 2 and not errors):
        raise SystemExit(f"{' '.join(args)} failed ({run.returncode}):\n{run.stderr[-3000:]}")
    return run.returncode, run.wall_s, run.rss_mib, steps, errors[-1] if errors else ""


def compile_case(family: str, size: str, cluster: str) -> dict[str, Any]:
    model = f"bench/models/scale/{family}_{size}.py"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "plan"
        rc, wall, rss, steps, error = measure(
            [PARTC, "compile", model, "-b", str(BATCH[family]), "--cluster", cluster,
             "-o", str(out)])
        row: dict[str, Any] = {"family": family, "size": size, "cluster": cluster,
                               "batch": BATCH[family], "wall_s": wall, "rss_mib": rss,
                               "steps": steps, "fits": rc == 0, "error": error}
        if rc == 0:
            plan = yaml.safe_load((out / "plan.yaml").read_text())
            solver = plan["solver"]
            row.update(params=plan["model"]["parameters"], shape=_shape(plan),
                       iteration_s=plan["predicted"]["iteration_s"], status=solver["status"],
                       gap=solver.get("gap"), blocks=solver.get("blocks"),
                       shapes=solver["shapes"]["enumerated"],
                       solver_wall_s=yaml.safe_load((out / "timings.yaml").read_text()).get(
                           "solver_wall_s"))
    return row


def _shape(plan: dict[str, Any]) -> str:
    t = plan["training"]
    ckpt = " ckpt" if t["activation_checkpointing"] else ""
    return (f"S{t['stages']}xR{t['replicas']} M{t['num_microbatches']} "
            f"m{t['microbatch_size']} {t['schedule']}{ckpt}")


def onnx_case(family: str, size: str) -> dict[str, Any]:
    model = f"bench/models/scale/{family}_{size}.py"
    rc, wall, rss, steps, error = measure([PARTC, "inspect", model, "-b", "2"])
    return {"family": family, "size": size, "wall_s": wall, "rss_mib": rss,
            "onnx_s": steps.get("onnx"), "error": error}


def params_of(family: str, size: str) -> int:
    """Parameter count without building anything big (meta device, in this process)."""
    sys.path.insert(0, str(ROOT / "bench" / "models" / "scale"))
    import scale_family  # noqa: E402

    model = getattr(scale_family, f"build_{family}")(size)
    return sum(p.numel() for p in model.parameters())


def median_row(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median wall time, with medians of wall time and steps, max RSS."""
    mid = dict(sorted(runs, key=lambda r: r["wall_s"])[len(runs) // 2])
    mid["wall_s"] = statistics.median(r["wall_s"] for r in runs)
    mid["rss_mib"] = max(r["rss_mib"] for r in runs)
    mid["steps"] = {k: statistics.median(r["steps"].get(k, 0.0) for r in runs)
                    for k in mid["steps"]}
    mid["repeats"] = [r["wall_s"] for r in runs]
    return mid


def markdown(rows: list[dict[str, Any]], onnx: dict[tuple[str, str], dict[str, Any]]) -> str:
    out = ["| model | params | cluster | plan | wall s | load s | export s | opgraph s | cost s "
           "| coarsen s | solve s | emit s | peak RSS MiB | onnx s (inspect) |",
           "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        s = r["steps"]
        plan = (f"{r['shape']} ({r['status']}, gap {100 * (r['gap'] or 0):.2f}%)" if r["fits"]
                else "no plan fits: " + _short(r["error"]))
        o = onnx.get((r["family"], r["size"]))
        ox = f"{o['onnx_s']:.1f}" if o and o.get("onnx_s") is not None else "-"
        out.append(f"| {r['family']}_{r['size']} | {r['params'] / 1e9:.2f}B | {r['cluster']} | "
                   f"{plan} | {r['wall_s']:.1f} | "
                   + " | ".join(f"{s.get(k, 0.0):.1f}" if k in s else "-" for k in STEPS)
                   + f" | {r['rss_mib']:.0f} | {ox} |")
    return "\n".join(out)


def _short(error: str) -> str:
    match = re.search(r"needs at least ([\d.]+\s*\w+) but a (\S+) has ([\d.]+\s*\w+) usable",
                      error)
    return (f"needs >= {match.group(1)} per {match.group(2)}, {match.group(3)} usable"
            if match else error.replace("partc: error: ", "")[:90])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--sizes", default=",".join(SIZES))
    parser.add_argument("--clusters", default=",".join(CLUSTERS))
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs per case below 2B parameters (median reported)")
    parser.add_argument("--repeats-large", type=int, default=1,
                        help="runs per case from 2B parameters (minutes each on 2 cores)")
    parser.add_argument("--no-onnx", action="store_true", help="skip the ONNX export column")
    parser.add_argument("--json", type=Path, help="write the raw rows here")
    args = parser.parse_args()
    command = " ".join([".venv/bin/python", "bench/compile_scale.py"] + sys.argv[1:])
    machine = (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cpus, python "
               f"{platform.python_version()}")
    print(f"command: `{command}`; {machine}")
    rows: list[dict[str, Any]] = []
    onnx: dict[tuple[str, str], dict[str, Any]] = {}
    start = time.perf_counter()
    for family in args.families.split(","):
        for size in args.sizes.split(","):
            params = params_of(family, size)
            for cluster in args.clusters.split(","):
                repeats = args.repeats if params < 2e9 else args.repeats_large
                runs = [compile_case(family, size, cluster) for _ in range(repeats)]
                row = median_row(runs)
                row["params"] = params
                rows.append(row)
                print(f"... {family}_{size} {cluster}: {row['wall_s']:.1f} s, "
                      f"{row['rss_mib']:.0f} MiB, {row.get('shape') or 'no plan'}",
                      file=sys.stderr, flush=True)
            if not args.no_onnx:
                onnx[(family, size)] = onnx_case(family, size)
                print(f"... {family}_{size} onnx: {onnx[(family, size)]['onnx_s']} s",
                      file=sys.stderr, flush=True)
    print(markdown(rows, onnx))
    total = time.perf_counter() - start
    print(f"\nbench wall time: {total:.0f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(
            {"command": command, "machine": machine, "rows": rows, "onnx": list(onnx.values()),
             "wall_s": total}, indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
