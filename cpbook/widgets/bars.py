"""Horizontal bar charts as plain HTML, for explorer readouts that are lighter than a PNG.

A chart is a few hundred bytes of ``<div>`` elements with inline styles: no image, no script,
no network.  It fits any width down to a phone's (labels and values keep their size, the bars
take what is left) and its numbers are text, so it needs no alt text.
Callers pass colours of the book's palette (:mod:`cpbook.viz.style`), as the figures do.
"""

from __future__ import annotations

import html
from typing import Sequence

from cpbook.core.errors import RuleError

__all__ = ["bar_chart"]

BarSegment = tuple[float, str]


def bar_chart(
    rows: Sequence[tuple[str, Sequence[BarSegment], str]],
    *,
    title: str = "",
    scale: float | None = None,
    legend: Sequence[tuple[str, str]] = (),
) -> str:
    """HTML bars, one row per ``(label, [(value, colour), ...], text)``; segments stack.

    Lengths are relative to ``scale`` (default: the largest row total), so a row of total
    ``scale`` spans the whole track.  ``text`` is printed after the bar; ``legend`` pairs
    ``(name, colour)``.  Values must be non-negative.
    """
    totals = [sum(v for v, _ in segs) for _, segs, _ in rows]
    if any(v < 0 for _, segs, _ in rows for v, _ in segs):
        lowest = min(v for _, segs, _ in rows for v, _ in segs)
        raise RuleError("bar-values", "non-negative values", lowest=lowest)
    top = scale if scale is not None else max(totals, default=0.0)
    out = ['<div class="cpx-bars" style="font-size:.85em;margin:.3em 0">']
    if title:
        out.append(f'<div style="font-weight:600;margin-bottom:.2em">{html.escape(title)}</div>')
    for (label, segs, text), total in zip(rows, totals):
        bar = "".join(
            f'<span style="display:inline-block;height:100%;width:{100 * v / top:.2f}%;'
            f'background:{c}"></span>'
            for v, c in segs
            if top > 0 and v > 0
        )
        out.append(
            '<div style="display:flex;align-items:center;gap:.5em;margin:.15em 0">'
            f'<span style="flex:0 0 7.5em;overflow-wrap:anywhere">{html.escape(label)}</span>'
            '<span style="flex:1 1 auto;min-width:2em;height:1em;background:#f0f2f4;'
            f'display:flex;white-space:nowrap;overflow:hidden">{bar}</span>'
            '<span style="flex:0 0 auto;min-width:5em;font-family:monospace;'
            f'text-align:right">{html.escape(text)}</span></div>'
        )
    if legend:
        keys = "".join(
            f'<span style="white-space:nowrap"><span style="display:inline-block;width:.8em;'
            f'height:.8em;background:{c};margin-right:.3em"></span>{html.escape(n)}</span> '
            for n, c in legend
        )
        out.append(
            f'<div style="display:flex;flex-wrap:wrap;gap:.2em 1em;margin-top:.2em">{keys}</div>'
        )
    out.append("</div>")
    return "".join(out)
