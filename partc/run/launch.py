"""`partc launch`: validate a plan, then run it with torch.distributed's elastic launcher.

`launch` is the agent side: it checks the plan (schema, stage-file hashes, layout, world size
against this machine's devices, the model file, --init-from, --resume) before any process starts,
then hands torch's elastic agent the configuration torchrun's parser makes of the flags a user
would give torchrun (--nnodes, --node-rank, --rdzv-*, --max-restarts; --standalone on one node),
with partc.run.worker.run_forked as the entry point: every worker is forked from multiprocessing's
forkserver, which imported torch and the runtime once, and calls partc.run.runtime.run_rank
(what `python -m partc.launch` runs under a user's own torchrun). Nothing here imports torch
before the plan has been checked.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from partc.errors import LaunchError, summarize_exception
from partc.hardware.local import PARENT_PID_ENV, physical_cores, process_state
from partc.interrupts import held_interrupts
from partc.options import ElasticOptions, TrainOptions
from partc.plans.plan import Plan, load_plan, refuse_plan_artifact
from partc.run.checkpoint import CheckpointError, choose_resume
from partc.run.rank_layout import rank_layout
from partc.run.step_trace import prepare_trace_directory

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure


class RunFailedError(LaunchError):
    """A worker failed (and restarts, if any, were used up): the run did not finish."""

    exit_code = 1


class LaunchInterrupted(KeyboardInterrupt):
    """`partc launch` got SIGINT (Ctrl-C), SIGTERM, SIGHUP or SIGQUIT and stopped every worker of
    this node. `line` is the one line to print, `exit_code` 128 + the signal (130 for Ctrl-C)."""

    def __init__(self, line: str, exit_code: int) -> None:
        super().__init__(line)
        self.line = line
        self.exit_code = exit_code


# The signals torch's elastic agent turns into SignalException (TORCHELASTIC_SIGNALS_TO_HANDLE).
_AGENT_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
# Signals the agent's teardown sends (a rank killed by one, without an error file, was stopped
# because of another rank's failure or an interruption, and is not its cause).
_TEARDOWN_SIGNALS = (signal.SIGTERM, signal.SIGKILL, signal.SIGINT)
# torch's elastic log lines about tearing workers down, which partc's own line replaces.
_TEARDOWN_LOGS = ("Received %s death signal", "Sending process %s closing signal",
                  "Closing process %s via signal", "Got termination signal",
                  # a forked rank's failure, with the agent's own traceback: partc's line
                  # names the rank and its reason (the rank printed its own traceback)
                  "failed (exitcode: %s) local_rank: %s")
_ELASTIC_LOGGERS = ("torch.distributed.elastic.agent.server.api",
                    "torch.distributed.elastic.multiprocessing.api")


def root_failure(failures: dict[int, ProcessFailure]) -> tuple[int, ProcessFailure]:
    """The (global rank, failure) that came first, the cause of the others.

    torch's `ChildFailedError.get_first_failure` takes the earliest `timestamp`, which has whole
    seconds: ranks that fail within the same second as the real cause (a peer's closed
    connection) tie with it and the lowest rank wins. Here a rank the teardown killed (SIGTERM,
    SIGKILL or SIGINT, no error file) is never chosen while another failed, and the others are
    ordered by their error file's modification time (ns; written when the rank failed), else the
    time the agent saw the exit."""
    def key(item: tuple[int, ProcessFailure]) -> tuple[bool, int, int]:
        rank, failure = item
        try:
            when = os.stat(failure.error_file).st_mtime_ns
            has_file = True
        except (OSError, TypeError, ValueError):
            when, has_file = int(failure.timestamp) * 1_000_000_000, False
        torn_down = not has_file and failure.exitcode < 0 and \
            -failure.exitcode in {int(s) for s in _TEARDOWN_SIGNALS}
        return torn_down, when, rank
    return min(failures.items(), key=key)


def failure_reason(failure: ProcessFailure) -> str:
    """One line: the first line of the error the rank recorded (a rank that recorded its error
    may still be killed by the teardown while it exits), else the signal that killed it."""
    message: Any = failure.message
    if isinstance(message, dict):  # the error file @record wrote: {"message": "...", ...}
        message = message.get("message", "")
    if isinstance(message, str) and os.path.isfile(failure.error_file):
        line = next((ln.strip() for ln in message.splitlines() if ln.strip()), "")
        if line:
            return line
    if failure.exitcode < 0:
        try:
            return f"killed by {signal.Signals(-failure.exitcode).name}"
        except ValueError:
            return f"killed by signal {-failure.exitcode}"
    return ""  # no error file: torch's placeholder text is no reason


class _QuietTeardown(logging.Filter):
    """Drops torch's elastic warnings about signalling workers while they are torn down, and
    its report of a failed rank, which partc's one line replaces."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_TEARDOWN_LOGS)


