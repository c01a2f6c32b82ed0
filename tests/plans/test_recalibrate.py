"""The closed loop (partc.plans.recalibrate, `partc compile --calibrate-from`): a real 2-process
gloo launch of a small plan writes metrics naming its plan; a compile calibrated from them
predicts the measured stage times for the same cut, writes the corrected costs as profile.yaml,
checks as current and diffs as a change of cost source; and every run that cannot calibrate the
compile is refused with a one-line error."""
from __future__ import annotations

import dataclasses
import json
import math
import shutil
import statistics
from pathlib import Path
from typing import Any, Callable, Sequence

import pytest
import yaml
from conftest import EXAMPLES
from partc_process import run_partc

from partc.emit.check import check_plan
from partc.emit.compile import CompileOptions, compile_model
from partc.files import sha256_file
from partc.frontend.capture import CaptureResult, capture_graph
from partc.hardware.configs import load_cluster
from partc.options import SearchOptions, TrainingConfig
from partc.plans.plan import load_plan
from partc.plans.recalibrate import (
    MIN_RUN_SPREAD_STEPS,
    MIN_SPREAD_STEPS,
    CalibrationError,
    RunOfPlan,
    load_launched_run,
    read_run_of_plan,
    read_runs_of_plan,
    unit_samples_of_maxima,
)
from partc.plans.run_metrics import (
    CLOCK_CUDA,
    MEMORY_CPU_PROFILER,
    RunMetrics,
    RunMetricsError,
    StepMetrics,
)
from partc.progress import Progress
from partc.solve.stage_problem import gradient_add_s

CPU4 = load_cluster("cpu-4")
MLP = EXAMPLES / "mlp.py"
STEPS = 4  # step 1 is warm-up and one is profiled (CPU peak memory): the other two are timed
# The shape both compiles pin, so the calibrated compile cuts the same stages (uniform: cheap and
# deterministic) and its predictions can be compared with the run stage by stage.
SHAPE = SearchOptions(stages=2, replicas=1, num_microbatches=4, strategy="uniform")


def _run_warnings(stderr: str) -> list[str]:
    """partc's warnings but the one that says the shipped device config was calibrated on
    another CPU (it depends on the machine the tests run on)."""
    return [x for x in stderr.splitlines()
            if x.startswith("partc: warning: ") and "was calibrated on" not in x]


def run_of(metrics: Path | Sequence[Path] | None) -> tuple[RunOfPlan, ...]:
    """Metrics files as compile takes them (the CLI reads them before capturing)."""
    if metrics is None:
        return ()
    return read_runs_of_plan([metrics] if isinstance(metrics, Path) else metrics)


def compile_mlp(out: Path, calibrate_from: Path | Sequence[Path] | None = None,
                model: Path = MLP) -> Path:
    compile_model(model, CPU4, out, CompileOptions(batch_size=16, search=SHAPE, costs="analytic",
                                                   calibrate_from=run_of(calibrate_from)))
    return out / "plan.yaml"


@dataclasses.dataclass(frozen=True)
class Launched:
    plan: Path
    run: Path


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> Launched:
    """One real launch for the whole module: the analytic plan of the MLP, 4 steps, metrics."""
    tmp = tmp_path_factory.mktemp("launched")
    plan = compile_mlp(tmp / "a")
    run = tmp / "run.jsonl"
    result = run_partc("launch", str(plan), "--steps", str(STEPS), "--metrics", str(run))
    assert result.returncode == 0, result.stderr[-3000:]
    return Launched(plan=plan, run=run)


@pytest.fixture(scope="module")
def mlp_capture() -> CaptureResult:
    return capture_graph(MLP, 2, onnx=False)


def test_metrics_name_their_plan(launched: Launched) -> None:
    run = RunMetrics.load(launched.run)
    plan, sha = run.launched_plan()
    assert plan == launched.plan.resolve() and sha == sha256_file(launched.plan)
    assert all(s.plan == str(plan) and s.plan_sha256 == sha for s in run.steps)


