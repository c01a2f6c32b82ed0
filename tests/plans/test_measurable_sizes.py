"""A model too large for one device (what partc plans for) cannot be measured whole on one:
compile measures only at the sizes the whole model fits one device at
(partc.plans.measurable_sizes), prices by the roofline where it fits at none and says so, and
turns an out-of-memory error while measuring into the same fallback (`auto`) or a one-line error
(`--costs measured`), never a crash or a process the OS kills."""
from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path

import pytest
import torch
import yaml
from conftest import ROOT, TEST_MODELS, captured
from partc_process import run_partc

from partc.cost.measured import MeasuringOutOfMemory
from partc.cost.plan_costs import measurement, plan_costs
from partc.frontend.model_file import is_out_of_memory
from partc.hardware.configs import load_cluster
from partc.options import TrainingConfig
from partc.plans.measurable_sizes import WholeModelMemory, check_profile_sizes, whole_model_fits
from partc.plans.plan import load_plan
from partc.solve.memory import stage_memory, usable_memory

HEAVY = TEST_MODELS / "heavy_weights.py"
MiB = 2**20


def test_the_larger_size_is_halved_until_the_whole_model_fits() -> None:
    assert measurement("cpu", 2, 256, "fp32").batch_sizes == (2, 64)  # type: ignore[union-attr]
    up_to_20 = measurement("cpu", 2, 256, "fp32", extra_sizes=(12, 48), fits=lambda b: b <= 20)
    assert up_to_20 is not None and up_to_20.batch_sizes == (2, 12, 16)
    # a profile needs two sizes: none larger than B fits, or B itself does not
    assert measurement("cpu", 2, 256, "fp32", fits=lambda b: b <= 3) is None
    assert measurement("cpu", 2, 256, "fp32", fits=lambda b: False) is None


def test_out_of_memory_errors_are_told_apart_from_other_kernel_errors() -> None:
    with pytest.raises(RuntimeError) as refused:  # more than any machine has: refused at once
        torch.empty(2**62, dtype=torch.uint8)
    assert is_out_of_memory(refused.value)
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"))
    assert not is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_out_of_memory(NotImplementedError('"histogram_cpu" not implemented for Int'))


def test_the_whole_model_fits_by_the_memory_model_at_its_boundary() -> None:
    result = captured(HEAVY)
    cpu = load_cluster("cpu").device
    training = TrainingConfig(optimizer="sgd")
    assert whole_model_fits(result, cpu, training)(64)  # gigabytes: the graph's bound settles it
    # the memory model's peak of the whole model, one micro-batch, no optimizer step
    table = plan_costs(result, cpu)
    peak = stage_memory(table, [n.name for n in result.graph.nodes], microbatch_size=8,
                        num_microbatches=1, stage_index=0, num_stages=1, config=training)
    weights = sum(p.nbytes for p in result.graph.params)
    # weights, gradients, one weight's gradient buffer in the backward, little else
    assert 2 * weights <= peak.total < 2.4 * weights
    for memory, fits in ((peak.total + MiB, True), (peak.total - MiB, False)):
        device = dataclasses.replace(cpu, memory_bytes=int(memory / 0.9) + 1)
        assert usable_memory(device.memory_bytes, training) >= peak.total - MiB
        assert whole_model_fits(result, device, training)(8) is fits


def _small_cluster(tmp_path: Path, memory: str) -> Path:
    data = yaml.safe_load((ROOT / "configs" / "clusters" / "cpu.yaml").read_text())
    data["device_memory_bytes"] = memory
    path = tmp_path / "small.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _compile(tmp_path: Path, cluster: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return run_partc("compile", str(HEAVY), "-b", "8", "--stages", "2", "--optimizer", "sgd",
                     "--cluster", str(cluster), "-o", str(tmp_path / "out"), *flags, timeout=600)


def test_a_model_no_one_device_holds_is_priced_by_the_roofline_and_checks(tmp_path: Path) -> None:
    """Four 4 MiB layers: the whole model with its gradients (36 MiB) does not fit a device of
    30 MiB, two stages do. Compile (`--costs auto`, this machine's cluster) says why it does not
    measure, plans by the roofline and records it; check re-solves it as current; `--costs
    measured` refuses in one line and writes nothing."""
    cluster = _small_cluster(tmp_path, "30MiB")
    proc = _compile(tmp_path, cluster)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "warning: the whole model does not fit one cpu device's memory to be measured, " \
        "even at batch 2: priced by the roofline instead" in proc.stderr, proc.stderr[-3000:]
    plan = load_plan(tmp_path / "out")
    assert plan.costs.source == "analytic" and plan.num_stages == 2
    assert not (tmp_path / "out" / "profile.yaml").exists()
    check = run_partc("check", str(tmp_path / "out" / "plan.yaml"), timeout=600)
    assert check.returncode == 0, check.stdout + check.stderr[-3000:]

    refused = _compile(tmp_path / "measured", cluster, "--costs", "measured")
    assert refused.returncode == 2, refused.stderr[-3000:]
    errors = [ln for ln in refused.stderr.splitlines() if ln.startswith("partc: error:")]
    assert len(errors) == 1 and "--costs measured: the whole model does not fit" in errors[0]
    assert "(hint: " in errors[0] and "Traceback" not in refused.stderr
    assert not (tmp_path / "measured" / "out").exists()


def test_a_profile_is_refused_before_measuring_sizes_the_device_cannot_hold() -> None:
    """Between the sizes' peaks: the larger is refused, the hint names two that fit."""
    result = captured(HEAVY)
    cpu = load_cluster("cpu").device
    training = TrainingConfig()
    at = WholeModelMemory(result, cpu, training)
    assert at.needed(256) < at.needed(512)
    budget = (at.needed(256) + at.needed(512)) // 2
    device = dataclasses.replace(cpu, memory_bytes=int(budget / 0.9))
    assert usable_memory(device.memory_bytes, training) <= budget
    check_profile_sizes(result, device, training, (128, 256))  # both fit: no error
    with pytest.raises(MeasuringOutOfMemory) as refused:
        check_profile_sizes(result, device, training, (256, 512))
    assert "to be measured at batch 512:" in str(refused.value)
    assert "--batch-sizes 128,256" in refused.value.hint
    tiny = dataclasses.replace(cpu, memory_bytes=MiB)  # not even the weights
    with pytest.raises(MeasuringOutOfMemory) as none_fit:
        check_profile_sizes(result, tiny, training, (1, 2))
    assert "measure a smaller model" in none_fit.value.hint


def test_partc_profile_refuses_a_model_larger_than_this_machine(tmp_path: Path) -> None:
    """16 GiB of weights built on meta: measuring it whole would materialise 32 GiB with its
    gradients, and on a CPU the OS kills such a process where no handler sees it. Profile
    refuses in one line before materialising anything, and writes nothing."""
    out = tmp_path / "profile.yaml"
    proc = run_partc("profile", str(TEST_MODELS / "huge_meta.py"), "-b", "2", "--method", "torch",
                     "-o", str(out), timeout=600)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("partc: error:")]
    assert len(errors) == 1 and "does not fit one cpu" in errors[0], proc.stderr[-3000:]
    assert "(hint: " in errors[0] and "Traceback" not in proc.stderr
    assert "materialising" not in proc.stderr and not out.exists()
