"""`python -m partc`: the partc command line (the same as the `partc` console script)."""
from partc.cli.main import main

main()
