"""The `partc` console script's entry point: a module importing almost nothing before `main`,
so that a Ctrl-C while the CLI itself loads (its first ~0.2 s, twice: the CLI re-executes itself
with seeded str hashing) ends in one line and exit 130 like any later one, not a
KeyboardInterrupt traceback from the script's import line. Across that re-exec SIGINT and SIGTERM
are blocked (a blocked signal stays pending through exec), and let in here: a Ctrl-C while the
second interpreter starts is taken here too."""
from __future__ import annotations

import sys
from typing import TYPE_CHECKING, NoReturn

from partc.interrupts import release_held_signals


def main() -> NoReturn:
    """Load the CLI (partc.cli.main) and run it."""
    try:
        release_held_signals()  # a Ctrl-C pending since the re-exec raises from here on
        if TYPE_CHECKING:  # installed as partc.cli (setup.cfg's package_dir); mypy reads cli/
            from cli.main import main as run
        else:
            from partc.cli.main import main as run
    except KeyboardInterrupt:
        sys.stderr.write("partc: interrupted\n")
        sys.exit(130)
    run()
