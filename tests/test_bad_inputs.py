"""Bad inputs through the real `partc` CLI (one process per invocation, forked from a server that
imported partc once: tests/partc_process.py, whose fidelity to the installed script
tests/test_cli.py checks; a command needing a fresh interpreter runs the script itself).

What this suite guarantees, for every bad input a user can hand partc through the command they
would hit it with (model files, device/cluster configs, batch flags, plan directories, stage
files, torchrun's world size, missing arguments, unwritable outputs):

* the process exits non-zero: 2 for a user/input error (never 0, never 3 "internal error");
* stderr holds exactly one line starting with `partc: error:` that names the cause and carries
  a `(hint: ...)`; nothing in stdout or stderr is a Python `Traceback`;
* nothing is produced from a bad input: no plan.yaml is written, no training step runs;
* `--debug` (before or after the command name) does show the traceback.

Click's own usage errors (a missing argument) keep click's format: exit 2, `Usage:` and one
`Error:` line.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable, Sequence

import pytest
import yaml
from conftest import EXAMPLES, ROOT, TEST_MODELS, captured
from partc_process import run_partc

from partc.hardware.local import physical_cores

BIN = Path(sys.executable).parent
PARTC = str(BIN / "partc")
TORCHRUN = str(BIN / "torchrun")
MLP = str(EXAMPLES / "mlp.py")
ERROR = "partc: error:"
# Without these two capabilities root obeys file permissions like any other user.
NO_DAC = ["setpriv", "--bounding-set=-dac_override,-dac_read_search"]

Proc = subprocess.CompletedProcess


def run(*args: str, prefix: Sequence[str] = (), timeout: float = 300) -> Proc[str]:
    """`partc ARGS...` as a user runs it, from the repository root, in its own process
    (forked from a server that imported partc: tests/partc_process.py)."""
    return run_partc(*args, prefix=prefix, timeout=timeout)


def _context(proc: Proc[str]) -> str:
    return (f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n"
            f"--- stderr\n{proc.stderr[-3000:]}")


def assert_one_line_error(proc: Proc[str], *fragments: str | tuple[str, ...],
                          stdout_empty: bool = True, code: int = 2) -> str:
    """The contract: exit `code` (2: a user error), one `partc: error:` line with every fragment
    (a tuple: any of its strings) and a hint, no traceback anywhere. Returns the error line."""
    context = _context(proc)
    assert proc.returncode == code, context
    errors = [line for line in proc.stderr.splitlines() if line.startswith(ERROR)]
    assert len(errors) == 1, context
    line = errors[0]
    assert "(hint: " in line, context
    for fragment in fragments:
        options = fragment if isinstance(fragment, tuple) else (fragment,)
        assert any(f in line for f in options), (fragment, context)
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout, context
    assert "internal error" not in proc.stderr, context
    if stdout_empty:
        assert proc.stdout == "", context
    return line


def unreadable_copy(source: Path, target: Path) -> list[str]:
    """Copy `source` to `target`, chmod 000 it and return the command prefix under which the
    copy really is unreadable (root reads anything unless its DAC capabilities are dropped)."""
    shutil.copy(source, target)
    target.chmod(0)
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("running as root, which can read a chmod 000 file, and no setpriv")
    probe = subprocess.run([*NO_DAC, "cat", str(target)], capture_output=True)
    if probe.returncode == 0 or b"Permission denied" not in probe.stderr:
        pytest.skip("running as root, which can read a chmod 000 file (setpriv cannot drop "
                    "CAP_DAC_OVERRIDE here)")
    return NO_DAC


# ---- shared plans ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def mlp_plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A good 2-stage plan of examples/mlp.py on cpu-4 (compiled once); copy it before damaging."""
    out = tmp_path_factory.mktemp("good") / "mlp"
    # replicas pinned: the tests below read the world size. Priced by the roofline: what these
    # tests damage and refuse does not depend on the costs, and profiling on cpu-4 (three busy
    # neighbours) took ~20 s of this file's time (measured plans: tests/emit/test_compile.py,
    # tests/plans/test_plan_tools.py)
    proc = run("compile", MLP, "-b", "8", "--stages", "2", "--replicas", "1", "--cluster", "cpu-4",
               "--costs", "analytic", "-o", str(out))
    assert proc.returncode == 0, _context(proc)
    assert (out / "plan.yaml").exists() and (out / "stage_1.pt").exists()
    return out


def copy_plan(mlp_plan: Path, tmp_path: Path) -> Path:
    plan_dir = tmp_path / "plan"
    shutil.copytree(mlp_plan, plan_dir)
    return plan_dir


