"""Run metrics as typed data (partc.plans.run_metrics) and `partc show --metrics`: the reader's
round trip and errors, and the measured-vs-predicted table and picture on this repository's
checked-in example plan. The metrics lines here are built with the same dataclasses the launch
runtime writes them with (tests/run/test_launch.py writes them with a real run)."""
from __future__ import annotations

import hashlib
import json
import math
import re
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT
from partc_process import run_partc

from partc.plans.run_metrics import (
    CLOCK_CPU,
    CLOCK_CUDA,
    MEMORY_CPU_PROFILER,
    MEMORY_NONE,
    RunMetrics,
    RunMetricsError,
    StageMetrics,
    StepMetrics,
)

PARTC = str(Path(sys.executable).parent / "partc")
MLP = ROOT / "examples" / "plans" / "mlp"  # 2 stages, 1 replica


def step(n: int, stages: int = 2, step_s: float = 0.01, peak: int | None = None,
         cpu: bool = True) -> StepMetrics:
    rows = tuple(StageMetrics(index=k, pipeline_rank=k, forward_s=0.001 * (k + 1) * n,
                              backward_s=0.002 * (k + 1), p2p_s=0.0005, optimizer_s=0.0003,
                              ddp_allreduce_s=0.0, tied_sync_s=0.0,
                              peak_memory_bytes=peak and peak + k,
                              forward_cpu_s=0.0009 * (k + 1) * n if cpu else None,
                              backward_cpu_s=0.0018 * (k + 1) if cpu else None,
                              optimizer_cpu_s=0.0002 if cpu else None,
                              between_cpu_s=0.0001 if cpu else None) for k in range(stages))
    return StepMetrics(step=n, loss=1.0 / n, step_s=step_s * n, samples_per_s=100.0 / n,
                       stage_forward_s=tuple(r.forward_s for r in rows),
                       stage_backward_s=tuple(r.backward_s for r in rows), stages=rows,
                       num_microbatches=1, replicas=1, clock=CLOCK_CPU,
                       memory_method=MEMORY_NONE if peak is None else MEMORY_CPU_PROFILER)


def write(path: Path, steps: list[StepMetrics]) -> Path:
    path.write_text("".join(s.to_json() + "\n" for s in steps))
    return path


def test_round_trip_and_summaries(tmp_path: Path) -> None:
    steps = [step(1), step(2, peak=5 << 20), step(3), step(4), step(5)]
    run = RunMetrics.load(write(tmp_path / "m.jsonl", steps))
    assert run.steps == tuple(steps) and run.num_stages == 2
    # the first step (warm-up) and the profiled one are left out of the time summaries
    assert [s.step for s in run.timed_steps()] == [3, 4, 5]
    assert run.median_step_s() == pytest.approx(0.04)
    assert RunMetrics.load(write(tmp_path / "skew.jsonl", [*steps, step(20)])).mean_step_s() \
        == pytest.approx((0.03 + 0.04 + 0.05 + 0.2) / 4)  # the mean, not the median
    first, second = run.stage_summaries()
    assert first.forward_s == pytest.approx(0.004) and second.forward_s == pytest.approx(0.008)
    assert first.forward_cpu_s == pytest.approx(0.0036)
    assert second.backward_cpu_s == pytest.approx(0.0036)
    # the stage's own work as a prediction prices a pass: with the runtime's CPU between passes
    assert first.between_cpu_s == pytest.approx(0.0001)
    assert first.compute_s(shared_core=True) == pytest.approx((0.0037, 0.0019, 0.0002))
    assert first.compute_s(shared_core=False) == pytest.approx((0.0041, 0.0021, 0.0003))
    # a line without CPU times (CUDA, earlier partc) reads as None, and so does the summary
    legacy = json.loads(step(6).to_json())
    for row in legacy["stages"]:
        for key in ("forward_cpu_s", "backward_cpu_s", "optimizer_cpu_s", "between_cpu_s"):
            del row[key]
    mixed = RunMetrics.load(write(tmp_path / "l.jsonl", steps))
    mixed = RunMetrics(steps=(*mixed.steps, StepMetrics.from_dict(legacy)))
    assert mixed.steps[-1].stages[0].forward_cpu_s is None
    assert mixed.stage_summaries()[0].forward_cpu_s is None
    assert (first.peak_memory_bytes, second.peak_memory_bytes) == (5 << 20, (5 << 20) + 1)
    assert run.memory_method == MEMORY_CPU_PROFILER
    # a step written twice (a restart) counts with its last line
    again = RunMetrics.load(write(tmp_path / "r.jsonl", [*steps, step(3, step_s=1.0)]))
    assert len(again.steps) == 5 and again.steps[2].step_s == pytest.approx(3.0)


