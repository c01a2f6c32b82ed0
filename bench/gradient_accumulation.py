"""Gradient accumulation, measured against its price: what does a backward pass cost more when
it adds its parameters' gradients into the ones it already holds (launch's micro-batches 2..M,
and every micro-batch under DDP) than when it takes them over (a profile's backwards, which
start with the gradients set to None)?

For a model file at micro-batch size m, in one process on one core, rounds of two training
backwards of the eager model (forward under the precision's autocast, as launch runs a stage;
backward from ones as the outputs' gradients), each from a cold cache (`flush_cpu_caches`, as a
pipeline stage's pass starts after other micro-batches' work): one with every gradient None,
one with every gradient held (zeros). The median of the per-round differences is the measured
cost; beside it the price partc gives the same adds (`add_seconds_of` summed over the model's
trainable parameters) on a device config.

Usage: OMP_NUM_THREADS=1 taskset -c 0 python bench/gradient_accumulation.py MODEL_FILE M
           [--precision fp32|bf16-mixed] [--rounds 30] [--device DEVICE_CONFIG]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.utils._pytree as pytree  # noqa: E402

from partc.cost.torch_profiler import (  # noqa: E402
    cpu_settings,
    flush_cpu_caches,
    precision_autocast,
)
from partc.frontend.capture import capture_graph  # noqa: E402
from partc.frontend.model_file import load_model_file  # noqa: E402
from partc.hardware.configs import load_device  # noqa: E402
from partc.options import PRECISIONS, Precision, TrainingConfig  # noqa: E402
from partc.solve.stage_problem import add_seconds_of  # noqa: E402


def backward_s(model: torch.nn.Module, inputs: tuple[tuple[Any, ...], dict[str, Any]],
               params: list[torch.nn.Parameter], held: bool, precision: Precision) -> float:
    """One backward's wall time, the gradients held (zeros) or None before it."""
    for p in params:
        if not held:
            p.grad = None
        elif p.grad is None:
            p.grad = torch.zeros_like(p)
    flush_cpu_caches()
    args, kwargs = inputs
    with precision_autocast(precision, "cpu"):
        out = model(*args, **kwargs)
    leaves = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)
              and t.requires_grad]
    grads = [torch.ones_like(t) for t in leaves]
    start = time.perf_counter()
    torch.autograd.backward(leaves, grads)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("microbatch", type=int)
    parser.add_argument("--precision", default="fp32", choices=PRECISIONS)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--device", default="cpu",
                        help="the device config that prices the adds (a name or a YAML path)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    spec = load_model_file(args.model)
    model = spec.build().train()
    inputs = spec.inputs(args.microbatch)  # (args, kwargs), normalised by the loader
    params = [p for p in model.parameters() if p.requires_grad]
    with cpu_settings(torch.device("cpu")):
        for _ in range(3):
            backward_s(model, inputs, params, False, args.precision)
            backward_s(model, inputs, params, True, args.precision)
        taken, added = [], []
        for _ in range(args.rounds):
            taken.append(backward_s(model, inputs, params, False, args.precision))
            added.append(backward_s(model, inputs, params, True, args.precision))
    measured = statistics.median(b - a for a, b in zip(taken, added, strict=True))
    device = load_device(Path(args.device) if args.device.endswith(".yaml") else args.device)
    graph = capture_graph(args.model, 2, onnx=False).graph
    training = TrainingConfig(precision=args.precision)
    priced = sum(add_seconds_of(p, training, device) for p in graph.params
                 if p.kind == "parameter" and p.trainable)
    nbytes = sum(p.numel() * 4 for p in params)
    ratio = f"{priced / measured:.2f}x" if measured > 0 else "-"
    print(f"{args.model.name} m={args.microbatch} {args.precision}: {len(params)} gradients, "
          f"{nbytes / 2**20:.1f} MiB; backward {statistics.median(taken) * 1e3:.2f} ms taking "
          f"them over, {statistics.median(added) * 1e3:.2f} ms adding; the adds measured "
          f"{measured * 1e3:.3f} ms (median of {args.rounds} rounds' differences), priced "
          f"{priced * 1e3:.3f} ms on {device.name} ({ratio})")


if __name__ == "__main__":
    main()