@pytest.fixture(scope="module")
def own_mlp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding a copy of examples/mlp.py (mlp.py) and its 2-stage plan on cpu-4 (plan/),
    compiled once; tests that change the model file take their own copy (`own_copy`)."""
    folder = tmp_path_factory.mktemp("own")
    shutil.copy(EXAMPLES / "mlp.py", folder / "mlp.py")
    proc = run("compile", str(folder / "mlp.py"), "-b", "8", "--stages", "2", "--replicas", "1",
               "--cluster", "cpu-4", "--costs", "analytic", "-o", str(folder / "plan"))
    assert proc.returncode == 0, _context(proc)
    return folder


def own_copy(own_mlp: Path, tmp_path: Path) -> tuple[Path, Path]:
    """(model file, plan directory): a private copy of `own_mlp`, the plan naming its model by
    the same relative path, which now leads to the copy."""
    shutil.copy(own_mlp / "mlp.py", tmp_path / "mlp.py")
    shutil.copytree(own_mlp / "plan", tmp_path / "plan")
    return tmp_path / "mlp.py", tmp_path / "plan"


# ---- model files -------------------------------------------------------------------------------

MODEL_CASES = [
    ("compile", TEST_MODELS / "missing.py", "model file not found"),
    ("compile", TEST_MODELS, "is a directory"),
    ("compile", TEST_MODELS / "raises_on_import.py",
     "raised RuntimeError: cannot reach the dataset server"),
    ("compile", TEST_MODELS / "no_build.py", "does not define build_model()"),
    # the model's line that branched, which torch's own message never names
    ("compile", TEST_MODELS / "data_dependent.py",
     "torch.export failed on data_dependent (batch size 2) at data_dependent.py:13 "
     "(`if y.sum() > 0:`): "),
    ("inspect", TEST_MODELS / "data_dependent_shape.py",
     "operator aten.index.Tensor (index) gives a data-dependent shape at "
     "data_dependent_shape.py:22 (`kept = h[h.sum(-1) > 0]`)"),
    ("compile", TEST_MODELS / "data_dependent_shape.py", "gives a data-dependent shape"),
    # a numpy draw inside forward() is one constant in the program: refused, not trained on
    ("compile", TEST_MODELS / "numpy_random_mask.py",
     "forward() makes the tensor lifted_tensor_0 (bool[2, 8]) from data outside torch, used at "
     "numpy_random_mask.py:16 (`keep = torch.tensor(np.random.rand(*h.shape) > 0.5)`), and two "
     "captures drew different values"),
    ("compile", TEST_MODELS / "int_output.py", "non-tensor output at [1]: int"),
    # a plan for batch B compiled on 3 samples, with no dimension to split micro-batches along
    ("compile", TEST_MODELS / "ignores_batch_size.py",
     "example_inputs(2) and example_inputs(4) in ignores_batch_size.py return tensors of the "
     "same shapes (args[0] [3, 4]): it ignores its batch_size"),
    # trained, the first backward failed on every rank ("Cannot access storage of
    # SparseTensorImpl"); the model's own line, not torch's F.embedding inside nn.Embedding
    ("compile", TEST_MODELS / "sparse_embedding.py",
     "parameter embed.weight would get a sparse gradient (aten.embedding.default with "
     "sparse=True at sparse_embedding.py:18 (`return self.head(self.embed(ids).mean(1))`))"),
    ("compile", TEST_MODELS / "string_output.py", "non-tensor output at [1]: str"),
    ("inspect", TEST_MODELS / "string_output.py", "non-tensor output at [1]: str"),
    ("inspect", TEST_MODELS, "is a directory"),
]


@pytest.mark.parametrize("command, model, fragment", MODEL_CASES,
                         ids=[f"{c}-{m.name}" for c, m, _ in MODEL_CASES])
def test_bad_model_file(command: str, model: Path, fragment: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    if command == "compile":
        proc = run("compile", str(model), "-b", "4", "--cluster", "cpu-4", "-o", str(out))
    else:
        proc = run("inspect", str(model), "--no-onnx")
    assert_one_line_error(proc, fragment)
    assert not (out / "plan.yaml").exists()


@pytest.mark.parametrize("body, fragment", [
    ("    raise RuntimeError('no data mounted')\n    yield",
     "raised RuntimeError: no data mounted"),
    ("    return iter(())", "yielded nothing"),
], ids=["raises", "empty"])
def test_batches_that_fail_while_pricing(body: str, fragment: str, tmp_path: Path) -> None:
    """An analytic compile for a CPU cluster draws one batch from batches() (a CPU rank holds
    its batch in its own memory): a batches() that raises or yields nothing is one line."""
    model = tmp_path / "mlp_bad_batches.py"
    model.write_text((EXAMPLES / "mlp.py").read_text().split("def batches(")[0]
                     + f"def batches(batch_size):\n{body}\n")
    proc = run("compile", str(model), "-b", "8", "--cluster", "cpu-4", "--costs", "analytic",
               "-o", str(tmp_path / "out"))
    assert_one_line_error(proc, "batches(", fragment)


def test_unreadable_model_file(tmp_path: Path) -> None:
    model = tmp_path / "mlp.py"
    prefix = unreadable_copy(EXAMPLES / "mlp.py", model)
    proc = run("compile", str(model), "-b", "4", "--cluster", "cpu-4", "-o", str(tmp_path / "o"),
               prefix=prefix)
    assert_one_line_error(proc, str(model), ("Permission denied", "not readable"))


@pytest.mark.parametrize("args, fragment", [
    (["compile", "PIPE", "-b", "4"], "model file PIPE is a named pipe, not a file"),
    (["check", "PLAN", "--model", "PIPE"], "--model PIPE is not a file"),
    (["show", "PLAN", "--metrics", "PIPE"], "metrics file PIPE is a named pipe, not a file"),
    (["compile", MLP, "-b", "8", "--cluster", "cpu-4", "--calibrate-from", "PIPE"],
     "is a named pipe, not a file"),
], ids=["model", "check-model", "show-metrics", "calibrate-from"])
def test_a_named_pipe_is_refused_not_waited_on(args: list[str], fragment: str, mlp_plan: Path,
                                               tmp_path: Path) -> None:
    """Reading a named pipe waits for a writer: these readers waited forever."""
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    args = [str(pipe) if a == "PIPE" else str(mlp_plan) if a == "PLAN" else a for a in args]
    proc = run(*args, timeout=120)
    assert_one_line_error(proc, fragment.replace("PIPE", str(pipe)))


def test_a_binary_model_file_is_not_python_source(tmp_path: Path) -> None:
    model = tmp_path / "weights.py"
    model.write_bytes(b"\x00\x01binary" * 10)
    proc = run("inspect", str(model), "--no-onnx")
    assert_one_line_error(proc, f"model file {model} is not Python source")
    assert "line None" not in proc.stderr


# ---- devices, clusters, batch flags ------------------------------------------------------------

def _cluster_yaml(tmp: Path, edit: Callable[[dict], None]) -> Path:
    data = yaml.safe_load((ROOT / "configs" / "clusters" / "cpu-4.yaml").read_text())
    edit(data)
    path = tmp / "cluster.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _text(tmp: Path, name: str, text: str) -> Path:
    path = tmp / name
    path.write_text(text)
    return path


def _bytes(tmp: Path, name: str, data: bytes) -> Path:
    path = tmp / name
    path.write_bytes(data)
    return path


def _compile(*flags: str) -> Callable[[Path], list[str]]:
    return lambda tmp: ["compile", MLP, *flags, "-o", str(tmp / "out")]


def _with_cluster(make: Callable[[Path], Path], *flags: str) -> Callable[[Path], list[str]]:
    return lambda tmp: ["compile", MLP, "-b", "8", *flags, "--cluster", str(make(tmp)),
                        "-o", str(tmp / "out")]


CONFIG_CASES: dict[str, tuple[Callable[[Path], list[str]], tuple[str | tuple[str, ...], ...]]] = {
    "unknown-device": (
        lambda tmp: ["profile", MLP, "--analytic", "nope", "-o", str(tmp / "p.yaml")],
        ("unknown device 'nope'",)),
    "device-yaml-not-yaml": (
        lambda tmp: ["profile", MLP, "--analytic", str(_text(tmp, "dev.yaml", "[1, 2")),
                     "-o", str(tmp / "p.yaml")],
        ("dev.yaml", "not valid YAML")),
    "profile-threads-beyond-the-cores": (  # measured oversubscribed, without a word
        lambda tmp: ["profile", MLP, "--threads", str(physical_cores() + 1),
                     "-o", str(tmp / "p.yaml")],
        (f"--threads {physical_cores() + 1} is more than this machine's {physical_cores()} "
         "physical cores",)),
    "unknown-cluster": (_compile("-b", "8", "--cluster", "nope"), ("unknown cluster 'nope'",)),
    "cluster-not-yaml": (
        _with_cluster(lambda tmp: _text(tmp, "c.yaml", "name: [unclosed\n")),
        ("c.yaml", "not valid YAML")),
    "cluster-not-a-mapping": (
        _with_cluster(lambda tmp: _text(tmp, "c.yaml", "- a\n- b\n")),
        ("c.yaml", "must be a mapping")),
    "cluster-repeated-key": (  # PyYAML keeps the last silently; a reader sees the first
        _with_cluster(lambda tmp: _text(tmp, "c.yaml", (ROOT / "configs" / "clusters" /
                                                        "cpu-4.yaml").read_text()
                                        + "devices_per_node: 64\n")),
        ("c.yaml", "key 'devices_per_node' appears twice")),
    "cluster-not-text": (
        _with_cluster(lambda tmp: _bytes(tmp, "c.yaml", bytes(range(256)) * 4)),
        ("c.yaml", "not a text file")),
    "cluster-without-a-name": (
        _with_cluster(lambda tmp: _cluster_yaml(tmp, lambda d: d.update(name=" "))),
        ("cluster.yaml", "'name'", "a name on one line")),
    "cluster-missing-key": (
        _with_cluster(lambda tmp: _cluster_yaml(tmp, lambda d: d.pop("intra_node"))),
        ("cluster.yaml", "'intra_node'", "missing")),
    "batch-not-divisible": (
        _compile("-b", "10", "--microbatches", "4", "--cluster", "cpu-4"),
        ("global batch 10", "--microbatches 4")),
    "interleaved-on-one-stage": (  # the hint says what interleaving needs, not 1F1B's alone
        _compile("-b", "8", "--stages", "1", "--schedule", "interleaved-1f1b", "--cluster",
                 "cpu-4", "--costs", "analytic"),
        ("no pipeline shape fits", "interleaved 1F1B needs 2 stages or more")),
    "infeasible-memory": (  # priced by the roofline: the refusal is the solve's, not a profile's
        _with_cluster(lambda tmp: _cluster_yaml(
            tmp, lambda d: d.update(device_memory_bytes="1MiB")), "--costs", "analytic"),
        ("does not fit", ("usable", "margin"))),
}


@pytest.mark.parametrize("case", list(CONFIG_CASES))
def test_bad_config_or_flags(case: str, tmp_path: Path) -> None:
    make_args, fragments = CONFIG_CASES[case]
    proc = run(*make_args(tmp_path))
    assert_one_line_error(proc, *fragments)
    assert not (tmp_path / "out" / "plan.yaml").exists() and not (tmp_path / "p.yaml").exists()


def test_pinned_options_no_shape_fits_fail_before_the_model_is_priced(tmp_path: Path) -> None:
    # a batch the pinned micro-batches cannot split: the error comes before a profile is
    # measured (seconds to minutes), with nothing written to the profile cache
    cache = tmp_path / "cache"
    proc = run_partc("compile", MLP, "-b", "10", "--microbatches", "4", "--cluster", "cpu-4",
                     "-o", str(tmp_path / "out"), env={**os.environ, "PARTC_CACHE_DIR": str(cache)})
    assert_one_line_error(proc, "global batch 10", "--microbatches 4")
    assert not cache.exists() or not any(cache.iterdir())
    assert "measur" not in proc.stderr.lower()


def test_unreadable_cluster_file(tmp_path: Path) -> None:
    cluster = tmp_path / "cluster.yaml"
    prefix = unreadable_copy(ROOT / "configs" / "clusters" / "cpu-4.yaml", cluster)
    proc = run("compile", MLP, "-b", "8", "--cluster", str(cluster), "-o", str(tmp_path / "o"),
               prefix=prefix)
    assert_one_line_error(proc, "cannot read", "Permission denied")


# ---- plan files --------------------------------------------------------------------------------

def _truncate(plan_dir: Path) -> None:
    path = plan_dir / "plan.yaml"
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


def _binary(plan_dir: Path) -> None:
    (plan_dir / "plan.yaml").write_bytes(bytes(range(256)) * 8)


def _a_list(plan_dir: Path) -> None:
    (plan_dir / "plan.yaml").write_text("- just\n- a list\n")


def _schema_99(plan_dir: Path) -> None:
    path = plan_dir / "plan.yaml"
    text = path.read_text()
    assert "schema_version: 1\n" in text
    path.write_text(text.replace("schema_version: 1\n", "schema_version: 99\n"))


def _huge_number(plan_dir: Path) -> None:
    path = plan_dir / "plan.yaml"
    text, n = re.subn(r"num_nodes: \d+", "num_nodes: " + "9" * 5000, path.read_text(), count=1)
    assert n == 1
    path.write_text(text)


def _repeated_key(plan_dir: Path) -> None:
    # a reviewer reads the first `num_microbatches:`, PyYAML alone would run the second
    path = plan_dir / "plan.yaml"
    text, n = re.subn(r"\n(  num_microbatches: \d+\n)", r"\n  num_microbatches: 1\n\1",
                      path.read_text(), count=1)
    assert n == 1
    path.write_text(text)


PLAN_DAMAGE: dict[str, tuple[Callable[[Path], None] | None, tuple[str | tuple[str, ...], ...]]] = {
    "missing": (None, ("no-such-plan", "not found")),
    # cut in half: not YAML, or YAML that lacks half the plan, depending on where the cut falls
    "truncated": (_truncate, ("plan.yaml", ("not valid YAML", "not a valid plan"))),
    "binary": (_binary, ("plan.yaml", "not valid YAML")),
    "not-a-mapping": (_a_list, ("plan.yaml", "not a valid plan")),
    "repeated-key": (_repeated_key, ("plan.yaml", "key 'num_microbatches' appears twice")),
    "schema-99": (_schema_99, ("schema_version 99",)),
    # int() refuses 4300+ digits with a ValueError the YAML reader let through: exit 3
    "huge-number": (_huge_number, ("plan.yaml", "not valid YAML", "5000 digits")),
}
PLAN_COMMANDS = {
    "verify": lambda plan, good: ["verify", plan],
    "show": lambda plan, good: ["show", plan],
    "check": lambda plan, good: ["check", plan],
    "launch": lambda plan, good: ["launch", plan, "--steps", "1"],
    "diff": lambda plan, good: ["diff", good, plan],
}


@pytest.mark.parametrize("command", list(PLAN_COMMANDS))
@pytest.mark.parametrize("damage", list(PLAN_DAMAGE))
def test_bad_plan(damage: str, command: str, mlp_plan: Path, tmp_path: Path) -> None:
    edit, fragments = PLAN_DAMAGE[damage]
    if edit is None:
        plan_dir = tmp_path / "no-such-plan"
    else:
        plan_dir = copy_plan(mlp_plan, tmp_path)
        edit(plan_dir)
    proc = run(*PLAN_COMMANDS[command](str(plan_dir), str(mlp_plan)))
    assert_one_line_error(proc, *fragments)


# Documents no partc file is, which the YAML and JSON readers raised as ValueError (an integer
# of 4300+ digits, a date that is no date) or RecursionError (deep nesting): internal errors
HOSTILE_YAML = {
    "huge-integer": ("version: " + "9" * 5000 + "\n", "5000 digits"),
    "no-such-date": ("when: 2026-13-45\n", r"month must be in 1\.\.12"),
    # (the profile reader's C parser stops at its own depth limit, "exceeded maximum nesting depth")
    "nested-too-deeply": ("a: " + "[" * 50_000 + "]" * 50_000 + "\n",
                          "nested too deeply|nesting depth"),
    "repeated-key": ("name: a\nkind: cpu\nname: b\n", "key 'name' appears twice"),
}


@pytest.mark.parametrize("case", list(HOSTILE_YAML))
def test_hostile_yaml_and_json_files_are_one_line_errors(case: str, tmp_path: Path) -> None:
    """Every YAML file partc reads (plan, cluster and device configs, profile) and the OpGraph
    JSON: a PartcError naming the file, in process (the CLI prints those as one line)."""
    from partc.cost.table import CostTable
    from partc.errors import PartcError
    from partc.graph.opgraph import OpGraph
    from partc.hardware.configs import load_cluster, load_device
    from partc.plans.plan import load_plan

    text, needle = HOSTILE_YAML[case]
    path = tmp_path / "file.yaml"
    path.write_text(text)
    graph = captured(EXAMPLES / "mlp.py").graph
    for read in (lambda: load_plan(path), lambda: load_cluster(path), lambda: load_device(path),
                 lambda: CostTable.load(path, graph)):
        with pytest.raises(PartcError, match=needle) as info:
            read()
        assert str(path) in info.value.one_line() and "\n" not in info.value.one_line()
    json_text = {"huge-integer": '{"version": ' + "9" * 5000 + "}",
                 "nested-too-deeply": "[" * 100_000 + "]" * 100_000}.get(case)
    if json_text is not None:
        graph_file = tmp_path / "graph.json"
        graph_file.write_text(json_text)
        with pytest.raises(PartcError, match=needle) as info:
            OpGraph.load(graph_file)
        assert "\n" not in info.value.one_line()


@pytest.mark.parametrize("as_file", [
    False,
    True,
], ids=["directory", "plan.yaml"])
def test_unreadable_plan(as_file: bool, mlp_plan: Path, tmp_path: Path) -> None:
    plan_dir = tmp_path / "plan"
    plan_dir.mkdir()
    prefix = unreadable_copy(mlp_plan / "plan.yaml", plan_dir / "plan.yaml")
    target = plan_dir / "plan.yaml" if as_file else plan_dir
    proc = run("show", str(target), prefix=prefix)
    assert_one_line_error(proc, "plan.yaml", "Permission denied")


# ---- stage files -------------------------------------------------------------------------------

def _drop_stage(plan_dir: Path) -> None:
    (plan_dir / "stage_1.pt").unlink()


def _append_byte(plan_dir: Path) -> None:
    with open(plan_dir / "stage_1.pt", "ab") as f:
        f.write(b"\0")


STAGE_DAMAGE = {
    "stage-missing": (_drop_stage, "is missing"),
    "stage-hash-mismatch": (_append_byte, "does not match plan.yaml"),
}


@pytest.mark.parametrize("command", ["verify", "launch", "check"])
@pytest.mark.parametrize("damage", list(STAGE_DAMAGE))
def test_bad_stage_file(damage: str, command: str, mlp_plan: Path, tmp_path: Path) -> None:
    edit, fragment = STAGE_DAMAGE[damage]
    plan_dir = copy_plan(mlp_plan, tmp_path)
    edit(plan_dir)
    metrics = tmp_path / "metrics.jsonl"
    extra = ["--steps", "1", "--metrics", str(metrics)] if command == "launch" else []
    proc = run(command, str(plan_dir / "plan.yaml"), *extra)
    assert_one_line_error(proc, "stage_1.pt", fragment)
    assert not metrics.exists()  # refused before any training step ran


def test_check_with_a_missing_model_file(mlp_plan: Path, tmp_path: Path) -> None:
    model = tmp_path / "gone.py"
    proc = run("check", str(mlp_plan), "--model", str(model))
    assert_one_line_error(proc, str(model), "is not a file")


# ---- torchrun with the wrong world size --------------------------------------------------------

# The worker's one line: `partc launch: rank N: error: ...` (as tests/run/test_launch.py accepts).
WORKER_ERROR = re.compile(r"^partc(?: launch: rank \d+)?: error: ")


@pytest.fixture(scope="module")
def torchrun_one_process(mlp_plan: Path) -> Proc[str]:
    """torchrun starting 1 worker for the 2-process plan (run once for the tests below)."""
    return subprocess.run([TORCHRUN, "--standalone", "--nproc-per-node", "1", "-m",
                           "partc.launch", str(mlp_plan / "plan.yaml"), "--steps", "1"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)


def test_torchrun_world_size_mismatch(torchrun_one_process: Proc[str]) -> None:
    proc = torchrun_one_process
    context = _context(proc)
    assert proc.returncode != 0, context
    errors = [line for line in proc.stderr.splitlines() if WORKER_ERROR.match(line)]
    assert len(errors) == 1, context
    assert "the plan runs on 2 processes, torchrun started 1" in errors[0], context
    assert "(hint: " in errors[0], context
    assert "internal error" not in proc.stderr and "Traceback" not in proc.stdout, context
    # torchrun prints its own failure report (its traceback starts in torchrun, not in partc)
    lines = proc.stderr.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("Traceback (most recent call last):"):
            assert "bin/torchrun" in lines[i + 1], context


def test_torchrun_world_size_mismatch_shows_no_partc_frames(
        torchrun_one_process: Proc[str]) -> None:
    assert not re.search(r'File "[^"]*/partc/', torchrun_one_process.stderr), \
        _context(torchrun_one_process)


# ---- missing arguments and unwritable outputs --------------------------------------------------

@pytest.mark.parametrize("args, missing", [
    (["check"], "Missing argument 'PLAN"),
    (["diff", "PLAN"], "Missing argument 'NEW'"),
], ids=["check-no-plan", "diff-one-plan"])
def test_missing_arguments_are_usage_errors(args: list[str], missing: str,
                                            mlp_plan: Path) -> None:
    args = [str(mlp_plan) if a == "PLAN" else a for a in args]
    proc = run(*args)
    context = _context(proc)
    assert proc.returncode == 2, context
    assert proc.stderr.startswith(f"Usage: partc {args[0]} "), context
    errors = [line for line in proc.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and missing in errors[0], context
    assert "Traceback" not in proc.stderr and proc.stdout == "", context


@pytest.mark.parametrize("args", [
    ["compile", MLP, "-b", "8", "--cluster", "cpu-4", "--costs", "analytic", "-o", "LOOP"],
    ["profile", MLP, "-o", "LOOP"],
    ["show", "PLAN", "--png", "LOOP"],
    ["check", "LOOP"],
], ids=["compile-output", "profile-output", "show-png", "check-plan"])
def test_a_symlink_loop_is_a_usage_error(args: list[str], mlp_plan: Path,
                                         tmp_path: Path) -> None:
    """A path that cannot be resolved was an internal error (exit 3: `RuntimeError: Symlink loop
    from ...`) wherever partc resolved an output path."""
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    args = [str(mlp_plan) if a == "PLAN" else str(tmp_path / "a") if a == "LOOP" else a
            for a in args]
    proc = run(*args)
    context = _context(proc)
    assert proc.returncode == 2, context
    errors = [line for line in proc.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "cannot be resolved" in errors[0], context
    assert "Traceback" not in proc.stderr and "internal error" not in proc.stderr, context


@pytest.mark.parametrize("flag", ["--png", "--html"])
def test_show_to_an_unwritable_path(flag: str, mlp_plan: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    target = blocker / f"report.{flag[2:]}"
    proc = run("show", str(mlp_plan), flag, str(target))
    # the summary is printed before the picture is drawn, so stdout is not empty
    assert_one_line_error(proc, "cannot write", str(target), stdout_empty=False)
    assert blocker.read_text() == "x"


# ---- --debug shows the traceback ---------------------------------------------------------------

def _debug_case(name: str, mlp_plan: Path, tmp: Path) -> list[str]:
    if name == "model-raises":
        return ["--debug", "compile", str(TEST_MODELS / "raises_on_import.py"), "-b", "4",
                "--cluster", "cpu-4", "-o", str(tmp / "out")]
    if name == "unknown-cluster":
        return ["compile", MLP, "-b", "8", "--cluster", "nope", "-o", str(tmp / "out"), "--debug"]
    plan_dir = copy_plan(mlp_plan, tmp)
    if name == "plan-truncated":
        _truncate(plan_dir)
        return ["--debug", "show", str(plan_dir)]
    assert name == "stage-hash-mismatch"
    _append_byte(plan_dir)
    return ["verify", str(plan_dir), "--debug"]


@pytest.mark.parametrize("case", ["model-raises", "unknown-cluster", "plan-truncated",
                                  "stage-hash-mismatch"])
def test_debug_shows_the_traceback(case: str, mlp_plan: Path, tmp_path: Path) -> None:
    proc = run(*_debug_case(case, mlp_plan, tmp_path))
    context = _context(proc)
    assert proc.returncode == 2, context
    assert "Traceback (most recent call last):" in proc.stderr, context
    assert sum(line.startswith(ERROR) for line in proc.stderr.splitlines()) == 1, context


# ---- the plan as a trust boundary (docs/trust.md) ----------------------------------------------

def _set_in_plan(plan_dir: Path, edit: Callable[[dict], None]) -> None:
    """Edit plan.yaml's content (as a careless or hostile user would) and write it back."""
    path = plan_dir / "plan.yaml"
    data = yaml.safe_load(path.read_text())
    edit(data)
    path.write_text(yaml.safe_dump(data, sort_keys=True))


