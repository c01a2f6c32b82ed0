"""The hybrid search's wall time as the cluster grows: one model, one node type, 1 to N nodes.

partc promises plans for a thousand GPUs and more; the search enumerates every (stages, replicas,
micro-batches, schedule, checkpointing, sharding, placement) shape the cluster allows and bounds
each. This times `partc.solve.search.search` alone (the model captured once, priced with the
node's analytic device config, coarsened once), in this process, for each node count: median
and range over the repeats, the shapes enumerated, and the plan chosen (which must not change
with the cluster once the cluster holds every shape the batch allows).

    .venv/bin/python bench/search_cluster_size.py [--model bench/models/scale/gpt_1b.py]
        [--cluster 8x8xh100-80gb] [--batch 1024] [--nodes 1,16,128,1024] [--repeats 3]
        [--json J]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

from partc.cost.roofline import analytic_cost_table
from partc.frontend.capture import capture_graph
from partc.hardware.configs import load_cluster
from partc.options import SearchOptions, TrainingConfig
from partc.solve.coarsen import coarsen
from partc.solve.search import search

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / "bench/models/scale/gpt_1b.py"))
    parser.add_argument("--cluster", default="8x8xh100-80gb",
                        help="the node type: its devices per node, device and links")
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--nodes", default="1,16,128,1024")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()

    node = load_cluster(args.cluster)
    graph = capture_graph(args.model, 2, onnx=False).graph
    table = analytic_cost_table(graph, node.device)
    options = SearchOptions()
    blocks = coarsen(table, options.max_blocks)
    training = TrainingConfig()
    print(f"{Path(args.model).name}: {len(blocks.blocks)} blocks, global batch {args.batch}, "
          f"nodes of {node.devices_per_node} x {node.device.name}", flush=True)
    print("| nodes | devices | search s (median, range) | shapes | plan |")
    print("|---:|---:|---|---:|---|")
    rows = []
    for n in [int(x) for x in args.nodes.split(",")]:
        cluster = replace(node, num_nodes=n)
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            partition = search(table, cluster, args.batch, training, options, blocks=blocks)
            times.append(time.perf_counter() - start)
        row = {"nodes": n, "devices": cluster.num_devices, "search_s": times,
               "shapes": partition.solver.shapes_enumerated, "plan": partition.shape.label()}
        rows.append(row)
        print(f"| {n:,} | {cluster.num_devices:,} | {statistics.median(times):.2f} "
              f"({min(times):.2f}-{max(times):.2f}) | {row['shapes']:,} | {row['plan']} |",
              flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"argv": sys.argv[1:], "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
