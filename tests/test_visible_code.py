"""The code a chapter shows is the idea, formatted for the page: no visible cell carries a
``# fmt: skip`` marker or a line longer than the code box holds at 1280 px (88 characters;
``tests/test_site.py`` checks the rendered box too).  Hidden cells (``hide-input``,
``remove-input``, ``remove-cell``, ``hide-cell``) hold the plumbing and are not checked.
Static: reads the ``.ipynb`` JSON, runs nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
HIDDEN = {"hide-input", "remove-input", "remove-cell", "hide-cell"}
WIDTH = 88


def visible_code(path: Path) -> list[tuple[int, str]]:
    """``(cell index, source)`` of the code cells a reader sees."""
    cells = json.loads(path.read_text())["cells"]
    return [
        (i, "".join(c["source"]))
        for i, c in enumerate(cells)
        if c["cell_type"] == "code" and not HIDDEN & set(c["metadata"].get("tags", []))
    ]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_visible_code_is_formatted_for_the_page(path):
    bad = [
        f"cell {i}: {line.strip()[:60]!r}"
        for i, src in visible_code(path)
        for line in src.splitlines()
        if "fmt: skip" in line or len(line) > WIDTH
    ]
    head = f"{path.name}: visible code with fmt: skip or wider than {WIDTH}:"
    assert not bad, "\n".join([head, *bad])