def test_a_pass_takes_its_posts_as_its_device_prices_them(tmp_path: Path) -> None:
    """A run of partc since 2026-12-06 measures its p2p posts' CPU apart (`p2p_cpu_s`: gloo's
    copy of a sent tensor's bytes is in it, which the link prices). A pass's own work takes the
    posts at the device's price where it prices them apart (`p2p_post_cpu_s`), as measured where
    its microbatch_overhead_s holds them, and a run that counted them in `between_cpu_s`
    (earlier partc) as it is."""
    posted = replace(step(3), stages=tuple(
        replace(s, p2p_cpu_s=0.0004) for s in step(3).stages))
    run = RunMetrics.load(write(tmp_path / "p.jsonl", [posted]))
    s = run.steps[0].stages[0]
    assert s.p2p_cpu_s == pytest.approx(0.0004)  # written and read back
    assert run.stage_summaries()[0].p2p_cpu_s == pytest.approx(0.0004)
    # the forward's CPU 0.0027 + between 0.0001, then the posts
    assert s.compute_s(shared_core=True)[0] == pytest.approx(0.0028 + 0.0004)  # type: ignore
    assert s.compute_s(shared_core=True, post_s=0.00005)[0] == pytest.approx(  # type: ignore
        0.0028 + 0.00005)
    earlier = step(3).stages[0]  # no p2p_cpu_s: its between_cpu_s held them
    assert earlier.compute_s(shared_core=True, post_s=0.00005)[0] == pytest.approx(  # type: ignore
        0.0028)


def test_load_errors_name_the_file_and_hint(tmp_path: Path) -> None:
    cases: dict[str, str | None] = {
        "not found": None,
        "has no steps": "\n\n",
        "is not a partc metrics line": "{not json\n",
        "missing key": json.dumps({"version": 1, "step": 1, "stages": []}) + "\n",
        "written by an older partc": json.dumps({"step": 1, "loss": 1.0}) + "\n",
        "mixes runs": step(1).to_json() + "\n" + step(2, stages=3).to_json() + "\n",
    }
    for needle, text in cases.items():
        path = tmp_path / f"{len(needle)}.jsonl"
        if text is not None:
            path.write_text(text)
        with pytest.raises(RunMetricsError, match=needle) as info:
            RunMetrics.load(path)
        assert info.value.hint and "\n" not in info.value.one_line()


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return run_partc(*args)


def test_show_with_metrics_table_and_picture(tmp_path: Path) -> None:
    metrics = write(tmp_path / "m.jsonl", [step(1), step(2, peak=3 << 20), step(3), step(4)])
    png, page = tmp_path / "r.png", tmp_path / "r.html"
    proc = run("show", str(MLP), "--metrics", str(metrics), "--png", str(png), "--html",
               str(page))
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "memory per device" in out  # the plan's own summary is still there
    assert "measured (4 step(s); medians over step(s) 3..4" in out
    assert "iteration 35.0 ms (median)" in out
    header = next(ln for ln in out.splitlines() if ln.lstrip().startswith("stage rank |"))
    for column in ("fwd ms", "bwd ms", "p2p ms", "opt ms", "sync ms", "peak MiB", "pred"):
        assert column in header
    table = out.split(header + "\n")[1].splitlines()[:2]
    assert [ln.split()[0] for ln in table] == ["0", "1"]
    assert "Peak memory: torch.profiler" in out
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    # the measured bars change the picture; without metrics it is the plan's alone
    plain = tmp_path / "plain.png"
    assert run("show", str(MLP), "--png", str(plain)).returncode == 0
    assert plain.read_bytes() != data
    assert "measured (4 step(s)" in page.read_text()


