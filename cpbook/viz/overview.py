"""Chapter 1's overview figures: the map of context parallelism (PCP splits the prompt, DCP
splits the KV cache) and the LSE merge that every CP mechanism ends with.

Sized for the book's text column at a 1280-px window (about 690 px): 6.6 inches wide at 110
dpi (726 px), so they render at 95 % or more, with no text smaller than 9.5 pt.
"""

from __future__ import annotations

import torch
from matplotlib.patches import FancyArrowPatch, Rectangle

from cpbook.core.attention import dense_attention
from cpbook.core.problems import merge_problem
from cpbook.viz.style import figure, ink, rank_color

__all__ = ["cp_map", "lse_merge"]

SMALL = 9.5  # the smallest font size in these figures (pt)
WIDTH = 6.6  # inches


def _row(ax, y: float, owners: list[int], label: str) -> None:
    """One box per token at ``x = position``, coloured by its owner rank, numbered."""
    for i, r in enumerate(owners):
        ax.add_patch(Rectangle((i, y), 0.9, 0.8, color=rank_color(r)))
        ax.text(
            i + 0.45,
            y + 0.4,
            str(i),
            ha="center",
            va="center",
            fontsize=10,
            color=ink(rank_color(r)),
        )
    ax.text(-0.4, y + 0.4, label, ha="right", va="center", fontsize=10.5)


def _rank_legend(ax, n: int, name: str, y: float) -> None:
    for r in range(n):
        ax.add_patch(Rectangle((r * 3.6, y), 0.6, 0.5, color=rank_color(r)))
        ax.text(r * 3.6 + 0.8, y + 0.25, f"{name} rank {r}", va="center", fontsize=10)


