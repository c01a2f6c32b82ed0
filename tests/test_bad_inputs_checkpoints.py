"""Checkpoints that never lose a good state, and run outputs checked before workers start,
through the real `partc` CLI (real compiles, real `partc launch` runs on gloo, real damaged
files, a really read-only directory, a really exceeded file size limit).

The contract, as in tests/test_bad_inputs.py: a refusal exits 2 with one `partc: error:` line
carrying a `(hint: ...)`, no traceback, and no training step run; a failure during the run exits
1 with one `partc: error:` line naming the reason (each failing rank says the same in its own
`partc launch: rank N: error:` line). And nothing is lost: the previous good checkpoint stays.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Sequence

import pytest
import torch
from conftest import ROOT, TEST_MODELS, losses_of
from test_bad_inputs import (
    ERROR,
    MLP,
    NO_DAC,
    WORKER_ERROR,
    Proc,
    _context,
    assert_one_line_error,
    run,
)

from partc.files import sha256_file
from partc.run import checkpoint as ckpt_module
from partc.run.checkpoint import (
    FORMAT,
    CheckpointError,
    StageFile,
    checkpoint_at,
    choose_resume,
    save_stage,
    verify,
    write_manifest,
)

STEP = "step-{:08d}"


# ---- helpers -----------------------------------------------------------------------------------

def launch(plan: Path, *flags: str, prefix: Sequence[str] = ()) -> Proc[str]:
    return run("launch", str(plan), *flags, prefix=prefix, timeout=300)


def damage(path: Path) -> None:
    """Flip 16 bytes in the middle of `path`, in place, keeping its size (the tensors' data:
    torch.load still reads it, with other values)."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 16] = bytes(b ^ 0xFF for b in data[middle:middle + 16])
    with open(path, "r+b") as f:
        f.write(data)
    ckpt_module._verdicts.clear()  # this process may have verified the old bytes


def good(directory: Path, step: int) -> bool:
    found = checkpoint_at(directory, step)
    return found is not None and verify(found) is None