def _tamper_stage(plan_dir: Path) -> None:
    """Add code to stage 1's TorchScript (a changed operator) and update its sha256 in plan.yaml:
    every hash still matches, so only a re-emit can tell."""
    import hashlib
    import io
    import zipfile

    path = plan_dir / "stage_1.pt"
    original = path.read_bytes()
    src = zipfile.ZipFile(io.BytesIO(original))
    out = io.BytesIO()
    changed = False
    with zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            payload = src.read(info.filename)
            if info.filename.endswith(".py") and b"torch.relu(" in payload and not changed:
                payload = payload.replace(b"torch.relu(", b"torch.sigmoid(", 1)
                changed = True
            dst.writestr(info, payload)
    assert changed, "stage 1 of the MLP plan calls relu"
    path.write_bytes(out.getvalue())
    plan = plan_dir / "plan.yaml"
    old, new = (hashlib.sha256(b).hexdigest() for b in (original, out.getvalue()))
    assert plan.read_text().count(old) == 1
    plan.write_text(plan.read_text().replace(old, new))


def _digest(proc: Proc[str]) -> str:
    line = next(ln for ln in proc.stdout.splitlines() if "plan digest: sha256:" in ln)
    return line.split("plan digest: ", 1)[1].strip()


@pytest.fixture(scope="module")
def mlp_digest(mlp_plan: Path) -> str:
    proc = run("check", str(mlp_plan))
    assert proc.returncode == 0, _context(proc)
    return _digest(proc)


