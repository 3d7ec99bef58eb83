"""Chapter 4's figure of one PCP prefill layer, one column per rank of the PCP group.

Drawn from a real run of :func:`cpbook.demos.ch04_pcp.pcp_prefill_rank`: what each rank holds
comes from the partition the run used (:func:`cpbook.pcp.zigzag.pcp_partition`), the causal
work from the run's result and every byte from its trace
(:class:`cpbook.core.comm.CommRecord`: op, shape and bytes of every collective), so the picture
cannot drift from :func:`cpbook.pcp.prefill.pcp_prefill_attention` and
:func:`cpbook.pcp.prefill.pcp_restore`.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from matplotlib.patches import Rectangle

from cpbook.pcp.zigzag import pcp_partition
from cpbook.viz.style import figure, rank_color, tint

__all__ = ["STAGES", "gather_label", "pcp_prefill_flow"]

#: the rows of the figure, top to bottom
STAGES = (
    "① each rank holds its zigzag chunks: Q, K, V of its own tokens",
    "② AllGather K and V in the PCP group (every layer)",
    "③ causal attention of its queries over the gathered keys",
    "④ restore: AllGather the outputs, index them back into sequence order",
)
_EMPTY = "#F2F2F2"
_EDGE = "#555555"
_FS = 11  # 7.2 in wide: shown at about 0.87 of that in the book's column (≈ 9.5 pt)


def gather_label(record: Any, what: str) -> str:
    """``"K (2, 12, 8): 1,536 B sent"`` for one traced all-gather of ``what``."""
    return f"{what} {tuple(record.shape)}: {record.bytes_sent:,} B sent"


def _runs(positions: Sequence[int]) -> str:
    """``[0, 6) + [18, 22)`` for the sorted positions ``0..5, 18..21``."""
    out, start = [], None
    for i, p in enumerate(positions):
        if start is None:
            start = p
        if i + 1 == len(positions) or positions[i + 1] != p + 1:
            out.append(f"[{start}, {p + 1})")
            start = None
    return " + ".join(out)


def _frame(ax, x, y, w, h):
    ax.add_patch(Rectangle((x, y), w, h, fill=False, edgecolor=_EDGE, lw=0.6))


def pcp_prefill_flow(
    results: Sequence[Mapping[str, Any]],
    traces: Sequence[Sequence[Any]],
    seq_len: int,
    partition: str = "zigzag",
):
    """One column per PCP rank, one band per stage of :data:`STAGES`, for one prompt of
    ``seq_len`` tokens; ``results[r]`` and ``traces[r]`` are rank ``r``'s (TP = 1, one PCP group
    spanning the run).  Each trace holds the layer's K and V all-gathers and the restore, in that
    order; each column prints its own rank's traced bytes.  Data units are inches."""
    n = len(results)
    part = pcp_partition((seq_len,), n, partition)
    padded = part.padded_lens[0]
    owner = [0] * padded
    for r in range(n):
        for s in part.metadata(r).segments:
            for p in range(s.start, s.end):
                owner[p] = r
    width, margin, gap = 7.2, 0.1, 0.35
    w_col = (width - 2 * margin - gap * (n - 1)) / n
    tw = w_col / padded  # one token's width
    bh, rows_h = 0.3, part.tokens_per_rank * 0.075
    heights = [bh, bh, rows_h, bh]
    head, below = 0.38, 0.5  # stage title above each band, two lines of text below it
    ys, y = [], below
    for h in reversed(heights):
        ys.insert(0, y)
        y += h + head + below
    top = ys[0] + heights[0] + head + 0.3
    fig, ax = figure(figsize=(width, top + 0.15))
    mono = {"ha": "center", "va": "top", "fontsize": _FS, "family": "monospace"}
    for yy, h, name in zip(ys, heights, STAGES):
        ax.text(margin, yy + h + 0.1, name, fontsize=_FS, weight="bold", va="bottom")
    for r, res in enumerate(results):
        meta = part.metadata(r)
        x0, own = margin + r * (w_col + gap), rank_color(r)
        mid = margin + r * (w_col + gap) + w_col / 2
        k_rec, v_rec, out_rec = traces[r]
        ax.text(mid, top - 0.05, f"rank {r}", ha="center", va="top", fontsize=12, weight="bold")
        # ① the prompt's positions, filled where this rank holds them (hatched: padding)
        for p in range(padded):
            mine, pad = owner[p] == r, p >= seq_len
            ax.add_patch(
                Rectangle(
                    (x0 + p * tw, ys[0]),
                    tw,
                    bh,
                    facecolor=(tint(own, 0.6) if pad else own) if mine else _EMPTY,
                    edgecolor="white",
                    hatch="///" if mine and pad else None,
                    lw=0.4,
                )
            )
        _frame(ax, x0, ys[0], padded * tw, bh)
        held = [p for s in meta.segments for p in range(s.start, s.end) if p < seq_len]
        pad = meta.num_tokens - len(held)
        t, hq, d = out_rec.shape
        ax.text(
            mid,
            ys[0] - 0.05,
            f"positions {_runs(held)}"
            + (f" + {pad} pad" if pad else "")
            + f"\nq ({t}, {hq}, {d})   k, v {tuple(k_rec.shape)}",
            **mono,
        )
        # ② after the K/V all-gather: every rank's rows of the whole prompt
        for p in range(padded):
            ax.add_patch(Rectangle((x0 + p * tw, ys[1]), tw, bh, lw=0, color=rank_color(owner[p])))
        _frame(ax, x0, ys[1], padded * tw, bh)
        ax.text(
            mid, ys[1] - 0.05, f"{gather_label(k_rec, 'K')}\n{gather_label(v_rec, 'V')}", **mono
        )
        # ③ the rank's query rows against the gathered keys: prefix in full, diagonal causal
        rh, row = rows_h / part.tokens_per_rank, 0
        for s in meta.segments:
            for p in range(s.start, s.end):
                yy = ys[2] + rows_h - (row + 1) * rh
                if p < seq_len:
                    ax.add_patch(Rectangle((x0, yy), s.start * tw, rh, lw=0, color=tint(own, 0.55)))
                    ax.add_patch(
                        Rectangle(
                            (x0 + s.start * tw, yy), (p - s.start + 1) * tw, rh, lw=0, color=own
                        )
                    )
                row += 1
        _frame(ax, x0, ys[2], padded * tw, rows_h)
        ax.text(
            mid,
            ys[2] - 0.05,
            f"{res['work']:,} (query, key) pairs per head\nlight: prefix   dark: diagonal",
            **mono,
        )
        # ④ the output back in sequence order, each row from the rank that computed it
        for p in range(seq_len):
            ax.add_patch(Rectangle((x0 + p * tw, ys[3]), tw, bh, lw=0, color=rank_color(owner[p])))
        _frame(ax, x0, ys[3], seq_len * tw, bh)
        ax.text(
            mid,
            ys[3] - 0.05,
            f"{gather_label(out_rec, 'out')}\n→ out ({seq_len}, {hq}, {d}) in order",
            **mono,
        )
    ax.set_xlim(0, width)
    ax.set_ylim(0, top + 0.1)
    ax.axis("off")
    ax.set_title(
        f"PCP prefill, PCP = {n}, {partition}: one prompt of {seq_len} tokens, padded to "
        f"{padded}\nbars: positions 0–{padded - 1}, coloured by the rank that holds them; "
        "bytes from each rank's trace",
        fontsize=_FS,
        loc="left",
    )
    return fig
