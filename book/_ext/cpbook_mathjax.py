"""MathJax served by the book itself, so every formula renders with no network.

The files come from the ``sphinx-mathjax-offline`` wheel on PyPI (MathJax 3.2.2, in
``requirements.txt``); this extension copies only what the pages load: the ``tex-chtml``
component, its CommonHTML fonts, the TeX extensions it autoloads (``\\require``, ``ams`` …),
and the menu's accessibility and speech modules, about 7 MB instead of the wheel's 24 MB.
``mathjax_path`` points at the copy.  A missing package fails the build, with the fix.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path
from typing import Any

PACKAGE = "sphinx-mathjax-offline"  #: the wheel's module name (with hyphens, as it ships)
#: what ``tex-chtml.js`` loads from its own folder, relative to the MathJax root
FILES = ["tex-chtml.js"]
FOLDERS = ["output/chtml/fonts", "input/tex/extensions", "a11y", "ui", "sre", "adaptors"]
TARGET = "_static/mathjax"


def mathjax_root() -> Path:
    """The MathJax folder inside the installed package; ``ValueError`` if it is not installed."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or spec.origin is None:
        raise ValueError(
            f"[offline-mathjax] requires the {PACKAGE!r} package (MathJax 3 files); "
            "got none installed: pip install -r requirements.txt"
        )
    root = Path(spec.origin).parent / "static" / "mathjax"
    missing = [p for p in FILES + FOLDERS if not (root / p).exists()]
    if missing:
        raise ValueError(f"[offline-mathjax] requires {missing} under {root}; got none there")
    return root


def _point_at_copy(app, config) -> None:
    mathjax_root()  # fail before the build, not after it
    config.mathjax_path = "mathjax/tex-chtml.js"


def _copy(app, exc) -> None:
    if exc is not None or app.builder.format != "html":
        return
    root, out = mathjax_root(), Path(app.outdir) / TARGET
    for name in FILES:
        out.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / name, out / name)
    for name in FOLDERS:
        shutil.copytree(root / name, out / name, dirs_exist_ok=True)


def setup(app) -> dict[str, Any]:
    app.connect("config-inited", _point_at_copy)
    app.connect("build-finished", _copy)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
