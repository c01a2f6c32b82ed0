"""multiprocessing's forkserver for the processes partc starts: launch's ranks and calibrate's
measurements (`start_forkserver`).

The server starts in the user's foreground process group and imports its preload modules (torch:
seconds) before it ignores SIGINT, as it does from then on: a terminal's Ctrl-C in that window
ended it with a KeyboardInterrupt traceback on the user's terminal (seen here: `partc launch`
interrupted 0.5-1.5 s after its start). So it starts with SIGINT ignored (a disposition its exec
keeps, where a blocked mask is reset), and `partc.hardware.forkserver_ready`, the last module it
imports, puts Python's default handler back, which the server keeps for every process it forks:
they are interrupted as a spawned process would be. The starting process holds SIGINT blocked
while its disposition is SIG_IGN for the spawn, so a Ctrl-C meanwhile reaches it afterwards
(Linux never ignores a blocked signal).
"""
from __future__ import annotations

import multiprocessing
import signal
import sys
import threading
from multiprocessing import forkserver, synchronize
from types import TracebackType
from typing import Sequence


def starting_server() -> bool:
    """Whether this code runs inside multiprocessing's forkserver, importing its preload."""
    frame = sys._getframe()
    main = forkserver.main.__code__
    while frame is not None:
        if frame.f_code is main:
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def _abandoned(exc: BaseException) -> bool:
    """Whether `exc` is a forked process failing to rebuild a semaphore its requester passed it:
    the requester (launch's agent) has already torn down and unlinked it, as it does when a
    Ctrl-C stops a launch while its ranks are being forked."""
    if not isinstance(exc, FileNotFoundError):
        return False
    tb = exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_name == "__setstate__" and code.co_filename == synchronize.__file__:
            return True
        tb = tb.tb_next
    return False


def quiet_abandoned_starts(exc_type: type[BaseException], exc: BaseException,
                           tb: TracebackType | None) -> None:
    """sys.excepthook for the forkserver's processes: a process whose start its requester
    abandoned exits without a word (with status 1; the launcher, interrupted, has already said
    why in one line); every other failure prints its traceback, as Python's hook does."""
    if _abandoned(exc):
        return
    sys.__excepthook__(exc_type, exc, tb)


def helper_pids() -> set[int]:
    """The forkserver and resource tracker multiprocessing keeps for this process (their pids
    are multiprocessing's private state: none where a Python version names them otherwise)."""
    from multiprocessing import resource_tracker

    found = (getattr(forkserver._forkserver, "_forkserver_pid", None),
             getattr(resource_tracker._resource_tracker, "_pid", None))
    return {pid for pid in found if pid}


def start_forkserver(preload: Sequence[str]) -> None:
    """Start this process's forkserver (once per process: a running one is kept, whatever it
    preloaded) importing `preload`, deaf to Ctrl-C until it has imported them."""
    multiprocessing.set_forkserver_preload([*preload, "partc.hardware.forkserver_ready"])
    handler = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or handler is None:
        forkserver.ensure_running()  # signal.signal needs the main thread and a Python handler
        return
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        forkserver.ensure_running()
    finally:
        signal.signal(signal.SIGINT, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
