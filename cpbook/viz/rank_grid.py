"""The TP × DCP rank grid of a real deployment: which GPU holds which query heads, which KV head
(or MLA's latent) and which token shard, and how often each KV row is stored.

Drawn from :class:`cpbook.core.groups.RankGrid` (each rank's TP and DCP coordinates) and
:mod:`cpbook.core.heads` (its heads) for a :class:`~cpbook.core.config.ParallelConfig` built
from a model of :data:`cpbook.costmodel.MODELS`.
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence

from matplotlib.patches import Rectangle

from cpbook.core.config import ParallelConfig
from cpbook.core.groups import RankGrid
from cpbook.core.heads import kv_heads_of, q_heads_of
from cpbook.viz.style import figure, ink, rank_color, tint

__all__ = ["gpu_holdings", "kv_copies", "rank_grid_figure"]


def gpu_holdings(config: ParallelConfig) -> list[dict]:
    """Per global rank: ``tp_rank``, ``dcp_rank``, its query heads and KV heads (``slice``)."""
    grid = RankGrid.from_config(config)
    out = []
    for rank in range(grid.world_size):
        c = grid.coords(rank)
        out.append(
            dict(
                rank=rank,
                tp_rank=c.tp_rank,
                dcp_rank=c.dcp_rank,
                q_heads=q_heads_of(config, c.tp_rank),
                kv_heads=kv_heads_of(config, c.tp_rank),
            )
        )
    return out


def kv_copies(config: ParallelConfig) -> int:
    """How many GPUs store each KV row: ranks holding the same KV heads and the same DCP token
    shard, counted on the grid (without DCP: ``kv_head_replicas``)."""
    held = Counter(
        (g["kv_heads"].start, g["kv_heads"].stop, g["dcp_rank"]) for g in gpu_holdings(config)
    )
    return max(held.values())


def _kv_name(config: ParallelConfig, heads: slice) -> str:
    if config.use_mla:
        return "latent"
    if heads.stop - heads.start == 1:
        return f"KV head {heads.start}"
    return f"KV {heads.start}–{heads.stop - 1}"


def rank_grid_figure(deployments: Sequence[tuple[str, ParallelConfig]]):
    """One row of GPU boxes per ``(name, config)``: colour = the token shard (DCP rank, tokens
    ``p`` with ``p // interleave % dcp == dcp_rank``), lighter tint = another GPU of the same
    KV heads; each box says its query heads and KV heads.  Data units are inches."""
    box_w, box_h, gap, left = 0.8, 1.05, 0.08, 0.05
    row_h = box_h + 0.75
    width = max(c.world_size for _, c in deployments) * (box_w + gap) + left
    fig, ax = figure(figsize=(width, row_h * len(deployments) + 0.1))
    for i, (name, cfg) in enumerate(deployments):
        y = (len(deployments) - 1 - i) * row_h
        copies = kv_copies(cfg)
        no_dcp = cfg.kv_head_replicas
        ax.text(
            left,
            y + box_h + 0.42,
            f"{name}: TP {cfg.tp} / DCP {cfg.dcp}, {cfg.num_q_heads} query heads, "
            + ("one MLA latent" if cfg.use_mla else f"{cfg.num_kv_heads} KV heads"),
            fontsize=10.5,
            weight="bold",
            va="center",
        )
        ax.text(
            left,
            y + box_h + 0.16,
            f"each KV row stored on {copies} GPU{'s' if copies > 1 else ''} "
            f"(×{no_dcp} without DCP): KV per GPU ÷ {no_dcp // copies}",
            fontsize=10,
            va="center",
        )
        for g in gpu_holdings(cfg):
            x = left + g["rank"] * (box_w + gap)
            color = rank_color(g["dcp_rank"])
            first = g["tp_rank"] % cfg.kv_head_replicas < cfg.dcp
            face = color if first or cfg.dcp == 1 else tint(color, 0.5)
            ax.add_patch(
                Rectangle((x, y), box_w, box_h, facecolor=face, edgecolor="#333333", lw=0.8)
            )
            q = g["q_heads"]
            shard = "all tokens" if cfg.dcp == 1 else f"tokens ≡{g['dcp_rank']} (mod {cfg.dcp})"
            ax.text(
                x + box_w / 2,
                y + box_h / 2,
                f"GPU {g['rank']}\nq {q.start}–{q.stop - 1}\n"
                f"{_kv_name(cfg, g['kv_heads'])}\n{shard.replace(' (', chr(10) + '(')}",
                ha="center",
                va="center",
                fontsize=9,
                color=ink(face),
            )
    ax.set_xlim(0, width)
    ax.set_ylim(-0.05, row_h * len(deployments))
    ax.axis("off")
    return fig
