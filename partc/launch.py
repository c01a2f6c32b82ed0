"""`python -m partc.launch PLAN [train flags]`: the program every `partc launch` worker runs.

It is the one public entry point for users who start jobs with torchrun themselves (SLURM,
Kubernetes): under torchrun (RANK set) it trains this rank of the plan (partc.run.runtime);
outside torchrun it behaves like `partc launch PLAN` (partc.run.launch).

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29400 \\
        -m partc.launch plans/gpt2/plan.yaml --steps 1000 --checkpoint-dir ckpt
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from partc.errors import PartcError
from partc.files import write_atomic
from partc.options import TrainOptions, add_arguments, from_namespace
from partc.run.launch import launch


def _record_user_error(line: str) -> None:
    """Write a worker's user error to torchelastic's error file as one line without a traceback,
    in the format @record writes, so the agent (and partc launch) report the reason and torchrun's
    failure summary shows no partc stack frames for an error the user caused."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": {"message": line, "extraInfo": {
        "py_callstack": f"(a partc user error, no traceback) {line}",
        "timestamp": str(int(time.time()))}}}
    write_atomic(path, json.dumps(data))


def main(argv: list[str] | None = None) -> int:
    """`python -m partc.launch PLAN [flags]`: a worker under torchrun, else `partc launch`."""
    from torch.distributed.elastic.multiprocessing.errors import record

    parser = argparse.ArgumentParser(prog="python -m partc.launch",
                                     description="Run a partc plan (one process per device).")
    parser.add_argument("plan", type=Path)
    add_arguments(parser, TrainOptions)
    ns = parser.parse_args(argv)
    plan = ns.plan
    del ns.plan

    @record
    def worker() -> None:
        from partc.run.runtime import run_rank

        try:
            run_rank(plan, from_namespace(TrainOptions, ns))
        except PartcError as exc:
            line = exc.one_line()
            print(f"partc launch: rank {os.environ.get('RANK', '?')}: error: {line}",
                  file=sys.stderr, flush=True)
            _record_user_error(line)
            sys.exit(1)  # @record leaves SystemExit alone: no traceback in the error file

    try:
        if "TORCHELASTIC_RUN_ID" in os.environ or "RANK" in os.environ:
            worker()
        else:
            launch(plan, from_namespace(TrainOptions, ns))
    except PartcError as exc:
        print(f"partc launch: error: {exc.one_line()}", file=sys.stderr)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
