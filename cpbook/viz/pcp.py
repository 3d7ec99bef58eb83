"""Figures of chapter 4: who owns which causal work, DualChunkSwap's pairing, the partition, the
rank grid, the balance."""

from __future__ import annotations

from typing import Sequence

import matplotlib.colors as mcolors
import numpy as np
from matplotlib.patches import Arc, Patch, Rectangle

from cpbook.core.groups import RankGrid
from cpbook.pcp.zigzag import PCPPartition, causal_work, pcp_partition
from cpbook.viz.style import PALETTE, figure, ink, rank_color

__all__ = [
    "causal_ownership_figure",
    "work_figure",
    "dual_chunk_swap_figure",
    "partition_figure",
    "rank_grid_figure",
    "balance_figure",
]

# Every figure is at most _WIDTH inches wide (770 px at the book's 110 dpi), so that on a page
# about 700 px wide it shrinks by at most ~10 % and its 10 pt text stays at ~9 pt or more.
_WIDTH = 7.0
_MASKED = "#F2F2F2"
_PAD = "#BBBBBB"
_LABELS = {"contiguous": "contiguous", "zigzag": "zigzag (DualChunkSwap)", "striped": "striped"}
_PARTITION_COLOR = {"contiguous": PALETTE[5], "zigzag": PALETTE[0], "striped": PALETTE[1]}


def _owners(part: PCPPartition) -> np.ndarray:
    """Owner rank of every position of a single-request partition (padding included)."""
    own = np.empty(sum(part.padded_lens), dtype=int)
    for r, toks in enumerate(part.rank_tokens):
        own[toks] = r
    return own