def test_old_metrics_lines_read_without_plan(launched: Launched, tmp_path: Path) -> None:
    """Lines written before the plan keys existed read back with None, and the round trip of a
    line without them leaves them out."""
    rows = [json.loads(x) for x in launched.run.read_text().splitlines()]
    for row in rows:
        del row["plan"], row["plan_sha256"]
    old = tmp_path / "old.jsonl"
    old.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = RunMetrics.load(old)
    assert all(s.plan is None and s.plan_sha256 is None for s in run.steps)
    assert "plan" not in run.steps[0].to_dict()
    with pytest.raises(RunMetricsError, match="does not name the plan"):
        run.launched_plan()


def test_the_posts_come_back_at_their_price_not_with_the_copies(launched: Launched,
                                                                tmp_path: Path) -> None:
    """The run measured its p2p posts' CPU apart from the CPU between passes (gloo copies a
    send's bytes in the post, which the link prices); a device that prices the posts
    (p2p_post_cpu_s) gets them back in each pass at that price, not as measured (a device
    without it, as measured: test_calibrated_compile_predicts_the_measured_stage_times)."""
    run = RunMetrics.load(launched.run)
    measured = run.stage_summaries(run.strictly_timed_steps())
    assert all(m.p2p_cpu_s is not None and m.p2p_cpu_s > 0 for m in measured)
    posts = 50e-6
    cluster = dataclasses.replace(CPU4, device=dataclasses.replace(CPU4.device,
                                                                   p2p_post_cpu_s=posts))
    compile_model(MLP, cluster, tmp_path / "p", CompileOptions(
        batch_size=16, search=SHAPE, costs="analytic", calibrate_from=run_of(launched.run)))
    plan = load_plan(tmp_path / "p" / "plan.yaml")
    for stage, m in zip(plan.stages, measured, strict=True):
        assert m.between_cpu_s is not None
        # two stages: each pass receives or sends one tensor
        assert stage.forward_s == pytest.approx(m.forward_s + m.between_cpu_s + posts, abs=2e-9)
        assert stage.backward_s == pytest.approx(m.backward_s + m.between_cpu_s + posts,
                                                 abs=2e-9)


