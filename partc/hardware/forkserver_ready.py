"""Imported last by partc's forkserver (partc.hardware.forkserver), which started with SIGINT
ignored while it imported the rest: Python's default handler back, which the server saves and
gives every process it forks; and the hook that keeps a process whose start was abandoned (a
Ctrl-C while launch's ranks are being forked) from printing a traceback under the launcher's
one line."""
from __future__ import annotations

import signal
import sys

from partc.hardware.forkserver import quiet_abandoned_starts, starting_server

if starting_server():
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.excepthook = quiet_abandoned_starts
