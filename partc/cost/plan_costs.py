"""The CostTable a plan is solved with: a checked-in profile, a profile measured on this machine
(cached), or the analytic roofline."""
from __future__ import annotations

import gc
from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch.utils._pytree as pytree

from partc.cost.activations import saved_activations, storage_bytes
from partc.cost.measured import MeasuringOutOfMemory, ProfileOptions
from partc.cost.roofline import analytic_cost_table
from partc.cost.speed_correction import correction_text, speed_corrected, table_probe_ratio
from partc.cost.table import CostTable, Curve, SavedActivations
from partc.errors import PartcError
from partc.frontend.capture import CaptureResult
from partc.hardware.local import measurable_device
from partc.hardware.specs import ClusterSpec, DeviceSpec
from partc.options import CostsMode, Precision
from partc.progress import Progress


def plan_costs(result: CaptureResult, device: DeviceSpec, profile: str | Path | None = None,
               progress: Progress | None = None, precision: Precision = "fp32",
               saved: SavedActivations | None = None) -> CostTable:
    """The CostTable a plan is solved with: a saved profile of this model (`partc profile`,
    checked against the graph hash and the precision) or, without one, the analytic roofline on
    `device` under `precision`, with saved activations measured on meta as `device`'s kernels
    keep them (`saved`: those of an earlier `saved_activations(result.capture, device.kind)`,
    which runs the model's forward twice, to price one capture on several devices). A profile
    of the machine `device` was calibrated on, timed while that machine ran more than 10% off
    its calibrated mean speed, is scaled toward it (partc.cost.speed_correction)."""
    progress = progress or Progress()
    if profile is not None:
        with progress.step(f"loading profile {profile}"):
            table = CostTable.load(profile, result.graph, precision=precision)
        return corrected_for(table, device, progress)
    with progress.step(f"pricing {len(result.graph.nodes)} operators on {device.name} (roofline)"):
        if saved is None:
            saved = saved_activations(result.capture, target_kind=device.kind)
        table = analytic_cost_table(result.graph, device, saved=saved, precision=precision)
    if device.kind == "cpu":
        # a CPU rank's batch is in its own memory (partc.solve.memory.host_data_bytes): the
        # roofline knows the model's inputs only, the model file's batches() also the target
        table = replace(table, batch_bytes=drawn_batch_bytes(result, table.source.batch_sizes))
    return table


def corrected_for(table: CostTable, device: DeviceSpec, progress: Progress) -> CostTable:
    """`table` scaled toward `device`'s reference speed where it applies (speed_corrected),
    and, where `device` has a reference to read the table's probe against, one progress line
    on what the probe read and what it did."""
    ratio = table_probe_ratio(table, device)
    if ratio is None:
        return table
    with progress.step(correction_text(ratio, device)):
        return speed_corrected(table, device)


def drawn_batch_bytes(result: CaptureResult, sizes: tuple[int, ...]) -> Curve:
    """Bytes of one batch of each of `sizes` samples, inputs and target, as the model file's
    batches() yields it (synthetic batches without one), through those sizes."""
    graph, captured = result.graph, result.capture.batch_size
    first = graph.tensor(graph.outputs[0].tensor) if graph.outputs else None
    points = []
    for b in sizes:
        shape: tuple[int, ...] | None = None
        if first is not None:
            shape = tuple(d * b // captured if i == first.batch_dim else d
                          for i, d in enumerate(first.shape))
        batch, target = result.capture.model_file.first_batch(b, output_shape=shape)
        points.append((float(b), float(storage_bytes(pytree.tree_leaves((batch, target))))))
    return Curve.through(points)


class CostsError(PartcError):
    """Costs that cannot be had as asked: measuring a cluster this machine is not."""


def measured_device(mode: CostsMode, cluster: ClusterSpec) -> str | None:
    """The device compile measures costs on under `mode`, or None for the analytic roofline:
    `auto` measures when the cluster is this machine (`measurable_device`), `measured` insists."""
    if mode == "analytic":
        return None
    device = measurable_device(cluster)
    if device is None and mode == "measured":
        raise CostsError(f"--costs measured: cluster {cluster.name} is not this machine, so its "
                         f"devices cannot be measured here",
                         hint="use --cluster local (or a one-node CPU cluster), or --costs "
                              "analytic to plan for a cluster you cannot run on")
    return device


