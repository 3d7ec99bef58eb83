"""pytest configuration shared by the package tests and nbval.

nbval (strict, ``--nbval``) compares every stored output.  Two kinds of output are not lessons
and change from run to run, so they are not compared: stderr (library warnings, torchrun logs)
and SVG/JavaScript (random ids).  The chapters store PNG figures, which nbval does not compare.
"""

import pytest


def pytest_collection_modifyitems(items):
    """Every nbval cell is a ``notebook`` test (``pytest -m "not notebook"`` skips them)."""
    for item in items:
        if str(item.fspath).endswith(".ipynb"):
            item.add_marker(pytest.mark.notebook)


def pytest_collectstart(collector):
    path = str(getattr(collector, "path", getattr(collector, "fspath", "")))
    if path.endswith(".ipynb"):
        collector.skip_compare += ("stderr", "image/svg+xml", "application/javascript")
