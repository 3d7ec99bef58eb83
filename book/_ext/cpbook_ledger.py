"""Sphinx extension: the claim ledger's counts, computed from its tables when the book builds.

``book/claim_ledger.md`` states its counts as MyST substitutions (``{{ ledger_total }}``,
``{{ ledger_reproduced }}``, ...), never as typed numbers; :func:`ledger_counts` counts the
verdicts and evidence kinds of the page's table rows and this extension hands them to MyST
before any page is parsed.  ``tests/test_claim_ledger.py`` checks that the page uses the
substitutions and that these counts equal its own count of the rows.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

LEDGER = Path(__file__).resolve().parents[1] / "claim_ledger.md"
VERDICTS = ("reproduced", "corrected", "modelled", "not reproducible")
KINDS = ("exact", "measured", "source", "modelled")
_VERDICT = re.compile(r"\*\*(reproduced|corrected|modelled|not reproducible)\*\*")
_KIND = re.compile(r"\*(exact|measured|source|modelled)\*")


def ledger_rows(text: str) -> list[list[str]]:
    """The cells of every body row of the page's tables (header and separator rows dropped)."""
    rows = []
    for line in text.splitlines():
        if not line.startswith("|") or set(line) <= set("|-: ") or line.startswith("| Claim"):
            continue
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def ledger_counts(text: str) -> dict[str, int]:
    """``ledger_total``, ``ledger_<verdict>`` (spaces as ``_``) and ``ledger_kind_<kind>``: how
    many rows have each verdict (second cell) and name each evidence kind (third cell)."""
    rows = ledger_rows(text)
    verdicts = Counter(m.group(1) for r in rows for m in [_VERDICT.search(r[1])] if m)
    kinds = Counter(k for r in rows for k in set(_KIND.findall(r[2])))
    counts = {"ledger_total": len(rows)}
    counts |= {f"ledger_{v.replace(' ', '_')}": verdicts[v] for v in VERDICTS}
    counts |= {f"ledger_kind_{k}": kinds[k] for k in KINDS}
    return counts


def _substitute(app, config) -> None:
    counts = {k: str(v) for k, v in ledger_counts(LEDGER.read_text()).items()}
    config.myst_substitutions = {**(config.myst_substitutions or {}), **counts}


def setup(app):
    app.connect("config-inited", _substitute)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