def _interrupted(sig: signal.Signals, nproc: int, options: TrainOptions) -> LaunchInterrupted:
    """Make sure no worker outlives the launcher (torch's teardown, cut short by a second
    signal, may have left some), then the one line to report."""
    from partc.run.checkpoint import latest_checkpoint

    _stop_children()
    newest = latest_checkpoint(options.checkpoint_dir) if options.checkpoint_dir else None
    resume = (f"; rerun with --resume to continue from step {newest.step} ({newest.directory})"
              if newest is not None else "")
    return LaunchInterrupted(f"partc launch: interrupted by {sig.name}: stopped the {nproc} "
                             f"worker process(es) of this node{resume}", 128 + int(sig))


def _stop_children(grace_s: float = 5.0) -> None:
    """SIGTERM every worker's group (each worker is a session of its own), SIGKILL what is
    still there after `grace_s`; further SIGINT/SIGTERM are ignored meanwhile."""
    children = _worker_pids()
    if not children:
        return
    in_main = threading.current_thread() is threading.main_thread()
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)} if in_main else {}
    for s in saved:
        signal.signal(s, signal.SIG_IGN)
    try:
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, grace_s)):
            for pid in children:
                try:
                    os.killpg(pid, sig)
                except OSError:
                    try:
                        os.kill(pid, sig)
                    except OSError:
                        pass
            end = time.monotonic() + wait_s
            while children and time.monotonic() < end:
                children = [p for p in children if not _gone(p)]
                time.sleep(0.05)
            if not children:
                return
    finally:
        for s, handler in saved.items():
            if handler is not None:
                signal.signal(s, handler)


def _worker_pids() -> list[int]:
    """The live processes this launch started: this process's children and the forkserver's
    (the ranks), other than multiprocessing's own helpers (from /proc; none without /proc)."""
    from partc.hardware.forkserver import helper_pids

    # multiprocessing's own helpers are kept: the next launch of this process forks from them
    helpers = helper_pids()
    parents = {os.getpid(), *helpers}
    found = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit() or int(entry) in helpers:
            continue
        state = process_state(int(entry))
        if state is not None and state[1] in parents and state[0] != "Z":
            found.append(int(entry))
    return found


def _gone(pid: int) -> bool:
    """Whether a worker has ended: reaped here if it is this process's child, else (a rank the
    forkserver forked, and reaps) no longer in /proc or a zombie."""
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        state = process_state(pid)
        return state is None or state[0] == "Z"
    return done == pid


