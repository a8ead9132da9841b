"""`python -m partitioner`: the command line (see partitioner/cli/main.py)."""

import sys

from partitioner.cli.main import main

__all__: list[str] = []

if __name__ == "__main__":
    sys.exit(main())