def test_calibrated_compile_predicts_the_measured_stage_times(launched: Launched,
                                                              tmp_path: Path) -> None:
    plan_path = compile_mlp(tmp_path / "b", calibrate_from=launched.run)
    plan = load_plan(plan_path)
    old = load_plan(launched.plan)
    assert [s.modules for s in plan.stages] == [s.modules for s in old.stages]  # the same cut
    assert plan.training.shape == old.training.shape
    run = RunMetrics.load(launched.run)
    measured = run.stage_summaries(run.strictly_timed_steps())
    for stage, m in zip(plan.stages, measured, strict=True):
        # equal up to plan.yaml's 1 ns and the profile's 12 significant digits: each pass as it
        # ran, with the runtime's CPU between passes and in the p2p posts (which this device's
        # overhead prices together: it has no p2p_post_cpu_s)
        assert m.between_cpu_s is not None and m.between_cpu_s > 0
        assert m.p2p_cpu_s is not None and m.p2p_cpu_s > 0
        host = m.between_cpu_s + m.p2p_cpu_s
        assert stage.forward_s == pytest.approx(m.forward_s + host, abs=2e-9)
        assert stage.backward_s == pytest.approx(m.backward_s + host, abs=2e-9)
    # plan.yaml names the profile with its sha256; the profile records where it came from
    profile = plan_path.parent / "profile.yaml"
    assert plan.costs.source == "profile" and plan.costs.profile == "profile.yaml"
    assert plan.costs.profile_sha256 == sha256_file(profile)
    source = yaml.safe_load(profile.read_text())
    record = source["calibration"]["calibrated_from"]
    assert source["kind"] == "analytic"  # what distributed the time over nodes: kept
    assert record["runs"] == [{"run": str(launched.run.resolve()),
                               "steps": [s.step for s in run.strictly_timed_steps()]}]
    assert record["plan"] == str(launched.plan.resolve())
    assert record["plan_sha256"] == sha256_file(launched.plan)
    assert len(record["runs"][0]["steps"]) >= 1 and len(record["stages"]) == 2
    assert all(s["forward_factor"] > 0 and s["backward_factor"] > 0 for s in record["stages"])
    # the optimizer step: one factor, the ranks' measured steps over their price (the launched
    # plan's, the same cut on the same device), which every step of the new plan is priced at
    own = [m.compute_s(False) for m in measured]  # 2 processes on cpu-4's 2 cores: wall times
    step = record["optimizer"]
    assert step["ranks"] == [0, 1]
    assert step["priced_s"] == pytest.approx(list(old.predicted.optimizer_s), rel=1e-8)
    assert step["measured_s"] == pytest.approx([w[2] for w in own if w is not None], rel=1e-9)
    factor = sum(step["measured_s"]) / sum(step["priced_s"])
    assert source["optimizer_factor"] == step["factor"] == pytest.approx(factor, rel=1e-9)
    assert list(plan.predicted.optimizer_s) == pytest.approx(
        [x * factor for x in old.predicted.optimizer_s], rel=1e-6)
    # two timed steps give no speed spread (and cpu-4's config has none): none is priced
    assert STEPS - 2 < MIN_SPREAD_STEPS
    assert "speed_spread" not in source and "speed_spread" not in record
    assert plan.predicted.speed_modes == () and plan.predicted.iteration_at_priced_speed_s is None
    # partc check re-solves from the calibrated profile to the same plan
    report = check_plan(plan_path)
    assert report.current, report.reasons
    # the same inputs give the same bytes
    again = compile_mlp(tmp_path / "c", calibrate_from=launched.run)
    assert again.read_bytes() == plan_path.read_bytes()
    assert (again.parent / "profile.yaml").read_bytes() == profile.read_bytes()

    # partc diff shows the change of cost source
    diff = run_partc("diff", str(launched.plan), str(plan_path), timeout=120)
    assert diff.returncode == 0, diff.stderr
    assert (f"costs: analytic -> profile profile.yaml (analytic, calibrated from "
            f"{launched.run.resolve()}, sha256 {plan.costs.profile_sha256[:12]})") in diff.stdout
    # between two calibrated plans with equal profiles nothing differs
    same = run_partc("diff", str(plan_path), str(again), timeout=120)
    assert same.stdout.rstrip().endswith("no differences"), same.stdout


def _rewrite(src: Path, dst: Path, **changes: object) -> Path:
    """The run's lines with StepMetrics fields replaced (None: a key not written at all)."""
    steps = [dataclasses.replace(StepMetrics.from_dict(json.loads(x)),
                                 **changes)  # type: ignore[arg-type]
             for x in src.read_text().splitlines()]
    dst.write_text("".join(s.to_json() + "\n" for s in steps))
    return dst


def _lengthened(src: Path, dst: Path, factors: Sequence[float]) -> Path:
    """A run of the same plan with one timed step per factor: the source's warm-up step, then
    copies of its first timed step with every time scaled by the factor (the stages ran that
    much slower in that step)."""
    run = RunMetrics.load(src)
    timed = run.strictly_timed_steps()[0]
    keys = ("forward_s", "backward_s", "forward_cpu_s", "backward_cpu_s", "between_cpu_s",
            "p2p_cpu_s")
    steps = [run.steps[0]]
    for i, f in enumerate(factors):
        stages = tuple(dataclasses.replace(st, **{k: getattr(st, k) * f for k in keys
                                                  if getattr(st, k) is not None})
                       for st in timed.stages)
        steps.append(dataclasses.replace(timed, step=i + 2, step_s=timed.step_s * f,
                                         stages=stages))
    dst.write_text("".join(s.to_json() + "\n" for s in steps))
    return dst


