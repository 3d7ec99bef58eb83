"""Re-execute notebooks in place, top to bottom, with nbclient, saving widget state.

``python -m cpbook.tools.execute notebooks/01_*.ipynb`` — what contributors run after changing a
chapter or the package; the stored outputs are what the book renders and what nbval compares.
Each notebook runs in its own folder (as nbval and Jupyter Book do) with a fresh kernel.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient


def execute(path: Path, timeout: int = 900, kernel: str = "python3") -> float:
    """Execute ``path`` in place; returns the seconds it took.  Raises on the first failing cell."""
    nb = nbformat.read(path, as_version=4)
    t0 = time.perf_counter()
    client = NotebookClient(
        nb,
        timeout=timeout,
        kernel_name=kernel,
        store_widget_state=True,
        resources={"metadata": {"path": str(path.parent.resolve())}},
    )
    client.execute()
    nb.metadata.pop("papermill", None)
    nbformat.write(nb, path)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m cpbook.tools.execute", description=__doc__.splitlines()[0]
    )
    p.add_argument("notebooks", nargs="+", type=Path)
    p.add_argument("--timeout", type=int, default=900, help="seconds per cell")
    a = p.parse_args(argv)
    for nb in a.notebooks:
        print(f"{nb}: executed in {execute(nb, a.timeout):.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
