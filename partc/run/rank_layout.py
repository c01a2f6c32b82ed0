"""Where each (virtual) stage of a plan runs: the plan's devices as torch.distributed ranks.

A plan of S pipeline ranks x R data-parallel replicas x C virtual stages per rank uses S * R
devices. Stage k runs on pipeline rank `k % S` (torch.distributed.pipelining's loop mapping) and
replica r of it on device `stage.devices[r]`; the placement the solver chose (stage-major or
pipeline-major) is already in those device numbers. Global rank g is the g-th of the plan's
devices in ascending order, which is torchrun's node-major numbering when every node runs
`devices_per_node` processes. The mesh is laid out (pipeline, data): mesh[p][r] is the global
rank of pipeline rank p in replica r, so the "pp" group of a rank is its replica's pipeline and
the "dp" group is the replicas of its stages. Pure Python: testable without processes.
"""
from __future__ import annotations

from dataclasses import dataclass

from partc.plans.plan import Plan, PlanError


@dataclass(frozen=True)
class RankLayout:
    """The plan's stages on global ranks."""

    pipeline_size: int  # S
    replicas: int  # R
    num_stages: int  # V = S * chunks
    mesh: tuple[tuple[int, ...], ...]  # [pipeline rank][replica] -> global rank
    devices: tuple[int, ...]  # global rank -> the plan's device number

    @property
    def world_size(self) -> int:
        return self.pipeline_size * self.replicas

    def coordinates(self, rank: int) -> tuple[int, int]:
        """(pipeline rank, replica) of a global rank."""
        for p, row in enumerate(self.mesh):
            if rank in row:
                return p, row.index(rank)
        raise ValueError(f"rank {rank} is not in the layout (world size {self.world_size})")

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The virtual stages a global rank runs, ascending."""
        p, _ = self.coordinates(rank)
        return tuple(range(p, self.num_stages, self.pipeline_size))

    def rank_of(self, stage: int, replica: int) -> int:
        return self.mesh[stage % self.pipeline_size][replica]


def rank_layout(plan: Plan) -> RankLayout:
    """The plan's layout; PlanError when its stages' devices are not a pipeline x data grid."""
    S, R, V = plan.training.shape.stages, plan.training.shape.replicas, plan.num_stages
    if V % S:
        raise PlanError(f"the plan has {V} stages on {S} pipeline ranks",
                        hint="re-run partc compile; the plan is inconsistent")
    devices = sorted({d for st in plan.stages for d in st.devices})
    if len(devices) != S * R:
        raise PlanError(f"the plan's stages use {len(devices)} devices, its shape "
                        f"{S} x {R} needs {S * R}", hint="re-run partc compile")
    rank_of_device = {d: g for g, d in enumerate(devices)}
    rows: dict[int, tuple[int, ...]] = {}
    for st in plan.stages:
        if st.rank != st.index % S or len(st.devices) != R:
            raise PlanError(f"stage {st.index} is on pipeline rank {st.rank} with "
                            f"{len(st.devices)} replica(s); the plan's shape expects rank "
                            f"{st.index % S} with {R}", hint="re-run partc compile")
        row = tuple(rank_of_device[d] for d in st.devices)
        if rows.setdefault(st.rank, row) != row:
            raise PlanError(f"stages on pipeline rank {st.rank} run on different devices",
                            hint="re-run partc compile; the plan is inconsistent")
    mesh = tuple(rows[p] for p in range(S))
    if len({g for row in mesh for g in row}) != S * R:
        raise PlanError("two pipeline ranks of the plan share a device",
                        hint="re-run partc compile; the plan is inconsistent")
    return RankLayout(pipeline_size=S, replicas=R, num_stages=V, mesh=mesh,
                      devices=tuple(devices))
