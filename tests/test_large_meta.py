"""A 1.3B-parameter GPT-2 on the meta device captures without being materialised (slow)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import EXAMPLES

SCRIPT = """
import json, resource, sys
from partc.frontend.capture import capture_graph
r = capture_graph(sys.argv[1], 1)
g = r.graph
print(json.dumps({
    "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    "params": g.num_parameters, "on_meta": g.on_meta, "onnx": g.onnx.status,
    "mapped": g.onnx.mapped_nodes, "onnx_nodes": g.onnx.num_nodes, "hash": g.content_hash(),
    "all_meta": all(p.is_meta for p in r.capture.model.parameters()),
    "tied": [list((p.name,) + p.aliases) for p in g.tied_parameters],
    "flops": g.total_flops,
}))
"""


@pytest.mark.slow
def test_gpt2_1p3b_meta_captures_in_under_1gb() -> None:
    runs = []
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-c", SCRIPT, str(EXAMPLES / "gpt2_1p3b_meta.py")],
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    first = runs[0]
    assert first["on_meta"] and first["all_meta"]
    assert first["params"] == 1_313_626_112
    assert first["rss_mib"] < 1024, first["rss_mib"]
    assert first["onnx"] == "ok" and first["mapped"] == first["onnx_nodes"]
    assert first["tied"] == [["transformer.wte.weight", "lm_head.weight"]]
    # forward FLOPs at batch 1, sequence 1024: at least 2 x params x tokens (plus attention)
    assert first["flops"] >= 2 * first["params"] * 1024 * 0.95
    assert runs[1]["hash"] == first["hash"]


@pytest.mark.slow
def test_gpt2_1p3b_meta_analytic_profile(tmp_path) -> None:
    out = tmp_path / "h100.yaml"
    partc = str(__import__("pathlib").Path(sys.executable).parent / "partc")
    proc = subprocess.run([partc, "profile", str(EXAMPLES / "gpt2_1p3b_meta.py"), "-b", "1",
                           "--analytic", "h100-80gb", "-o", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "analytic costs of gpt2_1p3b_meta on h100-80gb" in proc.stdout
    import yaml
    d = yaml.safe_load(out.read_text())
    assert d["kind"] == "analytic" and d["batch_sizes"] == [1, 2]
    # forward at batch 1 runs at most at the H100's dense fp32 peak (67 TFLOP/s): 2.7 TFLOP
    assert d["totals_at_batch_sizes"]["1"]["forward_s"] > 2 * 1.3e9 * 1024 / 67e12
    assert d["totals_at_batch_sizes"]["2"]["saved_bytes"] \
        > d["totals_at_batch_sizes"]["1"]["saved_bytes"]


SOLVE = """
import json, resource, sys, time
start = time.perf_counter()
from partc.hardware.configs import load_cluster
from partc.cost.plan_costs import plan_costs
from partc.frontend.capture import capture_graph
from partc.options import SearchOptions
from partc.solve.search import search
cluster = load_cluster("8xa100-80gb")
r = capture_graph(sys.argv[1], 1, onnx=False)
table = plan_costs(r, cluster.device)
p = search(table, cluster, 64, options=SearchOptions(stages=8, replicas=1, schedule="1f1b"))
print(json.dumps({"wall_s": time.perf_counter() - start,
                  "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "stages": len(p.stages), "gap": p.solver.gap, "status": p.solver.status,
                  "fits": all(m.total <= p.usable_memory_bytes for m in p.memory),
                  "params": sum(s.parameter_count for s in p.stages)}))
"""


@pytest.mark.slow
def test_gpt2_1p3b_meta_solves_for_8_a100_without_materialising() -> None:
    proc = subprocess.run([sys.executable, "-c", SOLVE, str(EXAMPLES / "gpt2_1p3b_meta.py")],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["stages"] == 8 and out["fits"]
    assert out["gap"] is not None and out["gap"] < 0.05
    assert out["rss_mib"] < 2048, out["rss_mib"]
    # the tied wte/lm_head weight counts in both the first and the last stage
    assert out["params"] >= 1_313_626_112


COMPILE_SCRIPT = """
import json, resource, sys, time
from partc.emit.compile import CompileOptions, compile_model
from partc.hardware.configs import load_cluster
from partc.plans.plan import load_plan
from partc.options import SearchOptions
start = time.perf_counter()
r = compile_model(sys.argv[1], load_cluster("8xa100-80gb"), sys.argv[2],
                  CompileOptions(batch_size=512, search=SearchOptions(stages=8)))
wall = time.perf_counter() - start
plan = load_plan(sys.argv[2])
print(json.dumps({"rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "wall_s": wall, "stages": plan.num_stages, "weights": plan.model.weights,
                  "tied": [list(t.stages) for t in plan.tied_parameters],
                  "params": sum(s.parameters for s in plan.stages),
                  "gap": plan.solver.gap}))
"""


@pytest.mark.slow
def test_gpt2_1p3b_meta_compiles_for_8_a100_without_materialising(tmp_path) -> None:
    out = tmp_path / "xl"
    proc = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT,
                           str(EXAMPLES / "gpt2_1p3b_meta.py"), str(out)],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["stages"] == 8 and result["weights"] == "initialise-at-launch"
    assert result["tied"] == [[0, 7]]  # wte in the first stage, the LM head in the last
    # every parameter is in a stage (the tied one in two)
    assert result["params"] == 1_313_626_112 + 50257 * 2048
    assert result["rss_mib"] < 2048, result  # 5.3 GB of fp32 weights never materialised
    assert sum(p.stat().st_size for p in out.glob("stage_*.pt")) < 2_000_000
    print(f"1.3B compile: {result['wall_s']:.1f} s, {result['rss_mib']:.0f} MiB RSS")
