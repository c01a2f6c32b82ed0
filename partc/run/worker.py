"""A rank's process: what every worker of a plan runs, however it was started.

`partc launch` forks its workers from one forkserver that imported torch and partc's runtime once
(`run_forked`), so a node's ranks, and the ranks of every restart, start without importing torch
again each (about 3.4 s of CPU per rank here, 2 cores: torch, torch._dynamo and
torch.distributed.pipelining). A user's own torchrun starts `python -m partc.launch`, which
calls `run_worker` in a fresh interpreter. Either way the rank trains with
partc.run.runtime.run_rank and ends as torchrun's agent expects: exit 0, exit 1 with its reason
in torchelastic's error file, or dead of the signal that stopped it.
"""
from __future__ import annotations

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
from partc.hardware.local import PARENT_PID_ENV, end_with_parent, name_process
from partc.options import TrainOptions

# How long a failing rank waits before it exits with its error: the agent (polling every 0.1 s)
# sees the first rank that fails and tears the others down meanwhile, so the ranks that fail only
# because a peer went away (a closed connection) are stopped instead of reported.
FAILURE_GRACE_S = 0.5

# What the forkserver's environment was when it imported this module (before forking any rank):
# in a forked rank, a variable that differs from it was set for the rank by the agent.
_IMPORT_ENV = dict(os.environ)

# What `partc launch`'s forkserver imports once, before it forks any rank: what every rank
# would import (torch's elastic worker wrapper, the runtime with torch.distributed.pipelining).
FORKSERVER_PRELOAD = ("torch.distributed.elastic.multiprocessing.api", "partc.run.runtime",
                      "partc.run.worker")


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


def _train(plan: Path, options: TrainOptions, launcher: int | None) -> None:
    # a launcher killed by SIGKILL cannot stop its workers: they stop
    end_with_parent(parent=launcher)
    try:
        from partc.run.runtime import run_rank

        try:
            run_rank(plan, options)
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


def run_worker(plan: Path, options: TrainOptions, launcher: int | None = None) -> None:
    """Train this rank of `plan` (its place from torchrun's RANK, WORLD_SIZE, ... variables);
    on failure exit 1 with the reason in torchelastic's error file, on Ctrl-C die of SIGINT.
    The rank ends itself if its parent process (or the `launcher` given) dies first."""
    from torch.distributed.elastic.multiprocessing.errors import record

    record(_train)(plan, options, launcher)


def rank_environment(launch_env: dict[str, str]) -> dict[str, str]:
    """The environment a forked rank runs with: `launch_env` (the launcher's, as its launch
    began) and, over it, what torch's agent set for the rank (RANK, MASTER_PORT, ...: the
    variables that differ from the forkserver's own when it imported this module)."""
    return {**launch_env, **{k: v for k, v in os.environ.items() if _IMPORT_ENV.get(k) != v}}


def run_forked(launch_env: dict[str, str], plan: Path, options: TrainOptions) -> None:
    """The entry point `partc launch` gives torch's elastic agent: a rank forked from the
    forkserver. Its environment becomes the launcher's as the launch began (`launch_env`: the
    server may have been started by an earlier launch of the same process) plus what the agent
    set for this rank, as a process torchrun started would have; and, as such a process, it
    runs in a session of its own, so a terminal's Ctrl-C reaches the agent, which forwards it.
    Its name (`ps -e`, /proc/PID/comm) is `partc-rank<RANK>`; /proc/PID/environ shows the
    forkserver's environment, not this rank's (os.environ has the rank's)."""
    env = rank_environment(launch_env)
    os.environ.clear()
    os.environ.update(env)
    try:
        os.setsid()
    except OSError:  # already a session leader
        pass
    # `ps -e` and `top` tell the ranks apart (their command line is the forkserver's)
    name_process(f"partc-rank{os.environ.get('RANK', '')}")
    # The launcher, not the forkserver, is what the rank lives for: every forked process holds
    # the server's liveness pipe, so the server outlives a launcher killed by SIGKILL
    named = launch_env.get(PARENT_PID_ENV, "")
    run_worker(plan, options, launcher=int(named) if named.isdigit() else None)
