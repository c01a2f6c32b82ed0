"""A CPU profile's speed probe (partc.cost.speed_probe) and its correction to a calibrated
config's mean speed (partc.cost.speed_correction): real profiles of a small model, real compiles,
`partc check` and `partc diff` of the plans."""
from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import EXAMPLES, captured

from partc.cost.measured import ProfileOptions
from partc.cost.profile_cache import cached_profile
from partc.cost.speed_correction import (
    BAND,
    SPEED_CORRECTION,
    beyond_band,
    speed_corrected,
    speed_factor,
)
from partc.cost.speed_probe import PROBE
from partc.cost.table import CostTable, format_cost_summary
from partc.hardware.configs import load_cluster, load_device
from partc.hardware.local import cpu_model
from partc.hardware.specs import DeviceSpec
from partc.hardware.speed_spread import KERNEL

FAST = ProfileOptions(runs=2, warmup=1, method="torch", totals_budget_s=0.2)
PARTC = str(Path(sys.executable).parent / "partc")


def _profile(precision: str = "fp32") -> CostTable:
    table, _ = cached_profile(captured(EXAMPLES / "mlp.py"),
                              dataclasses.replace(FAST, precision=precision))
    return table


def _calibrated(reference: dict[str, float], on: str | None = None) -> DeviceSpec:
    """The shipped cpu config as if `partc calibrate` had measured it here, with `reference`."""
    return dataclasses.replace(load_device("cpu"), calibrated_on=on or cpu_model(),
                               speed_reference_s=reference)


@pytest.mark.parametrize(("precision", "dtype"), [("fp32", "float32"),
                                                  ("bf16-mixed", "bfloat16")])
def test_a_cpu_profile_records_its_speed_probe(precision: str, dtype: str) -> None:
    """The probe is the speed spread's kernel in the precision's matmul dtype, timed once per
    round of the totals: as many rounds as the totals ran (at least `runs`)."""
    table = _profile(precision)
    probe = table.source.calibration[PROBE]
    assert probe["dtype"] == dtype and tuple(probe["kernel"]) == KERNEL
    assert probe["rounds"] >= 3
    # one 512x512x128 matmul on one core: tens of microseconds to a few milliseconds
    assert 1e-5 < probe["median_s"] < 0.05
    # and `partc profile` says it
    assert (f"machine speed while the totals were timed: a 512x512x128 {dtype} matmul took "
            f"{probe['median_s'] * 1e3:.3f} ms (median of {probe['rounds']} rounds"
            in format_cost_summary(table))


def test_a_profile_is_scaled_by_what_its_probe_reads_beyond_the_band(tmp_path: Path) -> None:
    """Probe 1.25x the reference (a slow spell): scaled by 1.10 / 1.25, the part beyond the
    probe's own noise (BAND); times only, never bytes; recorded, and never applied twice."""
    assert BAND == 0.10
    table = _profile()
    probe = table.source.calibration[PROBE]["median_s"]
    device = _calibrated({"float32": 0.8 * probe})
    assert speed_factor(table, device) == pytest.approx(0.88)
    fixed = speed_corrected(table, device)
    for name, cost in table.nodes.items():
        for m in table.source.batch_sizes:
            assert fixed.forward_s(name, m) == pytest.approx(0.88 * cost.forward.at(m))
            assert fixed.backward_s(name, m) == pytest.approx(0.88 * cost.backward.at(m))
            assert fixed.saved_bytes(name, m) == cost.saved.at(m)  # memory does not move
    m = table.source.batch_sizes[-1]
    assert fixed.loss.forward.at(m) == pytest.approx(0.88 * table.loss.forward.at(m))
    record = fixed.source.calibration[SPEED_CORRECTION]
    assert record["factor"] == pytest.approx(0.88) and record["device"] == "cpu"
    assert record["band"] == BAND
    # corrected once: neither again, nor when read back from the profile it is written to
    # (compile --calibrate-from writes a corrected table into the plan directory)
    assert speed_factor(fixed, device) is None and speed_corrected(fixed, device) is fixed
    loaded = CostTable.load(fixed.save(tmp_path / "profile.yaml"), table.graph)
    assert loaded.source.calibration[SPEED_CORRECTION] == record
    assert speed_factor(loaded, device) is None
    assert math.isclose(loaded.total_forward_s(m), fixed.total_forward_s(m), rel_tol=1e-4)


