"""partc launch end to end: real torchrun/elastic agent, real gloo process groups, real
torch.distributed.pipelining schedules and DDP, compared step by step with single-process training
of the same model on the same data (partc.run.training.train_single_process)."""
from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import EXAMPLES, ROOT, TEST_MODELS, launched_ranks, losses_of
from partc_process import run_partc

from partc.emit.compile import CompileOptions, compile_model
from partc.hardware.configs import load_cluster
from partc.options import SearchOptions, TrainingConfig, TrainOptions
from partc.plans.plan import PlanError, load_plan
from partc.run.checkpoint import latest_checkpoint
from partc.run.rank_layout import rank_layout
from partc.run.reference import train_single_process

PARTC = str(Path(sys.executable).parent / "partc")
TORCHRUN = str(Path(sys.executable).parent / "torchrun")
CPU4 = load_cluster("cpu-4")
RTOL = 1e-5  # fp32: the pipeline sums micro-batch gradients in another order than one batch


def compile_plan(tmp: Path, model: Path, stages: int, replicas: int, batch: int = 16,
                 training: TrainingConfig | None = None, **search: object) -> Path:
    """A plan of `model` on cpu-4, priced by the roofline: these tests check what launch
    computes and does, whatever the costs (measured costs have their own tests)."""
    out = tmp / f"{model.stem}-{stages}x{replicas}"
    compile_model(model, CPU4, out, CompileOptions(
        batch_size=batch, training=training or TrainingConfig(), costs="analytic",
        search=SearchOptions(stages=stages, replicas=replicas, **search)))
    return out / "plan.yaml"