def test_check_proves_a_current_plan_byte_for_byte(mlp_plan: Path, mlp_digest: str) -> None:
    import hashlib

    assert mlp_digest == "sha256:" + hashlib.sha256((mlp_plan / "plan.yaml").read_bytes()
                                                    ).hexdigest()


def test_check_reports_a_tampered_stage_file(mlp_plan: Path, mlp_digest: str,
                                             tmp_path: Path) -> None:
    plan_dir = copy_plan(mlp_plan, tmp_path)
    _tamper_stage(plan_dir)
    verify = run("verify", str(plan_dir))  # the hashes match: only check can tell
    check = run("check", str(plan_dir))
    assert check.returncode == 4, _context(check)
    assert "TAMPERED" in check.stdout and "stage_1.pt is not what compile writes" in check.stdout, \
        _context(check)
    assert "Traceback" not in check.stderr + verify.stderr
    # a cluster job pinned to the reviewed digest refuses it before any worker starts
    metrics = tmp_path / "m.jsonl"
    proc = run("launch", str(plan_dir), "--steps", "1", "--expect", mlp_digest,
               "--metrics", str(metrics))
    assert_one_line_error(proc, "--expect", "not the reviewed one")
    assert not metrics.exists()


def test_check_reports_a_hand_edited_plan(mlp_plan: Path, tmp_path: Path) -> None:
    plan_dir = copy_plan(mlp_plan, tmp_path)
    path = plan_dir / "plan.yaml"
    text = path.read_text()
    line = next(ln for ln in text.splitlines() if ln.strip().startswith("forward_s:"))
    path.write_text(text.replace(line, line.split(":")[0] + ": 0.000001", 1))
    proc = run("check", str(plan_dir))
    assert proc.returncode == 4, _context(proc)
    assert "plan.yaml is not what compile writes" in proc.stdout, _context(proc)
    assert "0.001 -> " in proc.stdout, _context(proc)  # the edited forward time, 1 us


