"""A plan's stage files against the whole model, in one process: is the cut's own work what the
plan priced, whatever the machine's speed this minute?

A launched run's stage times mix the cost model's error with the machine's: on the shared VM
this project measures on, one kernel runs in a fast or a slow mode that flips within seconds
(bench/kernel_modes.py), so a launch minutes after its profile can miss by 1.3x with nothing
wrong in the model. This takes the machine's drift out by interleaving, round by round in one
process, the two things a prediction rests on:

- whole: the model's program as the profile times its totals (`totals_program`: the exported
  program as TorchScript, the form the stage files run in) under the plan's precision,
  forward then backward with ones as the outputs' gradients;
- staged: every stage file of the plan as launch runs it (`StageRunner.for_stage`: the plan's
  precision, checkpointing and boundary dtypes), forward through the stages, then backward in
  reverse, each stage's input gradients passed to the one before;

each pass from a cold cache (`flush_cpu_caches`, as a pipeline stage starts after other
micro-batches' work; `--cold once`: the staged passes from one flush at the round's start, as the
whole program's, so what a stage boundary costs beyond its cold start shows apart from it). It
reports per stage the measured forward and backward beside the plan's (which also hold the
runtime's per-micro-batch overhead and, on the last stage, the loss, which this does not run), and
per round staged/whole: a cut that costs more than its parts (a boundary cast, a recomputation the
stage files added) shows as staged/whole above 1, drift-free because both halves of the ratio ran
in the same seconds. `--neighbours` keeps the node's other devices busy training the model as the
profile does (`busy_neighbours`); this process runs on core 0, as the profile's does.

CPU only. Usage: python bench/staged_vs_whole.py PLAN_DIR [--rounds 30] [--neighbours]
           [--cold stage|once] [--json out.json]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.utils._pytree as pytree  # noqa: E402

from partc.cost.neighbours import busy_neighbours  # noqa: E402
from partc.cost.torch_profiler import (  # noqa: E402
    cpu_settings,
    flush_cpu_caches,
    precision_autocast,
    program_module,
    totals_program,
)
from partc.emit.stage_code import load_stage  # noqa: E402
from partc.emit.stage_graph import flatten_inputs  # noqa: E402
from partc.errors import PartcError  # noqa: E402
from partc.frontend.capture import capture_graph  # noqa: E402
from partc.frontend.model_file import normalize_inputs  # noqa: E402
from partc.hardware.local import pinned_to_core  # noqa: E402
from partc.plans.plan import Plan, load_plan  # noqa: E402
from partc.run.stage_runner import StageRunner  # noqa: E402

WARMUP = 3  # TorchScript's profiling executor optimises on early calls
CPU = torch.device("cpu")


def _grad_outputs(outputs: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The floating outputs that need a gradient, and ones as their gradients."""
    outs = [o for o in pytree.tree_leaves(outputs)
            if isinstance(o, torch.Tensor) and o.requires_grad]
    return outs, [torch.ones_like(o) for o in outs]


