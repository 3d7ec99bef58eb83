"""The book's one style: the colour-blind-safe palette, the text colour for a fill, the number
formatters, and the matplotlib settings every figure is drawn with.

Figures (:mod:`cpbook.viz`) and explorers (:mod:`cpbook.widgets`) take their colours and labels
from here, so a rank, a token count or a plain number looks the same in every chapter.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Callable

import matplotlib
import matplotlib.colors as mcolors
import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.text import Text

from cpbook.core.errors import RuleError

__all__ = [
    "BLUE",
    "ORANGE",
    "GREEN",
    "PURPLE",
    "SKY_BLUE",
    "VERMILLION",
    "YELLOW",
    "BLACK",
    "PALETTE",
    "rank_color",
    "tint",
    "ink",
    "tokens_label",
    "plain_label",
    "style",
    "figure",
    "legible",
    "write_png",
    "write_main",
]

# Okabe & Ito (2008), "Color Universal Design": distinguishable under common colour blindness.
BLUE = "#0072B2"
ORANGE = "#E69F00"
GREEN = "#009E73"  # Okabe–Ito's "bluish green"
PURPLE = "#CC79A7"  # Okabe–Ito's "reddish purple"
SKY_BLUE = "#56B4E9"
VERMILLION = "#D55E00"
YELLOW = "#F0E442"
BLACK = "#000000"
#: The book's colour cycle, in this order (rank ``r`` is ``PALETTE[r % 8]``).
PALETTE = [BLUE, ORANGE, GREEN, PURPLE, SKY_BLUE, VERMILLION, YELLOW, BLACK]


def rank_color(rank: int) -> str:
    """The colour of rank ``rank`` in every figure of the book (cycles after 8)."""
    return PALETTE[rank % len(PALETTE)]


def tint(color: str, amount: float = 0.5) -> str:
    """``color`` mixed with white (``amount`` 0: unchanged, 1: white), as ``#RRGGBB``: the light
    shade of a palette colour, for a second part of the same quantity."""
    if not 0.0 <= amount <= 1.0:
        raise RuleError("tint-amount", "0 <= amount <= 1", amount=amount)
    rgb = mcolors.to_rgb(color)
    return mcolors.to_hex(tuple(c + (1.0 - c) * amount for c in rgb)).upper()


def _relative_luminance(color: Any) -> float:
    """WCAG 2 relative luminance of a matplotlib colour: sRGB linearised, then Rec. 709 weights."""

    def linear(u: float) -> float:
        return u / 12.92 if u <= 0.04045 else ((u + 0.055) / 1.055) ** 2.4

    r, g, b = (linear(u) for u in mcolors.to_rgb(color))
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def ink(color: Any) -> str:
    """``"black"`` or ``"white"``: the text colour with the higher WCAG 2 contrast ratio on a
    fill of ``color`` (any matplotlib colour: ``"#RRGGBB"``, a name, an RGB tuple).

    The contrast ratio of colours with relative luminances ``L1 > L2`` is
    ``(L1 + 0.05) / (L2 + 0.05)``; black wins exactly when the fill's luminance exceeds
    ``sqrt(1.05 * 0.05) - 0.05 ≈ 0.179``.  This replaces two ad-hoc rules (Rec. 601 luma > 0.55,
    and Rec. 709 weights on gamma-encoded values > 0.45): both weigh gamma-encoded channels,
    which overrates dark greens and reds, and their thresholds were picked by eye.  WCAG's is the
    published, perceptually linear definition, and it picks the more legible ink by the same
    measure accessibility checkers use: on the palette, white on blue and black, black on the
    rest (bluish green and vermillion included, where black has 6.1:1 and 5.4:1 and white only
    3.4:1 and 3.9:1).
    """
    return "black" if _relative_luminance(color) > (1.05 * 0.05) ** 0.5 - 0.05 else "white"


def tokens_label(t: float, _pos: object = None) -> str:
    """A token count as a tick label: 1024 -> '1K', 2**20 -> '1M', 173507 -> '169K' (binary K
    and M, 3 significant digits); usable as a matplotlib ``FuncFormatter``."""
    if t >= 2**20:
        return f"{t / 2**20:.3g}M"
    if t >= 1024:
        return f"{t / 1024:.3g}K"
    return f"{t:.3g}"


def plain_label(v: float, _pos: object = None) -> str:
    """A number as a tick label in plain notation: 20 -> '20' (not 2 x 10^1), 0.5 -> '0.5';
    usable as a matplotlib ``FuncFormatter``."""
    return f"{v:g}"


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


def figure(*args: Any, **kwargs: Any) -> tuple[Figure, Any]:
    """``plt.subplots(*args, **kwargs)`` with the book's style applied: ``(fig, axes)``."""
    style()
    return plt.subplots(*args, **kwargs)


def legible(fig: Figure, size: float = 11.0) -> Figure:
    """Every text of ``fig`` at least ``size`` pt: 7.2 in wide figures are shown at about 0.87
    of that in the book's text column, so 11 pt renders at about 9.5 pt.  Returns ``fig``."""
    for ax in fig.axes:
        ax.tick_params(labelsize=size)
    for text in fig.findobj(Text):
        if text.get_text() and text.get_fontsize() < size:
            text.set_fontsize(size)
    return fig


def write_png(fig: Figure, folder: str | Path, filename: str, dpi: int = 165) -> Path:
    """Save ``fig`` as ``folder / filename`` (a PNG for a markdown page, no software stamp so
    a redraw changes the file only when the drawing changes); returns the path."""
    out = Path(folder) / filename
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi, metadata={"Software": None})
    return out


def write_main(draw: Callable[[], Figure], filename: str, doc: str) -> None:
    """``python -m cpbook.viz.<module> --write FOLDER``: draw the module's figure into FOLDER."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--write", metavar="FOLDER", required=True, help="where to write the PNG")
    print(write_png(draw(), p.parse_args().write, filename))