def test_a_run_long_enough_prices_its_own_speed_spread(launched: Launched,
                                                       tmp_path: Path) -> None:
    """A pipeline step waits for its slowest stage; the corrected costs (medians) leave the
    stages' slow steps out. A run of 12 timed steps in which both stages ran 1.5x in 3 of them
    gives the spread [[0.75, 1.0], [0.25, 1.5]] of the stages' median times, which the
    calibrated compile prices in place of the device config's: its prediction is the expected
    step (between the priced one and 1.5x it), plan.yaml says the spread is the run's, check
    re-solves it, diff shows it, and compile's summary says what the expectation is over."""
    factors = [1.0, 1.0, 1.5, 1.0, 1.0, 1.0, 1.5, 1.0, 1.0, 1.5, 1.0, 1.0]
    long_run = _lengthened(launched.run, tmp_path / "long.jsonl", factors)
    out = tmp_path / "b"
    proc = run_partc("compile", str(MLP), "-b", "16", "--cluster", "cpu-4", "--costs", "analytic",
                     "--stages", "2", "--replicas", "1", "--microbatches", "4", "--strategy",
                     "uniform", "--calibrate-from", str(long_run), "-o", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "expected over the speed spread of the runs calibrated from; " in proc.stdout
    assert not _run_warnings(proc.stderr), proc.stderr[-2000:]
    profile = yaml.safe_load((out / "profile.yaml").read_text())
    modes = [[0.75, 1.0], [0.25, 1.5]]
    assert profile["speed_spread"] == modes
    assert profile["calibration"]["calibrated_from"]["speed_spread"] == {
        "modes": modes, "steps": len(factors), "samples": 2 * len(factors)}
    plan = load_plan(out / "plan.yaml")
    p = plan.predicted
    assert p.speed_modes == ((0.75, 1.0), (0.25, 1.5)) and p.speed_spread_source == "run"
    assert p.iteration_at_priced_speed_s is not None
    assert p.iteration_at_priced_speed_s < p.iteration_s < 1.5 * p.iteration_at_priced_speed_s
    assert "source: run" in (out / "plan.yaml").read_text()
    report = check_plan(out / "plan.yaml")
    assert report.current, report.reasons
    diff = run_partc("diff", str(launched.plan), str(out / "plan.yaml"), timeout=120)
    assert diff.returncode == 0, diff.stderr
    assert "speed spread: none -> run's, 1.000-1.500x" in diff.stdout, diff.stdout

    # the same steps without the slow ones: a spread of one mode at the median, priced as is
    steady = _lengthened(launched.run, tmp_path / "steady.jsonl", [1.0] * MIN_SPREAD_STEPS)
    even = load_plan(compile_mlp(tmp_path / "c", calibrate_from=steady))
    assert even.predicted.speed_modes == ((1.0, 1.0),)
    assert even.predicted.iteration_s == even.predicted.iteration_at_priced_speed_s

    # a second steady run, 1.3x slower in every step (the machine's slower minute, all stages
    # together): the pooled medians move, the spread does not (each run's steps are read against
    # its own medians; pooled they were a 1.3x mode that units drew on their own)
    slower = _lengthened(launched.run, tmp_path / "slower.jsonl", [1.3] * MIN_SPREAD_STEPS)
    both = compile_mlp(tmp_path / "d", calibrate_from=[steady, slower])
    assert load_plan(both).predicted.speed_modes == ((1.0, 1.0),)
    record = yaml.safe_load((tmp_path / "d" / "profile.yaml").read_text())
    assert record["calibration"]["calibrated_from"]["speed_spread"]["steps"] == \
        2 * MIN_SPREAD_STEPS

    # runs too short to have medians of their own give none, and compile says so
    short = [_lengthened(launched.run, tmp_path / f"short{i}.jsonl", [1.0, 1.5, 1.0])
             for i in range(3)]
    said = _Said()
    compile_model(MLP, CPU4, tmp_path / "e", CompileOptions(
        batch_size=16, search=SHAPE, costs="analytic", calibrate_from=run_of(short)), said)
    assert load_plan(tmp_path / "e" / "plan.yaml").predicted.speed_modes == ()
    assert [w for w in said.warnings if "speed spread" in w] == [
        f"no run in 3 runs ({', '.join(p.name for p in short)}) has the "
        f"{MIN_RUN_SPREAD_STEPS} timed steps a speed spread is read within: none is priced "
        "(launch with more --steps for one)"]


class _Said(Progress):
    """Progress that keeps its warnings."""

    def __init__(self) -> None:
        self.warnings: list[str] = []

    def warn(self, message: str) -> None:
        self.warnings.append(message)


def test_a_units_spread_is_recovered_from_its_replicas_slowest() -> None:
    """A run reports each stage at the slowest of its replicas; with R independent units the
    slowest is slow with probability 1 - (1 - p)**R. unit_samples_of_maxima reads a unit's
    quantile q at the maxima's q**R: from maxima of two units slow 1.5x a quarter of the time
    (slow 7 times in 16), a quarter of its samples are slow again."""
    maxima = [1.0] * 9 + [1.5] * 7  # 16 draws of max(unit, unit)
    unit = unit_samples_of_maxima(maxima, 2)
    assert len(unit) == len(maxima) and unit == sorted(unit)
    assert unit.count(1.5) == 4  # 0.25 of 16 (the maxima's 7/16 ~ 1 - 0.75**2)
    assert unit_samples_of_maxima([1.2, 1.0, 1.1], 1) == [1.0, 1.1, 1.2]  # one unit: as is
    with pytest.raises(ValueError, match="units must be >= 1"):
        unit_samples_of_maxima([1.0], 0)


def test_several_runs_of_one_plan_pool_their_timed_steps(launched: Launched,
                                                        tmp_path: Path) -> None:
    """One launch's slow minute set every stage's costs (a 221 ms BERT plan launched at 865 ms
    on a shared machine predicted 775 ms after). `--calibrate-from` repeated pools the runs:
    each stage's times are medians over every run's timed steps. A second run of the same plan
    here is the first's lines with every time 1.5x (a slow launch, as the metrics would read),
    at a copy of the plan directory: the same plan's bytes wherever it was launched from."""
    copy = tmp_path / "copy"
    shutil.copytree(launched.plan.parent, copy)
    slow = tmp_path / "slow.jsonl"
    rows = [json.loads(x) for x in launched.run.read_text().splitlines()]
    for r in rows:
        r["plan"] = str((copy / "plan.yaml").resolve())
        for st in r["stages"]:
            for key in ("forward_s", "backward_s", "forward_cpu_s", "backward_cpu_s",
                        "between_cpu_s", "p2p_cpu_s"):
                if st.get(key) is not None:
                    st[key] *= 1.5
    slow.write_text("".join(json.dumps(r) + "\n" for r in rows))

    plan = load_plan(compile_mlp(tmp_path / "b", calibrate_from=[launched.run, slow]))
    pooled = [s for p in (launched.run, slow) for s in RunMetrics.load(p).strictly_timed_steps()]
    assert len(pooled) >= 4
    def median(k: int, key: str) -> float:
        return statistics.median(getattr(s.stages[k], key) for s in pooled)

    for stage in plan.stages:
        between = median(stage.index, "between_cpu_s") + median(stage.index, "p2p_cpu_s")
        # the pooled median, not either run's: between the fast run's and the slow one's
        assert stage.forward_s == pytest.approx(median(stage.index, "forward_s") + between,
                                                abs=2e-9)
        assert stage.backward_s == pytest.approx(median(stage.index, "backward_s") + between,
                                                 abs=2e-9)
    record = yaml.safe_load((tmp_path / "b" / "profile.yaml").read_text())[
        "calibration"]["calibrated_from"]
    assert [r["run"] for r in record["runs"]] == [str(launched.run.resolve()), str(slow)]
    # the slow run alone predicts slower stages than the pooled runs
    alone = load_plan(compile_mlp(tmp_path / "c", calibrate_from=slow))
    assert all(a.forward_s > p.forward_s for a, p in zip(alone.stages, plan.stages, strict=True))

    # a run of another plan (its plan.yaml's bytes differ) is refused before the capture, one
    # line, exit 2, no plan written
    other = tmp_path / "other"
    shutil.copytree(launched.plan.parent, other)
    with (other / "plan.yaml").open("a") as f:
        f.write("# reviewed\n")
    for r in rows:
        r["plan"] = str((other / "plan.yaml").resolve())
        r["plan_sha256"] = sha256_file(other / "plan.yaml")
    foreign = tmp_path / "foreign.jsonl"
    foreign.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "mixed"
    proc = run_partc("compile", str(MLP), "-b", "16", "--cluster", "cpu-4", "--costs", "analytic",
                     "--calibrate-from", str(launched.run), "--calibrate-from", str(foreign),
                     "-o", str(out))
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("partc: error:"), lines
    assert "runs calibrated from together must be of one plan" in lines[0]
    assert "(hint: pass only runs of the plan" in lines[0]
    assert not out.exists()


def test_refusals(launched: Launched, mlp_capture: CaptureResult, tmp_path: Path) -> None:
    run = launched.run
    # the plan changed since the run launched it
    changed = tmp_path / "changed"
    shutil.copytree(launched.plan.parent, changed)
    with (changed / "plan.yaml").open("a") as f:
        f.write("# edited\n")
    cases = {
        "changed since the run": _rewrite(run, tmp_path / "c.jsonl",
                                          plan=str(changed / "plan.yaml")),
        "is gone": _rewrite(run, tmp_path / "g.jsonl", plan=str(tmp_path / "nowhere.yaml")),
        "does not name the plan": _rewrite(run, tmp_path / "o.jsonl", plan=None),
    }
    steps = [json.loads(x) for x in run.read_text().splitlines()]
    warmup_only = tmp_path / "w.jsonl"  # the warm-up and the profiled step: nothing timed
    warmup_only.write_text("".join(json.dumps(r) + "\n" for r in steps
                                   if r["step"] == 1 or r["memory_method"] == MEMORY_CPU_PROFILER))
    cases["no timed steps"] = warmup_only
    one_stage = tmp_path / "s.jsonl"
    first = [StepMetrics.from_dict(r) for r in steps]
    one_stage.write_text("".join(dataclasses.replace(
        s, stages=s.stages[:1], stage_forward_s=s.stage_forward_s[:1],
        stage_backward_s=s.stage_backward_s[:1]).to_json() + "\n" for s in first))
    cases["is a run of 1 stage"] = one_stage
    for needle, path in cases.items():
        with pytest.raises((CalibrationError, RunMetricsError), match=needle) as info:
            load_launched_run(read_runs_of_plan([path]), mlp_capture)
        assert info.value.hint and "\n" not in info.value.one_line()

    # another model's compile, through the CLI: one line, exit 2, no plan written
    out = tmp_path / "other"
    result = run_partc("compile", str(EXAMPLES / "transformer.py"), "-b", "16", "--cluster",
                       "cpu-4", "--costs", "analytic", "--calibrate-from", str(run), "-o", str(out))
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [x for x in result.stderr.splitlines() if x.startswith("partc: error:")]
    assert len(errors) == 1 and "is a run of another model" in errors[0], result.stderr[-2000:]
    assert not (out / "plan.yaml").exists()


def test_calibrating_from_a_run_on_shared_cores_that_shards_gradients(tmp_path: Path) -> None:
    """2 stages x 2 replicas on cpu-4: 4 processes on this machine's 2 cores, so the stages'
    wall times hold their core-mates' turns and calibration takes each stage's CPU times
    instead (launch records both; the simulator adds the turns itself). Each stage shards its
    gradients (ZeRO-2): gloo reduces each micro-batch's buckets on its own threads, outside the
    computing thread's CPU time, so nothing is taken out for them, and the calibrated plan
    prices the reduces as any compile does: its backward is the measured CPU backward plus the
    predicted reduces. A run without CPU times (an older partc's) cannot calibrate such a plan."""
    shape = dataclasses.replace(SHAPE, replicas=2, sharding="gradients")

    def compile_sharded(out: Path, calibrate_from: Path | None = None,
                        search: SearchOptions = shape) -> Path:
        compile_model(MLP, CPU4, out, CompileOptions(batch_size=16, search=search,
                                                     costs="analytic",
                                                     calibrate_from=run_of(calibrate_from)))
        return out / "plan.yaml"

    sharded = compile_sharded(tmp_path / "a")
    run = tmp_path / "run.jsonl"
    result = run_partc("launch", str(sharded), "--steps", str(STEPS), "--metrics", str(run))
    assert result.returncode == 0, result.stderr[-3000:]
    old = load_plan(sharded)
    assert [s.sharding for s in old.stages] == ["gradients"] * 2
    # the predicted reduces per micro-batch: what sharding adds to the same cut's backward,
    # beside adding into fewer held gradients (a replica keeps its share only)
    plain = load_plan(compile_sharded(tmp_path / "plain", search=dataclasses.replace(
        shape, sharding="none")))
    assert [s.modules for s in plain.stages] == [s.modules for s in old.stages]
    graph = capture_graph(MLP, 2, onnx=False).graph

    def adds(plan: Any, stage: Any) -> float:
        return gradient_add_s([graph.param(n) for n in stage.parameter_names],
                              plan.training.config, CPU4.device, plan.training.shape,
                              stage.sharding)

    sharded_adds = [adds(old, s) for s in old.stages]
    assert all(0 < a < adds(plain, s) for a, s in zip(sharded_adds, plain.stages, strict=True))
    predicted_reduces = [a.backward_s - b.backward_s - adds(old, a) + adds(plain, b)
                         for a, b in zip(old.stages, plain.stages, strict=True)]
    assert all(r > 0 for r in predicted_reduces)

    calibrated_path = compile_sharded(tmp_path / "b", calibrate_from=run)
    calibrated = load_plan(calibrated_path)
    assert [s.modules for s in calibrated.stages] == [s.modules for s in old.stages]
    assert calibrated.training.shape == old.training.shape
    metrics = RunMetrics.load(run)
    measured = metrics.stage_summaries(metrics.strictly_timed_steps())
    assert old.pipeline_spec().shares_cores
    for stage, got, reduce_s in zip(calibrated.stages, measured, predicted_reduces, strict=True):
        assert got.ddp_allreduce_s > 0  # the sharder timed its reduces
        assert got.forward_cpu_s is not None and got.backward_cpu_s is not None
        # the stage's own work as a prediction prices its passes: its CPU and the runtime's
        # CPU between passes and in the posts (the device's microbatch_overhead_s has them all)
        assert got.between_cpu_s is not None and got.between_cpu_s > 0
        assert got.p2p_cpu_s is not None
        work = got.compute_s(shared_core=True)
        assert work is not None
        assert stage.forward_s == pytest.approx(
            got.forward_cpu_s + got.between_cpu_s + got.p2p_cpu_s, abs=2e-9)
        # the measured backward holds the adds: taken out to correct the operators, priced back
        assert stage.backward_s == pytest.approx(work[1] + reduce_s, abs=2e-9)
    report = check_plan(calibrated_path)
    assert report.current, report.reasons

    older = tmp_path / "older.jsonl"  # the same run as an older launch wrote it
    steps = [StepMetrics.from_dict(json.loads(x)) for x in run.read_text().splitlines()]
    older.write_text("".join(dataclasses.replace(step, stages=tuple(
        dataclasses.replace(st, forward_cpu_s=None, backward_cpu_s=None, optimizer_cpu_s=None)
        for st in step.stages)).to_json() + "\n" for step in steps))
    with pytest.raises(CalibrationError, match="no CPU times per stage") as info:
        compile_sharded(tmp_path / "c", calibrate_from=older)
    assert info.value.hint and "\n" not in info.value.one_line()


def test_a_run_at_another_precision_is_refused(launched: Launched, tmp_path: Path) -> None:
    """An fp32 run calibrating a bf16-mixed compile scaled the bf16 costs to the fp32 times and
    wrote the plan (exit 0): the costs are per precision."""
    bf16 = CompileOptions(batch_size=16, search=SHAPE, costs="analytic",
                          training=TrainingConfig(precision="bf16-mixed"),
                          calibrate_from=read_runs_of_plan([launched.run]))
    with pytest.raises(CalibrationError, match="trained at precision fp32, this compile prices "
                                               "bf16-mixed") as info:
        compile_model(MLP, CPU4, tmp_path / "bf16", bf16)
    assert "--precision fp32" in info.value.hint
    assert not (tmp_path / "bf16").exists()


def test_values_and_shapes_no_run_of_the_plan_has_are_refused(launched: Launched,
                                                               tmp_path: Path) -> None:
    """A NaN stage time was taken as measured: the factor was NaN and the compile wrote a plan
    from NaN-scaled costs (exit 0). Lines whose shape is not their plan's (edited, or stitched
    from another run) were used as its measurements."""
    rows = [json.loads(x) for x in launched.run.read_text().splitlines()]

    def edited(name: str, edit: Callable[[dict[str, Any]], None]) -> Path:
        changed = [json.loads(json.dumps(r)) for r in rows]
        for r in changed:
            edit(r)
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in changed))
        return path

    nan = edited("nan", lambda r: r["stages"][0].update(forward_s=math.nan,
                                                        forward_cpu_s=math.nan))
    with pytest.raises(RunMetricsError, match=r"stages\[0\]\.forward_s is nan"):
        compile_mlp(tmp_path / "nan-plan", calibrate_from=nan)
    assert not (tmp_path / "nan-plan").exists()
    # every pass timed at 0 s (an edited line) while the CPU between passes is kept: no factor
    def zero_passes(r: dict[str, Any]) -> None:
        for stage in r["stages"]:
            stage.update(forward_s=0.0, backward_s=0.0, forward_cpu_s=0.0, backward_cpu_s=0.0)
        r.update(stage_forward_s=[0.0] * len(r["stages"]),
                 stage_backward_s=[0.0] * len(r["stages"]))
    with pytest.raises(CalibrationError, match=r"stage 0's forward in .* measured 0 s") as info:
        compile_mlp(tmp_path / "zero-plan", calibrate_from=edited("zero", zero_passes))
    assert info.value.hint and "\n" not in info.value.one_line()
    assert not (tmp_path / "zero-plan").exists()
    for name, edit, needle in (
            ("microbatches", lambda r: r.update(num_microbatches=3),
             "is a run of 3 micro-batches per step, its plan"),
            ("cuda", lambda r: r.update(clock=CLOCK_CUDA), "is a run on CUDA devices, its plan")):
        with pytest.raises(RunMetricsError, match=needle) as info:
            read_run_of_plan(edited(name, edit))
        assert info.value.hint and "\n" not in info.value.one_line()


