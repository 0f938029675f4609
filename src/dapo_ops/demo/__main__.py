"""Entry point of ``python -m dapo_ops.demo``."""

import sys

from dapo_ops.demo.cli import main

if __name__ == "__main__":
    sys.exit(main())
