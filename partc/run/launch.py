"""`partc launch`: validate a plan, then run it with torch.distributed's elastic launcher.

`launch` is the agent side: it checks the plan (schema, stage-file hashes, layout, world size
against this machine's devices, the model file, --init-from, --resume) before any process starts,
then hands torchrun's own entry (`torch.distributed.run`) the same flags a user would give
torchrun (--nnodes, --node-rank, --rdzv-*, --max-restarts; --standalone on one node), with
partc's worker entry point as the program: every worker runs `python -m partc.launch PLAN [train
flags]` (partc/launch.py), which calls partc.run.runtime.run_rank.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from partc.errors import LaunchError, summarize_exception
from partc.hardware.local import physical_cores
from partc.options import ElasticOptions, TrainOptions, to_argv
from partc.plans.plan import Plan, load_plan
from partc.run.checkpoint import CheckpointError, choose_resume
from partc.run.rank_layout import rank_layout


class RunFailedError(LaunchError):
    """A worker failed (and restarts, if any, were used up): the run did not finish."""

    exit_code = 1


def launch(plan_path: str | Path, options: TrainOptions,
           elastic: ElasticOptions | None = None) -> None:
    """Validate, then start this node's processes and wait for them; LaunchError (one line)
    when a worker fails for good. `elastic` defaults to one node, no restarts."""
    elastic = elastic or ElasticOptions()
    plan = load_plan(plan_path)
    plan.check_stage_files()
    nproc = check_launch(plan, options, elastic)
    args = ["--nnodes", str(elastic.nnodes), "--nproc-per-node", str(nproc),
            "--max-restarts", str(elastic.max_restarts),
            "--monitor-interval", str(elastic.monitor_interval)]
    if elastic.nnodes == 1 and not elastic.rdzv_endpoint:
        args.append("--standalone")
    else:
        args += ["--node-rank", str(elastic.node_rank), "--rdzv-backend", elastic.rdzv_backend,
                 "--rdzv-endpoint", elastic.rdzv_endpoint, "--rdzv-id", elastic.rdzv_id]
    plan_file = Path(plan_path)
    plan_file = (plan_file / "plan.yaml" if plan_file.is_dir() else plan_file).resolve()
    args += ["-m", "partc.launch", str(plan_file), *to_argv(options)]
    if plan.cluster.backend != "nccl" and "OMP_NUM_THREADS" not in os.environ:
        # gloo workers share the CPU: each gets its share of the cores (torchrun would set 1)
        os.environ["OMP_NUM_THREADS"] = str(max(1, physical_cores() // nproc))
    # Workers get their own TCPStore per rendezvous round: with the agent's store shared (the
    # default), restarted workers read the previous round's gloo/NCCL addresses and fail to
    # connect (pytorch/pytorch#135712).
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError
    from torch.distributed.run import get_args_parser, run

    try:
        run(get_args_parser().parse_args(args))
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        message = failure.message
        if isinstance(message, dict):  # the error file @record wrote: {"message": "...", ...}
            message = message.get("message", "")
        message = message if isinstance(message, str) else ""
        reason = next((ln.strip() for ln in message.splitlines() if ln.strip()), "")
        raise RunFailedError(f"rank {rank} failed (exit code {failure.exitcode})"
                          + (f": {reason}" if reason else "")
                          + (f" after {elastic.max_restarts} restart(s)"
                             if elastic.max_restarts else ""),
                          hint="the rank's output above has the details") from None
    except (RendezvousError, OSError, RuntimeError) as exc:  # timeouts, unreachable endpoints
        raise LaunchError(f"the launcher failed before training: {summarize_exception(exc)}",
                          hint="check --rdzv-endpoint and that every node runs the same "
                               "command") from None


def check_launch(plan: Plan, options: TrainOptions, elastic: ElasticOptions) -> int:
    """Everything that can be checked before processes start; returns processes per node."""
    layout = rank_layout(plan)
    world = layout.world_size
    if elastic.nnodes < 1 or world % elastic.nnodes:
        raise LaunchError(f"the plan runs on {world} processes, which --nnodes "
                          f"{elastic.nnodes} does not divide evenly",
                          hint=f"use --nnodes {plan.cluster.num_nodes} (the plan's "
                               "cluster), or a divisor of the plan's device count")
    if not 0 <= elastic.node_rank < elastic.nnodes:
        raise LaunchError(f"--node-rank {elastic.node_rank} is outside 0..{elastic.nnodes - 1}",
                          hint="number nodes from 0")
    if elastic.nnodes > 1 and not elastic.rdzv_endpoint:
        raise LaunchError("a multi-node launch needs --rdzv-endpoint HOST:PORT",
                          hint="the same endpoint on every node, e.g. the first node's host:29400")
    nproc = world // elastic.nnodes
    if plan.cluster.backend == "nccl":
        import torch

        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if have < nproc:
            raise LaunchError(f"the plan needs {nproc} CUDA device(s) per node, this machine has "
                              f"{have}", hint="run it on the plan's cluster, or compile for this "
                              "machine: partc compile MODEL --cluster local")
    plan.existing_model_path()
    if options.init_from is not None and not options.init_from.is_file():
        raise LaunchError(f"--init-from {options.init_from} is not a file",
                          hint="pass a torch.save'd state_dict of the model")
    if options.checkpoint_dir is not None:
        if options.checkpoint_dir.exists() and not options.checkpoint_dir.is_dir():
            raise CheckpointError(f"--checkpoint-dir {options.checkpoint_dir} is a file",
                                  hint="pass a directory (it is created if missing)")
        try:
            options.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CheckpointError(f"cannot create --checkpoint-dir {options.checkpoint_dir}: "
                                  f"{exc.strerror}",
                                  hint="check the path and permissions") from None
        if elastic.node_rank == 0:  # the same choice rank 0 makes, before anything starts
            choose_resume(options.checkpoint_dir, resume=options.resume, restarted=False,
                          steps=options.steps, optimizer=plan.training.config.optimizer,
                          global_batch_size=plan.training.global_batch_size)
    if elastic.max_restarts and options.checkpoint_dir is None:
        print("partc launch: warning: --max-restarts without --checkpoint-dir: a restarted run "
              "starts again from step 0", file=sys.stderr)
    return nproc