def causal_ownership_figure(
    seq_len: int = 16,
    pcp: int = 2,
    partitions: Sequence[str] = ("contiguous", "zigzag", "striped"),
):
    """The causal score matrix of one prompt, each computed cell coloured by the rank that owns
    its query; panel titles give each rank's exact work and the straggler factor max/mean."""
    fig, axes = figure(1, len(partitions), figsize=(_WIDTH, 0.75 * _WIDTH / len(partitions) + 1.8))
    for ax, partition in zip(np.atleast_1d(axes), partitions):
        part = pcp_partition(seq_len, pcp, partition)
        own = _owners(part)[:seq_len]
        img = np.ones((seq_len, seq_len, 4))
        img[:] = mcolors.to_rgba(_MASKED)
        for q in range(seq_len):
            img[q, : q + 1] = mcolors.to_rgba(rank_color(int(own[q])))
        ax.imshow(img, interpolation="nearest")
        ax.set_xticks(range(0, seq_len, max(1, seq_len // 4)))
        ax.set_yticks(range(0, seq_len, max(1, seq_len // 4)))
        ax.grid(False)
        ax.set_xlabel("key position")
        if ax is np.atleast_1d(axes)[0]:
            ax.set_ylabel("query position")
        work = part.work()
        ax.set_title(
            f"{_LABELS[partition]}\npairs per rank {work}\nmax/mean = "
            f"{max(work) / (sum(work) / len(work)):.2f}",
            fontsize=10,
        )
    handles = [Patch(color=rank_color(r), label=f"rank {r}") for r in range(pcp)]
    fig.legend(handles=handles, loc="outside lower center", ncol=pcp)
    fig.suptitle(
        f"{seq_len} tokens on {pcp} ranks: cell (q, k) is computed by the owner of query q",
        fontsize=11,
    )
    return fig


def work_figure(seq_len: int = 5040, pcp: int = 4, max_pcp: int = 10):
    """Left: each rank's causal work relative to the mean, per partition.  Right: the straggler
    factor max/mean against the number of ranks (the step waits for the busiest rank)."""
    fig, (left, right) = figure(1, 2, figsize=(_WIDTH, 3.7))
    partitions = ("contiguous", "zigzag", "striped")
    width = 0.8 / len(partitions)
    for i, partition in enumerate(partitions):
        w = np.array(causal_work(seq_len, pcp, partition), dtype=float)
        left.bar(
            np.arange(pcp) + (i - 1) * width,
            w / w.mean(),
            width,
            color=_PARTITION_COLOR[partition],
            label=_LABELS[partition],
        )
    left.axhline(1.0, color="black", lw=0.8)
    left.set_xticks(range(pcp), [f"rank {r}" for r in range(pcp)])
    left.set_ylabel("causal pairs / mean")
    left.set_title(f"{seq_len:,} tokens on {pcp} ranks")
    ks = np.arange(1, max_pcp + 1)
    for i, partition in enumerate(partitions):
        f = [max(w) / (sum(w) / k) for k in ks for w in [causal_work(seq_len, int(k), partition)]]
        right.plot(
            ks, f, marker="o", ms=3, color=_PARTITION_COLOR[partition], label=_LABELS[partition]
        )
    right.plot(ks, 2 - 1 / ks, ls=":", color="black", label="2 − 1/K")
    right.set_xlabel("ranks K")
    right.set_ylabel("max / mean causal work")
    right.set_title(f"straggler factor, {seq_len:,} tokens")
    right.set_xticks(ks[1::2] if len(ks) > 6 else ks)
    handles, labels = right.get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=len(labels))
    return fig


def dual_chunk_swap_figure(pcp: int = 3, chunk_size: int = 4):
    """DualChunkSwap on one prompt of ``2·pcp`` chunks of ``chunk_size`` tokens.  Left: each
    chunk's causal cost in sequence order, coloured by its rank, the pairs joined by arcs.
    Right: each rank's head chunk plus tail chunk, the same total for every rank."""
    k, c = pcp, chunk_size
    n = 2 * k
    cost = [j * c * c + c * (c + 1) // 2 for j in range(n)]
    owner = [j if j < k else n - 1 - j for j in range(n)]
    fig, (left, right) = figure(1, 2, figsize=(_WIDTH, 3.9), width_ratios=(1.35, 1))
    left.bar(range(n), cost, 0.8, color=[rank_color(r) for r in owner])
    for j, v in enumerate(cost):
        left.text(j, v + 1, str(v), ha="center", va="bottom", fontsize=10)
    top = max(cost) + 0.12 * max(cost)
    for r in range(k):
        w = n - 1 - 2 * r
        h = 0.06 * max(cost) * (1 + w)
        arc = Arc((k - 0.5, top), w, 2 * h, theta1=0, theta2=180, color=rank_color(r), lw=2)
        left.add_patch(arc)
        left.text(
            k - 0.5,
            top + h,
            f"rank {r}",
            ha="center",
            va="center",
            fontsize=10,
            bbox={"fc": "white", "ec": "none", "pad": 1},
        )
    left.set_ylim(0, top + 0.06 * max(cost) * n + 0.1 * max(cost))
    left.set_xticks(range(n), [f"{j}" for j in range(n)])
    left.set_xlabel(f"chunk j ({c} tokens each), in sequence order")
    left.set_ylabel("causal pairs per head")
    left.set_title(f"chunk j costs j·c² + c(c+1)/2 (c = {c})", fontsize=10)
    left.grid(False, axis="x")
    total = (n - 1) * c * c + c * (c + 1)
    for r in range(k):
        head, tail = cost[r], cost[n - 1 - r]
        right.bar(r, head, 0.7, color=rank_color(r), alpha=0.45, edgecolor=rank_color(r))
        right.bar(r, tail, 0.7, bottom=head, color=rank_color(r), edgecolor="white")
        right.text(r, head / 2, str(head), ha="center", va="center", fontsize=10)
        right.text(
            r,
            head + tail / 2,
            str(tail),
            ha="center",
            va="center",
            fontsize=10,
            color=ink(rank_color(r)),
        )
    right.axhline(total, color="black", lw=0.8, ls="--")
    right.text(k - 0.6, total * 1.02, f"{total} pairs", ha="right", va="bottom", fontsize=10)
    right.set_xticks(range(k), [f"rank {r}\n{r} + {n - 1 - r}" for r in range(k)])
    right.set_ylim(0, total * 1.15)
    right.set_ylabel("causal pairs per head")
    right.set_title("head (light) + tail chunk, per rank", fontsize=10)
    right.grid(False, axis="x")
    return fig


def partition_figure(part: PCPPartition):
    """Top: every request in sequence order, each token coloured by its owner (grey: padding).
    Bottom: each rank's local rows in the order it holds them, labelled with positions."""
    n_req, p = len(part.seq_lens), part.pcp
    rows = n_req + p
    width = max(max(part.padded_lens), part.tokens_per_rank)
    # cells as wide as the page allows (beside ~1.6 in of row labels), at most 0.5 in
    cell_w = min(0.5, (_WIDTH - 1.6) / width)
    fs = 10 if cell_w >= 0.42 else 8
    fig, ax = figure(figsize=(cell_w * width + 1.6, 0.5 * rows + 1.0))
    owner: dict[tuple[int, int], int] = {}
    for r, segs in enumerate(part.segments):
        for s in segs:
            for pos in range(s.start, s.end):
                owner[(s.request, pos)] = r

    def cell(x: float, y: float, color: str, text: str) -> None:
        ax.add_patch(Rectangle((x, y), 1, 0.8, facecolor=color, edgecolor="white", lw=1.5))
        ax.text(x + 0.5, y + 0.4, text, ha="center", va="center", fontsize=fs, color=ink(color))

    labels = []
    for i, (n, padded) in enumerate(zip(part.seq_lens, part.padded_lens)):
        y = rows - 1 - i
        for pos in range(padded):
            cell(pos, y, _PAD if pos >= n else rank_color(owner[(i, pos)]), str(pos))
        labels.append((y, f"request {i}\n({n} tokens)"))
    for r, segs in enumerate(part.segments):
        y = p - 1 - r
        for s in segs:
            for j, pos in enumerate(range(s.start, s.end)):
                color = _PAD if pos >= part.seq_lens[s.request] else rank_color(r)
                cell(s.row + j, y, color, f"{pos}" if n_req == 1 else f"{s.request}:{pos}")
        labels.append((y, f"rank {r} holds"))
    ax.set_xlim(-0.2, width + 0.2)
    ax.set_ylim(-0.2, rows)
    ax.set_yticks([y + 0.4 for y, _ in labels], [t for _, t in labels])
    ax.set_xticks([])
    ax.grid(False)
    for side in ("left", "bottom"):
        ax.spines[side].set_visible(False)
    ax.axhline(p - 0.1, color="black", lw=0.8)
    ax.set_title(
        f"{part.partition} partition over {p} ranks; grey = padding, cells = "
        + ("position" if n_req == 1 else "request:position"),
        fontsize=10,
        loc="left",
    )
    return fig


#: the panels of chapter 4's rank-grid figure: (tp, pcp, dcp, group order)
RANK_GRID_PANELS = ((4, 2, 2, "v0.34"), (4, 2, 2, "v0.14"), (2, 2, 4, "v0.33"), (2, 2, 4, "v0.34"))


def rank_grid_figure(panels: Sequence[tuple[int, int, int, str]] = RANK_GRID_PANELS):
    """One panel per ``(tp, pcp, dcp, order)``, two per row: the world as PCP rows × TP columns,
    each cell a global rank filled by its DCP group and labelled with its DCP rank (its index
    in its group's list, which fixes the tokens it owns). TP groups are the rows, PCP groups
    the columns."""
    rows = (len(panels) + 1) // 2
    height = sum(0.75 * max(p[1] for p in panels[2 * i : 2 * i + 2]) + 1.3 for i in range(rows))
    fig, axes = figure(rows, 2, figsize=(_WIDTH, height + 0.4), squeeze=False)
    for ax, (tp, pcp, dcp, order) in zip(axes.flat, panels):
        grid = RankGrid(tp, pcp, dcp, order)
        groups = grid.dcp_groups()
        for rank in range(grid.world_size):
            p, t = divmod(rank, tp)
            g = next(i for i, grp in enumerate(groups) if rank in grp)
            color = rank_color(g)
            ax.add_patch(Rectangle((t, pcp - 1 - p), 0.92, 0.85, facecolor=color))
            label = f"{rank}\ndcp {grid.coords(rank).dcp_rank}"
            ax.text(t + 0.46, pcp - 1 - p + 0.42, label, ha="center", va="center", fontsize=10,
                    color=ink(color), weight="bold")  # fmt: skip
        ax.set_xlim(-0.1, tp)
        ax.set_ylim(-0.15, pcp)
        ax.set_xticks([t + 0.46 for t in range(tp)], [f"tp {t}" for t in range(tp)])
        ax.set_yticks([pcp - 1 - p + 0.42 for p in range(pcp)], [f"pcp {p}" for p in range(pcp)])
        ax.tick_params(length=0)
        ax.grid(False)
        for side in ("left", "bottom"):
            ax.spines[side].set_visible(False)
        if len(groups) == 1:
            what = "one DCP group: the world"
        else:
            what = f"DCP groups {'=' if groups == grid.pcp_groups() else '≠'} PCP groups"
        ax.set_title(f"TP {tp} × PCP {pcp}, DCP {dcp}, {order}\n{what}", fontsize=10)
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    fig.suptitle("Colour = DCP group; in each cell the global rank and its DCP rank", fontsize=11)
    return fig


def balance_figure(
    measured: dict[int, dict[str, list[float]]],
    exact: dict[int, dict[str, list[int]]],
    title: str = "Attention time per rank (thread CPU time) against exact causal work",
):
    """Per rank, measured attention time (bars) and exact causal work (markers), each relative
    to its mean over ranks; one panel per PCP size, zigzag beside contiguous."""
    sizes = sorted(measured)
    fig, axes = figure(1, len(sizes), figsize=(_WIDTH, 3.7))
    for ax, p in zip(np.atleast_1d(axes), sizes):
        for i, partition in enumerate(("zigzag", "contiguous")):
            t = np.array(measured[p][partition])
            w = np.array(exact[p][partition], dtype=float)
            x = np.arange(p) + (i - 0.5) * 0.4
            color = _PARTITION_COLOR[partition]
            ax.bar(x, t / t.mean(), 0.38, color=color, label=f"{partition}: measured time")
            ax.plot(x, w / w.mean(), "k_", ms=14, mew=2, label="counted work" if i else None)
        ax.axhline(1.0, color="black", lw=0.6)
        ax.set_xticks(range(p), [f"rank {r}" for r in range(p)])
        ax.set_title(f"PCP = {p}")
    first = np.atleast_1d(axes)[0]
    first.set_ylabel("relative to the mean over ranks")
    handles, labels = first.get_legend_handles_labels()
    order = sorted(range(len(labels)), key=lambda i: "measured" not in labels[i])  # bars first
    fig.legend(
        [handles[i] for i in order], [labels[i] for i in order], loc="outside lower center", ncol=3
    )
    fig.suptitle(title, fontsize=11)
    return fig
