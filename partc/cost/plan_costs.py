"""The CostTable a plan is solved with: a checked-in profile, or the analytic roofline."""
from __future__ import annotations

from pathlib import Path

from partc.cost.activations import saved_activations
from partc.cost.roofline import analytic_cost_table
from partc.cost.table import CostTable
from partc.frontend.capture import CaptureResult
from partc.hardware.specs import DeviceSpec
from partc.options import Precision
from partc.progress import Progress


def plan_costs(result: CaptureResult, device: DeviceSpec, profile: str | Path | None = None,
               progress: Progress | None = None, precision: Precision = "fp32") -> CostTable:
    """The CostTable a plan is solved with: a saved profile of this model (`partc profile`,
    checked against the graph hash and the precision) or, without one, the analytic roofline on
    `device` under `precision`, with saved activations measured on meta as `device`'s kernels
    keep them."""
    progress = progress or Progress()
    if profile is not None:
        with progress.step(f"loading profile {profile}"):
            return CostTable.load(profile, result.graph, precision=precision)
    with progress.step(f"pricing {len(result.graph.nodes)} operators on {device.name} (roofline)"):
        saved = saved_activations(result.capture, target_kind=device.kind)
        return analytic_cost_table(result.graph, device, saved=saved, precision=precision)
