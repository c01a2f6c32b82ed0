"""Capture benchmark: wall time per step and peak RSS of `capture_graph` for each example.

Each model runs in a fresh process (peak RSS is per process), `--repeat` times; the table shows
medians. Usage: python bench/capture.py [--repeat 3] [--batch-size 1] [model files...]
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODELS = ["mlp", "transformer", "bert", "gpt2", "resnet", "gpt2_1p3b_meta"]

CHILD = r"""
import contextlib, json, resource, sys, time
from partc.progress import Progress

class Timer(Progress):
    def __init__(self): self.steps = {}
    @contextlib.contextmanager
    def step(self, label):
        t = time.perf_counter(); yield
        self.steps[label.split(" (")[0]] = time.perf_counter() - t

from partc.frontend.capture import capture_graph
timer = Timer()
t0 = time.perf_counter()
g = capture_graph(sys.argv[1], int(sys.argv[2]), progress=timer).graph
total = time.perf_counter() - t0
print(json.dumps({"total_s": total,
                  "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "steps": timer.steps, "params": g.num_parameters, "ops": len(g.nodes),
                  "onnx_nodes": g.onnx.num_nodes, "onnx": g.onnx.status}))
"""


def measure(model: Path, batch: int) -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, str(model), str(batch)],
                          capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"{model}: {proc.stderr[-1000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def step_time(run: dict, prefix: str) -> float:
    return sum(v for k, v in run["steps"].items() if k.startswith(prefix))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("models", nargs="*")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=1)
    args = parser.parse_args()
    models = [Path(m) for m in args.models] or [
        ROOT / "examples" / f"{m}.py" for m in DEFAULT_MODELS
    ]
    print(f"machine: {platform.machine()}, "
          f"{platform.python_implementation()} {platform.python_version()}, "
          f"batch size {args.batch_size}, median of {args.repeat} fresh processes\n")
    print("| model | params | ops | ONNX nodes | load + build s | torch.export (B and 2B) s "
          "| ONNX s | OpGraph s | total s | peak RSS MiB |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for model in models:
        runs = [measure(model, args.batch_size) for _ in range(args.repeat)]
        med = lambda f, runs=runs: statistics.median(f(r) for r in runs)  # noqa: E731
        r0 = runs[0]
        print(f"| {model.stem} | {r0['params'] / 1e6:.1f}M | {r0['ops']} | {r0['onnx_nodes']} | "
              f"{med(lambda r: step_time(r, 'loading') + step_time(r, 'building the model')):.1f}"
              f" | {med(lambda r: step_time(r, 'capturing')):.1f} | "
              f"{med(lambda r: step_time(r, 'exporting to ONNX') + step_time(r, 'ONNX shape')):.1f}"
              f" | {med(lambda r: step_time(r, 'building the OpGraph')):.1f} | "
              f"{med(lambda r: r['total_s']):.1f} | {med(lambda r: r['rss_mib']):.0f} |",
              flush=True)


if __name__ == "__main__":
    main()