def no_dac_or_skip(read_only: Path) -> list[str]:
    """The command prefix under which `read_only` (chmod'ed by the caller) really is read-only:
    root writes anywhere unless its DAC capabilities are dropped."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("running as root, which writes into read-only directories, and no setpriv")
    target = read_only / ".probe" if read_only.is_dir() else read_only
    probe = subprocess.run([*NO_DAC, "sh", "-c", f"echo x >> '{target}'"], capture_output=True)
    if probe.returncode == 0 or b"Permission denied" not in probe.stderr:
        pytest.skip("running as root and setpriv cannot drop CAP_DAC_OVERRIDE here")
    return NO_DAC


def assert_run_failed(proc: Proc[str], *fragments: str, same_on_every_rank: bool = True) -> str:
    """A failure during the run: exit 1, one `partc: error:` line with every fragment and a hint;
    the ranks' own error lines all say the same (unless each rank has its own reason); no
    traceback."""
    line = assert_one_line_error(proc, *fragments, stdout_empty=False, code=1)
    ranks = {ln.split(": error: ", 1)[1] for ln in proc.stderr.splitlines()
             if WORKER_ERROR.match(ln) and not ln.startswith(ERROR)}
    assert len(ranks) <= 1 or not same_on_every_rank, _context(proc)
    return line


def leftovers(directory: Path) -> list[Path]:
    """Temporary files anywhere under `directory`."""
    return [p for p in directory.rglob("*") if p.name.endswith(".tmp")]


# ---- plans and a trained run, shared by the module ---------------------------------------------

def _compile(model: Path, out: Path) -> Path:
    # priced by the roofline: checkpoints do not depend on the costs, and measuring each model
    # variant here would dominate these tests' time
    proc = run("compile", str(model), "-b", "8", "--stages", "2", "--cluster", "cpu-4",
               "--costs", "analytic", "-o", str(out))
    assert proc.returncode == 0, _context(proc)
    return out / "plan.yaml"


@pytest.fixture(scope="module")
def plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """examples/mlp.py on 2 stages of cpu-4 (compiled once)."""
    return _compile(Path(MLP), tmp_path_factory.mktemp("plan") / "mlp")


@pytest.fixture(scope="module")
def trained(plan: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[float]]:
    """6 steps with checkpoints after steps 2, 4 and 6 (all kept), and the run's losses: the
    losses any correct resume must reproduce bit for bit. Copy the directory before damaging."""
    tmp = tmp_path_factory.mktemp("trained")
    ckpt, metrics = tmp / "ckpt", tmp / "clean.jsonl"
    proc = launch(plan, "--steps", "6", "--checkpoint-dir", str(ckpt), "--checkpoint-every",
                  "2", "--keep-checkpoints", "3", "--metrics", str(metrics))
    assert proc.returncode == 0, _context(proc)
    assert all(good(ckpt, s) for s in (2, 4, 6)), sorted(p.name for p in ckpt.iterdir())
    manifest = json.loads((ckpt / STEP.format(6) / "manifest.json").read_text())
    assert manifest["version"] == 2
    for name, entry in manifest["files"].items():  # the digests of the bytes really written
        assert entry["sha256"] == sha256_file(ckpt / STEP.format(6) / name)
    return ckpt, losses_of(metrics)


@pytest.fixture(scope="module")
def other_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Plans of two other models: the MLP with GELU (another graph, the same parameter names
    and shapes) and a narrower one (the same names, other shapes)."""
    tmp = tmp_path_factory.mktemp("others")
    source = Path(MLP).read_text()
    edits = {"mlp_gelu": ("self.act = nn.ReLU()", "self.act = nn.GELU()"),
             "mlp_narrow": ("HIDDEN = 256", "HIDDEN = 128")}
    plans = {}
    for name, (old, new) in edits.items():
        assert old in source
        model = tmp / f"{name}.py"
        model.write_text(source.replace(old, new))
        plans[name] = _compile(model, tmp / name)
    return plans


def copy_checkpoints(trained: tuple[Path, list[float]], tmp: Path) -> Path:
    ckpt = tmp / "ckpt"
    shutil.copytree(trained[0], ckpt)
    return ckpt


# ---- (a) a damaged newest checkpoint -----------------------------------------------------------

def test_damaged_newest_checkpoint_falls_back_to_the_previous_good_one(
        plan: Path, trained: tuple[Path, list[float]], tmp_path: Path) -> None:
    ckpt = copy_checkpoints(trained, tmp_path)
    shutil.rmtree(ckpt / STEP.format(6))  # as if the run had stopped after step 4
    stage = ckpt / STEP.format(4) / "stage-1.pt"
    size = stage.stat().st_size
    damage(stage)
    assert stage.stat().st_size == size  # the old completeness test would take it
    metrics = tmp_path / "resumed.jsonl"
    proc = launch(plan, "--steps", "6", "--resume", "--checkpoint-dir", str(ckpt),
                  "--metrics", str(metrics))
    context = _context(proc)
    assert proc.returncode == 0, context
    assert "Traceback" not in proc.stderr, context
    warnings = [ln for ln in proc.stderr.splitlines() if "partc launch: warning:" in ln]
    assert len(warnings) == 1, context  # said once: not again by rank 0 after the pre-flight
    assert "damaged checkpoint" in warnings[0] and STEP.format(4) in warnings[0], context
    assert "stage-1.pt" in warnings[0] and str(ckpt / STEP.format(2)) in warnings[0], context
    assert f"resuming from {ckpt / STEP.format(2)} (step 2)" in proc.stderr, context
    # steps 3..6 exactly as the uninterrupted run had them (the damaged one gave loss ~10^2)
    assert losses_of(metrics) == trained[1][2:], context
    # the new checkpoint verified, so pruning ran: it kept the newest 2 good ones, 6 and 2,
    # and dropped the damaged one, never the good one before it
    assert good(ckpt, 6) and good(ckpt, 2)
    assert sorted(p.name for p in ckpt.iterdir()) == [STEP.format(2), STEP.format(6)]
    assert not leftovers(ckpt)


