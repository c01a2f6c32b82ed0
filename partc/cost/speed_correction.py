"""A CPU profile of this machine scaled to the machine's mean speed: the calibrated device config's
speed reference over the speed probe the profile timed beside its totals (partc.cost.speed_probe).

Precondition: the table is a measured profile whose calibration records a `speed_probe`, of the
machine the device config was calibrated on (its device label names `calibrated_on`), at one
thread, and the config has a `speed_reference_s` for the probe's dtype. Otherwise the table is
returned unchanged: a profile of another machine, a datasheet config, a profile from before
probes (revision < 9) are priced as measured.

Postcondition: every node's and the loss's forward and backward times are multiplied by
reference / probe (bytes are not: memory does not move with speed), and the calibration records
the factor under SPEED_CORRECTION. A table that records one is never corrected again, so a
profile written after correcting (compile --calibrate-from writes its corrected table) reads
back as it was solved with.

Why the mean speed: the device's speed spread gives each step's speed as factors of the mean
(partc.hardware.speed_spread, priced by partc.solve.stragglers), which assumes the profile was
measured at the mean. A profile's totals take about a second per size, so on a VM whose speed
switches every few seconds they catch whichever mode was running.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping

from partc.cost.speed_probe import PROBE, probe_from
from partc.cost.table import CostTable, NodeCost
from partc.hardware.specs import DeviceSpec

SPEED_CORRECTION = "speed_correction"  # the profile calibration's key


def correction_factor(kind: object, device_label: object, threads: object,
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
              "reference_s": device.speed_reference_s[probe.dtype], "device": device.name}
    source = replace(table.source,
                     calibration={**table.source.calibration, SPEED_CORRECTION: record})
    return replace(table, source=source, nodes={n: scaled(c) for n, c in table.nodes.items()},
                   loss=scaled(table.loss))


def correction_text(factor: float, device: DeviceSpec) -> str:
    """The correction in a few words, for compile's progress."""
    return (f"profile scaled x{factor:.3f} to {device.name}'s calibrated mean speed (its "
            f"reference matmul ran {1 / factor:.2f}x the calibrated time while it was timed)")
