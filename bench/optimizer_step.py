"""The optimizer step's per-tensor cost on this CPU, in kernels: does OptimizerSpec.step_kernels
count what torch runs?

On a CPU torch's foreach step runs each of its kernels tensor by tensor, and partc prices each
parameter tensor `step_kernels` x the device's no-grad dispatch time
(partc.solve.stage_problem.step_dispatch_s). This measures, per optimizer partc offers, the step
of 257 tiny parameters (16 elements) less the step of one, over 256, divided by the no-grad
dispatch time `partc calibrate` measures (`measure_op_overheads`), in rounds in one process, the
fastest step over the fastest dispatch (both in the machine's fast mode): the kernels a tensor's
step really costs.
Every optimizer is built as launch builds it (partc.run.training.build_optimizer).

Usage: python bench/optimizer_step.py [--rounds 4] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from partc.cost.torch_profiler import cpu_settings  # noqa: E402
from partc.hardware.calibration import measure_op_overheads  # noqa: E402
from partc.options import OPTIMIZER_SPECS, Optimizer  # noqa: E402
from partc.run.training import build_optimizer  # noqa: E402

TENSORS = 256  # tiny tensors added to one: their steps are all fixed cost
NUMEL = 16


def step_s(name: Optimizer, tensors: int, steps: int = 30, numel: int = NUMEL,
           before: Callable[[], None] | None = None) -> float:
    """Median time of one optimizer step over `tensors` parameters of `numel` elements (s),
    built as launch builds its optimizers; `before` runs ahead of each timed step, untimed."""
    params = [torch.nn.Parameter(torch.randn(numel)) for _ in range(tensors)]
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer = build_optimizer(name, params)
    assert optimizer is not None
    for _ in range(5):
        optimizer.step()
    times = []
    for _ in range(steps):
        if before is not None:
            before()
        t0 = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows: list[dict[str, Any]] = []
    cpu = torch.device("cpu")
    print(f"torch {torch.__version__}, one thread; per tensor: step time and kernels "
          "(step time / no-grad dispatch)")
    with cpu_settings(cpu):
        measure_op_overheads(cpu, 0.5)  # warm-up: the first one read 2x (2026-11-29)
        for r in range(args.rounds):
            dispatch = measure_op_overheads(cpu, 1.0)["op_dispatch_no_grad_s"]
            cells = [f"dispatch {dispatch * 1e6:.2f} us"]
            for name in OPTIMIZER_SPECS:
                per = (step_s(name, TENSORS + 1) - step_s(name, 1)) / TENSORS
                rows.append({"round": r, "optimizer": name, "per_tensor_s": per,
                             "dispatch_s": dispatch, "kernels": per / dispatch,
                             "step_kernels": OPTIMIZER_SPECS[name].step_kernels})
                cells.append(f"{name} {per * 1e6:.1f} us = {per / dispatch:.1f} "
                             f"(spec {OPTIMIZER_SPECS[name].step_kernels})")
            print("; ".join(cells), flush=True)
    # this VM runs in a fast or a slow mode that flips within seconds (bench/kernel_modes.py),
    # so one round's ratio can pair a fast dispatch with a slow step: the fastest of each over
    # the rounds are both the fast mode's
    fastest_dispatch = min(r["dispatch_s"] for r in rows)
    for name in OPTIMIZER_SPECS:
        kernels = [r["kernels"] for r in rows if r["optimizer"] == name]
        fastest = min(r["per_tensor_s"] for r in rows if r["optimizer"] == name)
        print(f"{name}: {fastest / fastest_dispatch:.1f} kernels per tensor (fastest step "
              f"{fastest * 1e6:.1f} us / fastest dispatch {fastest_dispatch * 1e6:.2f} us; "
              f"per round {min(kernels):.1f}-{max(kernels):.1f}), step_kernels "
              f"{OPTIMIZER_SPECS[name].step_kernels}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
