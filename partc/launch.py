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
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import NoReturn

from partc.errors import PartcError, summarize_exception
from partc.files import write_atomic
from partc.options import TrainOptions, add_arguments, from_namespace
from partc.run.launch import LaunchInterrupted, launch

# How long a failing rank waits before it exits with its error: the agent (polling every 0.1 s)
# sees the first rank that fails and tears the others down meanwhile, so the ranks that fail only
# because a peer went away (a closed connection) are stopped instead of reported.
FAILURE_GRACE_S = 0.5


def _record_error(line: str, callstack: str | None = None) -> None:
    """Write a worker's error to torchelastic's error file as one line, in the format @record
    writes, so the agent (and partc launch) report the reason: a user error without a
    traceback (torchrun's failure summary then shows no partc stack frames for an error the
    user caused), any other with its `callstack`."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": {"message": line, "extraInfo": {
        "py_callstack": callstack or f"(a partc user error, no traceback) {line}",
        "timestamp": str(int(time.time()))}}}
    write_atomic(path, json.dumps(data))


def _die_of(sig: signal.Signals) -> NoReturn:
    """End this worker as the signal's default action would, without a traceback: the agent sees
    a rank stopped by `sig` (what it sent), not a failure of its own."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    signal.signal(sig, signal.SIG_DFL)
    os.kill(os.getpid(), sig)
    time.sleep(1)  # the signal ends the process; if it does not, exit as a shell reports it
    os._exit(128 + int(sig))


def _interrupted(exc: BaseException) -> bool:
    """Whether a KeyboardInterrupt is among the exceptions `exc` was raised while handling."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, KeyboardInterrupt):
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False


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
        from partc.hardware.local import end_with_parent

        end_with_parent()  # a launcher killed by SIGKILL cannot stop its workers: they stop
        try:
            from partc.run.runtime import run_rank

            try:
                run_rank(plan, from_namespace(TrainOptions, ns))
            except PartcError as exc:
                line = exc.one_line()
                print(f"partc launch: rank {os.environ.get('RANK', '?')}: error: {line}",
                      file=sys.stderr, flush=True)
                _record_error(line)
                sys.exit(1)  # @record leaves SystemExit alone: no traceback in the error file
            except Exception as exc:
                if _interrupted(exc):
                    # Ctrl-C inside a library that turned it into its own error on the way out
                    # (torch.save's zip writer): still the interrupt, not a failure
                    _die_of(signal.SIGINT)
                time.sleep(FAILURE_GRACE_S)  # torn down meanwhile if a peer failed first
                # The traceback in the rank's output, the innermost cause's line as its reason:
                # torch's pipelining wraps a stage's error in "RuntimeError: \n[Stage 1] failed
                # to run forward: ..." (no reason in its first line), which @record would write
                callstack = traceback.format_exc()
                print(callstack, file=sys.stderr, end="", flush=True)
                _record_error(summarize_exception(exc), callstack)
                sys.exit(1)
        except KeyboardInterrupt:  # the agent's SIGINT (Ctrl-C on partc launch): no traceback
            _die_of(signal.SIGINT)

    try:
        if "TORCHELASTIC_RUN_ID" in os.environ or "RANK" in os.environ:
            worker()
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
