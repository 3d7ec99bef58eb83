"""Figures for the chapters: one module per concept, one shared style.

Every figure is matplotlib, white background, labelled axes, the Okabe–Ito colour-blind-safe
palette, rendered to PNG in notebooks.  Functions return the ``Figure``; chapters call
``plt.show()`` (never a trailing ``;``, which nbval mishandles).
"""

from __future__ import annotations

import matplotlib
import matplotlib.pyplot as plt

__all__ = ["PALETTE", "rank_color", "style", "figure"]

# Okabe & Ito (2008), "Color Universal Design": distinguishable under common colour blindness.
PALETTE = ["#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#000000"]


def rank_color(rank: int) -> str:
    """The colour of rank ``rank`` in every figure of the book (cycles after 8)."""
    return PALETTE[rank % len(PALETTE)]


def style() -> None:
    """Apply the book's matplotlib style (idempotent)."""
    matplotlib.rcParams.update(
        {
            "figure.facecolor": "white",
            "axes.facecolor": "white",
            "savefig.facecolor": "white",
            "figure.dpi": 110,
            "savefig.dpi": 110,
            "font.size": 10,
            "axes.titlesize": 11,
            "axes.spines.top": False,
            "axes.spines.right": False,
            "axes.grid": True,
            "grid.alpha": 0.3,
            "axes.prop_cycle": matplotlib.cycler(color=PALETTE),
            "legend.frameon": False,
            "figure.constrained_layout.use": True,
            "svg.hashsalt": "cpbook",
            "image.cmap": "viridis",
        }
    )


def figure(*args, **kwargs):
    """``plt.subplots`` with the book's style applied."""
    style()
    return plt.subplots(*args, **kwargs)


def tokens_label(t: float, _pos: object = None) -> str:
    """A token count as a tick label: 1024 -> '1K', 2**20 -> '1M', 173507 -> '169K' (binary K
    and M, 3 significant digits); usable as a matplotlib ``FuncFormatter``."""
    if t >= 2**20:
        return f"{t / 2**20:.3g}M"
    if t >= 1024:
        return f"{t / 1024:.3g}K"
    return f"{t:.3g}"


def legible(fig, size: float = 11.0):
    """Every text of ``fig`` at least ``size`` pt: 7.2 in wide figures are shown at about 0.87
    of that in the book's text column, so 11 pt renders at about 9.5 pt.  Returns ``fig``."""
    from matplotlib.text import Text

    for ax in fig.axes:
        ax.tick_params(labelsize=size)
    for text in fig.findobj(Text):
        if text.get_text() and text.get_fontsize() < size:
            text.set_fontsize(size)
    return fig