def cp_map(prompt: int = 16, pcp: int = 2, context: int = 16, dcp: int = 4, interleave: int = 2):
    """Two stacked panels: zigzag PCP ownership of a prompt's tokens (prefill), then interleaved
    DCP ownership of a context's KV (decode), coloured by rank."""
    fig, (a, b) = figure(2, 1, figsize=(WIDTH, 4.6))
    chunk = prompt // (2 * pcp)
    zig = [min(c, 2 * pcp - 1 - c) for c in (t // chunk for t in range(prompt))]
    _row(a, 1.0, zig, "query tokens")
    _rank_legend(a, pcp, "PCP", -0.2)
    a.set_title(
        f"Prefill: PCP = {pcp} cuts the prompt into {2 * pcp} chunks; rank r gets\n"
        f"chunks r and {2 * pcp - 1}−r (head–tail), then gathers all K/V",
        fontsize=11,
        loc="left",
    )
    owners = [(t // interleave) % dcp for t in range(context)]
    _row(b, 1.0, owners, "KV cache")
    b.add_patch(
        Rectangle((context + 0.3, 1.0), 0.9, 0.8, facecolor="white", edgecolor="0.2", hatch="///")
    )
    b.text(context + 0.75, 1.95, "new\ntoken", ha="center", va="bottom", fontsize=SMALL)
    _rank_legend(b, dcp, "DCP", -0.2)
    b.set_title(
        f"Decode: DCP = {dcp} stores token t on rank ⌊t / {interleave}⌋ mod {dcp} "
        f"(interleave {interleave});\nevery rank attends its shard, the results merge by LSE",
        fontsize=11,
        loc="left",
    )
    for ax in (a, b):
        ax.set_xlim(-3.9, max(prompt, context) + 1.6)
        ax.set_ylim(-0.4, 2.7)
        ax.axis("off")
    return fig


def _arrow(ax, xy0, xy1) -> None:
    ax.add_patch(
        FancyArrowPatch(xy0, xy1, arrowstyle="-|>", mutation_scale=12, color="0.3", lw=1.2)
    )


def lse_merge(
    num_keys: int = 10,
    world_size: int = 4,
    num_queries: int = 2,
    num_q_heads: int = 4,
    head_dim: int = 16,
    seed: int = 1,
    query: int = 0,
    head: int = 0,
):
    """The LSE merge on real numbers: keys split over ranks, each rank's ``(o_r, l_r)``, the
    merge, and (below) the merge weights ``exp(l_r - l)`` next to the share of the dense
    softmax that falls on each rank's keys, for one query and head.

    Inputs come from :func:`cpbook.core.problems.merge_problem` with ``seed``, split like
    ``merge_rank`` splits them (``torch.tensor_split``), so the numbers match the chapter's.
    """
    q, k, v = merge_problem(num_keys, num_queries, num_q_heads, head_dim, seed)
    shards = torch.tensor_split(torch.arange(num_keys), world_size)
    lses = torch.stack([dense_attention(q, k[s], v[s])[1][query, head] for s in shards])
    lse = torch.logsumexp(lses, dim=0)
    weights = torch.exp(lses - lse)
    scores = (k[:, head] @ q[query, head]) / head_dim**0.5
    probs = torch.softmax(scores, dim=0)
    mass = torch.stack([probs[s].sum() for s in shards])

    fig, (a, b) = figure(2, 1, figsize=(WIDTH, 6.4), height_ratios=[3.4, 2.1])
    gap, key_y, rank_y, merge_y = 0.45, 5.4, 2.9, 0.2
    spans = []
    for r, s in enumerate(shards):
        xs = [int(j) + gap * r for j in s]
        for j, x in zip(s.tolist(), xs):
            a.add_patch(Rectangle((x, key_y), 0.86, 0.8, color=rank_color(r)))
            a.text(
                x + 0.43,
                key_y + 0.4,
                f"k{j}",
                ha="center",
                va="center",
                fontsize=SMALL,
                color=ink(rank_color(r)),
            )
        lo, hi = (xs[0], xs[-1] + 0.86) if xs else (gap * r + len(s), gap * r + len(s) + 0.86)
        spans.append((lo, hi))
    right = spans[-1][1]
    a.text(
        0,
        key_y + 1.05,
        f"{num_keys} keys split over {world_size} ranks; every rank has the query q",
        fontsize=10.5,
        va="bottom",
    )
    for r, (lo, hi) in enumerate(spans):
        mid = (lo + hi) / 2
        a.add_patch(
            Rectangle(
                (lo - 0.05, rank_y),
                hi - lo + 0.1,
                1.3,
                facecolor="white",
                edgecolor=rank_color(r),
                lw=2.2,
            )
        )
        a.text(
            mid,
            rank_y + 0.65,
            f"rank {r}\n$\\ell_{r}$ = {lses[r]:.2f}",
            ha="center",
            va="center",
            fontsize=10,
        )
        _arrow(a, (mid, key_y - 0.05), (mid, rank_y + 1.35))
        _arrow(a, (mid, rank_y - 0.05), (mid, merge_y + 1.55))
    a.text(
        right + 0.1,
        (key_y + rank_y + 1.3) / 2,
        "attend to\nown keys:\n$o_r$, $\\ell_r$",
        fontsize=SMALL,
        va="center",
    )
    a.text(
        right + 0.1,
        (rank_y + merge_y + 1.5) / 2,
        "all-gather\n$(o_r, \\ell_r)$",
        fontsize=SMALL,
        va="center",
    )
    a.add_patch(Rectangle((0, merge_y), right, 1.5, facecolor="0.94", edgecolor="0.3"))
    a.text(
        right / 2,
        merge_y + 0.75,
        "$\\ell = \\log\\sum_r e^{\\ell_r}$      $o = \\sum_r e^{\\ell_r-\\ell}\\, o_r$\n"
        f"= dense attention over all {num_keys} keys ($\\ell$ = {lse:.2f})",
        ha="center",
        va="center",
        fontsize=11,
    )
    a.set_xlim(-0.2, right + 2.4)
    a.set_ylim(-0.1, key_y + 1.7)
    a.axis("off")

    ranks = list(range(world_size))
    b.bar(
        ranks,
        weights.tolist(),
        color=[rank_color(r) for r in ranks],
        width=0.7,
        label="merge weight $e^{\\ell_r-\\ell}$",
    )
    b.plot(
        ranks,
        mass.tolist(),
        ls="none",
        marker="D",
        ms=8,
        mfc="white",
        mec="black",
        mew=1.5,
        label="dense softmax mass\non the rank's keys",
    )
    b.set_xticks(ranks, [f"rank {r}" for r in ranks], fontsize=10)
    b.tick_params(axis="y", labelsize=10)
    b.set_ylim(0, max(weights.max().item(), mass.max().item()) * 1.45)
    b.set_ylabel(f"weight (query {query}, head {head})", fontsize=10.5)
    b.set_title(
        f"each merge weight is the softmax share of the rank's keys; "
        f"sum = {weights.sum().item():.3f}",
        fontsize=11,
    )
    b.legend(loc="upper left", ncol=2, fontsize=SMALL)
    b.grid(axis="x", visible=False)
    return fig
