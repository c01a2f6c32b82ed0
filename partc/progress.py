"""Progress reporting for long passes: library code names its steps, the caller decides display."""
from __future__ import annotations

import contextlib
import sys
import threading
import time
from typing import Iterator, TextIO


class Progress:
    """Silent progress: the default for library calls. Subclasses show it."""

    @contextlib.contextmanager
    def step(self, label: str) -> Iterator[None]:
        yield

    def warn(self, message: str) -> None:
        pass


class TerminalProgress(Progress):
    """Prints each step with its duration to a stream (stderr); animates a spinner on a TTY so a
    long torch.export visibly runs."""

    _FRAMES = "|/-\\"

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())

    @contextlib.contextmanager
    def step(self, label: str) -> Iterator[None]:
        start = time.perf_counter()
        stop = threading.Event()
        spinner = None
        if self.tty:
            def spin() -> None:
                i = 0
                while not stop.wait(0.2):
                    elapsed = time.perf_counter() - start
                    self.stream.write(f"\r  {self._FRAMES[i % 4]} {label} ({elapsed:.0f} s)")
                    self.stream.flush()
                    i += 1
            spinner = threading.Thread(target=spin, daemon=True)
            spinner.start()
        else:
            self.stream.write(f"  .. {label}\n")
            self.stream.flush()
        ok = False
        try:
            yield
            ok = True
        finally:
            stop.set()
            if spinner is not None:
                spinner.join()
            elapsed = time.perf_counter() - start
            mark = "ok" if ok else "failed"
            prefix = "\r\033[K" if self.tty else ""
            self.stream.write(f"{prefix}  {mark} {label} ({elapsed:.1f} s)\n")
            self.stream.flush()

    def warn(self, message: str) -> None:
        self.stream.write(f"partc: warning: {message}\n")
        self.stream.flush()
