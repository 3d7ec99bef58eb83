"""Figures of chapter 7: routing decisions on a trace, the KV of a migrated request before and
after, the four policies' throughput–latency frontier, and how the CP break-even length moves
with TPA and with the batch that shares one set of collectives.

Every function draws numbers the chapter computed (a :class:`~cpbook.dynamic.router.Router`, the
per-rank results of :func:`cpbook.demos.ch07_migration.migration_rank`,
:func:`cpbook.dynamic.simulator.sweep`, :func:`cpbook.dynamic.router.Router.modelled`) and
returns the ``Figure``.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
from matplotlib.colors import ListedColormap
from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter, NullLocator

from cpbook.dynamic.simulator import DYNAMIC_CP, DYNAMIC_CP_TPA, STATIC_CP, STATIC_DP
from cpbook.viz.style import PALETTE, figure, legible, plain_label, rank_color, tokens_label

__all__ = ["routing_figure", "migration_figure", "frontier_figure", "crossover_figure"]

POLICY_STYLE = {  # policy -> (label, colour, marker)
    STATIC_DP: ("static DP", PALETTE[7], "o"),
    STATIC_CP: ("static CP = 8", PALETTE[5], "s"),
    DYNAMIC_CP: ("dynamic CP", PALETTE[1], "D"),
    DYNAMIC_CP_TPA: ("dynamic CP + TPA", PALETTE[0], "^"),
}
SIZE_COLOR = {1: PALETTE[7], 2: PALETTE[2], 4: PALETTE[1], 8: PALETTE[0]}


def _token_axis(axis, lo: float, hi: float) -> None:
    """Log axis ticks at 1K, 4K, 16K, ... (powers of 4 times 1024) between ``lo`` and ``hi``."""
    ticks = [1024 * 4**k for k in range(-2, 8) if lo <= 1024 * 4**k <= hi]
    axis.set_major_locator(FixedLocator(ticks))
    axis.set_major_formatter(FuncFormatter(tokens_label))
    axis.set_minor_locator(NullLocator())


def routing_figure(totals: np.ndarray, sizes: np.ndarray, thresholds: Sequence[float]):
    """Each request of a trace (arrival order) at its expected total length, coloured by the
    CP size the router gave it, with the thresholds drawn."""
    fig, ax = figure(figsize=(7.2, 3.6))
    idx = np.arange(len(totals))
    for n in sorted(set(sizes.tolist())):
        m = sizes == n
        ax.scatter(
            idx[m],
            totals[m],
            s=14,
            color=SIZE_COLOR.get(n, PALETTE[3]),
            label=f"CP = {n} ({int(m.sum())})" if n > 1 else f"DP ({int(m.sum())})",
        )
    for t in thresholds:
        ax.axhline(t, color=PALETTE[5], ls="--", lw=1.2)
        ax.annotate(
            f"threshold {tokens_label(t)}",
            (len(totals) - 1, t),
            ha="right",
            va="bottom",
            color=PALETTE[5],
        )
    ax.set_yscale("log")
    _token_axis(ax.yaxis, float(totals.min()), float(totals.max()) * 2)
    ax.set_xlabel("request (arrival order)")
    ax.set_ylabel("prompt + output tokens")
    ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncols=3)
    return legible(fig)


def migration_figure(results: Sequence[Mapping[str, Any]], seq_len: int, titles: Sequence[str]):
    """Which rank holds each cached position before and after the migration: one row per
    state, a cell per position, coloured by the rank that stores it."""
    n = len(results)
    grid = np.full((2, seq_len), -1)
    for r, res in enumerate(results):
        grid[0, res["positions_before"]] = r
        grid[1, res["positions_after"]] = r
    fig, ax = figure(figsize=(7.2, 2.2))
    cmap = ListedColormap([rank_color(r) for r in range(n)])
    ax.imshow(grid, aspect="auto", cmap=cmap, vmin=-0.5, vmax=n - 0.5, interpolation="nearest")
    ax.set_yticks([0, 1], list(titles))
    ax.set_xlabel("token position")
    ax.grid(False)
    for r in range(n):
        ax.plot([], [], "s", color=rank_color(r), label=f"rank {r}")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.45), ncols=n)
    return legible(fig)


def frontier_figure(rows: Sequence[Mapping[str, Any]]):
    """Throughput against TPOT p99 (left) and TTFT p99 (right) per policy, one point per
    arrival rate of the sweep."""
    fig, axes = figure(1, 2, figsize=(7.2, 3.6))
    for policy, (label, color, marker) in POLICY_STYLE.items():
        pts = sorted(
            (r["rate"], r["throughput_tok_s"], r["tpot_p99_ms"], r["ttft_p99_ms"])
            for r in rows
            if r["policy"] == policy
        )
        if not pts:
            continue
        _, x, tpot, ttft = (np.array(v) for v in zip(*pts))
        axes[0].plot(x, tpot, marker=marker, color=color, label=label)
        axes[1].plot(x, ttft / 1e3, marker=marker, color=color, label=label)
    axes[0].set_ylabel("TPOT p99 (ms)")
    axes[1].set_ylabel("TTFT p99 (s)")
    axes[1].set_yscale("log")
    axes[1].yaxis.set_major_locator(FixedLocator([5, 10, 20, 50, 100, 200, 500]))
    axes[1].yaxis.set_major_formatter(FuncFormatter(plain_label))
    axes[1].yaxis.set_minor_formatter(NullFormatter())
    for ax in axes:
        ax.set_xlabel("decode throughput (tok/s)")
    axes[0].legend(loc="upper left", fontsize=10)
    return legible(fig, 10.5)


def crossover_figure(
    batches: Sequence[int], lengths: Mapping[str, Sequence[float]], article: Mapping[float, str]
):
    """The modelled length above which CP's decode step is the shortest, against the number
    of requests that share one set of collectives, for standard DCP and DCP + TPA."""
    fig, ax = figure(figsize=(7.2, 3.6))
    styles = {"dcp": ("DCP, standard", PALETTE[5], "s"), "dcp_tpa": ("DCP + TPA", PALETTE[0], "^")}
    for key, ys in lengths.items():
        label, color, marker = styles[key]
        ax.plot(batches, ys, marker=marker, color=color, label=label)
    for y, text in article.items():
        ax.axhline(y, color=PALETTE[7], ls=":", lw=1.2)
        ax.annotate(text, (batches[-1], y), ha="right", va="bottom")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.xaxis.set_major_formatter(FuncFormatter(plain_label))
    ax.xaxis.set_minor_locator(NullLocator())
    ys = [y for v in lengths.values() for y in v] + list(article)
    _token_axis(ax.yaxis, min(ys) / 2, max(ys) * 2)
    ax.set_xlabel("requests sharing the step's collectives")
    ax.set_ylabel("break-even length (tokens)")
    ax.legend(loc="lower left")
    return legible(fig)
