"""`python -m partitioner`: the command line (see partitioner/cli.py)."""

import sys

from partitioner.cli import main

__all__: list[str] = []

if __name__ == "__main__":
    sys.exit(main())
