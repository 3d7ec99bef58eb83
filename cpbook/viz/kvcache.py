"""Chapter 2 figures: token ownership, per-rank slots, P/D transfer waste, memory per GPU."""

from __future__ import annotations

from typing import Sequence

import torch
from matplotlib.patches import Rectangle

from cpbook.kv.layout import DCPShard, local_positions, num_virtual_blocks, token_owner
from cpbook.kv.paged import PagedKVCache
from cpbook.kv.transfer import transfer_plan
from cpbook.viz.style import figure, rank_color

__all__ = ["ownership_figure", "transfer_figure", "waste_figure", "memory_figure"]


def _width(n: int, cap: int = 16) -> int:
    """Cells per drawn row: ``n`` itself if short, else its largest divisor <= ``cap``."""
    return max(d for d in range(1, min(n, cap) + 1) if n % d == 0)


def _cell(ax, x: float, y: float, color: str, text: str, fs: float, edge: str = "white") -> None:
    ax.add_patch(Rectangle((x, y), 1, 1, facecolor=color, edgecolor=edge, linewidth=1.0))
    if text:
        ax.text(
            x + 0.5,
            y + 0.5,
            text,
            ha="center",
            va="center",
            fontsize=fs,
            color="black" if color == "white" else "white",
        )


def _mark(ax, x: float, y: float) -> None:
    ax.add_patch(
        Rectangle(
            (x + 0.04, y + 0.04), 0.92, 0.92, fill=False, edgecolor="black", linewidth=2.2, zorder=5
        )
    )


def _frame(ax, width: float, height: float, title: str) -> None:
    ax.set_xlim(-0.1, width + 0.1)
    ax.set_ylim(height + 0.1, -0.1)
    ax.set_aspect("equal")
    ax.set_anchor("E")  # shrink towards the right: room for the row labels
    ax.set_title(title, loc="left")
    ax.grid(False)
    ax.set_xticks([])
    ax.tick_params(axis="y", length=0)
    for s in ("left", "bottom"):
        ax.spines[s].set_visible(False)


