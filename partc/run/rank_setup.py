"""Rank setup: what a worker learns from torchrun and agrees on with the other ranks before
training: its environment, its device and the process group, the pipeline x data mesh, the
checkpoint every rank resumes from, and the process groups of tied parameters.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from partc.errors import LaunchError
from partc.hardware.local import physical_cores, pin_to_core
from partc.options import TrainOptions
from partc.plans.plan import Plan, TiedParameter
from partc.run.checkpoint import Checkpoint, CheckpointError, checkpoint_at, choose_resume
from partc.run.rank_layout import RankLayout


@dataclass(frozen=True)
class RankEnv:
    """What torchrun tells a worker."""

    rank: int
    world_size: int
    local_rank: int
    restart_count: int
    local_world_size: int = 1  # this node's processes


def rank_env() -> RankEnv:
    """The torchrun environment of this process; LaunchError outside torchrun."""
    try:
        return RankEnv(rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                       local_rank=int(os.environ["LOCAL_RANK"]),
                       restart_count=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                       local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE",
                                                           os.environ["WORLD_SIZE"])))
    except (KeyError, ValueError):
        raise LaunchError("this process was not started by torchrun (RANK/WORLD_SIZE/LOCAL_RANK "
                          "unset)", hint="use `partc launch PLAN` or `torchrun ... -m partc.launch "
                          "PLAN`") from None


def init_process_group(plan: Plan, env: RankEnv) -> torch.device:
    """Join the run's process group (NCCL with CUDA, gloo on CPU, as plan.yaml's cluster says)
    and return this rank's device."""
    backend = plan.cluster.backend
    if backend == "nccl":
        if not torch.cuda.is_available() or torch.cuda.device_count() <= env.local_rank:
            raise LaunchError(f"the plan uses NCCL but local rank {env.local_rank} has no CUDA "
                              "device", hint="run on the plan's cluster, or compile the model for "
                              "this machine (partc compile --cluster local)")
        device = torch.device("cuda", env.local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        # a partc CPU device is a set of cores: local rank r on the r-th block of cores // local
        # processes (one core each when there are as many processes as cores or more, r on core
        # r modulo the cores), as many as launch gave it threads; before the process group
        # starts gloo's threads so that they inherit it
        pin_to_core(env.local_rank, max(1, physical_cores() // env.local_world_size))
    dist.init_process_group(backend=backend, rank=env.rank, world_size=env.world_size,
                            device_id=device if device.type == "cuda" else None)
    return device


def pipeline_groups(layout: RankLayout, device: torch.device, rank: int) -> tuple[Any, Any]:
    """The ("pp", "dp") DeviceMesh's groups of this rank: its pipeline and its replicas."""
    mesh = DeviceMesh(device.type, torch.tensor(layout.mesh), mesh_dim_names=("pp", "dp"))
    pp_group, dp_group = mesh.get_group("pp"), mesh.get_group("dp")
    pipeline_rank, _ = layout.coordinates(rank)
    if dist.get_group_rank(pp_group, rank) != pipeline_rank:
        raise LaunchError(f"rank {rank} is rank {dist.get_group_rank(pp_group, rank)} of its "
                          f"pipeline group, the plan puts it at {pipeline_rank}",
                          hint="re-run partc compile (the plan's device order is inconsistent)")
    return pp_group, dp_group


def resume_point(plan: Plan, options: TrainOptions, env: RankEnv,
                  device: torch.device) -> Checkpoint | None:
    """The checkpoint to continue from, the same on every rank: rank 0 chooses
    (checkpoint.choose_resume: the newest checkpoint whose files all verify, of the plan's model)
    and broadcasts its step and manifest digest; every rank must see that same checkpoint (the
    directory is shared across nodes). Only rank 0 reads the files to verify them, and not
    again when the launcher's pre-flight already did (checkpoint.SHARED_ENV)."""
    root = options.checkpoint_dir
    if root is None:
        return None
    decision: list[Any] = [None]
    if env.rank == 0:
        try:
            found = choose_resume(root, resume=options.resume, restarted=env.restart_count > 0,
                                  steps=options.steps, optimizer=plan.training.config.optimizer,
                                  global_batch_size=plan.training.global_batch_size,
                                  graph_hash=plan.model.graph_hash, model=plan.model.name,
                                  allow_other_model=options.allow_other_model)
            decision[0] = (("step", found.step, found.manifest_sha256) if found is not None
                           else None)
        except CheckpointError as exc:
            decision[0] = ("error", exc.message, exc.hint)
    dist.broadcast_object_list(decision, src=0, device=device)
    if decision[0] is None:
        return None
    if decision[0][0] == "error":
        raise CheckpointError(decision[0][1], hint=decision[0][2])
    _, step, manifest_sha256 = decision[0]
    found = checkpoint_at(root, step)
    if found is None or found.manifest_sha256 != manifest_sha256:
        raise CheckpointError(f"rank {env.rank} cannot see the checkpoint of step {step} in "
                              f"{root} that rank 0 resumes from"
                              + ("" if found is None else " (its manifest differs)"),
                              hint="the checkpoint directory must be one shared filesystem path "
                                   "for all nodes")
    return found


@dataclass(frozen=True)
class TiedGroup:
    parameter: TiedParameter
    group: Any  # the process group of this replica's ranks holding it; None: all on this rank


def tied_groups(plan: Plan, layout: RankLayout, rank: int) -> list[TiedGroup]:
    """This rank's tied parameters with the groups their gradients are summed over. Every rank
    creates every group, in the same order (new_group is collective)."""
    created: dict[tuple[int, ...], Any] = {}
    mine = []
    for tied in plan.tied_parameters:
        for r in range(layout.replicas):
            ranks = tuple(sorted({layout.rank_of(k, r) for k in tied.stages}))
            if len(ranks) > 1 and ranks not in created:
                created[ranks] = dist.new_group(list(ranks))
            if rank in ranks:
                mine.append(TiedGroup(tied, created.get(ranks)))
    return mine




def metrics_group() -> Any:
    """A gloo group of all the run's processes for launch's per-step metrics gather (collective:
    every rank creates it, after the others). Its own sockets and socket loop keep the gather,
    which runs while the next step trains, off the pipeline's connections, and gloo gathers
    host rows on a CUDA run without a device copy or a collective on NCCL's stream."""
    return dist.new_group(backend="gloo")
