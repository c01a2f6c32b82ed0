"""Ctrl-C and SIGTERM held while torch loads (`held_interrupts`) and across the CLI's re-exec.

A KeyboardInterrupt raised inside torch's import does not reliably stop the process: torch's C
extension imports numpy and carries on without it when that import fails, so a Ctrl-C in that
window was lost (`partc launch` trained on to its last step: 2 of 6 launches interrupted 1.0 s
after their start here, traced with strace: the launcher got the SIGINT, Python's handler ran, no
KeyboardInterrupt reached partc); one raised while pybind11 runs Python code aborted the process
with a C++ `terminate` dump (2 of 6 at 1.2 s); one in the middle of numpy's import left it half
loaded ("cannot load module more than once per process" later). So the signal waits for the
imports to end, a second or two, and then acts as it would have.
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading
from types import FrameType
from typing import Any, Iterator

# Blocked across the CLI's re-exec (seeded str hashing), with HELD_ENV set: a signal sent while
# the new interpreter starts stays pending until `release_held_signals` lets it in.
HELD_ENV = "PARTC_SIGNALS_HELD"
HELD_ACROSS_EXEC = frozenset({signal.SIGINT, signal.SIGTERM})


@contextlib.contextmanager
def held_interrupts(*, again_acts: bool = True) -> Iterator[None]:
    """Hold SIGINT and SIGTERM while the block runs, then deliver them to the handlers in place
    before (whatever ended the block): torch's import (where a KeyboardInterrupt is lost or
    aborts the process), or work that must not stop half-way (compile's swap of plan
    directories, `again_acts=False`). With `again_acts`, a second signal while one is held takes
    effect at once, for a block that does not end. Python-level handlers rather than
    pthread_sigmask: with the main thread's mask alone, the kernel hands the signal to one of
    torch's or CP-SAT's threads, whose C handler still makes the main thread raise
    KeyboardInterrupt. Outside the main thread nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    before: dict[signal.Signals, Any] = {}

    def restore() -> None:
        for signum, handler in before.items():
            signal.signal(signum, handler)

    def hold(signum: int, _frame: FrameType | None) -> None:
        if again_acts and received:  # sent again: the user will not wait for the block
            received.clear()
            restore()
            signal.raise_signal(signum)
            return
        received.append(signum)

    for signum in (signal.SIGINT, signal.SIGTERM):
        handler = signal.getsignal(signum)
        if handler is not None:  # None: installed outside Python, left alone
            before[signum] = handler
            signal.signal(signum, hold)
    try:
        yield
    finally:
        restore()
        for pending in dict.fromkeys(received):
            signal.raise_signal(pending)


def exec_holding_signals(argv: list[str]) -> None:
    """os.execv(argv[0], argv) with SIGINT and SIGTERM blocked through the exec: a Ctrl-C while
    the new interpreter starts, before partc's code can take it, waits for
    `release_held_signals`. Where the exec fails (OSError, raised) this process is as before."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, HELD_ACROSS_EXEC)
    os.environ[HELD_ENV] = "1"
    try:
        os.execv(argv[0], argv)
    finally:  # reached only where the exec failed
        del os.environ[HELD_ENV]
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def release_held_signals() -> None:
    """Let in the signals the CLI's re-exec held (a Ctrl-C pending since raises from here on);
    nothing where this process was not started so. Called first thing by the console script's
    entry and by the CLI's main (`python -m cli.main` enters there)."""
    if os.environ.pop(HELD_ENV, None) == "1":
        signal.pthread_sigmask(signal.SIG_UNBLOCK, HELD_ACROSS_EXEC)