def test_check_reports_an_edit_outside_the_layout(mlp_plan: Path, tmp_path: Path) -> None:
    """A field the re-solve does not compare (a stage's operator count) is caught by bytes."""
    plan_dir = copy_plan(mlp_plan, tmp_path)
    path = plan_dir / "plan.yaml"
    text = path.read_text()
    head, stages = text.split("\nstages:\n", 1)
    line = next(ln for ln in stages.splitlines() if ln.strip().startswith("num_nodes:"))
    path.write_text(head + "\nstages:\n" + stages.replace(line, line + "0", 1))
    proc = run("check", str(plan_dir))
    assert proc.returncode == 4, _context(proc)
    assert "plan.yaml is not what compile writes for this model (differs at stages/0/num_nodes)" \
        in proc.stdout, _context(proc)


def test_launch_runs_only_the_expected_digest(mlp_plan: Path, mlp_digest: str,
                                              tmp_path: Path) -> None:
    bad = run("launch", str(mlp_plan), "--steps", "1", "--expect", "sha256:" + "0" * 64)
    assert_one_line_error(bad, "not the reviewed one")
    garbage = run("launch", str(mlp_plan), "--steps", "1", "--expect", "yes")
    assert_one_line_error(garbage, "is not a plan digest")
    good = run("launch", str(mlp_plan), "--steps", "1", "--expect", mlp_digest)
    assert good.returncode == 0, _context(good)


