"""Cost-model truth: predicted vs measured torch fwd+bwd time (and peak memory) per example, on CPU.

For each example the measured cost model is profiled at micro-batches 2 and 4 (`partc profile`
defaults: onnxruntime forward per node, torch backward ratios, 1 thread), and the analytic model is
computed from configs/devices/cpu.yaml. Both are then checked against the *eager* model's measured
forward+backward wall time of the captured program (what partc's stages run; median of runs, 1
thread) at held-out batch sizes: 3 (between the
profiled sizes) and 8 (beyond them), and the predicted peak memory of a training step against the
measured one (partc.solve.memory vs torch.profiler's allocation trace of a real AdamW step).

    .venv/bin/python bench/cost_model.py [--examples mlp,bert] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# E402: partc is imported from the checkout, after the sys.path insert above.
from partc.cost.activations import saved_activations  # noqa: E402
from partc.cost.measured import ProfileOptions, measure_costs  # noqa: E402
from partc.cost.roofline import analytic_cost_table  # noqa: E402
from partc.cost.table import CostTable  # noqa: E402
from partc.cost.torch_profiler import program_module, time_model  # noqa: E402
from partc.frontend.capture import capture_graph  # noqa: E402
from partc.frontend.export import quiet_torch  # noqa: E402
from partc.hardware.configs import load_device  # noqa: E402
from partc.options import TrainingConfig  # noqa: E402
from partc.progress import Progress  # noqa: E402
from partc.run.reference import measure_training_peak  # noqa: E402
from partc.solve.memory import stage_memory  # noqa: E402

EXAMPLES = ("mlp", "transformer", "bert", "gpt2", "resnet")
HELD_OUT = (3, 8)


def fwd_bwd(module: torch.nn.Module, inputs: Any, runs: int = 10) -> float:
    """Median forward+backward wall time of a module at given inputs (1 thread)."""
    fwd, bwd = time_model(module, inputs, torch.device("cpu"), warmup=3, runs=runs)
    return fwd + bwd


def peak_memory(capture: Any, table: CostTable, b: int) -> tuple[float, float]:
    """(predicted, measured) peak bytes of one AdamW training step, whole model as one stage."""
    config = TrainingConfig(optimizer="adamw", precision="fp32", schedule="1f1b", memory_margin=0.0)
    nodes = [n.name for n in table.graph.nodes]
    predicted = stage_memory(table, nodes, microbatch_size=b, num_microbatches=1, stage_index=0,
                             num_stages=1, config=config).total
    measured = measure_training_peak(capture, b, 1, "adamw")
    return float(predicted), float(measured)


def run_example(name: str) -> dict[str, Any]:
    path = ROOT / "examples" / f"{name}.py"
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    result = capture_graph(path, 2)
    options = ProfileOptions()
    measured = measure_costs(result, torch.device("cpu"), options, Progress())
    profile_s = time.perf_counter() - t0
    analytic = analytic_cost_table(result.graph, load_device("cpu"),
                                   saved=saved_activations(result.capture))
    model = result.capture.model.train()
    row: dict[str, Any] = {"example": name, "profile_s": round(profile_s, 1),
                           "methods": measured.methods(), "held_out": {}}
    row["memory"] = {}
    for b in HELD_OUT:
        # What partc runs is the captured program (its stages are traced from it): that is the
        # ground truth; the user's eager module is shown beside it.
        held_out = capture_graph(path, b, onnx=False).capture
        inputs = held_out.inputs
        program = program_module(held_out.exported)
        with quiet_torch():
            truth = fwd_bwd(program, inputs)
            eager = fwd_bwd(model, inputs)
        m = measured.total_forward_s(b) + measured.total_backward_s(b)
        a = analytic.total_forward_s(b) + analytic.total_backward_s(b)
        row["held_out"][b] = {"program_s": truth, "eager_s": eager, "measured_model_s": m,
                              "analytic_model_s": a, "measured_err": (m - truth) / truth,
                              "analytic_err": (a - truth) / truth}
        predicted, measured_peak = peak_memory(held_out, measured, b)
        row["memory"][b] = {"predicted_bytes": predicted, "measured_bytes": measured_peak,
                            "err": (predicted - measured_peak) / measured_peak}

    return row


def markdown(rows: list[dict[str, Any]]) -> str:
    out = ["| example | batch | torch fwd+bwd (ms) | measured model (ms) | err "
           "| analytic model (ms) | err | eager module (ms) |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for b, h in r["held_out"].items():
            out.append(f"| {r['example']} | {b} | {h['program_s'] * 1e3:.2f} | "
                       f"{h['measured_model_s'] * 1e3:.2f} | {100 * h['measured_err']:+.1f}% | "
                       f"{h['analytic_model_s'] * 1e3:.2f} | {100 * h['analytic_err']:+.1f}% | "
                       f"{h['eager_s'] * 1e3:.2f} |")
    out += ["", "| example | batch | predicted peak (MiB) | measured peak (MiB) | err |",
            "|---|---|---|---|---|"]
    for r in rows:
        for b, m in r["memory"].items():
            out.append(f"| {r['example']} | {b} | {m['predicted_bytes'] / 2**20:.2f} | "
                       f"{m['measured_bytes'] / 2**20:.2f} | {100 * m['err']:+.1f}% |")
    errs = [abs(h["measured_err"]) for r in rows for h in r["held_out"].values()]
    aerrs = [abs(h["analytic_err"]) for r in rows for h in r["held_out"].values()]
    merrs = [abs(m["err"]) for r in rows for m in r["memory"].values()]
    out += ["", f"peak memory: max |error| {100 * max(merrs):.1f}%"]
    out += ["", f"median |error|: measured {100 * statistics.median(errs):.1f}%, "
                f"analytic {100 * statistics.median(aerrs):.1f}%; max |error|: measured "
                f"{100 * max(errs):.1f}%, analytic {100 * max(aerrs):.1f}%"]
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", default=",".join(EXAMPLES))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = []
    for name in args.examples.split(","):
        print(f"... {name}", file=sys.stderr, flush=True)
        rows.append(run_example(name))
    print(markdown(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2, sort_keys=True, default=str) + "\n")


if __name__ == "__main__":
    main()