class Halves:
    """The whole program and the plan's stage runners, each timed one pass at a time."""

    def __init__(self, plan: Plan, cold_stages: bool = True) -> None:
        self.plan = plan
        self.cold_stages = cold_stages  # a flush before every stage pass, else once a round
        self.precision = plan.training.config.precision
        size = plan.microbatch_size
        captured = capture_graph(plan.existing_model_path(), size, onnx=False)
        inputs = normalize_inputs(captured.capture.model_file.inputs(size), "inputs()")
        timed = totals_program(program_module(captured.capture.exported), inputs, CPU)
        if timed is None:
            raise SystemExit("the model's program cannot be scripted: no whole-model totals")
        self.program, (self.program_args, _) = timed
        self.flat = flatten_inputs(inputs, pytree.treespec_loads(plan.model.input_spec)) \
            if plan.model.input_spec else pytree.tree_leaves(inputs)
        self.stages = [StageRunner.for_stage(plan, load_stage(plan.stage_bytes(s)).train(),
                                             s.index, CPU) for s in plan.stages]

    def whole(self) -> tuple[float, float]:
        """One forward and backward of the whole program (s)."""
        flush_cpu_caches()
        t0 = time.perf_counter()
        with precision_autocast(self.precision, "cpu"):
            outputs = self.program(*self.program_args)
        t1 = time.perf_counter()
        outs, grads = _grad_outputs(outputs)
        torch.autograd.backward(outs, grads)
        t2 = time.perf_counter()
        for p in self.program.parameters():
            p.grad = None
        return t1 - t0, t2 - t1

    def staged(self) -> tuple[list[float], list[float]]:
        """Each stage's forward, then each stage's backward in reverse (s, in stage order)."""
        forward, backward = [], []
        current: list[torch.Tensor] = list(self.flat)
        kept = []
        flush_cpu_caches()
        for k, stage in enumerate(self.stages):
            taken = [t.detach().requires_grad_(t.is_floating_point() and k > 0)
                     for t in current]
            if self.cold_stages:
                flush_cpu_caches()
            t0 = time.perf_counter()
            outputs = stage(*taken)
            forward.append(time.perf_counter() - t0)
            kept.append((taken, outputs))
            current = list(outputs)
        grads_in: list[torch.Tensor] | None = None
        for taken, outputs in reversed(kept):
            outs, ones = _grad_outputs(outputs)
            grads = ones if grads_in is None else grads_in
            if self.cold_stages:
                flush_cpu_caches()
            t0 = time.perf_counter()
            torch.autograd.backward(outs, grads)
            backward.append(time.perf_counter() - t0)
            grads_in = [t.grad if t.grad is not None else torch.zeros_like(t)
                        for t in taken if t.requires_grad]
        for stage in self.stages:
            for p in stage.parameters():
                p.grad = None
        return forward, backward[::-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("plan", type=Path)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--neighbours", action="store_true",
                        help="the node's other devices busy training the model, as the profile")
    parser.add_argument("--cold", choices=("stage", "once"), default="stage",
                        help="flush the caches before every stage pass (default) or once a "
                             "round, as before the whole program")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    try:
        plan = load_plan(args.plan)
        halves = Halves(plan, cold_stages=args.cold == "stage")
    except PartcError as e:  # a bad plan directory or model file: one line, as the CLI says it
        raise SystemExit(e.one_line()) from None
    others = plan.cluster.devices_per_node - 1 if args.neighbours else 0
    whole: list[tuple[float, float]] = []
    staged: list[tuple[list[float], list[float]]] = []
    with contextlib.ExitStack() as stack:
        # (the neighbours start first: a child inherits its parent's pinning)
        stack.enter_context(busy_neighbours(others, plan.existing_model_path(),
                                            plan.microbatch_size, halves.precision))
        stack.enter_context(pinned_to_core(0, 1))  # device 0's core, as the profile
        stack.enter_context(torch.jit.optimized_execution(False))
        stack.enter_context(cpu_settings(CPU))
        for i in range(WARMUP + args.rounds):
            w, s = halves.whole(), halves.staged()
            if i >= WARMUP:
                whole.append(w)
                staged.append(s)
    med = statistics.median
    ratios = [(sum(f) + sum(b)) / (wf + wb) for (wf, wb), (f, b) in zip(whole, staged,
                                                                         strict=True)]
    rows: list[dict[str, Any]] = []
    print(f"{args.plan}: {plan.num_stages} stages, micro-batch {plan.microbatch_size}, "
          f"{halves.precision}, {args.rounds} rounds, neighbours {others}, cold {args.cold}; "
          "ms, median")
    print(f"whole   forward {med(w[0] for w in whole) * 1e3:8.2f}  backward "
          f"{med(w[1] for w in whole) * 1e3:8.2f}")
    for k, spec in enumerate(plan.stages):
        f, b = med(s[0][k] for s in staged), med(s[1][k] for s in staged)
        rows.append({"stage": k, "forward_s": f, "backward_s": b,
                     "predicted_forward_s": spec.forward_s,
                     "predicted_backward_s": spec.backward_s})
        print(f"stage {k} forward {f * 1e3:8.2f} (plan {spec.forward_s * 1e3:.2f})  backward "
              f"{b * 1e3:8.2f} (plan {spec.backward_s * 1e3:.2f})  measured/plan "
              f"{(f + b) / (spec.forward_s + spec.backward_s):.3f}")
    print(f"staged/whole per round: median {med(ratios):.3f} ({min(ratios):.3f}-"
          f"{max(ratios):.3f})")
    if args.json:
        args.json.write_text(json.dumps({"stages": rows, "staged_over_whole": ratios,
                                         "whole_s": whole}, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