def launch(plan: Path, *flags: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return run_partc("launch", str(plan), *flags, timeout=timeout)


def assert_close(got: list[float], want: list[float], rtol: float = RTOL) -> None:
    assert len(got) == len(want), (got, want)
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        assert abs(a - b) <= rtol * abs(b), f"step {step + 1}: launch {a!r} vs single process {b!r}"


def train_and_compare(plan: Path, tmp: Path, steps: int = 5, chunks: int = 1,
                      rtol: float = RTOL) -> list[float]:
    metrics = tmp / f"{plan.parent.name}.jsonl"
    result = launch(plan, "--steps", str(steps), "--metrics", str(metrics))
    assert result.returncode == 0, result.stderr[-3000:]
    # no library notices: Python warnings, c10's "[W<date> ...]" lines
    assert "Warning" not in result.stderr and not re.search(r"\[W\d{4} ", result.stderr), \
        result.stderr[-3000:]
    got = losses_of(metrics)
    want = train_single_process(load_plan(plan), TrainOptions(steps=steps), chunks=chunks)
    assert_close(got, want, rtol=rtol)
    check_metrics(plan, metrics)
    return got


def check_metrics(plan: Path, metrics: Path) -> None:
    """The metrics file reads back as typed data with a line per step and a row per stage; with
    replicas, DDP's gradient all-reduce was timed."""
    from partc.plans.run_metrics import RunMetrics

    p = load_plan(plan)
    run = RunMetrics.load(metrics)
    run.check_stages(p.num_stages)
    assert all(s.replicas == p.training.shape.replicas for s in run.steps)
    if p.training.shape.replicas > 1:
        assert all(st.ddp_allreduce_s > 0 for s in run.steps for st in s.stages)


# ---- equal to single-process training ----------------------------------------------------------

# slow set: the default run launches tied weights across two stages in
# test_a_model_that_computes_its_own_loss (HF GPT-2's lm_head, 2 x 1) and the killed-rank test
# (this transformer, 2 x 2), and checks launch's summary and data line in
# test_metrics_per_stage_and_show_beside_the_prediction
@pytest.mark.slow
def test_two_stages_tied_transformer(tmp_path: Path) -> None:
    """2 processes, 1F1B, an embedding tied to the output head across the two stages."""
    plan = compile_plan(tmp_path, EXAMPLES / "transformer.py", 2, 1)
    assert load_plan(plan).tied_parameters  # the tie really spans both stages
    metrics = tmp_path / "m.jsonl"
    result = launch(plan, "--steps", "5", "--metrics", str(metrics))
    assert result.returncode == 0, result.stderr[-3000:]
    assert_close(losses_of(metrics), train_single_process(load_plan(plan), TrainOptions(steps=5)))
    # the summary compares measured per-stage times with the plan's predictions
    assert "predicted" in result.stdout and "trained steps 1..5" in result.stdout
    assert "data: the model file's batches()" in result.stderr
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert all(len(r["stage_forward_s"]) == 2 and r["samples_per_s"] > 0 for r in rows)


# slow set: the default run trains the same HF GPT-2 (2 x 1) with its tied lm_head in
# test_a_model_that_computes_its_own_loss, and data parallel stages in the ResNet's 2 x 2
@pytest.mark.slow
def test_two_by_two_hf_gpt2_tied(tmp_path: Path) -> None:
    """4 processes: 2 stages x 2 replicas (DDP per stage), HF GPT-2 with tied lm_head."""
    plan = compile_plan(tmp_path, TEST_MODELS / "gpt2_no_dropout.py", 2, 2)
    layout = rank_layout(load_plan(plan))
    assert layout.world_size == 4 and layout.replicas == 2
    assert load_plan(plan).tied_parameters
    train_and_compare(plan, tmp_path)


# slow set: keyword inputs and a tied head spanning the stages are launched in the default run
# by test_a_model_that_computes_its_own_loss (HF GPT-2); this adds BERT's pair of targets
@pytest.mark.slow
def test_two_stages_hf_bert_keyword_inputs_pair_target(tmp_path: Path) -> None:
    """HF BERT: keyword inputs, a (masked-LM, next-sentence) target pair, tied decoder."""
    plan = compile_plan(tmp_path, TEST_MODELS / "bert_no_dropout.py", 2, 1)
    train_and_compare(plan, tmp_path)


def test_two_by_two_cnn_with_batch_norm(tmp_path: Path) -> None:
    """A ResNet (skip connections, batch norm) on 2 x 2: batch norm normalises each micro-batch,
    so the reference is single-process gradient accumulation over the same micro-batches."""
    plan = compile_plan(tmp_path, EXAMPLES / "resnet.py", 2, 2)
    p = load_plan(plan)
    chunks = p.training.shape.replicas * p.training.shape.num_microbatches
    # convolution and batch-norm backward sum over more elements than the MLP's layers, and the
    # two runs sum in different orders: measured up to 1.2e-5 relative by step 4 (a wrong
    # gradient is off by far more than 1e-3)
    train_and_compare(plan, tmp_path, chunks=chunks, rtol=5e-5)


def test_a_model_that_computes_its_own_loss(tmp_path: Path) -> None:
    """The Hugging Face habit: labels are a model input, the model returns `output.loss`, the
    batches yield no target. Pipeline training equals the single-process run, and verify checks
    it as launch runs it (2 x 2, data parallel too: test_two_by_two_hf_gpt2_tied, slow set)."""
    plan = compile_plan(tmp_path, TEST_MODELS / "gpt2_model_loss.py", 2, 1, batch=8)
    assert load_plan(plan).tied_parameters  # the tied lm_head spans both stages
    verify = run_partc("verify", str(plan), timeout=600)
    assert verify.returncode == 0 and "verify: ok" in verify.stdout, verify.stdout[-3000:]
    train_and_compare(plan, tmp_path, steps=3)


def test_interleaved_schedule_with_activation_checkpointing(tmp_path: Path) -> None:
    """2 ranks x 2 virtual stages (ScheduleInterleaved1F1B), forward recomputed in backward."""
    plan = compile_plan(tmp_path, EXAMPLES / "transformer.py", 2, 1,
                        schedule="interleaved-1f1b", activation_checkpointing=True)
    p = load_plan(plan)
    assert p.num_stages == 4 and p.training.shape.activation_checkpointing
    train_and_compare(plan, tmp_path, steps=3)


# slow set: the default run launches a ZeRO-2 plan to the end in
# tests/plans/test_recalibrate.py and restarts a ZeRO-1 one from its checkpoint (the killed-rank
# test's 2x2-sharded case); this one proves ZeRO-2's losses and resumes bit for bit
@pytest.mark.slow
def test_sharded_gradients_train_and_resume_as_the_unsharded_plan(tmp_path: Path) -> None:
    """ZeRO-2 (ZeroRedundancyOptimizer over each stage's replicas, each micro-batch's gradients
    reduced onto their owners as they form, partc.run.gradient_sharding) on 2 stages x 2
    replicas of the transformer example, its embedding tied to the output head across the
    stages (kept whole): the losses are
    single-process training's; a checkpoint it writes (by FQN, the sharded state gathered
    whole) resumes under the unsharded plan with the uninterrupted run's losses; and the
    measured peak of every rank is below the unsharded plan's. (ZeRO-1 and resuming a whole
    state into a sharded plan: the killed-rank test's 2x2-sharded case.)"""
    model = EXAMPLES / "transformer.py"
    # the same micro-batches in both, so that resuming one under the other is bit for bit
    sharded = compile_plan(tmp_path / "sharded", model, 2, 2, sharding="gradients",
                           num_microbatches=2)
    plain = compile_plan(tmp_path / "plain", model, 2, 2, sharding="none", num_microbatches=2)
    assert [st.sharding for st in load_plan(sharded).stages] == ["gradients"] * 2
    assert load_plan(sharded).tied_parameters  # the tie spans both stages
    assert [st.sharding for st in load_plan(plain).stages] == ["none"] * 2
    diff = run_partc("diff", str(plain), str(sharded), timeout=120)
    assert "sharding allowed: none -> gradients" in diff.stdout, diff.stdout + diff.stderr
    assert diff.stdout.count("- -> shard-gradients") == 2, diff.stdout
    got = train_and_compare(sharded, tmp_path, steps=3)

    ckpt, resumed = tmp_path / "ckpt", tmp_path / "resumed.jsonl"
    for plan, steps, flags in ((sharded, 2, ()), (plain, 3, ("--resume",))):
        result = launch(plan, "--steps", str(steps), "--checkpoint-dir", str(ckpt),
                        "--metrics", str(resumed), *flags)
        assert result.returncode == 0, result.stderr[-3000:]
    assert losses_of(resumed) == got  # bit for bit: the state moved whole between the plans

    # step 3 is the step whose memory both runs measured: the sharded run's own (of 3 steps),
    # the unsharded plan's only step after resuming
    from partc.plans.run_metrics import StepMetrics

    def peaks(path: Path, step: int) -> list[int]:
        # line by line: the resumed file holds both plans' runs, which RunMetrics.load refuses
        found = [s for s in (StepMetrics.from_dict(json.loads(line))
                             for line in path.read_text().splitlines()) if s.step == step]
        assert found[-1].memory_method != "none"
        return [int(st.peak_memory_bytes or 0) for st in found[-1].stages]

    metrics = tmp_path / f"{sharded.parent.name}.jsonl"
    assert all(a < b for a, b in zip(peaks(metrics, 3), peaks(resumed, 3), strict=True))


def test_bf16_mixed_trains_close_to_fp32(tmp_path: Path) -> None:
    plan = compile_plan(tmp_path, EXAMPLES / "transformer.py", 2, 1,
                        training=TrainingConfig(precision="bf16-mixed"))
    metrics = tmp_path / "m.jsonl"
    result = launch(plan, "--steps", "3", "--metrics", str(metrics))
    assert result.returncode == 0, result.stderr[-3000:]
    want = train_single_process(load_plan(plan), TrainOptions(steps=3))
    assert_close(losses_of(metrics), want, rtol=2e-2)  # bf16 compute, fp32 weights and loss


# ---- checkpoints, resume, elastic restart ------------------------------------------------------

# the sharded 2 x 2 run covers the restart path in the default run; 2 x 1 and the sharded
# gradients' (whose restart differs only in re-hooking the new processes' stages) are the slow
# set's
@pytest.mark.parametrize("layout", [pytest.param("2x1", marks=pytest.mark.slow), "2x2-sharded",
                                    pytest.param("2x2-sharded-gradients",
                                                 marks=pytest.mark.slow)])
def test_killed_rank_restarts_and_resumes_from_checkpoint(tmp_path: Path, layout: str) -> None:
    """SIGKILL of a worker under --max-restarts 1: every worker restarts and resumes from the
    newest checkpoint, and the losses are the clean run's, bit for bit. 2x2-sharded: 2 stages x
    2 replicas with the optimizer state sharded (ZeRO-1), whose checkpoint is gathered whole
    from the replicas and handed back to them in shares on resume; -gradients: the gradients
    sharded too (ZeRO-2)."""
    if layout == "2x1":
        plan = compile_plan(tmp_path, EXAMPLES / "transformer.py", 2, 1)
    else:
        # the MLP: what is restarted, gathered and handed back does not depend on the model,
        # and its steps cost a fraction of the transformer's (the default run's time)
        sharding = "gradients" if layout.endswith("gradients") else "optimizer"
        plan = compile_plan(tmp_path, EXAMPLES / "mlp.py", 2, 2, sharding=sharding)
        assert all(st.sharding == sharding for st in load_plan(plan).stages)
    steps = 24 if layout == "2x1" else 12
    clean = tmp_path / "clean.jsonl"
    result = launch(plan, "--steps", str(steps), "--metrics", str(clean))
    assert result.returncode == 0, result.stderr[-3000:]

    metrics, ckpt = tmp_path / "killed.jsonl", tmp_path / "ckpt"
    agent = subprocess.Popen([PARTC, "launch", str(plan), "--steps", str(steps), "--metrics",
                              str(metrics), "--checkpoint-dir", str(ckpt), "--checkpoint-every",
                              "1", "--max-restarts", "1"], cwd=ROOT, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    done_at_kill = 0
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and agent.poll() is None:
        done = len(metrics.read_text().splitlines()) if metrics.exists() else 0
        if done >= 4:
            victim = launched_ranks(agent.pid).get(1)  # the first round's: nothing killed yet
            if victim:
                done_at_kill = len(metrics.read_text().splitlines())
                os.kill(victim, signal.SIGKILL)
                break
        time.sleep(0.02)
    out, err = agent.communicate(timeout=300)
    assert done_at_kill >= 4, "the run ended before the test could kill a rank"
    assert done_at_kill < steps
    assert agent.returncode == 0, err[-3000:]
    resumed = [ln for ln in err.splitlines() if "resuming from" in ln]
    assert resumed, err[-2000:]
    step = int(resumed[-1].rsplit("(step ", 1)[1].rstrip(")"))
    assert step >= done_at_kill - 1  # at most the step in flight is run again
    assert losses_of(metrics) == losses_of(clean)  # bit for bit: nothing lost, nothing replayed
    last = latest_checkpoint(ckpt)
    assert last is not None and last.step == steps
    assert len(list(ckpt.glob("step-*"))) <= 2  # --keep-checkpoints 2


@pytest.mark.slow  # default run under 15 min; `make test-slow` runs it
def test_resume_with_a_replanned_layout(tmp_path: Path) -> None:
    """Checkpoints are by parameter name: 3 steps on 2 stages, then 2 more on 2 x 2."""
    a = compile_plan(tmp_path, EXAMPLES / "transformer.py", 2, 1)
    b = compile_plan(tmp_path, EXAMPLES / "transformer.py", 2, 2)
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    first = launch(a, "--steps", "3", "--checkpoint-dir", str(ckpt), "--metrics", str(metrics))
    assert first.returncode == 0, first.stderr[-3000:]
    assert latest_checkpoint(ckpt).step == 3
    # a fresh run must not mix its checkpoints with another run's
    again = launch(a, "--steps", "3", "--checkpoint-dir", str(ckpt))
    assert again.returncode == 2 and "already holds a checkpoint (step 3)" in again.stderr
    second = launch(b, "--steps", "5", "--checkpoint-dir", str(ckpt), "--resume",
                    "--metrics", str(metrics))
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resuming from" in second.stderr
    assert_close(losses_of(metrics), train_single_process(load_plan(a), TrainOptions(steps=5)))


def test_init_from_a_state_dict(tmp_path: Path) -> None:
    import torch

    from partc.frontend.model_file import load_model_file

    plan = compile_plan(tmp_path, EXAMPLES / "mlp.py", 2, 1)
    model = load_model_file(EXAMPLES / "mlp.py").build()
    torch.manual_seed(7)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.05)
    state = tmp_path / "init.pt"
    torch.save(model.state_dict(), state)
    metrics = tmp_path / "m.jsonl"
    result = launch(plan, "--steps", "3", "--init-from", str(state), "--metrics", str(metrics))
    assert result.returncode == 0, result.stderr[-3000:]
    want = train_single_process(load_plan(plan), TrainOptions(steps=3, init_from=state))
    default = train_single_process(load_plan(plan), TrainOptions(steps=3))
    assert_close(losses_of(metrics), want)
    assert abs(want[0] - default[0]) > 1e-3  # the init really changed the weights


def test_init_from_safetensors_saved_through_torch_compile(tmp_path: Path) -> None:
    """A torch.compile'd model's state_dict carries '_orig_mod.' on every name, and the file is
    safetensors: launch reads it as the model names its tensors, says so once, and trains from
    exactly those weights. A file lacking a tensor is refused before any process starts."""
    import torch
    from safetensors.torch import save_file

    from partc.frontend.model_file import load_model_file

    plan = compile_plan(tmp_path, EXAMPLES / "mlp.py", 2, 1)
    model = load_model_file(EXAMPLES / "mlp.py").build()
    torch.manual_seed(7)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.05)
    wrapped = torch.compile(model).state_dict()
    save_file({k: v.contiguous() for k, v in wrapped.items()}, tmp_path / "w.safetensors")
    torch.save(model.state_dict(), tmp_path / "plain.pt")
    metrics = tmp_path / "m.jsonl"
    result = launch(plan, "--steps", "2", "--init-from", str(tmp_path / "w.safetensors"),
                    "--metrics", str(metrics))
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr.count("under the prefix '_orig_mod.' (a torch.compile wrapper's)") == 1
    want = train_single_process(load_plan(plan),
                                TrainOptions(steps=2, init_from=tmp_path / "plain.pt"))
    assert_close(losses_of(metrics), want)
    del wrapped[sorted(wrapped)[-1]]
    save_file({k: v.contiguous() for k, v in wrapped.items()}, tmp_path / "partial.safetensors")
    result = run_partc("launch", str(plan), "--init-from", str(tmp_path / "partial.safetensors"),
                       timeout=120)
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert "(read without the prefix '_orig_mod.') lacks 1 tensor(s) a stage needs" in lines[0]


