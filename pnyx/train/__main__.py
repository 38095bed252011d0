"""`python -m pnyx.train ...`: the trainer without the full CLI (used by the kill tests' subprocesses)."""

from pnyx.cli.trainer import main

if __name__ == "__main__":
    main()