def test_a_probe_within_the_band_prices_the_profile_as_measured() -> None:
    """Within 10% either way the probe reads its own noise (shared cores read up to 9% slow on
    a quiet machine): no correction; beyond it, faster as well as slower, the excess."""
    table = _profile()
    probe = table.source.calibration[PROBE]["median_s"]
    for ratio in (1 / 1.099, 0.95, 1.0, 1.05, 1.099):
        device = _calibrated({"float32": ratio * probe})
        assert speed_factor(table, device) is None, ratio
        assert speed_corrected(table, device) is table
    assert speed_factor(table, _calibrated({"float32": 1.32 * probe})) == pytest.approx(1.2)
    assert beyond_band(0.5) == pytest.approx(0.55) and beyond_band(1.0) is None


def test_a_profile_is_priced_as_measured_where_the_correction_does_not_apply() -> None:
    table = _profile()
    probe = table.source.calibration[PROBE]["median_s"]
    src = table.source

    def with_source(**changes: object) -> CostTable:
        return dataclasses.replace(table, source=dataclasses.replace(src, **changes))

    def with_probe(**changes: object) -> CostTable:
        return with_source(calibration={**src.calibration,
                                        PROBE: {**src.calibration[PROBE], **changes}})

    cases = {
        "a datasheet config (no reference)": (table, load_device("cpu")),
        "a reference of another dtype": (table, _calibrated({"bfloat16": probe})),
        "a config calibrated on another machine": (
            table, _calibrated({"float32": probe}, on="Imaginary CPU 9000")),
        "a profile at more threads than the reference's one": (
            with_source(threads=2), _calibrated({"float32": probe})),
        "a profile of another machine": (
            with_source(device="cpu (Imaginary CPU 9000)"), _calibrated({"float32": probe})),
        "a profile without a probe (revision < 9)": (
            with_source(calibration={k: v for k, v in src.calibration.items() if k != PROBE}),
            _calibrated({"float32": probe})),
        "a probe of another kernel": (with_probe(kernel=[256, 256, 256]),
                                      _calibrated({"float32": probe})),
        "a probe that is not a time": (with_probe(median_s=-1.0),
                                       _calibrated({"float32": probe})),
        "a probe of no rounds": (with_probe(rounds=0), _calibrated({"float32": probe})),
    }
    for why, (t, device) in cases.items():
        assert speed_factor(t, device) is None, why
        assert speed_corrected(t, device) is t, why


def _cluster_file(directory: Path, reference: float) -> Path:
    """The shipped cpu cluster, its device calibrated here with `reference` (float32)."""
    cluster = load_cluster("cpu")
    device = _calibrated({"float32": reference})
    path = directory / "cluster.yaml"
    path.write_text(yaml.safe_dump(dataclasses.replace(cluster, device=device).to_dict()))
    return path


def _partc(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PARTC, *args], capture_output=True, text=True, timeout=600)


def test_compile_scales_this_machines_profile_and_check_and_diff_see_it(tmp_path: Path) -> None:
    """A compile for a calibrated cluster of this machine measures the model, scales the
    profile to the config's mean speed and says so; the plan directory holds the profile as
    measured, and `partc check` re-solves it to the same plan through the same correction.
    A config whose reference moved re-prices the same profile: `partc diff` names the change
    of cost source."""
    plans = []
    for i, reference in enumerate((0.02, 0.04)):
        out = tmp_path / f"plan{i}"
        proc = _partc("compile", str(EXAMPLES / "mlp.py"), "-b", "64", "--cluster",
                      str(_cluster_file(tmp_path, reference)), "-o", str(out))
        assert proc.returncode == 0, proc.stderr
        assert "toward cpu's calibrated mean speed" in proc.stderr
        profile = yaml.safe_load((out / "profile.yaml").read_text())
        probe = profile["calibration"][PROBE]["median_s"]
        assert SPEED_CORRECTION not in profile["calibration"]  # written as measured
        factor = beyond_band(reference / probe)
        assert factor is not None and f"profile scaled x{factor:.3f}" in proc.stderr
        check = _partc("check", str(out / "plan.yaml"))
        assert check.returncode == 0 and ": current" in check.stdout, check.stdout + check.stderr
        plans.append(out / "plan.yaml")
    # twice the reference, the same profile (the cache's entry): the model's work priced at
    # twice the time (the optimizer step and the runtime's overheads are the config's own)
    first, second = (yaml.safe_load(p.read_text())["predicted"] for p in plans)
    assert second["iteration_s"] > 1.2 * first["iteration_s"]
    diff = _partc("diff", str(plans[0]), str(plans[1]))
    costs = [line for line in diff.stdout.splitlines() if line.startswith("costs: ")]
    assert len(costs) == 1 and costs[0].count("speed-corrected x") == 2, diff.stdout
