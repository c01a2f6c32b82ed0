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
from typing import Callable, Iterator

Handler = Callable[[int, "FrameType | None"], object]

# The CLI re-executes itself (seeded str hashing) with these blocked and HELD_ENV set: a signal
# sent while the new interpreter starts stays pending until partc.cli.entry unblocks them.
HELD_ENV = "PARTC_SIGNALS_HELD"
HELD_ACROSS_EXEC = frozenset({signal.SIGINT, signal.SIGTERM})


@contextlib.contextmanager
def held_interrupts() -> Iterator[None]:
    """Hold SIGINT and SIGTERM while the block runs, where Python code handles them (Python's
    KeyboardInterrupt, the CLI's SIGTERM handler): the first one takes effect when the block ends
    (its handler runs then, raising there); a second one takes effect at once, for a block that
    does not end. Outside the main thread, or for a signal no Python handler takes, nothing
    changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    handlers: dict[int, Handler] = {}
    for signum in (signal.SIGINT, signal.SIGTERM):
        handler = signal.getsignal(signum)
        if callable(handler):
            handlers[int(signum)] = handler
    held: list[int] = []

    def hold(signum: int, frame: FrameType | None) -> None:
        if held:  # pressed again: the user will not wait for the block
            handlers[signum](signum, frame)
        held.append(signum)

    for held_signal in handlers:
        signal.signal(held_signal, hold)
    try:
        yield
    finally:
        for held_signal, saved in handlers.items():
            signal.signal(held_signal, saved)
    if held:
        handlers[held[0]](held[0], None)


def release_held_signals() -> None:
    """Let in the signals the CLI's re-exec held (a Ctrl-C pending since raises from here on);
    nothing where this process was not started so. Called first thing by the console script's
    entry and by the CLI's main (`python -m cli.main` enters there)."""
    if os.environ.pop(HELD_ENV, None) == "1":
        signal.pthread_sigmask(signal.SIG_UNBLOCK, HELD_ACROSS_EXEC)
