"""`partc` as users run it: a real subprocess per invocation, checking output and exit codes."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import EXAMPLES, ROOT, TEST_MODELS
from partc_process import run_partc

from partc.graph.opgraph import OpGraph

PARTC = str(Path(sys.executable).parent / "partc")


def run(*args: str) -> subprocess.CompletedProcess[str]:
    """The installed script itself, a fresh interpreter (what this file proves)."""
    return run_partc(*args, exec_=True)


def test_inspect_prints_the_table_and_writes_json_and_graph(tmp_path: Path) -> None:
    out = tmp_path / "summary.json"
    proc = run("inspect", str(EXAMPLES / "resnet.py"), "--batch-size", "2", "--depth", "1",
               "--json", str(out), "--save", str(tmp_path / "g"))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "resnet: batch size 2, module depth 1"
    assert any(line.startswith("layers ") and "Sequential" in line for line in lines)
    assert any(line.startswith("total ") for line in lines)
    assert "capturing with torch.export" in proc.stderr  # progress went to stderr
    summary = json.loads(out.read_text())
    # pooling and flatten are called by ResNet.forward itself: the root row ("")
    assert [r["path"] for r in summary["rows"]] == ["stem", "layers", "", "fc"]
    assert sum(r["parameters"] for r in summary["rows"]) == summary["total_parameters"] == 175258
    assert sum(r["flops"] for r in summary["rows"]) == summary["total_flops"]
    graph = OpGraph.load(tmp_path / "g" / "graph.json")
    assert summary["graph_hash"] == graph.content_hash()
    assert f"graph hash: {graph.content_hash()}" in proc.stdout
    assert (tmp_path / "g" / "model.onnx").stat().st_size > 0


def test_inspect_depth_zero_is_one_row() -> None:
    proc = run("inspect", str(EXAMPLES / "mlp.py"), "--depth", "0", "--no-onnx")
    assert proc.returncode == 0, proc.stderr
    table = proc.stdout.split("\n\n")[1].splitlines()
    assert table[2].startswith("(root)") and "MLP" in table[2] and table[3].startswith("---")


def test_onnx_failure_warns_and_succeeds() -> None:
    proc = run("inspect", str(TEST_MODELS / "qr_layer.py"))
    assert proc.returncode == 0, proc.stderr
    assert "warning: ONNX export failed" in proc.stderr
    assert "onnx: export failed" in proc.stdout


@pytest.mark.parametrize("model, fragment", [
    ("missing.py", "model file not found"),
    ("no_build.py", "does not define build_model()"),
    ("raises_on_import.py", "raised RuntimeError: cannot reach the dataset server"),
    ("syntax_error.py", "has a syntax error at line 1"),
    ("not_a_module.py", "not a torch.nn.Module"),
    ("bad_inputs.py", "example_inputs(1)"),
    ("gpt2_with_cache.py", "DynamicCache"),
    ("int_output.py", "non-tensor output"),
    ("data_dependent.py", "data-dependent"),
])
def test_user_errors_are_one_line_without_traceback(model: str, fragment: str) -> None:
    proc = run("inspect", str(TEST_MODELS / model))
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("partc: error:")]
    assert len(errors) == 1 and fragment in errors[0] and "(hint: " in errors[0]
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
    assert proc.stdout == ""


@pytest.mark.parametrize("where", ["before", "after"])
def test_debug_shows_the_traceback(where: str) -> None:
    model = str(TEST_MODELS / "raises_on_import.py")
    args = ("--debug", "inspect", model) if where == "before" else ("inspect", model, "--debug")
    proc = run(*args)
    assert proc.returncode == 2
    assert "Traceback" in proc.stderr and "partc: error:" in proc.stderr


def test_unwritable_output_is_a_user_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    proc = run("inspect", str(EXAMPLES / "mlp.py"), "--no-onnx", "--json", str(blocker / "s.json"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "partc: error: cannot write" in proc.stderr
    nested = tmp_path / "new" / "dir" / "s.json"  # missing parents are created
    assert run("inspect", str(EXAMPLES / "mlp.py"), "--no-onnx", "--json",
               str(nested)).returncode == 0
    assert nested.exists()


def test_bad_flags_are_usage_errors() -> None:
    proc = run("inspect", str(EXAMPLES / "mlp.py"), "--batch-size", "0")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "--batch-size" in proc.stderr


def test_version() -> None:
    proc = run("--version")
    assert proc.returncode == 0 and proc.stdout.startswith("partc, version ")


def test_profile_analytic_and_its_errors(tmp_path: Path) -> None:
    out = tmp_path / "a100.yaml"
    proc = run("profile", str(EXAMPLES / "mlp.py"), "--analytic", "a100-80gb", "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "analytic costs of mlp on a100-80gb" in proc.stdout and out.exists()
    for args, message in [
        (["--device", "cuda:3"], "CUDA"),
        (["--device", "tpu"], "unknown device 'tpu'"),
        (["--analytic", "no-such-gpu"], "no-such-gpu"),
    ]:
        proc = run("profile", str(EXAMPLES / "mlp.py"), *args, "-o", str(tmp_path / "x.yaml"))
        assert proc.returncode == 2, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert lines[-1].startswith("partc: error: ") and message in lines[-1]
        assert "(hint: " in lines[-1] and "Traceback" not in proc.stderr
    proc = run("profile", str(EXAMPLES / "mlp.py"), "--batch-sizes", "4")
    assert proc.returncode == 2 and "two or more distinct batch sizes" in proc.stderr


# (torch timing in the slow set: the default run's compiles on cpu-4 measure with it)
@pytest.mark.parametrize("method", ["auto", pytest.param("torch", marks=pytest.mark.slow)])
def test_profile_writes_a_profile_for_the_model_and_no_library_noise(method: str,
                                                                     tmp_path: Path) -> None:
    """partc profile measures the model at the sizes asked and writes a profile that loads for
    the same model at another batch size. What it prints is partc's: progress, the summary, the
    file it wrote; no deprecation notices, profiler or tracer chatter from the libraries it
    drives."""
    out = tmp_path / "p.yaml"
    # the smallest sizes: the noise is the libraries', not the sizes'
    proc = run("profile", str(EXAMPLES / "bert.py"), "--method", method, "--runs", "2",
               "--warmup", "1", "--batch-sizes", "1,2", "-o", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    noise = [ln for ln in proc.stderr.splitlines()
             if not ln.startswith(("  .. ", "  ok ", "wrote "))]
    assert noise == [], proc.stderr[-3000:]
    assert "measured costs of bert" in proc.stdout
    # auto: onnxruntime times what it can run (most operators here), torch the rest
    priced_by = next(ln for ln in proc.stdout.splitlines() if ln.startswith("priced by: "))
    assert ("onnxruntime " in priced_by) == (method == "auto") and "torch " in priced_by, \
        proc.stdout
    from partc.cost.table import CostTable
    from partc.frontend.capture import capture_graph

    graph = capture_graph(EXAMPLES / "bert.py", 3, onnx=False).graph
    table = CostTable.load(out, graph)  # same model, another batch: accepted
    assert table.source.batch_sizes == (1, 2)
    # measured costs never fall with the batch (Curve.measured); whether they rise between two
    # sizes of a small model is timing noise on a loaded machine (CI, 2026-11-29: equal)
    assert table.total_forward_s(3) >= table.total_forward_s(2) >= table.total_forward_s(1) > 0


def test_every_process_captures_a_set_iterating_model_alike() -> None:
    """A forward that iterates over a set of strings captures in the order of the process's str
    hash seed: partc seeds it itself, so processes started with different seeds agree (check
    compares a plan against a capture in another process)."""
    import os
    import re

    hashes = set()
    for seed in ("1", "2"):
        proc = subprocess.run([PARTC, "inspect", str(TEST_MODELS / "set_order.py"), "--no-onnx"],
                              capture_output=True, text=True, cwd=ROOT, timeout=300,
                              env={**os.environ, "PYTHONHASHSEED": seed})
        assert proc.returncode == 0, proc.stderr
        hashes.update(re.findall(r"graph hash: (sha256:\w+)", proc.stdout + proc.stderr))
    assert len(hashes) == 1, hashes


def test_a_model_returning_its_own_loss_trains_with_the_defaults(tmp_path: Path) -> None:
    """Its scalar output is the loss (default_loss_fn) and synthetic batches give a placeholder
    target no loss reads, which launch sends whole to every micro-batch."""
    import torch

    from partc.frontend.model_file import default_loss_fn, load_model_file, synthetic_batches

    model_file = load_model_file(TEST_MODELS / "own_loss.py")
    (args, kwargs), target = next(synthetic_batches(model_file, 4))
    assert target.shape == () and set(kwargs) == {"x", "labels"}
    loss = model_file.build()(*args, **kwargs)
    assert torch.equal(default_loss_fn(loss, target), loss)
    plan = tmp_path / "p"
    proc = run("compile", str(TEST_MODELS / "own_loss.py"), "-b", "8", "--stages", "2",
               "--microbatches", "2", "--cluster", "cpu", "--costs", "analytic", "-o", str(plan))
    assert proc.returncode == 0, proc.stderr
    proc = run("launch", str(plan), "--steps", "2")
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("args", [
    ("--version",),
    ("compile", "tests/models/missing.py", "-b", "4", "-o", "out/never"),  # a user error
    ("launch", "examples/plans/mlp/plan.yaml", "--steps", "0"),  # click's usage error
    ("check", "examples/plans/mlp/plan.yaml"),  # captures, prices and solves: exit 0
    ("inspect", "tests/models/exits_in_build.py", "--no-onnx"),  # the model calls sys.exit(0)
], ids=["version", "user-error", "usage-error", "check", "model-exits"])
def test_the_forked_cli_the_other_tests_use_behaves_as_the_script(args: tuple[str, ...]) -> None:
    """tests/partc_process.py forks most tests' `partc` commands from a server that imported
    partc once: what they prove holds for the installed script only where a forked command exits,
    prints and writes as the script's does. Timings differ between runs, so lines with seconds are
    compared without their numbers."""
    def settled(text: str) -> str:
        return re.sub(r"\d+(\.\d+)? ?(s|ms)\b", "<t>", text)

    script = run(*args)
    forked = run_partc(*args)
    assert forked.returncode == script.returncode, (forked.stderr, script.stderr)
    assert settled(forked.stdout) == settled(script.stdout)
    assert settled(forked.stderr) == settled(script.stderr)
