"""The book's front-page figure: where PCP and DCP act on one request's life.

One request, drawn per GPU: during **prefill** each PCP rank computes the causal attention of
two zigzag chunks of the prompt (:class:`~cpbook.pcp.zigzag.PCPPartition`), then the K/V are
all-gathered and written to the cache; during **decode** each DCP rank holds an interleaved share
of the KV cache (:func:`~cpbook.kv.layout.token_owner`), every new token lands on its owner, and
each step's partial attention outputs are merged by their log-sum-exp.

Sized for the book's text column at a 1280-px window (7.0 in at 110 dpi), no text under 10 pt.
Write the PNG the intro shows with ``python -m cpbook.viz.timeline --write book/figures/``.
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.patches import FancyArrowPatch, Rectangle

from cpbook.kv.layout import token_owner
from cpbook.pcp.zigzag import PCPPartition
from cpbook.viz.style import figure, ink, rank_color, tint, write_main, write_png

__all__ = ["request_timeline", "pcp_owners", "dcp_owners", "FILENAME", "write"]

FILENAME = "request_timeline.png"
WIDTH = 7.0  # inches
_EMPTY = "#F2F2F2"


def pcp_owners(prompt: int, pcp: int) -> list[int]:
    """The PCP rank that computes each prompt token's query (zigzag / DualChunkSwap)."""
    part = PCPPartition((prompt,), pcp)
    owner = [-1] * prompt
    for rank, segs in enumerate(part.segments):
        for s in segs:
            for t in range(s.start, min(s.end, prompt)):
                owner[t] = rank
    return owner


def dcp_owners(tokens: int, dcp: int, interleave: int) -> list[int]:
    """The DCP rank that stores each token's KV (vLLM's interleaved layout)."""
    return token_owner(range(tokens), dcp, interleave).tolist()


def _cell(ax, x: float, y: float, color: str | None, text: str = "", hatch: bool = False):
    ax.add_patch(
        Rectangle(
            (x, y),
            0.9,
            0.8,
            facecolor=color or _EMPTY,
            edgecolor="0.25" if hatch else "none",
            hatch="///" if hatch else None,
            lw=1.0,
        )
    )
    if text and color:
        ax.text(x + 0.45, y + 0.4, text, ha="center", va="center", fontsize=9.5, color=ink(color))


def request_timeline(
    prompt: int = 16, pcp: int = 2, dcp: int = 4, interleave: int = 2, decode_steps: int = 3
):
    """One request on a TP × PCP × DCP deployment: each PCP rank's prompt chunks (prefill, top)
    and each DCP rank's share of the KV cache as decode adds ``decode_steps`` tokens (bottom)."""
    q_owner = pcp_owners(prompt, pcp)
    total = prompt + decode_steps
    kv_owner = dcp_owners(total, dcp, interleave)
    rows = pcp + dcp
    fig, ax = figure(figsize=(WIDTH, 0.42 * (rows + 5.95)))
    fig.set_layout_engine(None)  # the texts run past the cells: place the axes by hand
    ax.set_position((0.0, 0.0, 1.0, 1.0))
    ax.axis("off")
    gap = 1.6  # between the two phases
    y_dec = 0.0
    y_pre = dcp + gap
    # prefill: one row per PCP rank; a token is filled where that rank computes its query
    for r in range(pcp):
        y = y_pre + (pcp - 1 - r)
        ax.text(-0.5, y + 0.4, f"PCP rank {r}", ha="right", va="center", fontsize=10.5)
        for t in range(prompt):
            mine = q_owner[t] == r
            _cell(ax, t, y, rank_color(r) if mine else None, str(t) if mine else "")
    chunk = PCPPartition((prompt,), pcp).chunk_sizes[0]
    ax.text(
        -4.6,
        y_pre + pcp + 0.35,
        f"① Prefill (time to first token): PCP = {pcp} cuts the {prompt}-token prompt into "
        f"{2 * pcp} chunks of {chunk};\n    rank r computes chunks r and {2 * pcp - 1}−r, "
        "so every rank does the same causal work",
        fontsize=10.5,
        va="bottom",
    )
    # the hand-over: K/V all-gathered in the PCP group, written by the slot mapping
    mid = y_dec + dcp + gap / 2
    ax.add_patch(
        FancyArrowPatch(
            (prompt / 2, y_pre - 0.1),
            (prompt / 2, y_dec + dcp + 0.05),
            arrowstyle="-|>",
            mutation_scale=14,
            color="0.3",
            lw=1.3,
        )
    )
    ax.text(
        prompt / 2 + 0.5,
        mid,
        "K/V all-gathered over PCP, each token's KV\nwritten on its DCP owner (slot mapping)",
        fontsize=10,
        va="center",
    )
    # decode: one row per DCP rank; a token is filled where that rank stores its KV
    for r in range(dcp):
        y = y_dec + (dcp - 1 - r)
        ax.text(-0.5, y + 0.4, f"DCP rank {r}", ha="right", va="center", fontsize=10.5)
        for t in range(total):
            mine = kv_owner[t] == r
            _cell(
                ax,
                t + (0.4 if t >= prompt else 0.0),
                y,
                tint(rank_color(r), 0.0) if mine else None,
                str(t) if mine else "",
                hatch=mine and t >= prompt,
            )
    ax.text(
        -4.6,
        y_dec - 0.35,
        f"② Decode (time per output token): DCP = {dcp} stores token t on rank "
        f"⌊t / {interleave}⌋ mod {dcp}\n    (hatched: {decode_steps} decode steps). Each step, "
        "every rank attends its share of the KV\n    and the partial outputs merge by LSE",
        fontsize=10.5,
        va="top",
    )
    ax.set_xlim(-4.7, total + 0.8)
    ax.set_ylim(y_dec - 1.75, y_pre + pcp + 1.3)
    return fig


def write(folder: str | Path, dpi: int = 165) -> Path:
    """Draw :func:`request_timeline` into ``folder`` / :data:`FILENAME`; returns the path."""
    return write_png(request_timeline(), folder, FILENAME, dpi)


if __name__ == "__main__":
    write_main(request_timeline, FILENAME, __doc__)
