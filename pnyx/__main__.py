"""`python -m pnyx ...` is the same as the `pnyx` console script (used to start fleet processes)."""

from pnyx.cli import main

main()