def test_show_refuses_metrics_of_another_plan(tmp_path: Path) -> None:
    metrics = write(tmp_path / "three.jsonl", [step(1, stages=3), step(2, stages=3)])
    proc = run("show", str(MLP), "--metrics", str(metrics))
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "is a run of 3 stage(s)" in lines[0] and "has 2" in lines[0]
    assert "hint:" in lines[0]
    missing = run("show", str(MLP), "--metrics", str(tmp_path / "none.jsonl"))
    assert missing.returncode == 2 and "not found" in missing.stderr


def test_replay_with_the_runs_stage_times() -> None:
    """`replay_measured` re-simulates the plan's schedule with a run's stage times: with the
    predicted times it is the prediction; slower stages make it slower. Where ranks share a core
    (their wall times hold their core-mates' turns) it replays the CPU times, which the simulator
    shares out itself, and nothing for a run without them (CUDA, earlier metrics files)."""
    from dataclasses import replace

    from partc.plans.plan import load_plan
    from partc.plans.report import replay, replay_measured

    plan = load_plan(MLP)
    optimizer = plan.predicted.optimizer_s

    def run_of(scale: float, cpu: float | None = None) -> RunMetrics:
        rows = tuple(StageMetrics(index=k, pipeline_rank=st.rank, forward_s=st.forward_s * scale,
                                  backward_s=st.backward_s * scale, p2p_s=0.0,
                                  optimizer_s=optimizer[st.rank], ddp_allreduce_s=0.0,
                                  tied_sync_s=0.0, peak_memory_bytes=None,
                                  forward_cpu_s=None if cpu is None else st.forward_s * cpu,
                                  backward_cpu_s=None if cpu is None else st.backward_s * cpu,
                                  optimizer_cpu_s=None if cpu is None else optimizer[st.rank])
                     for k, st in enumerate(plan.stages))
        steps = tuple(StepMetrics(step=n, loss=1.0, step_s=0.1, samples_per_s=1.0,
                                  stage_forward_s=(), stage_backward_s=(), stages=rows,
                                  num_microbatches=plan.training.shape.num_microbatches,
                                  replicas=1, clock=CLOCK_CPU, memory_method=MEMORY_NONE)
                      for n in (1, 2, 3))
        return RunMetrics(steps=steps)

    same = replay_measured(plan, run_of(1.0))
    assert same is not None
    assert same.iteration_s == pytest.approx(replay(plan).iteration_s, rel=1e-9)
    slower = replay_measured(plan, run_of(1.5))
    assert slower is not None and slower.iteration_s > same.iteration_s
    # on one process per core the wall times are replayed, whatever the CPU times say
    assert replay_measured(plan, run_of(1.0, cpu=3.0)).iteration_s == \
        pytest.approx(same.iteration_s, rel=1e-9)  # type: ignore[union-attr]
    shared = replace(plan, cluster=replace(plan.cluster, cores_per_node=1))
    assert replay_measured(shared, run_of(1.0)) is None
    # twice the wall times (the core-mate's turns), the work as predicted: the prediction
    cpu = replay_measured(shared, run_of(2.0, cpu=1.0))
    assert cpu is not None
    assert cpu.iteration_s == pytest.approx(replay(shared).iteration_s, rel=1e-9)
    heavier = replay_measured(shared, run_of(2.0, cpu=1.3))
    assert heavier is not None and heavier.iteration_s > cpu.iteration_s
    with pytest.raises(RunMetricsError):
        replay_measured(plan, RunMetrics(steps=tuple(step(n, stages=3) for n in (1, 2))))


