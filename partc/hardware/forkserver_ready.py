"""Imported last by partc's forkserver (partc.hardware.forkserver), which started with SIGINT
ignored while it imported the rest: Python's default handler back, which the server saves and
gives every process it forks."""
from __future__ import annotations

import signal

from partc.hardware.forkserver import starting_server

if starting_server():
    signal.signal(signal.SIGINT, signal.default_int_handler)
