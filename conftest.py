"""pytest configuration shared by the package tests and nbval.

nbval (strict, ``--nbval``) compares every stored output.  Two kinds of output are not lessons
and change from run to run, so they are not compared: stderr (library warnings, torchrun logs)
and SVG/JavaScript (random ids).  The chapters store PNG figures, which nbval does not compare.
The explorers (``cpbook.widgets.explorer``) inline their PNGs in ``text/html``; the payload of
those images, and nothing else, is replaced before comparing (``NBVAL_PNG_PATTERN``), so their
controls, state map and readouts are still compared.
"""

import pytest

from cpbook.widgets.explorer import NBVAL_PNG_PATTERN, NBVAL_PNG_REPLACE


def pytest_collection_modifyitems(items):
    """Every nbval cell is a ``notebook`` test (``pytest -m "not notebook"`` skips them)."""
    for item in items:
        if str(item.fspath).endswith(".ipynb"):
            item.add_marker(pytest.mark.notebook)


def pytest_collectstart(collector):
    path = str(getattr(collector, "path", getattr(collector, "fspath", "")))
    if path.endswith(".ipynb"):
        collector.skip_compare += ("stderr", "image/svg+xml", "application/javascript")
        # nbval's setup() adds the --nbval-sanitize-with patterns after this one
        collector.sanitize_patterns[NBVAL_PNG_PATTERN] = NBVAL_PNG_REPLACE
