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

# pytest-timeout limits above pyproject.toml's 300 s.  torchrun: 1200 s, above one job's
# run(job_timeout=900), so a hung job fails first with the launcher's message (stderr tail); the
# slowest torchrun test takes ~36 s on the book's 2-core CPU.  Notebook cells: 900 s, above
# nbval's --nbval-cell-timeout=600 (kernel start-up included).
TIMEOUT_S = {"torchrun": 1200, "notebook": 900}


def pytest_collection_modifyitems(items):
    """Every nbval cell is a ``notebook`` test (``pytest -m "not notebook"`` skips them);
    torchrun tests and notebook cells get the longer time limits of :data:`TIMEOUT_S`, unless
    a test sets its own ``@pytest.mark.timeout``."""
    for item in items:
        if str(item.fspath).endswith(".ipynb"):
            item.add_marker(pytest.mark.notebook)
        if item.get_closest_marker("timeout") is None:
            for marker, limit in TIMEOUT_S.items():
                if item.get_closest_marker(marker) is not None:
                    item.add_marker(pytest.mark.timeout(limit))
                    break


def pytest_collectstart(collector):
    path = str(getattr(collector, "path", getattr(collector, "fspath", "")))
    if path.endswith(".ipynb"):
        collector.skip_compare += ("stderr", "image/svg+xml", "application/javascript")
        # nbval's setup() adds the --nbval-sanitize-with patterns after this one
        collector.sanitize_patterns[NBVAL_PNG_PATTERN] = NBVAL_PNG_REPLACE