def _absolute_model(plan_dir: Path) -> None:
    _set_in_plan(plan_dir, lambda d: d["model"].update(file=str(EXAMPLES / "mlp.py")))


@pytest.mark.parametrize("command", ["verify", "launch", "check"])
def test_absolute_model_path_is_refused(command: str, mlp_plan: Path, tmp_path: Path) -> None:
    plan_dir = copy_plan(mlp_plan, tmp_path)
    _absolute_model(plan_dir)
    extra = ["--steps", "1"] if command == "launch" else []
    proc = run(command, str(plan_dir), *extra)
    assert_one_line_error(proc, "is an absolute path")


@pytest.mark.parametrize("command", ["verify", "launch", "check"])
def test_model_path_escaping_the_repository_is_refused(command: str, mlp_plan: Path,
                                                       tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / ".git").mkdir(parents=True)  # a repository the plan is reviewed in
    plan_dir = copy_plan(mlp_plan, repo)
    outside = tmp_path / "evil.py"
    shutil.copy(EXAMPLES / "mlp.py", outside)
    _set_in_plan(plan_dir, lambda d: d["model"].update(file="../../evil.py"))
    extra = ["--steps", "1"] if command == "launch" else []
    proc = run(command, str(plan_dir), *extra)
    assert_one_line_error(proc, "outside the plan's tree")


def test_compile_refuses_a_model_outside_the_plans_repository(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / ".git").mkdir(parents=True)
    proc = run("compile", MLP, "-b", "8", "--stages", "2", "--cluster", "cpu-4",
               "-o", str(repo / "plans" / "mlp"))
    # refused before the model is captured or priced: no progress line, no directory made
    assert_one_line_error(proc, "lies outside the repository")
    assert not (repo / "plans").exists()


def test_changed_model_file_is_not_imported(own_mlp: Path, tmp_path: Path) -> None:
    model, out = own_copy(own_mlp, tmp_path)
    marker = tmp_path / "ran"
    model.write_text(model.read_text() + f"\nopen({str(marker)!r}, 'w').close()\n")
    for command in (["verify", str(out)], ["launch", str(out), "--steps", "1"]):
        bad = run(*command)
        assert_one_line_error(bad, "changed since the plan was compiled")
    assert not marker.exists()  # the changed file never ran
    # check explains it: the graph is the same, the file's bytes are not
    stale = run("check", str(out))
    assert stale.returncode == 1, _context(stale)
    assert "model file's bytes changed" in stale.stdout, _context(stale)


@pytest.mark.parametrize("model, fragment", [
    ("exits_in_build.py", "called sys.exit(0)"),
    ("base_exception.py", "raised Stop"),
])
@pytest.mark.parametrize("command", ["inspect", "compile"])
def test_model_code_cannot_fake_success(command: str, model: str, fragment: str,
                                        tmp_path: Path) -> None:
    path = str(TEST_MODELS / model)
    args = (["inspect", path, "--no-onnx"] if command == "inspect" else
            ["compile", path, "-b", "4", "--cluster", "cpu-4", "-o", str(tmp_path / "o")])
    proc = run(*args)
    assert_one_line_error(proc, "build_model()", fragment)