def launch(plan_path: str | Path, options: TrainOptions,
           elastic: ElasticOptions | None = None) -> None:
    """Validate, then start this node's processes and wait for them; LaunchError (one line)
    when a worker fails for good. `elastic` defaults to one node, no restarts."""
    elastic = elastic or ElasticOptions()
    plan = load_plan(plan_path)
    if options.expect is not None:
        plan.require_digest(options.expect)
    plan.check_stage_files()
    plan.model_source()  # a changed model file is refused before any worker starts
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
    # The parser wants a program; the workers run partc.run.worker.run_forked instead (below).
    args += ["--start-method", "forkserver", "-m", "partc.launch", str(plan_file)]
    if plan.cluster.backend != "nccl" and "OMP_NUM_THREADS" not in os.environ:
        # gloo workers share the CPU: each gets its share of the cores (torchrun would set 1)
        os.environ["OMP_NUM_THREADS"] = str(max(1, physical_cores() // nproc))
    # Workers get their own TCPStore per rendezvous round: with the agent's store shared (the
    # default), restarted workers read the previous round's gloo/NCCL addresses and fail to
    # connect (pytorch/pytorch#135712).
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    # c10's own warnings (e.g. the CPU memory profiler's "Memory block of unknown size was
    # allocated before the profiling started", once per rank) are nothing a user can act on;
    # errors still print. A user who sets the level keeps theirs.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    # the workers end themselves if this process dies without stopping them (SIGKILL)
    os.environ[PARENT_PID_ENV] = str(os.getpid())
    # a rank's print reaches the console as it happens (torchrun runs its programs `python -u`)
    os.environ["PYTHONUNBUFFERED"] = "1"
    with held_interrupts():  # a Ctrl-C inside torch's import is lost or aborts (partc.interrupts)
        _start_forkserver()  # it imports torch and the runtime while this process imports the agent
        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.elastic.rendezvous import RendezvousError
        from torch.distributed.launcher.api import elastic_launch
        from torch.distributed.run import config_from_args, get_args_parser

        from partc.run.worker import run_forked

    # torch's agent installs handlers raising SignalException and leaves them: put ours back
    in_main = threading.current_thread() is threading.main_thread()
    saved = {sig: signal.getsignal(sig) for sig in
             (getattr(signal, name) for name in _AGENT_SIGNALS if hasattr(signal, name))
             } if in_main else {}
    quiet = _QuietTeardown()
    loggers = [logging.getLogger(name) for name in _ELASTIC_LOGGERS]
    for logger in loggers:
        logger.addFilter(quiet)
    try:
        parsed = get_args_parser().parse_args(args)
        if parsed.standalone:  # what torch.distributed.run.run does with --standalone
            parsed.rdzv_backend, parsed.rdzv_endpoint = "c10d", "localhost:0"
            parsed.rdzv_id = str(uuid.uuid4())
        config, _, _ = config_from_args(parsed)
        elastic_launch(config=config, entrypoint=run_forked)(dict(os.environ), plan_file, options)
    except ChildFailedError as exc:
        rank, failure = root_failure(exc.failures)
        # a rank's user error carries its own hint: it becomes the line's one hint
        reason, _, hint = failure_reason(failure).partition(" (hint: ")
        raise RunFailedError(f"rank {rank} failed"
                          + (f" (exit code {failure.exitcode})" if failure.exitcode > 0 else "")
                          + (f": {reason}" if reason else "")
                          + (f" after {elastic.max_restarts} restart(s)"
                             if elastic.max_restarts else ""),
                          hint=hint.removesuffix(")") if hint else
                          "the rank's output above has the details") from None
    except SignalException as exc:  # the agent stopped the workers (torch's own teardown)
        raise _interrupted(signal.Signals(exc.sigval), nproc, options) from None
    except KeyboardInterrupt as exc:  # before the agent's handlers (rendezvous) or after them
        sig = signal.SIGTERM if getattr(exc, "exit_code", 130) == 143 else signal.SIGINT
        raise _interrupted(sig, nproc, options) from None
    except (RendezvousError, OSError, RuntimeError) as exc:  # timeouts, unreachable endpoints
        raise LaunchError(f"the launcher failed before training: {summarize_exception(exc)}",
                          hint="check --rdzv-endpoint and that every node runs the same "
                               "command") from None
    finally:
        for logger in loggers:
            logger.removeFilter(quiet)
        for sig, handler in saved.items():
            if handler is not None:
                signal.signal(sig, handler)


def _start_forkserver() -> None:
    """Start multiprocessing's forkserver (once per process) with what every rank imports
    preloaded: torch's agent forks each rank, and each restart's, from it, already imported."""
    from partc.hardware.forkserver import start_forkserver
    from partc.run.worker import FORKSERVER_PRELOAD

    start_forkserver(FORKSERVER_PRELOAD)


def check_launch(plan: Plan, options: TrainOptions, elastic: ElasticOptions) -> int:
    """Everything that can be checked before processes start; returns processes per node."""
    from partc.files import probe_writable
    from partc.run.checkpoint import SHARED_ENV, shared_verdicts

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
    if options.init_from is not None:
        if not options.init_from.is_file():
            raise LaunchError(f"--init-from {options.init_from} is not a file",
                              hint="pass a torch.save'd state_dict of the model")
        from partc.emit.stage_weights import check_weights_file  # imports torch

        note = check_weights_file(options.init_from, plan)
        if note:
            print(f"partc launch: note: {note}", file=sys.stderr)
    if options.metrics is not None:  # rank 0 appends to it; found out now, not after a step
        metrics = options.metrics
        # appending to a plan file (or the model file) would change what the plan pins
        refuse_plan_artifact(metrics, "--metrics", plan.pinned_files())
        if metrics.is_dir():
            raise LaunchError(f"--metrics {metrics} is a directory",
                              hint="pass a file path: one JSON line per step is appended to it")
        above = next((p for p in metrics.parents if p.exists()), None)
        if above is not None and not above.is_dir():
            raise LaunchError(f"cannot write --metrics {metrics}: {above} is not a directory",
                              hint="pass a file in a writable directory")
        try:
            metrics.parent.mkdir(parents=True, exist_ok=True)
            if metrics.exists():
                with open(metrics, "a"):
                    pass
            else:
                probe_writable(metrics.parent)
        except OSError as exc:
            raise LaunchError(f"cannot write --metrics {metrics}: {exc.strerror or exc}",
                              hint="pass a file in a writable directory") from None
    if options.trace is not None:
        prepare_trace_directory(options.trace)
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
        try:  # an existing read-only directory would fail only at the first save
            probe_writable(options.checkpoint_dir)
        except OSError as exc:
            raise CheckpointError(f"--checkpoint-dir {options.checkpoint_dir} is not writable: "
                                  f"{exc.strerror}", hint="fix its permissions, or pass "
                                  "another directory") from None
        if elastic.node_rank == 0:  # the same choice rank 0 makes, before anything starts
            choose_resume(options.checkpoint_dir, resume=options.resume, restarted=False,
                          steps=options.steps, optimizer=plan.training.config.optimizer,
                          global_batch_size=plan.training.global_batch_size,
                          graph_hash=plan.model.graph_hash, model=plan.model.name,
                          allow_other_model=options.allow_other_model)
            # the workers inherit what was verified and warned about: rank 0 neither reads the
            # checkpoint again nor repeats a warning
            os.environ[SHARED_ENV] = shared_verdicts()
    if elastic.max_restarts and options.checkpoint_dir is None:
        print("partc launch: warning: --max-restarts without --checkpoint-dir: a restarted run "
              "starts again from step 0", file=sys.stderr)
    if elastic.nnodes > 1 and elastic.node_rank and elastic.rdzv_backend != "static":
        # torchrun's semantics: a dynamic rendezvous numbers nodes as they join
        print(f"partc launch: note: --node-rank {elastic.node_rank} is ignored by the "
              f"{elastic.rdzv_backend} rendezvous, which numbers nodes as they join (as "
              "torchrun does); pass --rdzv-backend static to fix node ranks", file=sys.stderr)
    return nproc