# ---- hostile and mistaken metrics files -------------------------------------------------------

def _line(n: int = 2, **changes: Any) -> str:
    """step(n)'s line with top-level keys replaced, or a stage's (key "k.name")."""
    row = json.loads(step(n).to_json())
    for key, value in changes.items():
        if "." in key:
            k, name = key.split(".")
            row["stages"][int(k)][name] = value
        else:
            row[key] = value
    return json.dumps(row)


# Values no run writes: each was read as a number (or ignored) and drawn, or crashed the report
# (exit 3), or, for --calibrate-from, scaled the costs into a plan (a NaN forward time did).
BAD_VALUES = {
    "nan-time": (_line(**{"0.forward_s": math.nan}), "stages[0].forward_s is nan"),
    "infinite-time": (_line(**{"1.backward_s": math.inf}), "stages[1].backward_s is inf"),
    "negative-time": (_line(**{"0.p2p_s": -0.001}), "stages[0].p2p_s is -0.001"),
    "absurd-time": (_line(**{"0.forward_s": 1e300}), "stages[0].forward_s is 1e+300, beyond"),
    "nan-cpu-time": (_line(**{"1.backward_cpu_s": math.nan}), "stages[1].backward_cpu_s is nan"),
    "boolean-time": (_line(**{"0.forward_s": True}), "stages[0].forward_s is true, not a number"),
    "string-time": (_line(**{"0.forward_s": "0.001"}), 'forward_s is "0.001", not a number'),
    "zero-step-time": (_line(step_s=0.0), "step_s is 0"),
    "negative-step-time": (_line(step_s=-1.0), "step_s is -1.0"),
    "step-overflowing-to-infinity": (_line().replace('"step": 2', '"step": 1e400'),
                                     "step is Infinity"),
    "fractional-step": (_line(step=2.5), "step is 2.5"),
    # was skipped as a line cut short (Python's int() limit raised a ValueError in json.loads)
    "step-of-5000-digits": (_line().replace('"step": 2', '"step": ' + "9" * 5000),
                            "holds an integer of 5000 digits"),
    "fractional-peak": (_line(**{"0.peak_memory_bytes": 1.5e9}),
                        "peak_memory_bytes is 1500000000.0"),
    "negative-peak": (_line(**{"0.peak_memory_bytes": -5}), "peak_memory_bytes is -5"),
    "absurd-peak": (_line(**{"0.peak_memory_bytes": 10**30}), "beyond any run's"),
    "stage-index-out-of-range": (_line(**{"1.index": 7}), "stages[1].index is 7, not 1"),
    "negative-rank": (_line(**{"1.pipeline_rank": -1}), "stages[1].pipeline_rank is -1"),
    "unknown-clock": (_line(clock="sundial"), 'clock is "sundial"'),
    "unknown-memory-method": (_line(memory_method="guess"), 'memory_method is "guess"'),
    "non-boolean-traced": (_line(traced="yes"), 'traced is "yes"'),
    "no-stages": (_line(stages=[]), "stages is not a non-empty list"),
    "stage-not-an-object": (_line(stages=[5, 6]), "stages[0] is not a JSON object"),
    "version-0": (_line(version=0), "version is 0"),
    "null-line": ("null", "not a JSON object"),
    "deeply-nested": ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
}


@pytest.mark.parametrize("case", BAD_VALUES)
def test_values_no_run_writes_are_refused(case: str, tmp_path: Path) -> None:
    text, needle = BAD_VALUES[case]
    path = tmp_path / "m.jsonl"
    path.write_text(step(1).to_json() + "\n" + text + "\n")
    with pytest.raises(RunMetricsError, match=re.escape(needle)) as info:
        RunMetrics.load(path)
    assert info.value.hint and "\n" not in info.value.one_line()


