"""The optimizer step's memory traffic on this CPU: which working set decides whether its passes
run from the cache, one parameter's or the whole group's?

partc prices a parameter's step (partc.solve.stage_problem.step_seconds_of) as if the CPU stepped
one parameter at a time: where that parameter's working set (weights, gradient, states, the
step's temporary) fits the device's cache, its later passes run at the cache's rate. launch
builds its optimizers with foreach kernels (partc.run.training.build_optimizer), and on a CPU a
foreach kernel runs one operation over every tensor of the group before the next operation:
does a pass then find its data in the cache only where the whole group's working set fits?

This times the step as launch builds and runs it (`cpu_settings`: freed memory kept), on core
0, over groups of n parameters of `numel` elements from a few MiB of working set up to 200 MiB,
and prints it beside two prices from the device config given: the per-parameter criterion (what
partc prices) and the same formula with the whole group's working set deciding, and the bytes
the step moves over the measured time less its dispatch: the rate its streams reach.

Measured on an AMD EPYC VM (2026-12-07, docs/benchmarks.md runs BM-BN): the per-parameter price
0.89-1.28x, the whole-group one 0.33-0.73x beyond the cache (streams of 24-51 GB/s where the
DRAM add streams 25): partc's criterion holds for the step alone. Without `cpu_settings` the
step's temporaries page-fault in every step and the same groups ran 1.0-1.9x slower.

Usage: OMP_NUM_THREADS=1 python bench/optimizer_stream.py DEVICE_YAML [--optimizer adamw]
           [--cold] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from optimizer_step import step_s  # noqa: E402  (a sibling script, not a package)

from partc.cost.torch_profiler import cpu_settings, flush_cpu_caches  # noqa: E402
from partc.graph.opgraph import Param  # noqa: E402
from partc.hardware.configs import load_device  # noqa: E402
from partc.hardware.specs import DeviceSpec  # noqa: E402
from partc.options import OPTIMIZER_SPECS, TrainingConfig  # noqa: E402
from partc.solve.stage_problem import (  # noqa: E402
    param_memory,
    step_dispatch_s,
    step_seconds_of,
    sync_bytes,
)

# (parameters, elements each): working sets of 1.3 MiB to 200 MiB under AdamW
GROUPS = ((4, 1 << 14), (20, 1 << 14), (100, 1 << 12), (50, 1 << 14), (5, 1 << 18),
          (400, 1 << 12), (200, 1 << 14), (3, 1 << 20), (40, 1 << 18), (10, 1 << 20))
STEPS = 15


def priced(n: int, numel: int, training: TrainingConfig, device: DeviceSpec
           ) -> dict[str, float]:
    """The per-parameter price partc uses, the whole-group variant, and their inputs."""
    p = Param(name="w", shape=(numel,), dtype="float32", kind="parameter", trainable=True)
    dispatch = n * step_dispatch_s(training, device)
    weights, grads, states, temps = param_memory(p, training)
    moved = n * sync_bytes(p, training)[1]
    group = n * (weights + grads + states + temps)
    memory, cached = device.bytes_per_s(), device.stream_bytes_per_s(group)
    if cached <= memory:
        whole = moved / memory
    else:
        first = min(n * (weights + grads + states), moved)
        whole = first / memory + (moved - first) / cached
    return {"per_parameter_s": n * step_seconds_of(p, training, device) + dispatch,
            "whole_group_s": whole + dispatch, "dispatch_s": dispatch, "moved_bytes": moved,
            "working_set_bytes": group}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("device", help="a device config (partc calibrate's devices/cpu.yaml)")
    parser.add_argument("--optimizer", default="adamw", choices=sorted(OPTIMIZER_SPECS))
    parser.add_argument("--cold", action="store_true",
                        help="flush the CPU caches before each timed step, as launch's step "
                             "follows the backward's and the transfers' work")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    os.sched_setaffinity(0, {0})
    torch.set_num_threads(1)
    device = load_device(args.device)
    training = TrainingConfig(optimizer=args.optimizer)
    print(f"{args.optimizer} on core 0; cache {device.cache_bytes / 2**20:.0f} MiB at "
          f"{device.cache_bandwidth / 1e9:.1f} GB/s, memory {device.bytes_per_s() / 1e9:.1f} "
          f"GB/s priced ({device.memory_bandwidth / 1e9:.1f} x {device.bandwidth_efficiency})")
    rows: list[dict[str, Any]] = []
    # as launch's ranks run: freed memory kept, so the step's temporaries do not page-fault in
    # again every step (without it the same steps measured 1.1-1.7x slower here)
    settings = cpu_settings(torch.device("cpu"))
    settings.__enter__()
    for n, numel in GROUPS:
        got = step_s(args.optimizer, n, STEPS, numel,
                     before=flush_cpu_caches if args.cold else None)
        price = priced(n, numel, training, device)
        rate = price["moved_bytes"] / max(got - price["dispatch_s"], 1e-9)
        rows.append({"parameters": n, "numel": numel, "cold": args.cold, "measured_s": got, **price,
                     "stream_bytes_per_s": rate})
        per = price["per_parameter_s"]
        print(f"{n:4d} x {numel:8d}, working set {price['working_set_bytes'] / 2**20:6.1f} MiB: "
              f"measured {got * 1e3:7.2f} ms; per-parameter price {per * 1e3:7.2f}"
              f" ({got / per:.2f}x); whole-group "
              f"{price['whole_group_s'] * 1e3:7.2f} ({got / price['whole_group_s']:.2f}x); "
              f"streams {rate / 1e9:.1f} GB/s", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