# ---- (b) every checkpoint damaged --------------------------------------------------------------

def test_no_intact_checkpoint_is_one_line(plan: Path, trained: tuple[Path, list[float]],
                                          tmp_path: Path) -> None:
    ckpt = copy_checkpoints(trained, tmp_path)
    for step in (2, 4, 6):
        damage(ckpt / STEP.format(step) / "stage-0.pt")
    metrics = tmp_path / "m.jsonl"
    proc = launch(plan, "--steps", "8", "--resume", "--checkpoint-dir", str(ckpt),
                  "--metrics", str(metrics))
    assert_one_line_error(proc, "no checkpoint in", "is intact", STEP.format(6),
                          "does not match its SHA-256")
    assert not metrics.exists()  # refused before any worker started
    assert sorted(p.name for p in ckpt.iterdir()) == [STEP.format(s) for s in (2, 4, 6)]


# ---- (c) a checkpoint of another model ---------------------------------------------------------

def test_checkpoint_of_another_model_is_refused(other_models: dict[str, Path],
                                                trained: tuple[Path, list[float]],
                                                tmp_path: Path) -> None:
    ckpt = copy_checkpoints(trained, tmp_path)
    metrics = tmp_path / "m.jsonl"
    proc = launch(other_models["mlp_gelu"], "--steps", "7", "--resume", "--checkpoint-dir",
                  str(ckpt), "--metrics", str(metrics))
    assert_one_line_error(proc, STEP.format(6), "is of model 'mlp'", "mlp_gelu",
                          "--allow-other-model")
    assert not metrics.exists()


def test_allow_other_model_loads_by_name_and_shape(other_models: dict[str, Path],
                                                   trained: tuple[Path, list[float]],
                                                   tmp_path: Path) -> None:
    ckpt = copy_checkpoints(trained, tmp_path)
    metrics = tmp_path / "m.jsonl"
    proc = launch(other_models["mlp_gelu"], "--steps", "7", "--resume", "--checkpoint-dir",
                  str(ckpt), "--metrics", str(metrics), "--allow-other-model")
    context = _context(proc)
    assert proc.returncode == 0, context
    warnings = [ln for ln in proc.stderr.splitlines() if "partc launch: warning:" in ln]
    assert len(warnings) == 1 and "--allow-other-model" in warnings[0], context
    assert [json.loads(ln)["step"] for ln in metrics.read_text().splitlines()] == [7]
    assert good(ckpt, 7)
    # other shapes under the same names: refused when the weights are loaded
    proc = launch(other_models["mlp_narrow"], "--steps", "8", "--resume", "--checkpoint-dir",
                  str(ckpt), "--allow-other-model")
    assert_run_failed(proc, STEP.format(7), "the stage needs", same_on_every_rank=False)
    assert good(ckpt, 7) and not (ckpt / STEP.format(8)).exists()


# ---- (d) a read-only checkpoint directory ------------------------------------------------------

@pytest.mark.parametrize("resume", [False, True], ids=["empty", "with-checkpoints"])
def test_read_only_checkpoint_dir_is_refused_before_workers_start(
        resume: bool, plan: Path, trained: tuple[Path, list[float]], tmp_path: Path) -> None:
    if resume:
        ckpt = copy_checkpoints(trained, tmp_path)
    else:
        ckpt = tmp_path / "ckpt"
        ckpt.mkdir()
    ckpt.chmod(0o555)
    try:
        prefix = no_dac_or_skip(ckpt)
        metrics = tmp_path / "m.jsonl"
        proc = launch(plan, "--steps", "8", "--checkpoint-dir", str(ckpt), "--metrics",
                      str(metrics), *(["--resume"] if resume else []), prefix=prefix)
        assert_one_line_error(proc, f"--checkpoint-dir {ckpt} is not writable",
                              "Permission denied")
        assert not metrics.exists()  # no step ran
        assert not [p for p in ckpt.iterdir() if p.name.startswith(".partc-probe")]
    finally:
        ckpt.chmod(0o755)
    if resume:
        assert all(good(ckpt, s) for s in (2, 4, 6))


