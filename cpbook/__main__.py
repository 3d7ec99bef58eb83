"""``python -m cpbook`` and the ``cpbook`` console script: :func:`cpbook.cli.main`."""

from __future__ import annotations

import sys

from cpbook.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