def test_compile_checks_the_run_before_capturing_and_warns_of_a_cut_short_line(
        launched: Launched, tmp_path: Path) -> None:
    """A broken metrics file failed only after the model was captured (imported and run); now
    before. A run whose last line was cut short (killed mid-write) calibrates from its complete
    lines, with a warning. The model file here is a renamed copy of the launched plan's (the
    same graph): that was refused as a plan that "no longer re-solves to itself", the model's
    name (its file's stem) being compared with the plan's."""
    marker = tmp_path / "imported"
    model = tmp_path / "marked.py"
    model.write_text(MLP.read_text() + f"\nopen({str(marker)!r}, 'w').close()\n")
    broken = tmp_path / "broken.jsonl"
    broken.write_text("{not json\n")
    out = tmp_path / "plan"
    proc = run_partc("compile", str(model), "-b", "16", "--cluster", "cpu-4", "--costs",
                     "analytic", "--calibrate-from", str(broken), "-o", str(out))
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "broken.jsonl:1 is not a partc metrics line" in lines[0]
    assert not marker.exists() and not out.exists()

    cut = tmp_path / "cut.jsonl"
    text = launched.run.read_text()
    cut.write_text(text + text.splitlines()[-1][:120])  # a step 5 the run never finished
    proc = run_partc("compile", str(model), "-b", "16", "--cluster", "cpu-4", "--costs",
                     "analytic", "--stages", "2", "--microbatches", "4", "--strategy", "uniform",
                     "--calibrate-from", str(cut), "-o", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]  # the same graph as the launched plan's
    warnings = _run_warnings(proc.stderr)
    assert len(warnings) == 2 and f"{cut}:{STEPS + 1}, the last line, is cut short" in \
        warnings[0], proc.stderr[-2000:]
    # and its two timed steps are too few for a speed spread: said, with what is priced instead
    assert (f"partc: warning: {STEPS - 2} timed step(s) in {cut}, fewer than the "
            f"{MIN_SPREAD_STEPS} a speed spread is taken from: none is priced (launch with more "
            "--steps for one)"
            ) in proc.stderr.splitlines(), proc.stderr[-2000:]
    assert marker.exists()  # captured after the check passed
