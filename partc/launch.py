"""`python -m partc.launch PLAN [train flags]`: the program every `partc launch` worker runs.

It is the one public entry point for users who start jobs with torchrun themselves (SLURM,
Kubernetes): under torchrun (RANK set) it trains this rank of the plan (partc.run.runtime);
outside torchrun it behaves like `partc launch PLAN` (partc.run.launch).

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29400 \\
        -m partc.launch plans/gpt2/plan.yaml --steps 1000 --checkpoint-dir ckpt
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from partc.errors import PartcError
from partc.options import TrainOptions, add_arguments, from_namespace
from partc.run.launch import LaunchInterrupted, launch
from partc.run.worker import run_worker


def main(argv: list[str] | None = None) -> int:
    """`python -m partc.launch PLAN [flags]`: a worker under torchrun, else `partc launch`."""
    parser = argparse.ArgumentParser(prog="python -m partc.launch",
                                     description="Run a partc plan (one process per device).")
    parser.add_argument("plan", type=Path)
    add_arguments(parser, TrainOptions)
    ns = parser.parse_args(argv)
    plan = ns.plan
    del ns.plan

    try:
        if "TORCHELASTIC_RUN_ID" in os.environ or "RANK" in os.environ:
            run_worker(plan, from_namespace(TrainOptions, ns))
        else:
            launch(plan, from_namespace(TrainOptions, ns))
    except PartcError as exc:
        print(f"partc launch: error: {exc.one_line()}", file=sys.stderr)
        return exc.exit_code
    except LaunchInterrupted as exc:
        print(exc.line, file=sys.stderr)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
