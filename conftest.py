"""pytest configuration shared by the package tests and nbval.

nbval (strict, ``--nbval``) compares every stored output.  Two kinds of output are not lessons
and change from run to run, so they are not compared: stderr (library warnings, torchrun logs)
and SVG/JavaScript (random ids).  The chapters store PNG figures, which nbval does not compare.
"""


def pytest_collectstart(collector):
    path = str(getattr(collector, "path", getattr(collector, "fspath", "")))
    if path.endswith(".ipynb"):
        collector.skip_compare += ("stderr", "image/svg+xml", "application/javascript")
