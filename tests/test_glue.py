"""Numbers two pages share reach the prose only through glue.

The book computes four families of numbers once, in the package, and every page that quotes one
glues it (``glue("name", value, display=False)`` in a hidden cell, `` {glue:text}`name` `` in the
markdown) instead of typing it:

- the DCP decode break-even (:func:`cpbook.costmodel.break_even_table`: both decode models, 1 and
  16 requests, with and without TPA), as the prose rounds it ("74K", "169K") and exactly
  ("76,141");
- KV bytes per token of the book's models (:func:`cpbook.costmodel.kv_bytes_per_token`, 16-bit
  and FP8: "70,272", "35,136");
- the AG-Q/AG-KV crossover factor $C^\\ast/T$ as chapter 5 prints it ("7.25" on its grid; "7.03"
  at head size 128), solved from :func:`cpbook.pcp.chunked_plan.comm_plan`'s bytes;
- the PCP straggler factor of a contiguous split (:func:`cpbook.pcp.zigzag.causal_work`) for the
  PCP sizes chapter 4 shows ("1.5", "1.75", "1.875"); the formula $2 - 1/K$ is text, not a number.

The test reads the reader's text (``tests/prose.py``: code, math, directive options, link
addresses and roles, ``{glue:…}`` included, are not text) of every ``book/*.md`` page and every
markdown cell of ``notebooks/*.ipynb``, and fails on any of those numbers typed as literal text,
listing each file and cell.  A number is matched as a whole number: "74K" not inside "174K",
"70,272" not inside "170,272" or "70,272.5".  Numbers that are also something else carry a
context: a power of two ("131,072", Llama-3.1-8B's KV bytes, is also 128K tokens) counts only in
a clause that speaks of bytes and not as a token count; the straggler and crossover factors only
in a clause about a contiguous split / straggler or about the crossover / gathers.  Static:
computes with the package, reads files, executes no notebook.
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass
from functools import cache

import pytest

from tests.prose import BOOK, NOTEBOOKS, ROOT, lines, markdown_cells

#: pages that may state a shared number as text, with the reason
EXEMPT = {
    # the reference tables of the specs: a checked copy of the package that
    # tests/test_costmodel.py recomputes number by number
    "book/appendix_hardware_models.md": "checked copy of cpbook.costmodel (test_costmodel.py)",
}

_BYTES = re.compile(r"\bbytes?\b|\d\s?B\b|\b[KMG]i?B\b")
_STRAGGLER = re.compile(r"straggl|contiguous|busiest|max\s*/\s*mean|mean work|times the mean", re.I)
_CROSSOVER = re.compile(r"crossover|cross-over|gather|AG-Q|AG-KV|\bC\*", re.I)
_CODE_SPAN = re.compile(r"(`+)[^`\n]*?\1")
_CLAUSE = re.compile(r"(?<=[.;!?])\s+|\n\s*\n")


@dataclass(frozen=True)
class Shared:
    """One shared number: ``text`` as the book prints it, what it is, and (optionally) the
    context its clause must have for the match to count, and a tail that excuses it."""

    text: str
    what: str
    context: re.Pattern | None = None
    not_followed_by: str | None = None

    @property
    def pattern(self) -> re.Pattern:
        body = re.escape(self.text).replace(r"\ ", r"\s?")
        if self.text.endswith("K"):  # "74K", "74 K", "74k"
            body = re.escape(self.text[:-1]) + r"\s?[Kk]"
        tail = r"(?!\d|[.,]\d|\w)"
        if self.not_followed_by:
            tail += rf"(?!{self.not_followed_by})"
        return re.compile(rf"(?<![\d.,\w]){body}{tail}")


def _grouped(n: float) -> list[str]:
    """``n`` rounded, with thousands separators and without."""
    i = round(n)
    return [f"{i:,}", str(i)] if i >= 10_000 else [f"{i:,}"]


@cache
def shared_numbers() -> tuple[Shared, ...]:
    from cpbook import costmodel as cm
    from cpbook.core.comm import comm_bytes
    from cpbook.costmodel.specs import MODELS
    from cpbook.pcp.chunked_plan import RankSizes, comm_plan
    from cpbook.pcp.zigzag import causal_work

    out: dict[str, Shared] = {}

    def add(s: Shared) -> None:
        out.setdefault(s.text, s)

    for r in cm.break_even_table():
        what = f"DCP break-even ({r.decode_model}, {r.num_reqs} req, {r.label})"
        add(Shared(f"{r.k_tokens}K", what))
        for t in _grouped(r.tokens):
            add(Shared(t, what))

    for name, m in MODELS.items():
        for kv in ("bf16", "fp8"):
            b = cm.kv_bytes_per_token(m, kv)
            pow2 = b & (b - 1) == 0
            for t in _grouped(b):
                add(
                    Shared(
                        t,
                        f"KV bytes per token, {name} {kv}",
                        _BYTES if pow2 else None,
                        r"[\s-]?tokens?\b" if pow2 else None,
                    )
                )

    # the crossover C*/T: where AllGather-KV's bytes (linear in the context) reach
    # AllGather-Q's, on chapter 5's grid (head size 16, float64) and at head size 128 in bf16
    for d, e in ((16, 8), (128, 2)):
        sizes, t = RankSizes(8, 1, d, d, False, 2, 2, 1, 1 << 22, e), 1024
        q = comm_bytes(comm_plan("allgather_q", [0], [t], sizes))
        kv0, kv1 = (comm_bytes(comm_plan("allgather_kv", [c], [t], sizes)) for c in (0, 1 << 16))
        factor = (q - kv0) / ((kv1 - kv0) / (1 << 16)) / t
        for digits in (2, 3):
            add(Shared(f"{factor:.{digits}f}", "AG-Q/AG-KV crossover C*/T", _CROSSOVER))

    # the straggler factor max/mean of a contiguous split: chapter 4's prompts (one of 2,048
    # and one of 300 tokens), and a long prompt (-> 2 - 1/K)
    for k in (2, 4, 8):
        for lens in ((2048, 300), 1 << 16):
            w = causal_work(lens, k, "contiguous")
            x = max(w) / statistics.mean(w)
            for digits in (2, 3):
                text = f"{x:.{digits}f}".rstrip("0").rstrip(".")
                add(Shared(text, f"PCP straggler factor, K = {k}", _STRAGGLER))
    return tuple(out.values())


def _reader_text(markdown: str) -> str:
    """The reader's text without inline code (roles are already resolved by ``lines``)."""
    text = "\n".join(t if isinstance(t, str) else t[1] for t in lines(markdown))
    return _CODE_SPAN.sub(" ", text)