def test_loss_of_a_diverged_run_is_read() -> None:
    """A NaN loss is what a diverging run measured: read, not refused."""
    row = json.loads(_line(loss=math.nan))
    assert math.isnan(StepMetrics.from_dict(row).loss)


def _one_error_line(proc: subprocess.CompletedProcess[str], needle: str) -> None:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("partc: error: "), proc.stderr
    assert needle in lines[0] and "(hint: " in lines[0], lines[0]


@pytest.mark.parametrize("case", ["nan-time", "zero-step-time", "step-overflowing-to-infinity",
                                  "deeply-nested"])
def test_show_refuses_bad_values_in_one_line(case: str, tmp_path: Path) -> None:
    """These crashed `partc show --metrics` with an internal error (exit 3)."""
    text, needle = BAD_VALUES[case]
    path = tmp_path / "m.jsonl"
    path.write_text(step(1).to_json() + "\n" + text + "\n")
    _one_error_line(run("show", str(MLP), "--metrics", str(path)), needle)


def test_show_refuses_a_stage_on_a_rank_the_plan_does_not_have(tmp_path: Path) -> None:
    """Stage 1 on pipeline rank 9 (the plan has ranks 0 and 1) was an IndexError (exit 3)."""
    path = tmp_path / "m.jsonl"
    path.write_text(_line(1, **{"1.pipeline_rank": 9}) + "\n" + _line(2) + "\n")
    with pytest.raises(RunMetricsError, match="mixes runs that placed the stages"):
        RunMetrics.load(path)
    path.write_text("".join(_line(n, **{"1.pipeline_rank": 9}) + "\n" for n in (1, 2)))
    _one_error_line(run("show", str(MLP), "--metrics", str(path)),
                    "ran stage 1 on pipeline rank 9, plan")


def test_a_line_cut_short_by_a_killed_run_is_skipped_with_a_warning(tmp_path: Path) -> None:
    """A run killed while writing a line leaves it cut short: last in the file, or, when a
    resumed run appended to the same file, glued in front of the resumed run's first line.
    The complete lines are used and a note says what was skipped; a cut-short line with nothing
    complete is no run, and garbage is still an error."""
    lines = [step(n).to_json() for n in (1, 2, 3, 4)]
    last = tmp_path / "last.jsonl"
    last.write_text("\n".join(lines[:3]) + "\n" + lines[3][:100])
    got = RunMetrics.load(last)
    assert [s.step for s in got.steps] == [1, 2, 3]
    assert len(got.notes) == 1 and f"{last}:4, the last line, is cut short" in got.notes[0]
    # killed while writing step 3, resumed from step 2's checkpoint: step 3 again, then 4
    glued = tmp_path / "glued.jsonl"
    glued.write_text("\n".join(lines[:2]) + "\n" + lines[2][:150] + "\n".join(lines[2:]) + "\n")
    got = RunMetrics.load(glued)
    assert got.steps == tuple(step(n) for n in (1, 2, 3, 4))
    assert len(got.notes) == 1 and f"{glued}:3 starts with a line cut short" in got.notes[0]
    only = tmp_path / "only.jsonl"
    only.write_text(lines[0][:80])
    with pytest.raises(RunMetricsError, match="has no steps: its only step is cut short"):
        RunMetrics.load(only)
    # killed while writing step 2, resumed from step 1: launch ends the cut line first
    middle = tmp_path / "middle.jsonl"
    middle.write_text("\n".join([lines[0], lines[1][:90], *lines[1:]]) + "\n")
    got = RunMetrics.load(middle)
    assert got.steps == tuple(step(n) for n in (1, 2, 3, 4))
    assert len(got.notes) == 1 and f"{middle}:2 is cut short" in got.notes[0]
    for name, text in {"garbage-in-the-middle": "\n".join([lines[0], "hello", *lines[1:]]),
                       "garbage-at-the-end": "\n".join(lines) + "\nhello"}.items():
        bad = tmp_path / f"{name}.jsonl"
        bad.write_text(text)
        with pytest.raises(RunMetricsError, match="is not a partc metrics line"):
            RunMetrics.load(bad)
    proc = run("show", str(MLP), "--metrics", str(last))
    assert proc.returncode == 0, proc.stderr
    warnings = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(warnings) == 1 and warnings[0].startswith("partc: warning: ")
    assert "is cut short" in warnings[0]
    assert "measured (3 step(s)" in proc.stdout