# ---- torchrun directly, and errors -------------------------------------------------------------

def test_torchrun_runs_the_worker_module(tmp_path: Path) -> None:
    plan = compile_plan(tmp_path, EXAMPLES / "mlp.py", 2, 1)
    metrics = tmp_path / "m.jsonl"
    result = subprocess.run([TORCHRUN, "--standalone", "--nproc-per-node", "2", "-m",
                             "partc.launch", str(plan), "--steps", "2", "--metrics", str(metrics)],
                            capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(losses_of(metrics)) == 2


# slow set: the default run starts torchrun with the wrong world size in
# tests/test_bad_inputs.py (test_torchrun_world_size_mismatch: one worker for a 2-process plan)
@pytest.mark.slow
def test_torchrun_with_the_wrong_world_size_fails_in_one_line(tmp_path: Path) -> None:
    plan = compile_plan(tmp_path, EXAMPLES / "mlp.py", 2, 1)
    result = subprocess.run([TORCHRUN, "--standalone", "--nproc-per-node", "3", "-m",
                             "partc.launch", str(plan), "--steps", "1"],
                            capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode != 0
    # each worker says why in one line (torchrun then prints its own failure report)
    assert "error: the plan runs on 2 processes, torchrun started 3" in result.stderr


def test_launch_errors_are_one_line(tmp_path: Path) -> None:
    plan = compile_plan(tmp_path, EXAMPLES / "mlp.py", 2, 1)
    cases = {
        "--resume needs --checkpoint-dir": [str(plan), "--resume"],
        "no complete checkpoint": [str(plan), "--resume", "--checkpoint-dir",
                                   str(tmp_path / "empty")],
        "not found": [str(tmp_path / "nope" / "plan.yaml")],
        "--init-from": [str(plan), "--init-from", str(tmp_path / "missing.pt")],
        "does not divide": [str(plan), "--nnodes", "3", "--rdzv-endpoint", "localhost:1"],
    }
    for needle, args in cases.items():
        result = run_partc("launch", *args, timeout=120)
        assert result.returncode == 2, (needle, result.stderr)
        lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and needle in lines[0] and "hint:" in lines[0], (needle, lines)
    # a tampered stage file is refused before any process starts
    stage = plan.parent / "stage_1.pt"
    data = bytearray(stage.read_bytes())
    data[len(data) // 2] ^= 0xFF
    stage.write_bytes(bytes(data))
    result = launch(plan, "--steps", "1")
    assert result.returncode == 2 and "does not match plan.yaml" in result.stderr


def test_nccl_plan_without_gpus_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "xl"
    compile_model(TEST_MODELS / "tiny_gpt2_meta.py", load_cluster("8xa100-80gb"), out,
                  CompileOptions(batch_size=8, search=SearchOptions(stages=2, replicas=1)))
    result = launch(out / "plan.yaml", "--steps", "1")
    assert result.returncode == 2
    assert "CUDA device" in result.stderr and "--cluster local" in result.stderr


# ---- the layout (no processes) -----------------------------------------------------------------

def test_rank_layout_of_both_placements(tmp_path: Path) -> None:
    plan = load_plan(compile_plan(tmp_path, EXAMPLES / "mlp.py", 2, 2))
    layout = rank_layout(plan)
    assert layout.world_size == 4
    for p in range(2):
        for r in range(2):
            g = layout.mesh[p][r]
            assert layout.coordinates(g) == (p, r)
            assert layout.stages_of(g) == (p,)
            assert plan.stages[p].devices[r] == layout.devices[g]
    # pipeline-major: each replica's pipeline on neighbouring devices
    swapped = dataclasses.replace(plan, stages=(
        dataclasses.replace(plan.stages[0], devices=(0, 2)),
        dataclasses.replace(plan.stages[1], devices=(1, 3))))
    assert rank_layout(swapped).mesh == ((0, 2), (1, 3))
    broken = dataclasses.replace(plan, stages=(
        dataclasses.replace(plan.stages[0], devices=(0, 1)),
        dataclasses.replace(plan.stages[1], devices=(1, 3))))
    with pytest.raises(PlanError, match="devices"):
        rank_layout(broken)


def test_cpu_workers_are_pinned_one_per_core_and_compute_under_cpu_settings(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A partc CPU device is one core: each gloo worker runs on core local_rank % cores only (its
    data-drawing ranks record where they may run), and gloo's socket loops run SCHED_BATCH, so
    they cannot preempt the worker's own threads and spin (the last stage's loss records them).
    The workers compute with denormals flushed to zero and freed memory kept by the C allocator,
    as single-process training and the profiler do: a profile times the arithmetic launch
    runs."""
    from partc.cost.measured import ProfileOptions, profile_model
    from partc.hardware.local import core_cpus

    model = TEST_MODELS / "process_probe.py"
    plan = compile_plan(tmp_path, model, 2, 1)
    probe = tmp_path / "probe"
    probe.mkdir()
    env = {**os.environ, "PARTC_PROBE_DIR": str(probe)}
    result = run_partc("launch", str(plan), "--steps", "2", env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    cores = core_cpus()
    for rank in (0, 1):
        cpus = {int(c) for c in (probe / f"rank{rank}.txt").read_text().split(",")}
        assert cpus == set(cores[rank % len(cores)]), (rank, cpus, cores)
    # every process group's loop (the world's, the pipeline's, the replicas'), while training
    loops = (probe / "gloo_io.txt").read_text().split()
    assert len(loops) >= 2 and set(loops) == {"batch"}, loops
    denormals = probe / "denormals.txt"
    allocator = probe / "allocator.txt"
    assert set(denormals.read_text().split()) == {"flushed"}  # launch's last stage
    assert set(allocator.read_text().split()) == {"kept"}
    denormals.unlink()
    allocator.unlink()
    # the same probe in a fresh process that does not enter cpu_settings: glibc's default
    default = subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); "
                              "import process_probe, torch; process_probe.loss_fn("
                              "torch.zeros(2, 4), torch.zeros(2, dtype=torch.long))",
                              str(TEST_MODELS)], capture_output=True, text=True, env=env,
                             timeout=120)
    assert default.returncode == 0, default.stderr[-2000:]
    assert allocator.read_text().split() == ["returned"]
    denormals.unlink()
    allocator.unlink()
    monkeypatch.setenv("PARTC_PROBE_DIR", str(probe))
    train_single_process(load_plan(plan), TrainOptions(steps=1))
    assert set(denormals.read_text().split()) == {"flushed"}
    assert set(allocator.read_text().split()) == {"kept"}
    denormals.unlink()
    allocator.unlink()
    profile_model(model, 4, ProfileOptions(batch_sizes=(2, 4), warmup=1, runs=2))
    assert set(denormals.read_text().split()) == {"flushed"}
    assert set(allocator.read_text().split()) == {"kept"}
    # and this process computes as torch's default again
    assert float(torch.full((), 1e-40) * 2) != 0.0


# ---- metrics: what a run measured, per stage -----------------------------------------------------

def test_metrics_per_stage_and_show_beside_the_prediction(tmp_path: Path) -> None:
    """2 processes (gloo): every step's line has synchronised per-stage times, p2p, optimizer and
    peak memory; the typed reader reads exactly what the runtime wrote; `partc show --metrics`
    sets them beside the plan's prediction."""
    from partc.plans.run_metrics import MEMORY_CPU_PROFILER, MEMORY_NONE, RunMetrics

    plan = compile_plan(tmp_path, EXAMPLES / "mlp.py", 2, 1)
    metrics = tmp_path / "m.jsonl"
    result = launch(plan, "--steps", "4", "--metrics", str(metrics))
    assert result.returncode == 0, result.stderr[-3000:]
    # the summary compares measured per-stage times with the plan's predictions
    assert "predicted" in result.stdout and "trained steps 1..4" in result.stdout
    assert "data: the model file's batches()" in result.stderr
    run = RunMetrics.load(metrics)
    assert [s.step for s in run.steps] == [1, 2, 3, 4] and run.num_stages == 2
    for step in run.steps:
        assert step.clock == "perf_counter" and step.replicas == 1
        M = step.num_microbatches
        assert [s.index for s in step.stages] == [0, 1]
        assert [s.pipeline_rank for s in step.stages] == [0, 1]
        for s in step.stages:
            for value in (s.forward_s, s.backward_s, s.p2p_s, s.optimizer_s, s.ddp_allreduce_s,
                          s.tied_sync_s):
                assert value >= 0.0
            assert s.forward_s > 0 and s.backward_s > 0 and s.optimizer_s > 0
            # the stage's forwards and backwards happen inside the step
            assert M * (s.forward_s + s.backward_s) <= step.step_s
            assert s.ddp_allreduce_s == 0.0  # no replicas
            # the computing thread's CPU time of the same calls: there, and not above the wall
            # time (each process has its own core here, so nearly all of it)
            for cpu, wall in ((s.forward_cpu_s, s.forward_s), (s.backward_cpu_s, s.backward_s),
                              (s.optimizer_cpu_s, s.optimizer_s)):
                assert cpu is not None and 0.0 < cpu <= wall * 1.01 + 1e-4, (cpu, wall)
            # the process's CPU between the passes, per pass: schedule loop, step setup
            assert s.between_cpu_s is not None and 0.0 < s.between_cpu_s
            assert 2 * M * s.between_cpu_s <= step.step_s
            # and apart, per pass, its CPU in the p2p posts and waits (gloo copies a send's
            # bytes there): never above their wall time
            assert s.p2p_cpu_s is not None and 0.0 < s.p2p_cpu_s
            assert 2 * M * s.p2p_cpu_s <= s.p2p_s * 1.01 + 1e-4
        # the legacy keys agree with the stages (one replica: mean == max)
        assert step.stage_forward_s == tuple(s.forward_s for s in step.stages)
    # CPU: the profiler measures the third step only (and it is left out of time medians)
    assert [s.memory_method for s in run.steps] == [MEMORY_NONE, MEMORY_NONE,
                                                   MEMORY_CPU_PROFILER, MEMORY_NONE]
    peaks = [s.peak_memory_bytes for s in run.steps[2].stages]
    assert all(p is not None and p > 0 for p in peaks)
    # the memory model's promise on this CPU: each stage's predicted peak is never below what
    # the run measured, and at most 10% above (launch's own metrics buffers included)
    predicted = [s.peak_memory_bytes for s in load_plan(plan).stages]
    for want, got in zip(predicted, peaks, strict=True):
        assert got is not None and got <= want <= 1.10 * got, (predicted, peaks)
    assert [s.step for s in run.timed_steps()] == [2, 4]
    # one definition of the keys: the file's lines are the dataclasses' JSON
    assert [s.to_json() for s in run.steps] == metrics.read_text().splitlines()
    assert "p2p ms" in result.stdout and "peak" in result.stdout
    # each step's metrics reach rank 0 during the next step: every step is still reported once,
    # in order, the last one too
    assert re.findall(r"^step (\d+)/4 ", result.stderr, re.M) == ["1", "2", "3", "4"], \
        result.stderr

    shown = run_partc("show", str(plan), "--metrics", str(metrics), timeout=120)
    assert shown.returncode == 0, shown.stderr
    out = shown.stdout
    assert "measured (4 step(s); medians over step(s) 2..4" in out
    assert "iteration" in out and "(median)" in out and "Peak memory: torch.profiler" in out
    rows = [ln for ln in out.splitlines() if ln.split("|")[0].split()[:1] in (["0"], ["1"])
            and ln.count("|") == 6]
    assert len(rows) == 2, out


def test_trace_profiles_the_third_step_of_every_rank(tmp_path: Path) -> None:
    """--trace: the step the CPU memory probe watches runs under one profiler that also writes,
    per rank, a Chrome trace and an operator table; the step is marked traced and left out of the
    time summaries, and its peak memory is still measured (and still within the model's bounds)."""
    from partc.plans.run_metrics import MEMORY_CPU_PROFILER, RunMetrics

    plan = compile_plan(tmp_path, EXAMPLES / "mlp.py", 2, 1)
    metrics, trace = tmp_path / "m.jsonl", tmp_path / "trace" / "run"
    result = launch(plan, "--steps", "4", "--metrics", str(metrics), "--trace", str(trace))
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"trace of step 3 -> {trace}" in result.stderr + result.stdout
    assert sorted(p.name for p in trace.iterdir()) == [
        "rank0.json", "rank0.txt", "rank1.json", "rank1.txt"]  # no temporary files left
    for rank in (0, 1):
        events = json.loads((trace / f"rank{rank}.json").read_text())["traceEvents"]
        ops = {e["name"] for e in events if e.get("cat") == "cpu_op"}
        assert "aten::addmm" in ops or "aten::mm" in ops, sorted(ops)[:20]
        assert any("Input Dims" in e.get("args", {}) for e in events)  # shapes recorded
        table = (trace / f"rank{rank}.txt").read_text()
        assert table.startswith(f"partc launch --trace: {plan}, step 3, rank {rank}, "
                                f"stage(s) {rank}, device cpu"), table[:300]
        assert "Self CPU" in table and "aten::" in table
    run = RunMetrics.load(metrics)
    assert [s.traced for s in run.steps] == [False, False, True, False]
    assert run.steps[2].memory_method == MEMORY_CPU_PROFILER and run.steps[2].profiled
    assert [s.step for s in run.timed_steps()] == [2, 4]
    predicted = [s.peak_memory_bytes for s in load_plan(plan).stages]
    peaks = [s.peak_memory_bytes for s in run.steps[2].stages]
    for want, got in zip(predicted, peaks, strict=True):
        assert got is not None and got <= want <= 1.10 * got, (predicted, peaks)
    # untraced lines are written as before (no "traced" key)
    lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert ["traced" in x for x in lines] == [False, False, True, False]


def test_node_rank_under_a_dynamic_rendezvous_is_named(capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    """--node-rank means nothing to c10d (torchrun ignores it too): partc says so, and says
    nothing under the static rendezvous that honours it."""
    from partc.options import ElasticOptions
    from partc.run.launch import check_launch

    plan = load_plan(EXAMPLES / "plans" / "mlp")
    options = TrainOptions(steps=1)
    dynamic = ElasticOptions(nnodes=2, node_rank=1, rdzv_endpoint="127.0.0.1:29400")
    assert check_launch(plan, options, dynamic) == 1
    assert "--node-rank 1 is ignored by the c10d rendezvous" in capsys.readouterr().err
    static = ElasticOptions(nnodes=2, node_rank=1, rdzv_endpoint="127.0.0.1:29400",
                            rdzv_backend="static")
    check_launch(plan, options, static)
    assert "--node-rank" not in capsys.readouterr().err


FORKED_ENVIRONMENT = """
import json, os, sys
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes
from partc.run.launch import _start_forkserver
from partc.run.worker import rank_environment

def rank_env(rank, launch_env):
    pc = start_processes(name="probe", entrypoint=rank_environment, args={0: (launch_env,)},
                         envs={0: {"RANK": str(rank)}}, logs_specs=DefaultLogsSpecs(),
                         start_method="forkserver")
    result = pc.wait()
    assert not result.is_failed(), result.failures
    return result.return_values[0]

os.environ["PARTC_PROBE"], os.environ["PARTC_GONE"] = "first", "x"
_start_forkserver()
first = rank_env(0, dict(os.environ))
os.environ["PARTC_PROBE"] = "second"
del os.environ["PARTC_GONE"]
second = rank_env(1, dict(os.environ))
print(json.dumps([{k: env.get(k) for k in ("RANK", "PARTC_PROBE", "PARTC_GONE")}
                  for env in (first, second)]))
"""


def test_a_forked_rank_runs_with_the_launchers_environment_of_its_launch() -> None:
    """Ranks are forked from one forkserver, started by a process's first launch with that
    moment's environment: a later launch's ranks still get the launcher's environment as it is
    then, with their own RANK over it (torch's agent sets it in the forked process)."""
    proc = subprocess.run([sys.executable, "-c", FORKED_ENVIRONMENT], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, second = json.loads(proc.stdout.strip().splitlines()[-1])
    assert first == {"RANK": "0", "PARTC_PROBE": "first", "PARTC_GONE": "x"}
    assert second == {"RANK": "1", "PARTC_PROBE": "second", "PARTC_GONE": None}
