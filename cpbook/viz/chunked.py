"""Figures of chapter 5: who holds what under PCP × DCP chunked prefill, and what each strategy
moves.

The ownership figures take one request: ``context_len`` cached tokens, DCP-interleaved
(:func:`cpbook.kv.layout.token_owner`), then a chunk of ``chunk_len`` new tokens split zigzag over
PCP (:func:`cpbook.pcp.zigzag.zigzag_partition`), on ``tp = 1`` and ``dcp = pcp``: rank ``r`` is
PCP rank ``r`` and DCP rank ``r``, so one colour per rank says who holds a token.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
from matplotlib.patches import Patch, Rectangle

from cpbook.kv.layout import token_owner
from cpbook.pcp.zigzag import zigzag_partition
from cpbook.viz.style import PALETTE, figure, ink, rank_color

__all__ = [
    "STRATEGY_COLORS",
    "holders",
    "chunk_ownership_figure",
    "strategies_figure",
    "bytes_figure",
    "ring_figure",
]

# _WIDTH inches is 690 px at the book's 110 dpi, the width of the content column at a 1280 px
# window: figures render at 1:1 there and their 9-10 pt text stays 9-10 pt.
_WIDTH = 6.25
_MASKED = "#E6E6E6"
_MISSING = "#FFFFFF"
STRATEGY_COLORS = {
    "allgather_q": PALETTE[2],
    "allgather_kv": PALETTE[3],
    "pass_kv": PALETTE[4],
    "pass_q": PALETTE[5],
}
_NAMES = {
    "allgather_q": "AllGather-Q",
    "allgather_kv": "AllGather-KV",
    "pass_kv": "ring pass-KV",
    "pass_q": "ring pass-Q",
}


def holders(context_len: int, chunk_len: int, ranks: int, interleave: int) -> np.ndarray:
    """The rank holding each position's K/V: the DCP owner for the context, the zigzag owner
    for the chunk (whose queries live on the same rank).  Shape ``[context_len + chunk_len]``."""
    own = np.empty(context_len + chunk_len, dtype=int)
    if context_len:
        own[:context_len] = token_owner(range(context_len), ranks, interleave).numpy()
    for r, toks in enumerate(zigzag_partition(chunk_len, ranks).rank_tokens):
        for t in toks:
            if t < chunk_len:
                own[context_len + t] = r
    return own


def _matrix(ax, own: np.ndarray, context_len: int, color_of) -> None:
    """Query rows = the chunk's positions, key columns = every position; ``color_of(q, k)``
    gives a colour or None (needed, but nobody computes it yet)."""
    n = len(own)
    for i, q in enumerate(range(context_len, n)):
        for k in range(n):
            c = _MASKED if k > q else (color_of(q, k) or _MISSING)
            ax.add_patch(Rectangle((k, i), 1, 1, facecolor=c, edgecolor="white", lw=0.6))
    ax.add_patch(Rectangle((0, 0), n, n - context_len, fill=False, edgecolor="#444444", lw=0.8))
    ax.axvline(context_len, color="black", lw=1.5)
    ax.set_xlim(0, n)
    ax.set_ylim(n - context_len, 0)
    ax.set_aspect("equal")
    ax.grid(False)
    ax.set_xticks([k + 0.5 for k in range(0, n, 2)], [str(k) for k in range(0, n, 2)])
    ax.set_yticks(
        [i + 0.5 for i in range(n - context_len)], [str(q) for q in range(context_len, n)]
    )
    ax.tick_params(length=0)
    ax.set_xlabel("key position (context | chunk)")
    ax.set_ylabel("query position")


def chunk_ownership_figure(
    context_len: int = 12, chunk_len: int = 8, ranks: int = 2, interleave: int = 2
):
    """Top: every token of the request, coloured by the rank holding its K/V (and, for the
    chunk, its Q).  Bottom: the (query, key) pairs the chunk needs; a pair is coloured when
    one rank holds both the query and the key, and left white when no rank does."""
    own = holders(context_len, chunk_len, ranks, interleave)
    n = len(own)
    fig, (top, bot) = figure(2, 1, figsize=(_WIDTH, 4.6), height_ratios=[0.8, 2.4])
    for p in range(n):
        c = rank_color(int(own[p]))
        new = p >= context_len
        top.add_patch(Rectangle((p, 0), 1, 1, facecolor=c, edgecolor="white", lw=1.2))
        top.text(
            p + 0.5,
            0.5,
            str(p),
            ha="center",
            va="center",
            fontsize=9,
            color=ink(c),
            fontweight="bold" if new else "normal",
        )
    top.text(
        context_len / 2,
        1.25,
        f"cached context, C = {context_len}: K/V in the paged cache,"
        f"\nDCP-interleaved in runs of I = {interleave}",
        ha="center",
        va="bottom",
        fontsize=9,
    )
    top.text(
        context_len + chunk_len / 2,
        1.25,
        f"new chunk, T = {chunk_len}:\nQ, K, V zigzag over PCP",
        ha="center",
        va="bottom",
        fontsize=9,
    )
    top.axvline(context_len, color="black", lw=1.5)
    top.set_xlim(0, n)
    top.set_ylim(-0.1, 2.3)
    top.set_aspect("equal")
    top.axis("off")
    have = {r: int((own[context_len:] == r).sum()) for r in range(ranks)}

    def local(q: int, k: int) -> str | None:
        return rank_color(int(own[q])) if own[q] == own[k] else None

    _matrix(bot, own, context_len, local)
    needed = sum(q + 1 for q in range(context_len, n))
    done = sum(1 for q in range(context_len, n) for k in range(q + 1) if own[q] == own[k])
    bot.set_title(
        f"pairs the chunk needs: {needed}; computable with local data only: {done} "
        f"({100 * done / needed:.0f} %)",
        fontsize=10,
    )
    handles = [
        Patch(facecolor=rank_color(r), label=f"rank {r} ({have[r]} queries)") for r in range(ranks)
    ]
    handles += [
        Patch(facecolor=_MISSING, edgecolor="#888888", label="needs data from another rank"),
        Patch(facecolor=_MASKED, label="masked (causal)"),
    ]
    fig.legend(handles=handles, loc="outside lower center", ncol=2, fontsize=9)
    return fig


def strategies_figure(
    context_len: int = 12, chunk_len: int = 8, ranks: int = 2, interleave: int = 2
):
    """The needed pairs again, coloured by the rank that computes them after each collective:
    AllGather-Q hands every rank all queries (it computes the key columns it holds; a row's
    parts meet in an LSE merge), AllGather-KV hands every rank all keys (it computes its own
    query rows, whole)."""
    own = holders(context_len, chunk_len, ranks, interleave)
    fig, axes = figure(2, 1, figsize=(_WIDTH, 5.0))
    _matrix(axes[0], own, context_len, lambda q, k: rank_color(int(own[k])))
    axes[0].set_title("AllGather-Q: Q moves; rank r computes the keys it holds", fontsize=10)
    _matrix(axes[1], own, context_len, lambda q, k: rank_color(int(own[q])))
    axes[1].set_title("AllGather-KV: K/V move; rank r computes the queries it owns", fontsize=10)
    axes[0].set_xlabel("")
    handles = [
        Patch(facecolor=rank_color(r), label=f"computed by rank {r}") for r in range(ranks)
    ] + [Patch(facecolor=_MASKED, label="masked (causal)")]
    fig.legend(handles=handles, loc="outside lower center", ncol=ranks + 1, fontsize=9)
    return fig


def bytes_figure(
    chunks: Sequence[int],
    contexts: Sequence[int],
    measured: Mapping[tuple[int, int, str], int],
    curve: Mapping[str, Sequence[tuple[float, float]]],
    crossover: float,
):
    """Top: bytes each rank sends per layer per chunk token against context tokens per chunk
    token; ``curve[strategy]`` is the formula as ``(C/T, bytes/T)`` points, markers are the
    traced grid (``measured[(T, C, strategy)]``), one shape per chunk length.  Bottom: which
    strategy sends less at each grid point, and the ratio AllGather-KV / AllGather-Q."""
    fig, (ax, grid) = figure(2, 1, figsize=(_WIDTH, 6.6), height_ratios=[1.2, 1.0])
    markers = "os^D"
    for st in ("allgather_q", "allgather_kv"):
        xs, ys = zip(*curve[st])
        ax.plot(xs, ys, color=STRATEGY_COLORS[st], lw=1.8, label=_NAMES[st] + " (formula)")
        for i, t in enumerate(chunks):
            ax.plot(
                [c / t for c in contexts],
                [measured[(t, c, st)] / t for c in contexts],
                markers[i % 4],
                color=STRATEGY_COLORS[st],
                mfc="white",
                ms=6,
                mew=1.3,
            )
    for i, t in enumerate(chunks):
        ax.plot([], [], markers[i % 4], color="#555555", mfc="white", label=f"traced, T = {t}")
    ax.axvline(crossover, color="black", lw=1, ls=":")
    ax.annotate(
        f"C* = {crossover:.2f} T",
        (crossover, 0.05),
        xycoords=("data", "axes fraction"),
        textcoords="offset points",
        xytext=(5, 0),
        fontsize=9,
    )
    ax.set_xscale("symlog", linthresh=0.125)
    ax.set_xlim(0, 1.3 * max(x for x, _ in curve["allgather_kv"]))
    ticks = [0, 1, 8, 64, 512]
    ax.set_xticks(ticks, [f"{x:g}" for x in ticks])
    ax.minorticks_off()
    ax.set_yscale("log")
    ax.set_xlabel("context tokens per chunk token, C / T")
    ax.set_ylabel("bytes sent per rank, per chunk token")
    ax.legend(fontsize=9, loc="upper left")
    for i, t in enumerate(chunks):
        for j, c in enumerate(contexts):
            q, kv = measured[(t, c, "allgather_q")], measured[(t, c, "allgather_kv")]
            win = "allgather_kv" if kv <= q else "allgather_q"
            col = STRATEGY_COLORS[win]
            grid.add_patch(Rectangle((j, i), 1, 1, facecolor=col, edgecolor="white", lw=1.5))
            grid.text(
                j + 0.5,
                i + 0.5,
                f"{'KV' if kv <= q else 'Q'}\n{kv / q:.2g}",
                ha="center",
                va="center",
                fontsize=9,
                color=ink(col),
            )
    grid.set_xlim(0, len(contexts))
    grid.set_ylim(len(chunks), 0)
    grid.set_xticks([j + 0.5 for j in range(len(contexts))], [f"{c:,}" for c in contexts])
    grid.set_yticks([i + 0.5 for i in range(len(chunks))], [str(t) for t in chunks])
    grid.tick_params(length=0)
    grid.grid(False)
    grid.set_xlabel("context length C")
    grid.set_ylabel("chunk length T")
    grid.set_title("fewer bytes; number = KV / Q", fontsize=10)
    return fig


def ring_figure(rows: Sequence[Mapping[str, object]], scenarios: Sequence[str]):
    """Per scenario (one row of panels): bytes sent, communication calls and peak temporary
    memory of one rank for each strategy.  ``rows``: dicts with ``scenario``, ``strategy``,
    ``bytes``, ``calls`` and ``peak``."""
    metrics = (
        ("bytes", "bytes sent"),
        ("calls", "communication calls"),
        ("peak", "peak temporary bytes"),
    )
    fig, axes = figure(
        len(scenarios), 3, figsize=(_WIDTH, 2.2 * len(scenarios) + 0.5), squeeze=False
    )
    order = ("allgather_q", "allgather_kv", "pass_kv", "pass_q")
    for i, sc in enumerate(scenarios):
        mine = {r["strategy"]: r for r in rows if r["scenario"] == sc}
        for j, (key, label) in enumerate(metrics):
            ax = axes[i, j]
            vals = [mine[s][key] for s in order]
            ax.barh(range(4), vals, color=[STRATEGY_COLORS[s] for s in order])
            ax.set_yticks(range(4), [_NAMES[s] for s in order] if j == 0 else [""] * 4)
            ax.invert_yaxis()
            ax.set_xlim(0, 1.6 * max(vals))
            for y, v in enumerate(vals):
                ax.text(
                    v,
                    y,
                    f" {v / 1024:,.0f} KiB" if key != "calls" else f" {v}",
                    va="center",
                    fontsize=9,
                )
            ax.set_xticks([])
            ax.grid(False)
            if i == 0:
                ax.set_title(label, fontsize=10)
        axes[i, 0].set_ylabel(sc, fontsize=9)
    return fig