def ownership_figure(
    seq_len: int = 64,
    dcp: int = 4,
    interleave: int = 4,
    block_size: int = 16,
    block_table: Sequence[int] | None = None,
    highlight: Sequence[int] = (20, 27),
):
    """Top: tokens ``0..seq_len-1`` coloured by owner rank, in rows of at most 16 (thick lines
    between virtual blocks).  Bottom: each rank's physical slots of the request, labelled with the
    token stored there (empty slots white) and the slot number.  ``highlight``: outlined tokens."""
    vb = block_size * dcp
    nb = num_virtual_blocks(seq_len, block_size, dcp)
    table = list(block_table) if block_table is not None else list(range(nb))
    w = _width(vb)
    sw = (
        block_size * min(nb, max(16 // block_size, 1)) if block_size <= 16 else 16
    )  # whole blocks per row
    rows, srows = -(-seq_len // w), -(-nb * block_size // sw)
    gap, rgap = (
        1.75,
        0.5,
    )  # drawn height of one row of slots (cells + slot numbers); space between ranks
    rank_h = srows * gap + rgap
    owners = token_owner(torch.arange(seq_len), dcp, interleave).tolist()
    # cell: inches per drawn cell; fonts stay >= 9 pt when the page shrinks the figure to ~85 %
    labels, fs, cell = seq_len <= 512, 10.5, 0.35
    width = max(w, sw + 0.3 * max(sw // block_size - 1, 0))  # a small gap between physical blocks
    fig, (top, bot) = figure(
        2,
        1,
        figsize=(cell * width + 1.6, cell * (rows + dcp * rank_h) + 1.3),
        height_ratios=[rows + 0.6, dcp * rank_h],
    )
    for p, r in enumerate(owners):
        _cell(top, p % w, p // w, rank_color(r), str(p) if labels else "", fs)
        if p in highlight:
            _mark(top, p % w, p // w)
    for b in range(1, nb):
        top.hlines(b * vb / w, 0, w, color="black", linewidth=2.5, zorder=6)
    top.set_yticks(
        [b * vb / w + min(vb / w, rows) / 2 for b in range(nb)],
        [f"vblock {b}\nid {table[b]}" for b in range(nb)],
        fontsize=10.5,
    )
    _frame(
        top,
        width,
        rows,
        f"Owner of token p: (p // {interleave}) % {dcp}; "
        f"one block id = {block_size} x {dcp} = {vb} tokens",
    )
    for r in range(dcp):
        held = local_positions(seq_len, dcp, r, interleave).tolist()
        slots = (
            PagedKVCache(
                max(table) + 1,
                block_size,
                1,
                1,
                shard=DCPShard(dcp, r, interleave),
            )
            .local_slots(table, nb * vb)
            .tolist()
        )
        for j, s in enumerate(slots):
            x, y = j % sw + 0.3 * (j % sw // block_size), r * rank_h + (j // sw) * gap
            p = held[j] if j < len(held) else None
            _cell(
                bot,
                x,
                y,
                "white" if p is None else rank_color(r),
                "" if p is None or not labels else str(p),
                fs,
                "#aaaaaa" if p is None else "white",
            )
            if p in highlight:
                _mark(bot, x, y)
            if labels:
                bot.text(
                    x + 0.5,
                    y + 1.35,
                    str(s),
                    ha="center",
                    va="center",
                    fontsize=10,
                    color="#555555",
                )
    bot.set_yticks(
        [r * rank_h + (srows * gap - 0.75) / 2 for r in range(dcp)],
        [f"rank {r}" for r in range(dcp)],
    )
    _frame(
        bot,
        width,
        dcp * rank_h - rgap - 0.45,
        f"Physical slots per rank (block_size {block_size}): token stored, slot number below",
    )
    return fig


def transfer_figure(
    seq_len: int = 16, block_size: int = 16, dcp: int = 4, interleaves: Sequence[int] = (1, 16)
):
    """One panel per interleave: each rank's blocks as bars of ``block_size`` slots, filled part
    coloured, empty part hatched (shipped whole in P/D transfer), unsent blocks omitted."""
    fig, axes = figure(
        1, len(interleaves), figsize=(3.1 * len(interleaves), 0.55 * dcp + 1.3), sharey=True
    )
    plans = [transfer_plan(seq_len, block_size, dcp, inter) for inter in interleaves]
    most = max(len(b) for plan in plans for b in plan.blocks_sent)
    for ax, inter, plan in zip(axes, interleaves, plans):
        for r, blocks in enumerate(plan.blocks_sent):
            if not blocks:
                ax.text(0.5, r, "no block to send", va="center", fontsize=9.5, color="#555555")
            for i, b in enumerate(blocks):
                filled = int(plan.fill[r, b])
                x0 = i * (block_size + 2)
                ax.barh(r, filled, left=x0, color=rank_color(r), height=0.6)
                ax.barh(
                    r,
                    block_size - filled,
                    left=x0 + filled,
                    color="white",
                    edgecolor="#999999",
                    hatch="///",
                    height=0.6,
                )
                ax.text(
                    x0 + block_size / 2,
                    r,
                    f"{filled}/{block_size}",
                    ha="center",
                    va="center",
                    fontsize=9.5,
                    bbox={"boxstyle": "round,pad=0.2", "facecolor": "white", "edgecolor": "none"},
                )
        ax.set_yticks(range(dcp), [f"rank {r}" for r in range(dcp)])
        ax.set_xlim(0, most * (block_size + 2) - 2)
        ax.set_xticks([])
        ax.set_xlabel(f"blocks sent, whole (tokens / {block_size} slots)")
        ax.set_title(
            f"interleave {inter}: {sum(map(len, plan.blocks_sent))} block(s), "
            f"waste {plan.waste:.0%}",
            loc="left",
        )
        ax.grid(False)
    axes[0].invert_yaxis()  # shared y: rank 0 on top
    return fig


def waste_figure(
    max_len: int = 4096,
    block_size: int = 16,
    dcp: int = 4,
    interleaves: Sequence[int] = (1, 4, 16),
):
    """Wasted fraction of P/D transfer bytes vs sequence length, per interleave, and without DCP."""
    lens = list(range(1, max_len + 1))
    fig, ax = figure(figsize=(6.2, 3.6))
    for i, inter in enumerate(interleaves):
        ax.plot(
            lens,
            [transfer_plan(n, block_size, dcp, inter).waste for n in lens],
            label=f"DCP {dcp}, interleave {inter}",
            color=rank_color(i),
            linewidth=2.2,
        )
    ax.plot(
        lens,
        [1 - n / (-(-n // block_size) * block_size) for n in lens],
        color="black",
        linestyle="--",
        linewidth=1,
        label="no DCP",
    )
    ax.set_xscale("log", base=2)
    article = transfer_plan(block_size, block_size, dcp, 1).waste
    ax.plot([block_size], [article], "o", color="black")
    ax.annotate(  # above the curves: past block_size tokens they all stay below 0.8
        f"{block_size} tokens, interleave 1: {article:.0%} wasted",
        (block_size, article),
        xytext=(block_size * 2, 0.93),
        fontsize=9.5,
        va="center",
        arrowprops={"arrowstyle": "->", "color": "black", "linewidth": 1},
    )
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("wasted fraction of bytes sent")
    ax.set_ylim(0, 1)
    ax.set_title(f"P/D transfer in whole blocks (block_size {block_size})", loc="left")
    ax.legend(loc="center right")  # long sequences waste little: the right middle is empty
    return fig


def memory_figure(usage: Sequence[dict], seq_len: int):
    """Tokens of KV each GPU holds for one request: without DCP (every GPU all) vs ``usage``
    (from :meth:`cpbook.kv.manager.KVCacheManager.rank_usage`)."""
    n = len(usage)
    fig, ax = figure(figsize=(6, 3.2))
    xs = range(n)
    ax.bar(
        [x - 0.2 for x in xs], [seq_len] * n, width=0.4, color="#bbbbbb", label="TP only: full copy"
    )
    ax.bar(
        [x + 0.2 for x in xs],
        [u["tokens"] for u in usage],
        width=0.4,
        color=[rank_color(u["rank"]) for u in usage],
        label=f"DCP {n}: own tokens",
    )
    for x, u in zip(xs, usage):
        ax.text(x + 0.2, u["tokens"], f"{u['tokens']:,}", ha="center", va="bottom", fontsize=9)
    ax.set_xticks(list(xs), [f"GPU {u['rank']}" for u in usage])
    ax.set_ylabel("tokens of KV stored")
    ax.set_title(f"One {seq_len:,}-token request", loc="left")
    ax.set_ylim(0, seq_len * 1.3)
    ax.legend(loc="upper center", ncol=2)
    return fig