def measurement(device: str, capture_batch: int, global_batch: int,
                precision: Precision, neighbours: int = 0,
                extra_sizes: tuple[int, ...] = (),
                fits: Callable[[int], bool] | None = None) -> ProfileOptions | None:
    """How compile measures a model on this machine: torch timing (it runs the plan's autocast
    and needs no ONNX export) at the capture batch B and a larger size near the micro-batches
    the search picks (a quarter of the global batch, between 2B and 32B), so that the fitted
    line interpolates rather than extrapolates far. One thread: partc runs one process per core.
    On a CPU, `neighbours` processes train the same model meanwhile: the node's other devices,
    which share its caches, memory bandwidth and (oversubscribed) cores in training.

    `fits(b)`: whether the whole model trains at batch b in one device's memory (the profile
    runs it whole). A larger size that does not fit is halved until one does; `extra_sizes` that
    do not fit are left out; None when B, or every larger size, does not fit: a profile needs
    two sizes, so the model is priced without measuring.
    """
    fits = fits or (lambda b: True)
    if not fits(capture_batch):
        return None
    high = min(max(global_batch // 4, 2 * capture_batch), 32 * capture_batch)
    while high > capture_batch and not fits(high):
        high //= 2
    if high <= capture_batch:
        return None
    sizes = tuple(sorted({capture_batch, high, *(b for b in extra_sizes if fits(b))}))
    return ProfileOptions(device=device, batch_sizes=sizes, method="torch",
                          threads=1, precision=precision,
                          neighbours=neighbours if device == "cpu" else 0)


def solve_costs(result: CaptureResult, cluster: ClusterSpec, global_batch: int, *,
                profile: str | Path | None = None, costs: CostsMode = "auto",
                precision: Precision = "fp32", extra_sizes: tuple[int, ...] = (),
                fits: Callable[[int], bool] | None = None,
                progress: Progress | None = None) -> tuple[CostTable, Path | None]:
    """The CostTable compile and solve price a model with, and the measured profile behind it
    when it was measured here (a cache file, `partc.cost.profile_cache`): `profile` when given,
    else measured on this machine when `costs` says so (`measured_device`; at `extra_sizes`
    too), else the roofline. `fits`: whether the whole model trains at a batch size in one
    device's memory (`measurement`); where it does not at the sizes a profile needs, or
    measuring runs out of memory all the same, `auto` prices by the roofline and says why,
    `measured` fails."""
    progress = progress or Progress()
    device = None if profile is not None else measured_device(costs, cluster)
    if device is None:
        return plan_costs(result, cluster.device, profile, progress, precision=precision), None
    from partc.cost.profile_cache import cached_profile

    # the node's other devices busy, placed as launch places them; where they oversubscribe the
    # cores one shares the measuring core, and the measurement times the work by CPU time
    # (partc.cost.measured.cpu_clocked): the turns themselves are the simulator's (core_sharing)
    batch = result.graph.batch_size
    options = measurement(device, batch, global_batch, precision,
                          neighbours=cluster.devices_per_node - 1, extra_sizes=extra_sizes,
                          fits=fits)
    why = ""
    if options is None:
        where = f"one {cluster.device.name} device's memory"
        why = (f"the whole model does not fit {where} to be measured, even at batch {batch}"
               if fits is None or not fits(batch) else
               f"the whole model fits {where} to be measured at batch {batch} only, and a "
               f"profile needs two sizes")
        if costs == "measured":
            raise CostsError(f"--costs measured: {why}",
                             hint="price it without measuring: --costs analytic (the roofline "
                                  "of the cluster's device config)")
    else:
        try:
            table, path = cached_profile(result, options, progress=progress)
            return corrected_for(table, cluster.device, progress), path
        except MeasuringOutOfMemory as exc:
            if costs == "measured":
                raise
            why = exc.message
        gc.collect()  # the failed measurement's tensors, now unreferenced
    progress.warn(f"{why}: priced by the roofline instead (--costs analytic)")
    return plan_costs(result, cluster.device, None, progress, precision=precision), None
