"""The search as compile and solve run it: price the model, cut it, and where the costs are
measured on this machine, measure again at the micro-batch size the plan picked until the plan
runs at a measured size.

A measured cost is exact at the sizes it was measured at and interpolated between them
(partc.cost.table.Curve); operators do not scale linearly with the micro-batch (caches, kernel
choices), so a plan whose micro-batch lies far from the measured sizes is priced by an
extrapolation (measured on this repository's CPU machine: an MLP profiled at 2 and 64 samples
ran 1.3x slower per stage at 512 than the line predicted). Each round adds the plan's size to the
profile (measuring only that size, the profile's whole-model totals timed again with it:
partc.cost.measured.extend_profile) and searches again; the shape can move, so this repeats, at
most `MEASURE_ROUNDS` times.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from partc.cost.plan_costs import solve_costs
from partc.cost.table import CostTable
from partc.frontend.capture import CaptureResult
from partc.hardware.local import foreign_calibration
from partc.hardware.specs import ClusterSpec
from partc.options import CostsMode, SearchOptions, TrainingConfig
from partc.plans.measurable_sizes import whole_model_fits
from partc.progress import Progress
from partc.solve.coarsen import BlockGraph, coarsen
from partc.solve.partition import Partition
from partc.solve.search import search

# Searches that may each add one measured size. The first search's pick is usually within a
# factor of 2 of the final one, and a size once measured stays in the (cached) profile.
MEASURE_ROUNDS = 3


@dataclass(frozen=True)
class PricedSearch:
    """A search's result with the costs it used: the table, the measured profile file behind it
    (None for a given profile or the roofline) and the block graph."""

    table: CostTable
    profile: Path | None
    blocks: BlockGraph
    partition: Partition
    costs_s: float  # wall time pricing (measuring) the model, every round
    search_s: float  # wall time coarsening and searching, every round


def warn_of_foreign_calibration(cluster: ClusterSpec, progress: Progress) -> None:
    """Say once, before pricing, when `cluster` is this machine priced with a device config
    calibrated on another one (partc.hardware.local.foreign_calibration): a measured profile
    times the operators here, the config's overheads and link stay the other machine's."""
    foreign = foreign_calibration(cluster)
    if foreign is not None:
        progress.warn(foreign.message())


def priced_search(result: CaptureResult, cluster: ClusterSpec, global_batch: int,
                  training: TrainingConfig, options: SearchOptions, *,
                  profile: str | Path | None = None, costs: CostsMode = "auto",
                  progress: Progress | None = None) -> PricedSearch:
    """Price `result` (partc.cost.plan_costs.solve_costs) and search; with costs measured here,
    measure the plan's micro-batch size too and search again until it is a measured size (module
    docstring)."""
    progress = progress or Progress()
    warn_of_foreign_calibration(cluster, progress)
    extra: tuple[int, ...] = ()
    costs_s = search_s = 0.0
    fits = whole_model_fits(result, cluster.device, training, progress)
    for round_ in range(MEASURE_ROUNDS + 1):
        start = time.perf_counter()
        table, measured = solve_costs(result, cluster, global_batch, profile=profile, costs=costs,
                                      precision=training.precision, extra_sizes=extra,
                                      fits=fits, progress=progress)
        costs_s += time.perf_counter() - start
        start = time.perf_counter()
        with progress.step(f"coarsen to at most {options.max_blocks} blocks"):
            blocks = coarsen(table, options.max_blocks)
        partition = search(table, cluster, global_batch, training, options, blocks=blocks,
                           progress=progress)
        search_s += time.perf_counter() - start
        m = partition.shape.microbatch_size
        # (a size the whole model does not fit one device at stays unmeasured: interpolated)
        if measured is None or m in table.source.batch_sizes or round_ == MEASURE_ROUNDS \
                or not fits(m):
            return PricedSearch(table=table, profile=measured, blocks=blocks,
                                partition=partition, costs_s=costs_s, search_s=search_s)
        extra = tuple(sorted({*extra, m}))
    raise AssertionError("unreachable")
