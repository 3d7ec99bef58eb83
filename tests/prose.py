"""The prose a reader reads, from the book's MyST markdown (pages and notebook markdown cells).

Shared by ``tests/test_word_budget.py`` and ``tests/test_internal_language.py``.  Static: reads
files, runs nothing.

What counts as prose (the words a reader reads):

- Text lines, headings, list items, table cells, and the body of MyST directives that hold
  text (admonitions, margins, dropdowns, figures' captions): all counted.
- A directive's argument is read (``{admonition} Takeaway`` shows "Takeaway"); its fence and
  name are not, nor its option lines (``:class: tip``, ``:name: fig-x``, ``:alt: ...``: alt text
  is for screen readers, the caption is what the page shows).
- Code blocks inside markdown (fences that are not ``{directive}``, and ``{code-cell}``,
  ``{code-block}``, ``{code}``) are code, not prose: not counted.  Display math (``$$ … $$`` and
  ``{math}``) is not counted; inline math ``$…$`` counts as one word.
- Links count their text, not their address; roles count what they show: ``{term}`KV cache```
  the term, ``{doc}`x``` / ``{ref}`` / ``{numref}`` / ``{cite}`` / ``{glue:…}`` one word (or
  their explicit title ``{doc}`title <x>```); inline code counts its words.
- MyST target lines ``(label)=``, HTML comments and tags are not read.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
BOOK = ROOT / "book"

#: a chapter notebook: ``NN_name.ipynb``
CHAPTERS = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))

_FENCE = re.compile(r"^\s*(`{3,}|~{3,}|:{3,})\s*(\{([\w:-]+)\})?\s*(.*)$")
_CODE_DIRECTIVES = {"code-cell", "code-block", "code", "math", "literalinclude", "raw"}
_OPTION = re.compile(r"^\s*:[\w-]+:(\s|$)")
_LABEL = re.compile(r"^\s*\([\w.:-]+\)=\s*$")
_HEADING = re.compile(r"^(#{1,6}) (.*)")
_ROLE = re.compile(r"\{([\w:-]+)\}`([^`]*)`")
_SHOWS_CONTENT = {"term", "abbr", "sub", "sup", "kbd", "guilabel", "math"}
_LINK = re.compile(r"!?\[([^\]]*)\]\([^)]*\)")
_HTML = re.compile(r"<!--.*?-->|<[^>]+>", re.S)
_WORD = re.compile(r"[A-Za-z0-9][\w'’.-]*")
_MENTION = re.compile(r"\b(article|talk|slide|speaker)s?\b", re.I)


def _role(m: re.Match) -> str:
    name, body = m.group(1), m.group(2)
    title = re.match(r"(.*?)\s*<[^>]*>\s*$", body)
    if title and title.group(1):
        return title.group(1)
    if name in _SHOWS_CONTENT:
        return body if name != "math" else "x"
    return "ref"  # a number, a citation or a page title: one word


def reader_line(line: str) -> str:
    """One markdown line as the reader sees its words."""
    line = _ROLE.sub(_role, line)
    line = _LINK.sub(lambda m: m.group(1), line)
    line = re.sub(r"\$[^$]+\$", "x", line)
    return _HTML.sub(" ", line)


def lines(markdown: str) -> list[str | tuple[int, str]]:
    """The reader's lines of one markdown text, with headings as ``(level, title)`` tuples.

    Code and math blocks, fences, directive names and options, and target lines are dropped."""
    out: list[str | tuple[int, str]] = []
    stack: list[tuple[str, bool]] = []  # open fences: (marker, holds prose)
    in_math = False
    opened = False  # just after a directive's opening line: its option lines follow
    for raw in re.sub(r"<!--.*?-->", "", markdown, flags=re.S).splitlines():
        f = _FENCE.match(raw)
        if stack and not stack[-1][1]:  # inside code: only its closing fence matters
            if f and not f.group(2) and not f.group(4) and f.group(1) == stack[-1][0]:
                stack.pop()
            continue
        if f and stack and f.group(1) == stack[-1][0] and not f.group(2) and not f.group(4):
            stack.pop()
            opened = False
            continue
        if f and (f.group(2) or f.group(1).startswith("`") or f.group(1).startswith("~")):
            name = f.group(3)
            prose = bool(name) and name not in _CODE_DIRECTIVES
            stack.append((f.group(1), prose))
            if prose and f.group(4):
                out.append(reader_line(f.group(4)))
            opened = prose
            continue
        if opened and _OPTION.match(raw):
            continue
        opened = False
        if raw.strip() == "$$" or (raw.strip().startswith("$$") and raw.strip().endswith("$$")):
            if raw.strip() == "$$":
                in_math = not in_math
            continue
        if in_math or _LABEL.match(raw):
            continue
        h = _HEADING.match(raw)
        if h:
            out.append((len(h.group(1)), reader_line(h.group(2))))
        else:
            out.append(reader_line(raw))
    return out


def words(text: str) -> int:
    return len(_WORD.findall(text))


def mentions(text: str) -> int:
    """Mentions of the talk the book started from: article, talk, slide, speaker (+ plurals)."""
    return len(_MENTION.findall(text))


def markdown_cells(path: Path) -> list[tuple[int, str]]:
    """``(cell index, source)`` of a notebook's markdown cells."""
    nb = json.loads(path.read_text())
    return [
        (i, "".join(c["source"]) if isinstance(c["source"], list) else c["source"])
        for i, c in enumerate(nb["cells"])
        if c["cell_type"] == "markdown"
    ]