def sources() -> list[tuple[str, str]]:
    """``(where, reader text)`` of every book page and notebook markdown cell."""
    out = []
    for p in sorted(BOOK.glob("*.md")):
        where = str(p.relative_to(ROOT))
        if where not in EXEMPT:
            out.append((where, _reader_text(p.read_text())))
    for nb in sorted(NOTEBOOKS.glob("*.ipynb")):
        for i, src in markdown_cells(nb):
            out.append((f"{nb.relative_to(ROOT)} cell {i}", _reader_text(src)))
    return out


def offenders(text: str) -> list[str]:
    """The shared numbers ``text`` states as literal text: ``"'74K' (what): …context…"``."""
    found = []
    for clause in _CLAUSE.split(text):
        for s in shared_numbers():
            if s.context is not None and not s.context.search(clause):
                continue
            for m in s.pattern.finditer(clause):
                ctx = clause[max(0, m.start() - 50) : m.end() + 30].replace("\n", " ")
                found.append(f"{s.text!r} ({s.what}): …{ctx}…")
    return found


def test_the_numbers_are_the_books():
    texts = {s.text for s in shared_numbers()}
    assert {"74K", "70K", "13K", "11K", "169K", "159K"} <= texts
    assert {"76,141", "173,522", "70,272", "35,136", "131,072"} <= texts
    assert {"7.25", "1.5", "1.75", "1.875"} <= texts


@pytest.mark.parametrize(
    ("text", "hits"),
    [
        ("DCP pays from about 74K tokens.", ["74K"]),
        ("DCP pays from about 74 K tokens, 11–13K with 16.", ["74K", "13K"]),
        ("about 174K tokens, or 740K, or 1.74K", []),
        ("DCP pays from {glue:text}`ch6_be_whole_1`K tokens.", []),
        ("Run `x = 74K` in code.", []),
        ("```python\nbe = 74  # 74K\n```\n", []),
        ("DeepSeek-V3 caches 70,272 bytes per token; 170,272 is not it.", ["70,272"]),
        ("A 131,072-token prompt at PCP = 4.", []),
        ("128K means 131,072 tokens.", []),
        ("the 8B Llama caches 70,272 B and Llama 131,072 B per token.", ["70,272", "131,072"]),
        ("Static DP is about 1.5 ms faster.", []),
        ("the contiguous split gives its last rank 1.5 times the mean work.", ["1.5"]),
        ("Gather K/V while the context is below 7.25 chunks.", ["7.25"]),
    ],
)
def test_matching(text: str, hits: list[str]):
    got = sorted({o.split("'")[1] for o in offenders(_reader_text(text))})
    assert got == sorted(hits), offenders(_reader_text(text))


def test_shared_numbers_come_from_glue():
    bad = [f"{where}: {o}" for where, text in sources() for o in offenders(text)]
    assert not bad, (
        f"{len(bad)} shared number(s) typed as text; glue them from the package "
        "(glue(...) in a hidden cell, {glue:text}`name` in the markdown):\n" + "\n".join(bad)
    )
