"""Chapter 1's map of context parallelism: PCP splits the prompt, DCP splits the KV cache."""

from __future__ import annotations

from matplotlib.patches import Rectangle

from . import figure, rank_color

__all__ = ["cp_map"]


def _row(ax, y: float, owners: list[int], label: str, start: int = 0) -> None:
    for i, r in enumerate(owners):
        ax.add_patch(Rectangle((start + i, y), 0.92, 0.8, color=rank_color(r)))
        ax.text(
            start + i + 0.46,
            y + 0.4,
            str(start + i),
            ha="center",
            va="center",
            fontsize=6,
            color="white",
        )
    ax.text(-0.6, y + 0.4, label, ha="right", va="center", fontsize=8)


def cp_map(prompt: int = 16, pcp: int = 2, context: int = 16, dcp: int = 4, interleave: int = 2):
    """Two panels: zigzag PCP ownership of a prompt's tokens (prefill) and interleaved DCP
    ownership of a context's KV (decode), coloured by rank."""
    fig, (a, b) = figure(1, 2, figsize=(9.6, 2.4))
    chunk = prompt // (2 * pcp)
    zig = [min(c, 2 * pcp - 1 - c) for c in (t // chunk for t in range(prompt))]
    _row(a, 1.0, zig, "query tokens")
    for r in range(pcp):
        a.add_patch(Rectangle((r * 4.5, -0.8), 0.6, 0.5, color=rank_color(r)))
        a.text(r * 4.5 + 0.8, -0.55, f"PCP rank {r}", va="center", fontsize=8)
    a.set_title(
        f"Prefill: PCP={pcp} splits the prompt's queries (zigzag)\nevery rank gathers all K/V",
        fontsize=9,
    )
    owners = [(t // interleave) % dcp for t in range(context)]
    _row(b, 1.0, owners, "KV cache")
    b.add_patch(
        Rectangle((context + 0.3, 1.0), 0.92, 0.8, facecolor="white", edgecolor="0.2", hatch="///")
    )
    b.text(context + 0.76, 2.0, "new\ntoken", ha="center", fontsize=7)
    for r in range(dcp):
        b.add_patch(Rectangle((r * 4.2, -0.8), 0.6, 0.5, color=rank_color(r)))
        b.text(r * 4.2 + 0.8, -0.55, f"DCP rank {r}", va="center", fontsize=8)
    b.set_title(
        f"Decode: DCP={dcp} splits the KV cache by token (interleave {interleave})\n"
        "every rank attends its shard, results merged by LSE",
        fontsize=9,
    )
    for ax in (a, b):
        ax.set_xlim(-4.5, max(prompt, context) + 1.5)
        ax.set_ylim(-1.0, 2.6)
        ax.axis("off")
    return fig
