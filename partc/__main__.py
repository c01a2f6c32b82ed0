"""`python -m partc`: the partc command line (the same as the `partc` console script)."""
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    # setup.cfg installs the top-level cli/ as partc.cli (package_dir), which mypy cannot follow;
    # it checks the same file under its source name.
    from cli.entry import main
else:
    from partc.cli.entry import main

main()
