"""Compact result tables for the chapters, without pandas.

:class:`Table` renders as an HTML table in the built book (class ``cpbook-compact``, styled by
``_static/cpbook.css``, which also gives wide tables a scroll cue on a phone) and as aligned plain
text everywhere else (``repr``: a terminal, nbval's comparison).  Cells are formatted once, when
the table is made, so both renderings show the same digits.
"""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from typing import Any

from cpbook.core.errors import RuleError

__all__ = ["Table", "table"]


def _cell(value: Any, digits: int) -> str:
    if isinstance(value, bool) or value is None:
        return {True: "yes", False: "no", None: "—"}[value]
    if isinstance(value, float):
        return f"{value:,.{digits}f}" if abs(value) < 1e15 else f"{value:.{digits}e}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _numeric(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


class Table:
    """A titled table of formatted cells; numbers right-aligned, thousands separated."""

    def __init__(
        self,
        rows: Sequence[Sequence[Any]],
        columns: Sequence[str],
        *,
        title: str | None = None,
        digits: int = 2,
    ) -> None:
        width = len(columns)
        for i, row in enumerate(rows):
            if len(row) != width:
                raise RuleError(
                    "table-row-width",
                    f"one cell per column ({width}) in every row",
                    row=i,
                    cells=list(row),
                )
        self.columns = [str(c) for c in columns]
        self.title = title
        self.cells = [[_cell(v, digits) for v in row] for row in rows]
        # a column is right-aligned when every non-empty value in it is a number
        self.right = [
            all(_numeric(r[j]) or r[j] is None for r in rows) and any(_numeric(r[j]) for r in rows)
            for j in range(width)
        ]

    def __repr__(self) -> str:
        widths = [
            max([len(c)] + [len(r[j]) for r in self.cells]) for j, c in enumerate(self.columns)
        ]

        def line(cells: Sequence[str]) -> str:
            parts = [
                c.rjust(w) if right else c.ljust(w)
                for c, w, right in zip(cells, widths, self.right)
            ]
            return "  ".join(parts).rstrip()

        out = [self.title] if self.title else []
        out += [line(self.columns), "  ".join("-" * w for w in widths)]
        out += [line(r) for r in self.cells]
        return "\n".join(out)

    def _repr_html_(self) -> str:
        def td(tag: str, text: str, right: bool) -> str:
            style = ' style="text-align: right"' if right else ""
            return f"<{tag}{style}>{html.escape(text)}</{tag}>"

        caption = f"<caption>{html.escape(self.title)}</caption>" if self.title else ""
        head = "".join(td("th", c, r) for c, r in zip(self.columns, self.right))
        body = "".join(
            "<tr>" + "".join(td("td", c, r) for c, r in zip(row, self.right)) + "</tr>"
            for row in self.cells
        )
        return (
            f'<table class="cpbook-compact cpbook-table">{caption}'
            f"<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
        )


def table(
    records: Sequence[Mapping[str, Any]],
    columns: Sequence[str] | Mapping[str, str] | None = None,
    *,
    title: str | None = None,
    digits: int = 2,
) -> Table:
    """A :class:`Table` of ``records`` (dicts): ``columns`` picks and orders the keys (all keys of
    the first record if omitted); a mapping ``{key: header}`` also renames them."""
    if columns is None:
        columns = list(records[0]) if records else []
    keys = list(columns)
    headers = list(columns.values()) if isinstance(columns, Mapping) else keys
    for i, rec in enumerate(records):
        missing = [k for k in keys if k not in rec]
        if missing:
            raise RuleError(
                "table-missing-key", "every key in every record", record=i, missing=missing
            )
    return Table([[rec[k] for k in keys] for rec in records], headers, title=title, digits=digits)