# ---- (e) an unwritable --metrics path ----------------------------------------------------------

def _metrics_case(case: str, tmp: Path) -> tuple[Path, Path | None]:
    """(the --metrics path, a path to make read-only) for each case."""
    if case == "a-directory":
        target = tmp / "metrics"
        target.mkdir()
        return target, None
    if case == "parent-is-a-file":
        (tmp / "blocker").write_text("x")
        return tmp / "blocker" / "m.jsonl", None
    if case == "read-only-file":
        target = tmp / "m.jsonl"
        target.write_text('{"step": 1}\n')
        return target, target
    assert case == "read-only-directory"
    (tmp / "ro").mkdir()
    return tmp / "ro" / "m.jsonl", tmp / "ro"


def test_metrics_directory_is_refused_before_workers_start(plan: Path, tmp_path: Path) -> None:
    """`partc launch` (click) refuses a directory as a usage error; `python -m partc.launch`
    (the torchrun entry, argparse) in check_launch's one line."""
    metrics, _ = _metrics_case("a-directory", tmp_path)
    ckpt = tmp_path / "ckpt"
    proc = launch(plan, "--steps", "2", "--metrics", str(metrics), "--checkpoint-dir", str(ckpt))
    context = _context(proc)
    assert proc.returncode == 2, context
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("Error:")]
    assert len(errors) == 1 and "'--metrics'" in errors[0] and "is a directory" in errors[0]
    assert "Traceback" not in proc.stderr, context
    proc = subprocess.run([sys.executable, "-m", "partc.launch", str(plan), "--steps", "2",
                           "--metrics", str(metrics), "--checkpoint-dir", str(ckpt)],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    context = _context(proc)
    assert proc.returncode == 2, context
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, context
    assert lines[0].startswith("partc launch: error: ") and "(hint: " in lines[0], context
    assert f"--metrics {metrics} is a directory" in lines[0], context
    assert not ckpt.exists() and not any(metrics.iterdir())


@pytest.mark.parametrize("case", ["parent-is-a-file", "read-only-file", "read-only-directory"])
def test_unwritable_metrics_is_refused_before_workers_start(case: str, plan: Path,
                                                            tmp_path: Path) -> None:
    metrics, read_only = _metrics_case(case, tmp_path)
    before = metrics.read_bytes() if metrics.is_file() else None
    prefix: list[str] = []
    if read_only is not None:
        read_only.chmod(0o444 if read_only.is_file() else 0o555)
    try:
        if read_only is not None:
            prefix = no_dac_or_skip(read_only)
        ckpt = tmp_path / "ckpt"
        proc = launch(plan, "--steps", "2", "--metrics", str(metrics), "--checkpoint-dir",
                      str(ckpt), prefix=prefix)
        assert_one_line_error(proc, "--metrics", str(metrics),
                              ("is not a directory", "Permission denied"))
    finally:
        if read_only is not None:
            read_only.chmod(0o755)
    assert not ckpt.exists()  # no step ran, nothing was checkpointed
    if before is not None:
        assert metrics.read_bytes() == before


@pytest.mark.parametrize("case", ["the-plan-directory", "read-only-directory"])
def test_bad_trace_directory_is_refused_before_workers_start(case: str, plan: Path,
                                                             tmp_path: Path) -> None:
    """--trace into the reviewed plan directory, or into one nobody can write: one line before
    any worker starts, and nothing written there."""
    prefix: list[str] = []
    if case == "the-plan-directory":
        trace = plan.parent
        fragments: tuple[str | tuple[str, ...], ...] = ("is a plan directory",)
    else:
        trace = tmp_path / "ro"
        trace.mkdir()
        trace.chmod(0o555)
        fragments = ("cannot write --trace", ("Permission denied", "Read-only"))
    before = sorted(p.name for p in trace.iterdir())
    try:
        if case == "read-only-directory":
            prefix = no_dac_or_skip(trace)
        ckpt = tmp_path / "ckpt"
        proc = launch(plan, "--steps", "2", "--trace", str(trace), "--checkpoint-dir",
                      str(ckpt), prefix=prefix)
        assert_one_line_error(proc, "--trace", *fragments)
    finally:
        trace.chmod(0o755)
    assert not ckpt.exists() and sorted(p.name for p in trace.iterdir()) == before


# ---- (f) a save that fails during the run ------------------------------------------------------

def test_failed_save_is_one_line_and_keeps_the_previous_checkpoint(
        plan: Path, trained: tuple[Path, list[float]], tmp_path: Path) -> None:
    """A file size limit below a stage file's size (as a full disk: the write fails with
    EFBIG; Python ignores SIGXFSZ): the checkpoint of step 8 fails on the rank writing it."""
    if shutil.which("prlimit") is None:
        pytest.skip("no prlimit")
    ckpt = copy_checkpoints(trained, tmp_path)
    before = {p: p.read_bytes() for p in ckpt.rglob("*") if p.is_file()}
    stage_sizes = [p.stat().st_size for p in (ckpt / STEP.format(6)).glob("stage-*.pt")]
    limit = 256 * 1024
    assert min(stage_sizes) > limit
    metrics = tmp_path / "m.jsonl"
    proc = launch(plan, "--steps", "8", "--resume", "--checkpoint-dir", str(ckpt),
                  "--metrics", str(metrics), prefix=["prlimit", f"--fsize={limit}"])
    assert_run_failed(proc, "the checkpoint of step 8 failed", "File too large",
                      "the checkpoint of step 6 is kept")
    assert [json.loads(ln)["step"] for ln in metrics.read_text().splitlines()] == [7, 8]
    assert not (ckpt / STEP.format(8)).exists()  # nothing half-written to mistake for one
    assert not leftovers(ckpt)
    assert {p: p.read_bytes() for p in ckpt.rglob("*") if p.is_file()} == before
    assert good(ckpt, 6)


# ---- (g) a loss that turns NaN ------------------------------------------------------------------

def test_a_nan_loss_stops_the_run_and_no_checkpoint_keeps_its_weights(tmp_path: Path) -> None:
    """tests/models/nan_loss.py's third batch is all padding (loss 0/0). The run stops at step
    3 in one line, the step-3 checkpoint that the first stage's rank may already be writing is
    discarded, and the checkpoints of steps 1-2 stay good; with --allow-nonfinite-loss it
    trains through (the metrics record the NaN)."""
    plan = _compile(TEST_MODELS / "nan_loss.py", tmp_path / "plan")
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    proc = launch(plan, "--steps", "5", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1",
                  "--metrics", str(metrics))
    assert_run_failed(proc, "the loss is nan at step 3", "--allow-nonfinite-loss",
                      "the checkpoint of step 2 is kept")
    assert good(ckpt, 1) and good(ckpt, 2)
    assert not (ckpt / STEP.format(3)).exists() and not leftovers(ckpt)
    assert [json.loads(ln)["step"] for ln in metrics.read_text().splitlines()] == [1, 2, 3]
    # between checkpoints: the last stage's ranks stop at once, the launcher ends the others
    proc = launch(plan, "--steps", "5")
    assert_run_failed(proc, "the loss is nan at step 3", same_on_every_rank=False)
    proc = launch(plan, "--steps", "4", "--metrics", str(tmp_path / "through.jsonl"),
                  "--allow-nonfinite-loss")
    assert proc.returncode == 0, _context(proc)
    losses = losses_of(tmp_path / "through.jsonl")
    assert len(losses) == 4 and math.isnan(losses[2]) and math.isfinite(losses[0])


# ---- checkpoint.py in-process: manifests, verification, pruning ---------------------------------

def _write(root: Path, step: int, keep: int = 2, value: float = 0.0,
           info: dict[str, object] | None = None) -> list[StageFile]:
    files = [save_stage(root, step, k, {f"w{k}": torch.full((64, 64), value + step)}, {})
             for k in range(2)]
    write_manifest(root, step, 2, {f.stage: f for f in files},
                   info or {"model": "m", "graph_hash": "g", "optimizer": "adam",
                            "global_batch_size": 8}, keep)
    return files


def _choose(root: Path, warnings: list[str], **kw: object) -> int:
    """The step choose_resume picks (as the plan of model "m", graph "g", would)."""
    args: dict[str, object] = dict(resume=True, restarted=False, steps=100, optimizer="adam",
                                   global_batch_size=8, graph_hash="g", model="m")
    args.update(kw)
    found = choose_resume(root, warn=warnings.append, **args)  # type: ignore[arg-type]
    assert found is not None
    return found.step


def test_manifest_records_what_was_written(tmp_path: Path) -> None:
    files = _write(tmp_path, 1)
    manifest = json.loads((tmp_path / STEP.format(1) / "manifest.json").read_text())
    assert manifest["format"] == FORMAT and manifest["version"] == 2
    assert manifest["graph_hash"] == "g" and manifest["model"] == "m"
    for f in files:
        path = tmp_path / STEP.format(1) / f.name
        assert manifest["files"][f.name] == {"size": path.stat().st_size,
                                             "sha256": sha256_file(path)}


def test_pruning_keeps_the_newest_good_checkpoints(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        _write(tmp_path, step, keep=3)
    damage(tmp_path / STEP.format(3) / "stage-1.pt")
    _write(tmp_path, 4, keep=2)
    # 4 and the newest good before it (2) are kept; the damaged 3 and the surplus 1 are gone
    assert sorted(p.name for p in tmp_path.iterdir()) == [STEP.format(2), STEP.format(4)]
    warnings: list[str] = []
    assert _choose(tmp_path, warnings) == 4 and not warnings


def test_a_new_checkpoint_that_does_not_verify_prunes_nothing(tmp_path: Path) -> None:
    _write(tmp_path, 1)
    _write(tmp_path, 2)
    files = [save_stage(tmp_path, 3, k, {"w": torch.full((64, 64), 3.0)}, {}) for k in range(2)]
    wrong = {f.stage: StageFile(f.stage, f.name, f.size, "0" * 64) for f in files}
    with pytest.raises(CheckpointError, match="does not read back as written"):
        write_manifest(tmp_path, 3, 2, wrong, {}, keep=1)
    assert good(tmp_path, 1) and good(tmp_path, 2)


def test_resume_falls_back_warns_and_refuses(tmp_path: Path) -> None:
    _write(tmp_path, 1)
    _write(tmp_path, 2)
    damage(tmp_path / STEP.format(2) / "stage-0.pt")
    warnings: list[str] = []
    assert _choose(tmp_path, warnings) == 1
    assert len(warnings) == 1 and STEP.format(2) in warnings[0]
    with pytest.raises(CheckpointError, match="is of model 'm'"):
        _choose(tmp_path, [], graph_hash="other", model="n")
    warnings = []
    assert _choose(tmp_path, warnings, graph_hash="other", allow_other_model=True) == 1
    assert any("--allow-other-model" in w for w in warnings)
    damage(tmp_path / STEP.format(1) / "stage-1.pt")
    with pytest.raises(CheckpointError, match="no checkpoint in .* is intact") as info:
        _choose(tmp_path, [])
    assert info.value.hint


def test_version_1_manifests_still_read_with_sizes_only(tmp_path: Path) -> None:
    _write(tmp_path, 1)
    path = tmp_path / STEP.format(1) / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["version"] = 1
    manifest["files"] = {n: e["size"] for n, e in manifest["files"].items()}
    path.write_text(json.dumps(manifest))
    warnings: list[str] = []
    assert _choose(tmp_path, warnings) == 1
    assert len(warnings) == 1 and "only its file sizes were checked" in warnings[0]