def test_a_file_without_newlines_is_refused_without_reading_it_whole(tmp_path: Path) -> None:
    """A binary without newlines as the metrics file (here 65 MiB of zeros, sparse): one line
    after MAX_LINE_BYTES, not the whole memory (the process is capped at 1 GiB to show it).
    /dev/zero, which never ends, is refused before it is read (a device, not a file)."""
    import resource

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))

    zeros = tmp_path / "zeros.jsonl"
    with open(zeros, "wb") as f:
        f.truncate(65 << 20)
    proc = subprocess.run([PARTC, "show", str(MLP), "--metrics", str(zeros)],
                          capture_output=True, text=True, cwd=ROOT, timeout=120, preexec_fn=cap)
    _one_error_line(proc, f"{zeros}:1 is longer than 64 MiB")
    proc = subprocess.run([PARTC, "show", str(MLP), "--metrics", "/dev/zero"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120, preexec_fn=cap)
    _one_error_line(proc, "metrics file /dev/zero is a character device, not a file")


def test_show_with_only_warm_up_and_profiled_steps_says_they_are_not_timed(
        tmp_path: Path) -> None:
    """Medians over the warm-up and a profiled step read as the plan's prediction being far
    off; the summary says they are all there is."""
    only = write(tmp_path / "w.jsonl", [step(1), step(2, peak=3 << 20)])
    proc = run("show", str(MLP), "--metrics", str(only))
    assert proc.returncode == 0, proc.stderr
    assert "NOT TIMED: every step of this run is its warm-up (step 1) or profiled" in proc.stdout
    timed = write(tmp_path / "t.jsonl", [step(1), step(2, peak=3 << 20), step(3)])
    assert "NOT TIMED" not in run("show", str(MLP), "--metrics", str(timed)).stdout


@pytest.mark.parametrize("change, needle", [
    ({"num_microbatches": 4}, "is a run of 4 micro-batches per step, plan"),
    ({"replicas": 2}, "is a run of 2 replicas, plan"),
    ({"clock": CLOCK_CUDA}, "is a run on CUDA devices, plan"),
])
def test_show_refuses_a_run_of_another_shape(change: dict[str, Any], needle: str,
                                             tmp_path: Path) -> None:
    """A run with the plan's stage count but other micro-batches, replicas or device kind was
    set beside the plan's prediction as if it were a run of it."""
    path = tmp_path / "m.jsonl"
    path.write_text("".join(_line(n, **change) + "\n" for n in (1, 2, 3)))
    _one_error_line(run("show", str(MLP), "--metrics", str(path)), needle)


def _run_of(plan: Path, path: Path, steps: tuple[int, ...] = (1, 2, 3)) -> Path:
    """Metrics lines naming `plan` (its path and its bytes' sha256), as launch writes them."""
    sha = hashlib.sha256(plan.read_bytes()).hexdigest()
    return write(path, [replace(step(n), plan=str(plan), plan_sha256=sha) for n in steps])


def test_show_compares_the_plan_the_run_names(tmp_path: Path) -> None:
    """Each line names the plan launched (path, sha256 of its bytes). Only the stage count was
    compared, so a run of another model, precision or cut with as many stages was shown as a
    run of this plan. Now: a run of this plan's bytes (wherever it lies) is shown; one of
    another plan file with the same model, shape, devices and stages (a recompile, a calibrated
    plan) with a warning; one of a plan that differs is refused, saying how; one whose plan is
    gone or changed, so that nothing can be told, with a warning."""
    ran = tmp_path / "ran"
    shutil.copytree(MLP, ran)
    metrics = _run_of(ran / "plan.yaml", tmp_path / "m.jsonl")
    text = (ran / "plan.yaml").read_text()

    def plan_with(name: str, new_text: str) -> Path:
        shutil.copytree(ran, tmp_path / name)
        (tmp_path / name / "plan.yaml").write_text(new_text)
        return tmp_path / name

    for same in (ran, MLP):  # the plan itself, and a copy of its bytes elsewhere
        proc = run("show", str(same), "--metrics", str(metrics))
        assert proc.returncode == 0 and not proc.stderr.strip(), proc.stderr
    recompiled = plan_with("recompiled", text + "# compiled again\n")
    proc = run("show", str(recompiled), "--metrics", str(metrics))
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.startswith("partc: warning: ") and len(proc.stderr.splitlines()) == 1
    assert "another plan file with the same model, shape, devices and stages" in proc.stderr
    assert "measured (3 step(s)" in proc.stdout
    for name, new_text, needle in (
            ("model", text.replace("graph_hash: sha256:b", "graph_hash: sha256:0"),
             "another model (mlp, graph sha256:b"),
            ("precision", text.replace("precision: fp32", "precision: bf16-mixed"),
             "trained at precision fp32, not bf16-mixed"),
            ("cut", text.replace("  - layers.2\n", "  - layers.9\n", 1),
             "its stage 0 holds other modules")):
        other = plan_with(name, new_text)
        _one_error_line(run("show", str(other), "--metrics", str(metrics)),
                        f"is a run of another plan, {ran / 'plan.yaml'}: {needle}")
    gone = _run_of(tmp_path / "model" / "plan.yaml", tmp_path / "gone.jsonl")
    shutil.rmtree(tmp_path / "model")
    proc = run("show", str(MLP), "--metrics", str(gone))
    assert proc.returncode == 0, proc.stderr
    assert "is gone or changed since" in proc.stderr and len(proc.stderr.splitlines()) == 1
    mixed = tmp_path / "mixed.jsonl"  # two launches of two plans appended to one file
    mixed.write_text(metrics.read_text() + _run_of(recompiled / "plan.yaml", tmp_path / "r.jsonl",
                                                   steps=(4, 5)).read_text())
    _one_error_line(run("show", str(MLP), "--metrics", str(mixed)), "mixes runs of 2 plans")


def test_launch_ends_a_line_a_killed_run_cut_short_before_appending(tmp_path: Path) -> None:
    """The metrics file a killed run left with its last line unfinished: a resumed run's first
    line goes on a line of its own, so only the cut-short part is lost."""
    import io

    from partc.options import TrainOptions
    from partc.plans.plan import load_plan
    from partc.run.reporting import Reporter

    lines = [step(n).to_json() for n in (1, 2)]
    path = tmp_path / "m.jsonl"
    path.write_text(lines[0] + "\n" + lines[1][:100])
    reporter = Reporter(load_plan(MLP), TrainOptions(steps=3, metrics=path), 1,
                        io.StringIO(), io.StringIO())
    for n in (2, 3):
        reporter.step(step(n))
    reporter.close()
    got = RunMetrics.load(path)
    assert got.steps == tuple(step(n) for n in (1, 2, 3))
    assert len(got.notes) == 1 and f"{path}:2 is cut short" in got.notes[0]
    # a file that ends its last line, or an empty one, gets nothing added
    for text in (lines[0] + "\n", ""):
        path.write_text(text)
        Reporter(load_plan(MLP), TrainOptions(steps=3, metrics=path), 1, io.StringIO(),
                 io.StringIO()).close()
        assert path.read_text() == text
