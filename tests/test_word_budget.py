"""The chapters' prose stays within the book's word budget, and teaches rather than fact-checks.

Per chapter notebook (``notebooks/NN_*.ipynb``), the prose is the words of its markdown cells
outside two sections: "Exercises" and "Where this lives in vLLM" (a section starts at a ``#`` or
``##`` heading line and runs to the next one; ``###`` headings stay inside).  What counts as a
word is what a reader reads (``tests/prose.py``: code blocks, display math, directive options,
link addresses and target lines are not counted), so the count is at most what
``wordcount.py``-style raw counts give.

- at most :data:`PER_CHAPTER` words per chapter and :data:`BOOK` for all chapters together;
- at most :data:`MENTIONS` mentions of "article", "talk", "slide" or "speaker" per chapter (in the
  same prose): the talk the book grew from is a source, not the spine.

A failure lists every chapter's counts.  Static: reads the ``.ipynb`` JSON, runs nothing.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.prose import CHAPTERS, lines, markdown_cells, mentions, words

PER_CHAPTER = 2_500
BOOK = 22_000
MENTIONS = 2
#: the closing sections that carry no budget (their titles, as the chapters write them)
UNCOUNTED = re.compile(r"^(exercises?\b|where this lives in vllm\b)", re.I)


def prose(path: Path) -> str:
    """The chapter's counted prose: its markdown cells' reader text outside the uncounted
    sections, one line per line."""
    out, skip = [], False
    for _, source in markdown_cells(path):
        for line in lines(source):
            if isinstance(line, tuple):
                level, title = line
                if level <= 2:
                    skip = bool(UNCOUNTED.match(title.strip()))
                line = title
            if not skip:
                out.append(line)
    return "\n".join(out)


def counts() -> dict[str, tuple[int, int]]:
    """``chapter stem -> (prose words, article/talk/slide/speaker mentions)``."""
    return {p.stem: (words(t), mentions(t)) for p in CHAPTERS for t in [prose(p)]}


def report(c: dict[str, tuple[int, int]]) -> str:
    rows = [f"  {k:<22} {w:>6,} words  {m:>3} mentions" for k, (w, m) in c.items()]
    total = sum(w for w, _ in c.values())
    return "\n".join(rows + [f"  {'all chapters':<22} {total:>6,} words"])


def test_the_chapters_are_found():
    assert len(CHAPTERS) >= 11, CHAPTERS


def test_sections_and_counting_rules():
    md = (
        "# Title\n(sec-a)=\nOne two three.\n"
        "```{admonition} Takeaway\n:class: tip\nFour five, see {doc}`x` and [six](http://a/b).\n```\n"
        "```python\nnot = counted(at_all)\n```\n$$\nx + y\n$$\n"
        "## Exercises\nskipped words here\n### Answer\nstill skipped\n"
        "## Where this lives in vLLM\nskipped too article\n## Summary\nseven article\n"
    )
    nb = {"cells": [{"cell_type": "markdown", "source": md}]}
    text = "\n".join(t if isinstance(t, str) else t[1] for t in lines(nb["cells"][0]["source"]))
    assert "class" not in text and "counted" not in text and "sec-a" not in text
    assert "Takeaway" in text and "http" not in text
    assert words("Four five, see ref and six.") == 6


def test_word_budget_and_talk_mentions():
    c = counts()
    total = sum(w for w, _ in c.values())
    over = [k for k, (w, _) in c.items() if w > PER_CHAPTER]
    talky = [k for k, (_, m) in c.items() if m > MENTIONS]
    problems = []
    if over:
        problems.append(f"over {PER_CHAPTER:,} words: {', '.join(over)}")
    if total > BOOK:
        problems.append(f"all chapters {total:,} words > {BOOK:,}")
    if talky:
        problems.append(f"more than {MENTIONS} article/talk/slide/speaker mentions: {talky}")
    assert not problems, "; ".join(problems) + "\n" + report(c)


@pytest.mark.parametrize("path", CHAPTERS, ids=[p.stem for p in CHAPTERS])
def test_prose_is_found(path: Path):
    assert words(prose(path)) > 100, path.name
