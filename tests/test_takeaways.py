"""Every ``##`` section of every chapter notebook closes with the book's takeaway admonition.

The form is fixed (issue 25): the section's last markdown text ends with ::

    ```{admonition} Takeaway
    :class: tip
    One or two sentences: the rule of thumb, with its number if it has one.
    ```

A chapter's closing sections (its summary, exercises and pointers into vLLM's source) are not
mechanisms and carry no takeaway.  Static: reads the ``.ipynb`` JSON, runs nothing.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))
# the closing sections every chapter ends with (their actual titles)
EXEMPT = ("Summary", "Exercises", "Where this lives in vLLM")
TAKEAWAY = re.compile(
    r"```\{admonition\} Takeaway\n:class: tip\n(?P<body>(?:(?!```).+\n){1,4})```\s*\Z"
)
_FENCE = re.compile(r"^(```|~~~)")
# MyST target labels, ``(name)=``, that end a section's text: they belong to the next heading
_LABELS = re.compile(r"(?:\n\s*\([\w-]+\)=\s*)+\Z")


def sections(nb: dict) -> list[tuple[str, str]]:
    """``(title, markdown)`` per ``##`` section, in order: the markdown text of the section
    (its cells' text joined, code cells left out), split at ``##`` lines outside code fences;
    the ``(label)=`` lines just above the next heading are the next section's.
    Text before the first ``##`` (the chapter's title and introduction) is not a section."""
    out: list[tuple[str, list[str]]] = []
    for cell in nb["cells"]:
        if cell["cell_type"] != "markdown":
            continue
        fenced = False
        for line in "".join(cell["source"]).splitlines():
            if _FENCE.match(line):
                fenced = not fenced
            if not fenced and line.startswith("## "):
                out.append((line[3:].strip(), []))
            elif out:
                out[-1][1].append(line)
        if out:
            out[-1][1].append("")  # a cell boundary
    return [
        (title, _LABELS.sub("", "\n".join(lines).strip()).strip() + "\n") for title, lines in out
    ]


def test_the_notebooks_are_found():
    assert len(NOTEBOOKS) >= 10, NOTEBOOKS


def test_sections_split_at_headings_outside_fences():
    nb = {
        "cells": [
            {"cell_type": "markdown", "source": ["# T\n", "intro\n", "## A\n", "a\n"]},
            {"cell_type": "code", "source": ["## not a heading\n"]},
            {"cell_type": "markdown", "source": ["```\n## in a fence\n```\n", "(b-label)=\n"]},
            {"cell_type": "markdown", "source": ["## B\n", "b"]},
        ]
    }
    assert [t for t, _ in sections(nb)] == ["A", "B"]
    assert "in a fence" in sections(nb)[0][1] and "b-label" not in sections(nb)[0][1]


def test_the_form_is_exact():
    good = "text\n\n```{admonition} Takeaway\n:class: tip\nKeep this, 8×.\n```\n"
    assert TAKEAWAY.search(good)
    for bad in (
        good.replace(":class: tip", ":class: note"),
        good.replace("Takeaway", "Take away"),
        good + "\nmore text after it\n",
        "```{admonition} Takeaway\n:class: tip\n```\n",  # no sentence
    ):
        assert not TAKEAWAY.search(bad), bad


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_every_section_ends_with_a_takeaway(path: Path):
    nb = json.loads(path.read_text())
    missing = [
        title
        for title, text in sections(nb)
        if not title.startswith(EXEMPT) and not TAKEAWAY.search(text)
    ]
    assert not missing, f"{path.name}: sections without a closing takeaway: {missing}"