def test_model_that_exits_cannot_pass_check_or_verify(own_mlp: Path, tmp_path: Path) -> None:
    """A plan whose model file now calls sys.exit(0) while building: no command exits 0."""
    model, out = own_copy(own_mlp, tmp_path)
    text = model.read_text().replace("    torch.manual_seed(0)\n",
                                     "    import sys\n    sys.exit(0)\n", 1)
    model.write_text(text)
    check = run("check", str(out))
    assert_one_line_error(check, "called sys.exit(0)")
    verify = run("verify", str(out))
    assert verify.returncode == 2, _context(verify)  # the file changed: refused before import


def test_print_flood_is_bounded() -> None:
    proc = run("inspect", str(TEST_MODELS / "prints_flood.py"), "--no-onnx")
    assert proc.returncode == 0, _context(proc)
    assert "building layer" not in proc.stdout and "importing layer" not in proc.stdout
    model_lines = [ln for ln in proc.stderr.splitlines() if "layer" in ln and "row" in ln
                   or ln.startswith("building layer")]
    assert len(model_lines) <= 40, _context(proc)
    assert "more line(s), not shown" in proc.stderr, _context(proc)


def _huge_microbatches(plan_dir: Path) -> None:
    _set_in_plan(plan_dir, lambda d: d["training"].update(num_microbatches=10 ** 30))


def _batch_mismatch(plan_dir: Path) -> None:
    _set_in_plan(plan_dir, lambda d: d["training"].update(
        microbatch_size=d["training"]["microbatch_size"] + 1))


def _stage_on_wrong_device(plan_dir: Path) -> None:
    def edit(d: dict) -> None:
        d["stages"][1]["devices"] = d["stages"][0]["devices"]
    _set_in_plan(plan_dir, edit)


def _input_from_the_future(plan_dir: Path) -> None:
    def edit(d: dict) -> None:
        d["stages"][0]["inputs"][0]["from"] = 1
    _set_in_plan(plan_dir, edit)


def _stage_file_elsewhere(plan_dir: Path) -> None:
    def edit(d: dict) -> None:
        d["stages"][1]["file"] = "../stage_1.pt"
    _set_in_plan(plan_dir, edit)


def _nan_time(plan_dir: Path) -> None:
    def edit(d: dict) -> None:
        d["stages"][0]["predicted"]["forward_s"] = float("nan")
    _set_in_plan(plan_dir, edit)


def _short_rank_list(plan_dir: Path) -> None:
    def edit(d: dict) -> None:
        d["predicted"]["optimizer_s"] = d["predicted"]["optimizer_s"][:1]
    _set_in_plan(plan_dir, edit)


def _wire_order_not_a_permutation(plan_dir: Path) -> None:
    def edit(d: dict) -> None:
        for ref in (d["stages"][0]["outputs"][0], d["stages"][1]["inputs"][0]):
            ref["wire_order"] = [0] * len(ref["shape"])
    _set_in_plan(plan_dir, edit)


def _received_in_another_order(plan_dir: Path) -> None:
    # same bytes, another meaning: received transposed, it would train on scrambled values
    def edit(d: dict) -> None:
        ref = d["stages"][1]["inputs"][0]
        ref["wire_order"] = list(reversed(range(len(ref["shape"]))))
    _set_in_plan(plan_dir, edit)


INCONSISTENT = {
    "nan-time": (_nan_time, "forward_s is nan"),
    "short-rank-list": (_short_rank_list, "predicted.optimizer_s has 1 entries"),
    "huge-microbatches": (_huge_microbatches, "num_microbatches"),
    "batch-arithmetic": (_batch_mismatch, "global batch"),
    "stage-device": (_stage_on_wrong_device, "stage 1 is"),
    "input-from-later-stage": (_input_from_the_future, "not an earlier stage"),
    "stage-file-path": (_stage_file_elsewhere, "stages/1/file"),
    "wire-order": (_wire_order_not_a_permutation, "not an order of its 2 dims"),
    "received-other-than-sent": (_received_in_another_order, "stage 0 sends"),
}


@pytest.mark.parametrize("command", ["show", "verify", "launch", "check", "diff"])
@pytest.mark.parametrize("damage", list(INCONSISTENT))
def test_inconsistent_plan_is_refused(damage: str, command: str, mlp_plan: Path,
                                      tmp_path: Path) -> None:
    edit, fragment = INCONSISTENT[damage]
    plan_dir = copy_plan(mlp_plan, tmp_path)
    edit(plan_dir)
    proc = run(*PLAN_COMMANDS[command](str(plan_dir), str(mlp_plan)), timeout=120)
    assert_one_line_error(proc, fragment)


def test_a_number_no_plan_holds_is_refused(mlp_plan: Path, tmp_path: Path) -> None:
    """A hand-edited backward_s of 1e308 passed the schema and the finite check, and `show
    --html` summed it to inf and failed with an internal error (exit 3)."""
    plan_dir = copy_plan(mlp_plan, tmp_path)

    def edit(d: dict) -> None:
        d["stages"][1]["predicted"]["backward_s"] = 1e308
    _set_in_plan(plan_dir, edit)
    proc = run("show", str(plan_dir), "--html", str(tmp_path / "plan.html"))
    assert_one_line_error(proc, "stages/1/predicted/backward_s is 1e+308, beyond any value")
    assert not (tmp_path / "plan.html").exists()


@pytest.mark.parametrize("target", ["plan.yaml", "stage_0.pt"])
@pytest.mark.parametrize("flag", ["--png", "--html"])
def test_outputs_never_overwrite_a_plan(flag: str, target: str, mlp_plan: Path,
                                        tmp_path: Path) -> None:
    plan_dir = copy_plan(mlp_plan, tmp_path)
    before = (plan_dir / target).read_bytes()
    proc = run("show", str(plan_dir), flag, str(plan_dir / target))
    assert_one_line_error(proc, "would overwrite a plan file")
    assert (plan_dir / target).read_bytes() == before


def test_data_unlike_example_inputs_is_refused_by_verify_and_launch(tmp_path: Path) -> None:
    """batches() giving `scale=3.0` where the plan was captured with example_inputs' 2.0 (baked
    into the program: training would silently use 2.0); verify was an internal error (exit 3)
    for data with other keyword arguments."""
    plan_dir = tmp_path / "plan"
    proc = run("compile", str(TEST_MODELS / "data_scale.py"), "-b", "8", "--stages", "2",
               "--replicas", "1", "--cluster", "cpu-4", "--costs", "analytic", "-o",
               str(plan_dir))
    assert proc.returncode == 0, _context(proc)
    env = {**os.environ, "PARTC_TEST_DATA_SCALE": "3.0"}
    fragment = "kwargs['scale'] is 3.0, example_inputs gives 2.0"
    proc = run_partc("verify", str(plan_dir), env=env)
    assert_one_line_error(proc, "yields inputs unlike example_inputs", fragment)
    proc = run_partc("launch", str(plan_dir), "--steps", "2", env=env)
    assert_one_line_error(proc, "rank 0 failed", fragment, stdout_empty=False, code=1)
    proc = run("launch", str(plan_dir), "--steps", "2")  # the data as captured: trains
    assert proc.returncode == 0, _context(proc)


