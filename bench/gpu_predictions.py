"""partc's analytic H100 predictions for the shapes measured in ../shared/data/h100-truth-*.md:
fwd+bwd of the captured program per precision at each micro-batch, and BERT-large's single-stage
peak memory (AdamW). Needs no GPU: it prints predictions to set beside a GPU run's measurements
(docs/benchmarks.md, "the analytic GPU model against the H100 measurements").

    .venv/bin/python bench/gpu_predictions.py [--device h100-80gb]
"""
from __future__ import annotations

import argparse

from partc.cost.plan_costs import plan_costs
from partc.frontend.capture import capture_graph
from partc.hardware.configs import load_device
from partc.options import PRECISIONS, TrainingConfig
from partc.solve.memory import stage_memory

CASES = [("examples/bert.py", (2, 16, 64), None), ("examples/gpt2.py", (2, 16, 64), None),
         ("examples/resnet.py", (2, 16, 64), None),
         ("examples/bert_large_meta.py", (1, 4, 16), 16)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="h100-80gb", help="a device config")
    args = parser.parse_args()
    device = load_device(args.device)
    print(f"| model | m | {' | '.join(f'{p} fwd+bwd ms' for p in PRECISIONS)} | peak GiB |")
    print(f"|---|---|{'---|' * len(PRECISIONS)}---|")
    for path, sizes, memory_at in CASES:
        result = capture_graph(path, 2, onnx=False)
        times, peaks = [], []
        for precision in PRECISIONS:
            table = plan_costs(result, device, precision=precision)
            totals = [table.total_forward_s(m) + table.total_backward_s(m) for m in sizes]
            times.append("/".join(f"{t * 1e3:.1f}" for t in totals))
            if memory_at:
                # gradients freed between steps, as launch frees them on one replica
                memory = stage_memory(table, [n.name for n in result.graph.nodes],
                                      microbatch_size=memory_at, num_microbatches=1,
                                      stage_index=0, num_stages=1, gradients_resident=False,
                                      config=TrainingConfig(precision=precision))
                peaks.append(f"{precision} {memory.total / 2**30:.2f} at m={memory_at}")
        print(f"| {path} | {'/'.join(map(str, sizes))} | {' | '.join(times)} | "
              f"{'; '.join(peaks) or '-'} |", flush=True)


if __name__ == "__main__":
    main()
