"""Chapter 3's figure of MLA's absorbed decode under DCP, one column per rank of the DCP group.

Drawn from a real run of :func:`cpbook.demos.ch03_decode.mla_decode_rank`: the shapes each rank
recorded and its trace (:class:`cpbook.core.comm.CommRecord`: op, shape and bytes of every
collective), so the picture cannot drift from
:func:`cpbook.dcp.mla.mla_decode_attention`.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from matplotlib.patches import Rectangle

from cpbook.kv.layout import token_owner
from cpbook.viz.style import figure, rank_color

__all__ = ["STAGES", "collective_label", "mla_decode_flow"]

#: the rows of the figure, top to bottom
STAGES = (
    "holds: latent KV shard",
    "W_UK-absorbed Q\n(own heads)",
    "AllGather Q",
    "attention on the\nlatent shard",
    "LSE combine",
    "W_UV up-projection",
)
_EMPTY = "#F2F2F2"
_OPS = {"all_gather": "AllGather", "reduce_scatter": "ReduceScatter", "all_to_all": "All2All"}


def collective_label(record: Any) -> str:
    """``"AllGather (3, 2, 40) float64: 5,760 B"`` for one traced :class:`CommRecord`."""
    return (
        f"{_OPS.get(record.op, record.op)} {tuple(record.shape)} {record.dtype}: "
        f"{record.bytes_sent:,} B sent"
    )


def _cell(ax, x, y, w, h, color, hatch=None, alpha=1.0):
    ax.add_patch(
        Rectangle(
            (x, y), w, h, facecolor=color, edgecolor="#555555", lw=0.5, hatch=hatch, alpha=alpha
        )
    )


def mla_decode_flow(
    results: Sequence[Mapping[str, Any]],
    traces: Sequence[Sequence[Any]],
    seq_lens: Sequence[int],
    interleave: int = 1,
):
    """One column per DCP rank, one row per stage of :data:`STAGES`; ``results[r]`` and
    ``traces[r]`` are rank ``r``'s (one DCP group spanning the run), ``seq_lens`` the requests'
    lengths.  Shapes are printed from the run, bytes from the trace.  Data units are inches."""
    n = len(results)
    s0 = results[0]["shapes"]
    b, h, width = s0["q"]  # requests, own heads, C + R
    c = s0["out_latent"][2]  # kv_lora_rank
    span, gap, left = 6.0, 0.22, 1.5
    w_col = (span - gap * (n - 1)) / n
    bh, pitch = 0.3, 0.98
    ys = [(len(STAGES) - 1 - i) * pitch for i in range(len(STAGES))]
    top = ys[0] + bh + 0.55
    fig, ax = figure(figsize=(left + span + 0.1, top + 0.2))
    mono = {"ha": "center", "va": "top", "fontsize": 9, "family": "monospace"}
    total = sum(seq_lens)
    for r, res in enumerate(results):
        x0, s, own = left + r * (w_col + gap), res["shapes"], rank_color(r)
        ax.text(x0 + w_col / 2, top - 0.2, f"rank {r}", ha="center", fontsize=10.5, weight="bold")
        # the latent shard: every cached token of every request, filled where this rank owns it
        rgap = 0.05  # between two requests
        tw, x = (w_col - rgap * (len(seq_lens) - 1)) / total, x0
        for L in seq_lens:
            owner = token_owner(list(range(L)), n, interleave).tolist()
            for t, o in enumerate(owner):
                ax.add_patch(
                    Rectangle((x + t * tw, ys[0]), tw, bh, lw=0, color=own if o == r else _EMPTY)
                )
            ax.add_patch(Rectangle((x, ys[0]), L * tw, bh, fill=False, edgecolor="#555555", lw=0.5))
            x += L * tw + rgap
        rows = "+".join(str(k[0]) for k in s["kv_local"])
        ax.text(
            x0 + w_col / 2, ys[0] - 0.04, f"{rows} rows × {width}\n(C={c} + R={width - c})", **mono
        )
        hw = w_col / (n * h)
        for j in range(n * h):  # head slots of the whole group
            mine = j // h == r
            _cell(ax, x0 + j * hw, ys[1], hw, bh, own if mine else _EMPTY)
            _cell(ax, x0 + j * hw, ys[2], hw, bh, rank_color(j // h))
            _cell(ax, x0 + j * hw, ys[3], hw, bh, own, hatch="///", alpha=0.45)
            _cell(ax, x0 + j * hw, ys[4], hw, bh, own if mine else _EMPTY)
            _cell(ax, x0 + j * hw, ys[5], hw, bh, own if mine else _EMPTY)
        labels = [
            "",
            f"{s['q']}",
            f"{s['q_gathered']}",
            f"O' {s['out_partial']}\n+ LSE",
            f"{s['out_latent']}",
            f"{s['out']}",
        ]
        for y, lab in zip(ys[1:], labels[1:]):
            ax.text(x0 + w_col / 2, y - 0.04, lab, **mono)
    for name, y in zip(STAGES, ys):
        ax.text(left - 0.1, y + bh / 2, name, ha="right", va="center", fontsize=10)
    # the collectives, from rank 0's trace (every rank of the group sends the same)
    calls = list(traces[0])
    between = {2: calls[:1], 4: calls[1:]}
    for row, recs in between.items():
        ax.text(
            left,
            ys[row] + bh + 0.08,
            "; ".join(collective_label(t) for t in recs),
            fontsize=9,
            style="italic",
            va="bottom",
        )
    ax.set_xlim(0, left + span + 0.1)
    ax.set_ylim(ys[-1] - 0.35, top)
    ax.axis("off")
    ax.set_title(
        f"MLA absorbed decode, DCP = {n}: {b} requests of {list(seq_lens)} tokens, {n * h} heads\n"
        "(shapes from the run; bytes from rank 0's trace, the same on every rank)",
        fontsize=10,
        loc="left",
    )
    return fig
