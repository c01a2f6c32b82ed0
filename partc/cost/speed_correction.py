"""A CPU profile of this machine scaled to the machine's mean speed: the calibrated device config's
speed reference over the speed probe the profile timed beside its totals (partc.cost.speed_probe).

Precondition: the table is a measured profile whose calibration records a `speed_probe`, of the
machine the device config was calibrated on (its device label names `calibrated_on`), at one
thread, and the config has a `speed_reference_s` for the probe's dtype. Otherwise the table is
returned unchanged: a profile of another machine, a datasheet config, a profile from before
probes (revision < 9) are priced as measured.

Postcondition: where reference / probe lies beyond BAND of 1 (below), every node's and the
loss's forward and backward times are multiplied by its excess over the band (bytes are not:
memory does not move with speed), and the calibration records the factor under
SPEED_CORRECTION. A table that records one is never corrected again, so a
profile written after correcting (compile --calibrate-from writes its corrected table) reads
back as it was solved with.

Why the mean speed: the device's speed spread gives each step's speed as factors of the mean
(partc.hardware.speed_spread, priced by partc.solve.stragglers), which assumes the profile was
measured at the mean. A profile's totals take about a second per size, so on a VM whose speed
switches every few seconds they catch whichever mode was running.

Only what lies beyond the probe's own disagreement with the reference is corrected (BAND). On
a quiet machine (run BV, 2026-12-08: no slow window on either core before or after) the probe
read the reference's 0.99-1.05x where one process runs per core and 1.03-1.09x where the
profiled process shares its core with a neighbour (cpu-4: its CPU time includes refilling the
caches its core-mate evicted), while the models' own re-measured drift did not follow it; a
profile taken in the slow mode reads 1.4-2x. So a ratio within BAND of 1 prices the profile as
measured, and a ratio beyond it is corrected by its excess only (a probe 1.43x slow scales the
profile by 1.10 / 1.43).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping

from partc.cost.speed_probe import PROBE, probe_from
from partc.cost.table import CostTable, NodeCost
from partc.hardware.specs import DeviceSpec

SPEED_CORRECTION = "speed_correction"  # the profile calibration's key
BAND = 0.10  # a probe within this of the reference (either way) is the probe's own noise


def probe_ratio(kind: object, device_label: object, threads: object,
                calibration: Mapping[str, Any], device: DeviceSpec) -> float | None:
    """reference / probe for a profile (its source's `kind`, `device` label, `threads` and
    `calibration`, as a CostSource or a profile file holds them) priced on `device`, or None
    where the module docstring's precondition does not hold (or it was corrected already)."""
    if SPEED_CORRECTION in calibration or kind != "measured" or threads != 1:
        return None
    probe = probe_from(calibration.get(PROBE))
    if probe is None:
        return None
    reference = device.speed_reference_s.get(probe.dtype)
    if reference is None or not device.calibrated_on \
            or device_label != f"cpu ({device.calibrated_on})":
        return None
    return reference / probe.median_s


def beyond_band(ratio: float) -> float | None:
    """The factor a profile whose probe reads `ratio` (reference / probe) is scaled by: None
    within BAND of 1 either way, else the ratio's excess beyond the band."""
    if ratio < 1 / (1 + BAND):
        return ratio * (1 + BAND)
    if ratio > 1 + BAND:
        return ratio / (1 + BAND)
    return None


def correction_factor(kind: object, device_label: object, threads: object,
                      calibration: Mapping[str, Any], device: DeviceSpec) -> float | None:
    """The factor a profile (`probe_ratio`'s arguments) is scaled by on `device`, or None where
    it is priced as measured."""
    ratio = probe_ratio(kind, device_label, threads, calibration, device)
    return None if ratio is None else beyond_band(ratio)


def table_probe_ratio(table: CostTable, device: DeviceSpec) -> float | None:
    """`probe_ratio` of a table."""
    source = table.source
    return probe_ratio(source.kind, source.device, source.threads, source.calibration, device)


def speed_factor(table: CostTable, device: DeviceSpec) -> float | None:
    """`correction_factor` of a table."""
    source = table.source
    return correction_factor(source.kind, source.device, source.threads, source.calibration,
                             device)


def speed_corrected(table: CostTable, device: DeviceSpec) -> CostTable:
    """`table` scaled to `device`'s reference speed where it applies (module docstring)."""
    factor = speed_factor(table, device)
    if factor is None:
        return table
    probe = probe_from(table.source.calibration[PROBE])
    assert probe is not None

    def scaled(cost: NodeCost) -> NodeCost:
        return replace(cost, forward=cost.forward.scaled(factor),
                       backward=cost.backward.scaled(factor))

    record = {"factor": float(f"{factor:.6g}"), "probe_s": probe.to_dict()["median_s"],
              "reference_s": device.speed_reference_s[probe.dtype], "band": BAND,
              "device": device.name}
    source = replace(table.source,
                     calibration={**table.source.calibration, SPEED_CORRECTION: record})
    return replace(table, source=source, nodes={n: scaled(c) for n, c in table.nodes.items()},
                   loss=scaled(table.loss))


def correction_text(ratio: float, device: DeviceSpec) -> str:
    """What a probe reading `ratio` (reference / probe) does to the profile, in a few words, for
    compile's progress."""
    factor = beyond_band(ratio)
    read = (f"its reference matmul ran {1 / ratio:.2f}x {device.name}'s calibrated mean time "
            "while it was timed")
    if factor is None:
        return f"profile priced as measured ({read}: within {BAND:.0%}, the probe's own noise)"
    return (f"profile scaled x{factor:.3f} toward {device.name}'s calibrated mean speed ({read};"
            f" the part beyond {BAND:.0%})")
