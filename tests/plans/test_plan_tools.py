"""Plans as code: `partc check`, `partc diff` and `partc show` as users run them (a real
subprocess per call), on plans compiled here and on the example plans checked into the repo."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from conftest import EXAMPLES, ROOT
from partc_process import run_partc

EXAMPLE_PLANS = ROOT / "examples" / "plans"


def run(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return run_partc(*args, cwd=cwd, timeout=600)


def compile_plan(out: Path, model: Path, *flags: str) -> Path:
    proc = run("compile", str(model), "--cluster", "cpu-4", "-o", str(out), *flags)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out


@pytest.fixture(scope="module")
def bert2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """HF BERT in 2 stages (pinned), compiled once for this module. Analytic costs: check can
    re-solve an edited model with them and show what moves (a measured plan cannot: see
    test_check_of_a_measured_plan_asks_to_recompile)."""
    return compile_plan(tmp_path_factory.mktemp("bert") / "bert2", EXAMPLES / "bert.py",
                        "-b", "8", "--stages", "2", "--costs", "analytic")


@pytest.fixture
def plan_copy(bert2: Path, tmp_path: Path) -> Path:
    """A private copy of the BERT plan, at the same depth below the temporary root as the
    original, so its relative model path still resolves."""
    out = tmp_path / "plan"
    shutil.copytree(bert2, out)
    assert (out / yaml.safe_load((out / "plan.yaml").read_text())["model"]["file"]).is_file()
    return out


def edited_bert(tmp_path: Path, edits: dict[str, str]) -> Path:
    text = (EXAMPLES / "bert.py").read_text()
    for old, new in edits.items():
        assert old in text
        text = text.replace(old, new)
    path = tmp_path / "bert_edited.py"
    path.write_text(text)
    return path


def edit_plan(plan_dir: Path, edit) -> None:
    path = plan_dir / "plan.yaml"
    data = yaml.safe_load(path.read_text())
    edit(data)
    path.write_text(yaml.safe_dump(data, sort_keys=True))


# ---- the example plans checked into this repository ---------------------------------------------

def recipe_commands() -> dict[str, list[str]]:
    """The `partc check` command lines of this repository's pre-commit hook and GitHub Actions
    job (the recipe docs/ci.md gives), without the executable."""
    hook = yaml.safe_load((ROOT / ".pre-commit-config.yaml").read_text())["repos"][0]["hooks"][0]
    workflow = yaml.safe_load((ROOT / ".github" / "workflows" / "plans.yml").read_text())
    step = next(s for s in workflow["jobs"]["partc-check"]["steps"]
                if "partc check" in s.get("run", ""))
    return {"pre-commit": hook["entry"].split()[1:] + hook["args"],
            "github-actions": step["run"].split()[1:]}


def test_example_plans_are_current() -> None:
    """The CI recipe of docs/ci.md, run on this repository's own plans: fails when an example
    model, the solver or the cost model changes without the plans being recompiled."""
    names = sorted(p.parent.name for p in EXAMPLE_PLANS.rglob("plan.yaml"))
    assert names == ["mlp", "resnet", "transformer"]
    commands = recipe_commands()
    assert commands["pre-commit"] == commands["github-actions"] == ["check", "examples/plans"]
    proc = run(*commands["pre-commit"])
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if not ln.startswith("  plan digest: sha256:")]
    assert len(lines) == 3 and all(": current (" in line for line in lines), proc.stdout


# ---- check -------------------------------------------------------------------------------------

def test_check_names_changed_added_and_moved_parameters_and_modules(plan_copy: Path,
                                                                    tmp_path: Path) -> None:
    """One edited model (wider layers and two more of them), one check: every kind of change
    is named (one re-solve of a BERT is ~20 s here, so the cases share it)."""
    model = edited_bert(tmp_path, {"intermediate_size=1024": "intermediate_size=1536",
                                   "num_hidden_layers=4": "num_hidden_layers=6"})
    proc = run("check", str(plan_copy), "--model", str(model))
    assert proc.returncode == 1, proc.stdout + proc.stderr[-2000:]
    out = proc.stdout
    assert ": STALE (bert" in out.splitlines()[0]
    assert "the model changed since the plan was compiled" in out
    # the four layers the plan had: three wider tensors each
    assert "parameters changed (12):" in out
    assert ("bert.encoder.layer.0.intermediate.dense.weight: float32[1024, 256] -> "
            "float32[1536, 256]") in out
    assert "modules whose operators changed" in out and "bert.encoder.layer.3.output.dense" in out
    # the two new layers
    assert "modules added (2):" in out
    assert "      bert.encoder.layer.4\n" in out and "      bert.encoder.layer.5\n" in out
    assert "parameters added (32):" in out
    assert "modules that change stage" in out  # two more layers: the boundary moves
    assert "samples/s (-" in out  # a bigger model is slower: old vs new throughput
    assert f"fix: partc compile {model}" in out and "--stages 2" in out


@pytest.mark.slow  # default run under 15 min; `make test-slow` runs it
def test_check_re_solves_and_shows_what_moves(plan_copy: Path) -> None:
    """Same model, but the plan's recorded stage contents and predictions are not what the
    solver produces, and another partc build wrote it (as after a solver or cost-model change):
    stale, with the moved modules. (With this build it would be a hand edit: tampered.)"""
    def move_a_module(data: dict) -> None:
        data["partc_build"] = "0123456789abcdef"
        first, second = data["stages"][0], data["stages"][1]
        moved = first["modules"].pop()
        second["modules"].insert(0, moved)
        first["predicted"]["forward_s"] = round(first["predicted"]["forward_s"] * 0.5, 10)

    edit_plan(plan_copy, move_a_module)
    proc = run("check", str(plan_copy))
    assert proc.returncode == 1, proc.stdout + proc.stderr[-2000:]
    out = proc.stdout
    assert "re-solving with the plan's recorded inputs gives a different plan" in out
    assert "the model changed" not in out
    assert "modules that change stage" in out and "stage 1 -> stage 0" in out
    assert "fwd ms" in out
    # The printed fix recompiles the plan from the same kind of costs (the default would measure
    # on this machine); afterwards it is current again.
    fix = next(line for line in out.splitlines() if line.strip().startswith("fix: "))
    assert "--costs analytic" in fix
    args = fix.strip().removeprefix("fix: partc ").split()
    assert run(*args).returncode == 0
    assert yaml.safe_load((plan_copy / "plan.yaml").read_text())["costs"]["source"] == "analytic"
    assert run("check", str(plan_copy)).returncode == 0


def test_a_cluster_under_a_shipped_name_is_recompiled_as_recorded(tmp_path: Path) -> None:
    """A cluster config under a shipped config's name that says something else (what `partc
    calibrate -o DIR` writes: DIR/clusters/cpu-4.yaml): check notes that the name now gives
    another cluster, and a stale plan's fix recompiles for the cluster the plan records (the
    plan itself as `--cluster`), not for the shipped config of that name."""
    clusters = tmp_path / "cal" / "clusters"
    clusters.mkdir(parents=True)
    shipped = (ROOT / "configs" / "clusters" / "cpu-4.yaml").read_text()
    assert "bandwidth: 1.39GB/s" in shipped
    (clusters / "cpu-4.yaml").write_text(shipped.replace("bandwidth: 1.39GB/s",
                                                         "bandwidth: 0.5GB/s"))
    out = tmp_path / "plan"
    proc = run("compile", str(EXAMPLES / "mlp.py"), "-b", "16", "--cluster",
               str(clusters / "cpu-4.yaml"), "--costs", "analytic", "-o", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    recorded = yaml.safe_load((out / "plan.yaml").read_text())["cluster"]
    assert recorded["name"] == "cpu-4" and recorded["intra_node"]["bandwidth"] == 5e8

    proc = run("check", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    assert (f"configs/clusters/cpu-4.yaml differs from the cluster recorded in the plan; the "
            f"check used the recorded one (--cluster {out / 'plan.yaml'} recompiles for it, "
            "--cluster cpu-4 for the config)") in proc.stdout

    # a plan (its directory or plan.yaml) as --cluster is the cluster it records
    again = tmp_path / "again"
    proc = run("compile", str(EXAMPLES / "mlp.py"), "-b", "16", "--cluster", str(out),
               "--costs", "analytic", "-o", str(again))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert yaml.safe_load((again / "plan.yaml").read_text())["cluster"] == recorded

    def stale(data: dict) -> None:  # as after a cost-model change: another build's prediction
        data["partc_build"] = "0123456789abcdef"
        data["stages"][0]["predicted"]["forward_s"] *= 0.5

    edit_plan(out, stale)
    proc = run("check", str(out))
    assert proc.returncode == 1, proc.stdout + proc.stderr[-2000:]
    fix = next(line for line in proc.stdout.splitlines() if line.strip().startswith("fix: "))
    assert f"--cluster {out / 'plan.yaml'}" in fix
    assert run(*fix.strip().removeprefix("fix: partc ").split()).returncode == 0
    assert yaml.safe_load((out / "plan.yaml").read_text())["cluster"] == recorded
    assert run("check", str(out)).returncode == 0


def test_check_when_memory_no_longer_fits(plan_copy: Path) -> None:
    def shrink(data: dict) -> None:
        data["cluster"]["device"]["memory_bytes"] = 1 << 20

    edit_plan(plan_copy, shrink)
    proc = run("check", str(plan_copy))
    assert proc.returncode == 1
    assert "no plan fits any more" in proc.stdout


@pytest.mark.slow  # default run under 15 min; `make test-slow` runs it
def test_check_of_a_plan_with_a_profile(tmp_path: Path) -> None:
    """A plan priced by a profile (what the default compile measures on this machine, or a
    checked-in `--profile`: here the example plan's, so nothing is measured; measuring itself is
    tests/cost's): check re-solves from that file and finds the plan current; a changed model
    asks to recompile; a different profile makes the plan stale; a missing one is a one-line
    error."""
    plan_dir = tmp_path / "tf"
    plan_dir.mkdir()
    profile = plan_dir / "profile.yaml"
    shutil.copyfile(EXAMPLE_PLANS / "transformer" / "profile.yaml", profile)
    compile_plan(plan_dir, EXAMPLES / "transformer.py", "-b", "8", "--stages", "2",
                 "--profile", str(profile))
    plan = yaml.safe_load((plan_dir / "plan.yaml").read_text())
    assert plan["costs"]["source"] == "profile" and plan["costs"]["profile"] == "profile.yaml"
    assert len(plan["costs"]["profile_sha256"]) == 64
    proc = run("check", str(plan_dir))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    # The model changed: the profile measured the old one, so the fix recompiles (and measures).
    text = (EXAMPLES / "transformer.py").read_text()
    edited = tmp_path / "transformer_edited.py"
    assert "LAYERS = 4" in text
    edited.write_text(text.replace("LAYERS = 4", "LAYERS = 5"))
    proc = run("check", str(plan_dir), "--model", str(edited))
    assert proc.returncode == 1, proc.stdout + proc.stderr[-2000:]
    assert "STALE" in proc.stdout and "recompile" in proc.stdout, proc.stdout
    # The profile is part of the plan's inputs: a different one makes the plan stale.
    data = yaml.safe_load(profile.read_text())
    for row in data["nodes"].values():  # [method, fwd fixed, fwd per sample, bwd ..., saved ...]
        row[1:5] = [x * 3 for x in row[1:5]]
    profile.write_text(yaml.safe_dump(data, sort_keys=True))
    proc = run("check", str(plan_dir))
    assert proc.returncode == 1 and "is not the one the plan was compiled with" in proc.stdout, \
        proc.stdout
    profile.unlink()
    proc = run("check", str(plan_dir))
    assert proc.returncode == 2 and "profile.yaml recorded in" in proc.stderr
    assert "(hint: " in proc.stderr and "Traceback" not in proc.stderr


def test_check_several_plans_reports_each(tmp_path: Path) -> None:
    """Two current plans with a missing one between them: each reported, in order, exit 2 for
    the bad input (current plans alone exit 0: test_example_plans_are_current). Checked-in
    plans: a re-solve of this module's BERT would add ~10 s."""
    proc = run("check", "examples/plans/transformer", str(tmp_path / "missing"),
               "examples/plans/mlp")
    assert proc.returncode == 2
    assert proc.stdout.count(": current (") == 2
    assert proc.stdout.startswith("examples/plans/transformer/plan.yaml: current (transformer, "
                                  "2 stage(s)")
    assert "examples/plans/mlp/plan.yaml: current (mlp" in proc.stdout
    errors = [line for line in proc.stderr.splitlines() if line.startswith("partc: error:")]
    assert len(errors) == 1 and "missing" in errors[0]


def test_check_missing_model_file(plan_copy: Path, tmp_path: Path) -> None:
    proc = run("check", str(plan_copy), "--model", str(tmp_path / "gone.py"))
    assert proc.returncode == 2 and "is not a file" in proc.stderr and "--model" in proc.stderr


# ---- diff --------------------------------------------------------------------------------------

@pytest.mark.slow  # default run under 15 min; `make test-slow` runs it
def test_diff_of_two_plans(bert2: Path, tmp_path: Path) -> None:
    bert4 = compile_plan(tmp_path / "bert4", EXAMPLES / "bert.py", "-b", "8", "--stages", "4")
    proc = run("diff", str(bert2), str(bert4))
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert out.startswith(f"--- {bert2}\n+++ {bert4}\n")
    assert "pipeline stages: 2 -> 4" in out
    assert "modules that change stage" in out and "-> stage 3" in out
    assert "    3  - -> 3" in out  # a stage only the new plan has
    assert "predicted: " in out and "samples/s" in out
    same = run("diff", str(bert2), str(bert2))
    assert same.returncode == 0 and same.stdout.rstrip().endswith("no differences")


def test_diff_shows_a_changed_cluster_config_under_the_same_name() -> None:
    """A recalibrated cluster (here the scheduler's wake credit, then a link) keeps its name;
    diff names the recorded keys that differ, and a plan against itself has none."""
    from dataclasses import replace

    from partc.plans.diff import diff_layouts, format_diff, layout_of_plan
    from partc.plans.plan import load_plan

    plan = load_plan(ROOT / "examples" / "plans" / "mlp" / "plan.yaml")
    assert plan.cluster.wake_credit_s > 0
    same = diff_layouts(layout_of_plan(plan), layout_of_plan(plan))
    assert same.same and same.cluster_config == ()
    other = replace(plan, cluster=replace(
        plan.cluster, wake_credit_s=0.0,
        intra_node=replace(plan.cluster.intra_node, bandwidth=2e9)))
    diff = diff_layouts(layout_of_plan(plan), layout_of_plan(other))
    assert not diff.same
    assert diff.cluster_config == ("intra_node.bandwidth", "wake_credit_s")
    text = format_diff(diff)
    assert "cluster config cpu-4 (2 key(s) differ):" in text
    assert f"  wake_credit_s: {plan.cluster.wake_credit_s} -> -" in text
    assert "  intra_node.bandwidth: " in text and "-> 2000000000.0" in text
    # where the config was compared with its device is not a number the pricing uses
    noted = replace(plan, cluster=replace(plan.cluster, device=replace(
        plan.cluster.device, checked_against="one imaginary CPU, 2026-12-07")))
    assert diff_layouts(layout_of_plan(plan), layout_of_plan(noted)).cluster_config == ()


# ---- show --------------------------------------------------------------------------------------

def test_show_summary_png_and_html(bert2: Path, tmp_path: Path) -> None:
    png, page = tmp_path / "r" / "bert.png", tmp_path / "r" / "bert.html"
    proc = run("show", str(bert2), "--png", str(png), "--html", str(page))
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert out.startswith("bert: 2 stage(s)") and "memory per device" in out
    assert "rank 1: busy" in out and "idle" in out
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 30_000
    text = page.read_text()
    assert "data:image/png;base64," in text and "<table" in text and "stage_1.pt" in text
    # Same plan, same picture (no timestamps): reports can be committed next to plans.
    again = tmp_path / "again.png"
    assert run("show", str(bert2), "--png", str(again)).returncode == 0
    assert again.read_bytes() == data


def test_replayed_schedule_is_the_predicted_iteration(bert2: Path) -> None:
    from partc.plans.plan import load_plan
    from partc.plans.report import replay

    plan = load_plan(bert2)
    sim = replay(plan)
    assert sim.iteration_s == pytest.approx(plan.predicted.iteration_s, rel=1e-6)
    assert sim.bubble_fraction == pytest.approx(plan.predicted.bubble_fraction, abs=1e-6)
    assert [int(x) for x in sim.peak_memory_bytes] == pytest.approx(
        plan.predicted.peak_memory_bytes, abs=2)


# ---- module attribution (pure) -----------------------------------------------------------------

def test_modules_are_attributed_by_nearest_listed_ancestor() -> None:
    from partc.plans.diff import LayoutStage, collapse_modules, module_stages

    def stage(index: int, modules: tuple[str, ...]) -> LayoutStage:
        return LayoutStage(index=index, rank=index, devices=(index,), modules=modules,
                           parameters=0, forward_s=0.0, backward_s=0.0, peak_memory_bytes=0,
                           send_forward_s=0.0, send_backward_s=0.0, activation_bytes=0,
                           static_bytes=0)

    # "m" is listed by both stages (its own operators are split); "m.a" is wholly in stage 0.
    stages = (stage(0, ("(root)", "m", "m.a")), stage(1, ("m", "m.b.c")))
    got = module_stages(stages, ["", "m", "m.a", "m.a.x", "m.b.c", "m.b.c.d", "m.z"])
    assert got == {"": (0,), "m": (0, 1), "m.a": (0,), "m.a.x": (0,), "m.b.c": (1,),
                   "m.b.c.d": (1,), "m.z": (0, 1)}
    universe = {"m", "m.a", "m.a.x", "m.b", "m.b.c"}
    assert collapse_modules(["m.a", "m.a.x", "m.b.c"], universe) == ["m.a", "m.b.c"]
    assert collapse_modules(["m.b", "m.b.c"], universe) == ["m.b"]