def test_launch_given_a_model_file(tmp_path: Path) -> None:
    proc = run("launch", MLP, "--steps", "1")
    assert_one_line_error(proc, "is a Python file, not a plan")


# ---- holes a hostile review found (2026-11-25) -------------------------------------------------

@pytest.mark.parametrize("injection", [
    "import os as _o\n_o._exit(0)\n",
    "import partc.plans.check as _c\n_c.CheckReport.exit_code = property(lambda s: 0)\n",
], ids=["os-exit", "patches-partc"])
def test_changed_model_code_cannot_make_check_pass(injection: str, own_mlp: Path,
                                                   tmp_path: Path) -> None:
    """A model file changed since compile runs in a child process: whatever its code does, the
    check of the plan is not "current"."""
    model, out = own_copy(own_mlp, tmp_path)
    model.write_text(model.read_text() + "\n" + injection)
    proc = run("check", str(out))
    assert proc.returncode == 1, _context(proc)
    assert "STALE" in proc.stdout, _context(proc)


def test_check_compares_the_plan_file_it_was_given(mlp_plan: Path, tmp_path: Path) -> None:
    """An edited copy of plan.yaml under another name, beside the real one, is not vouched for
    by comparing the real one."""
    plan_dir = copy_plan(mlp_plan, tmp_path)
    text = (plan_dir / "plan.yaml").read_text()
    assert "  weights: stage-files\n" in text
    reviewed = plan_dir / "reviewed.yaml"
    reviewed.write_text(text.replace("  weights: stage-files\n",
                                     "  weights: initialise-at-launch\n"))
    proc = run("check", str(reviewed))
    assert proc.returncode == 4, _context(proc)
    assert "differs at model/weights" in proc.stdout, _context(proc)


def test_an_empty_expect_is_refused(mlp_plan: Path) -> None:
    proc = run("launch", str(mlp_plan), "--steps", "1", "--expect", "")
    assert_one_line_error(proc, "is not a plan digest")


@pytest.mark.parametrize("command", ["show-html", "launch-metrics", "metrics-hard-link"])
def test_outputs_never_overwrite_the_model_or_a_linked_plan(command: str, own_mlp: Path,
                                                            tmp_path: Path) -> None:
    model, out = own_copy(own_mlp, tmp_path)
    before = {p: p.read_bytes() for p in (model, out / "plan.yaml")}
    if command == "show-html":
        proc = run("show", str(out), "--html", str(model))
    elif command == "launch-metrics":
        proc = run("launch", str(out), "--steps", "1", "--metrics", str(model))
    else:
        link = tmp_path / "metrics.jsonl"
        os.link(out / "plan.yaml", link)
        proc = run("launch", str(out), "--steps", "1", "--metrics", str(link))
    assert_one_line_error(proc, ("is also an input", "would overwrite"))
    assert {p: p.read_bytes() for p in before} == before


def test_diff_reads_no_profile_outside_the_plan(mlp_plan: Path, tmp_path: Path) -> None:
    plan_dir = copy_plan(mlp_plan, tmp_path)
    _set_in_plan(plan_dir, lambda d: d["costs"].update(source="profile", profile="/dev/zero"))
    proc = run("diff", str(mlp_plan), str(plan_dir), timeout=60)
    assert proc.returncode == 0, _context(proc)


def test_a_stage_file_without_a_listed_parameter_stops_every_rank(mlp_plan: Path,
                                                                  tmp_path: Path) -> None:
    """plan.yaml lists (and ties) a parameter stage 1's file does not hold: every rank stops
    with that one line before a step, no rank fails on a closed connection."""
    plan_dir = copy_plan(mlp_plan, tmp_path)

    def edit(d: dict) -> None:
        d["stages"][1]["parameter_names"].append("layers.0.weight")
        d["tied_parameters"] = [{"name": "layers.0.weight", "aliases": [], "stages": [0, 1]}]
    _set_in_plan(plan_dir, edit)
    metrics = tmp_path / "m.jsonl"
    proc = run("launch", str(plan_dir), "--steps", "1", "--metrics", str(metrics))
    assert_one_line_error(proc, "rank 1 cannot load its stages", "holds tensors", code=1)
    assert "Connection closed" not in proc.stderr
    assert not metrics.exists() or metrics.read_text() == ""


# ---- a model that does not run on the device it is measured, verified or trained on ------------

def test_a_program_this_device_cannot_run(tmp_path: Path) -> None:
    """A meta model whose forward counts integers with histc (as HF Mixtral's router does on
    meta): measuring it here is a one-line user error naming the kernel; priced analytically
    it compiles, and then verify fails on the model itself and launch names the same reason
    (not torch pipelining's empty "RuntimeError:" line)."""
    model = TEST_MODELS / "meta_cuda_path.py"
    reason = "NotImplementedError: \"histogram_cpu\" not implemented for 'Int'"
    proc = run("compile", str(model), "-b", "4", "--stages", "2", "--cluster", "cpu",
               "-o", str(tmp_path / "measured"))
    line = assert_one_line_error(proc, "the captured program does not run on cpu: " + reason,
                                 "build it on cpu", stdout_empty=False)
    assert not (tmp_path / "measured" / "plan.yaml").exists(), line
    plan = tmp_path / "analytic"
    proc = run("compile", str(model), "-b", "4", "--stages", "2", "--cluster", "cpu",
               "--costs", "analytic", "-o", str(plan))
    assert proc.returncode == 0, _context(proc)
    proc = run("verify", str(plan))
    assert proc.returncode == 1 and "internal error" not in proc.stderr, _context(proc)
    assert f"FAIL the model itself fails to run on cpu: {reason}" in proc.stdout, _context(proc)
    proc = run("launch", str(plan), "--steps", "1")
    assert proc.returncode == 1, _context(proc)
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith(ERROR)]
    assert len(errors) == 1 and errors[0].startswith("partc: error: rank 1 failed (exit code "
                                                     f"1): {reason} (hint: "), _context(proc)
