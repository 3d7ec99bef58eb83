"""cpbook.viz.style: the palette, the ink rule, the formatters, and the explorers' bar colours."""

from __future__ import annotations

import re

import matplotlib.colors as mcolors
import pytest

import cpbook.widgets.chunked as wchunked
from cpbook.viz.style import (
    BLUE,
    PALETTE,
    YELLOW,
    ink,
    plain_label,
    rank_color,
    tint,
    tokens_label,
)
from cpbook.widgets.pcp import work_readout
from cpbook.widgets.tpa import decode_readout

# a bar segment (``width:..%;background:#..``) or a legend swatch (``height:.8em;background:#..``)
_BAR_COLOUR = re.compile(r"(?:width:[\d.]+%|height:\.8em);background:(#[0-9A-Fa-f]{6})")


def _bar_colours(html: str) -> set[str]:
    found = {c.upper() for c in _BAR_COLOUR.findall(html)}
    assert found, "no bar segment found in the chart"
    return found


def test_palette_is_eight_distinct_hex_colours():
    assert len(PALETTE) == len(set(PALETTE)) == 8
    for c in PALETTE:
        assert re.fullmatch(r"#[0-9A-F]{6}", c), c
        assert mcolors.is_color_like(c)
    assert [rank_color(r) for r in range(10)] == PALETTE + PALETTE[:2]


def test_ink_white_on_dark_blue_black_on_yellow():
    assert BLUE == "#0072B2" and YELLOW == "#F0E442"
    assert ink(BLUE) == "white"
    assert ink(YELLOW) == "black"
    assert ink("#000000") == "white" and ink("white") == "black"
    assert ink((0.0, 0.447, 0.698)) == "white"  # any matplotlib colour, not only "#RRGGBB"


def test_ink_picks_the_higher_wcag_contrast():
    def lum(c):
        lin = [
            u / 12.92 if u <= 0.04045 else ((u + 0.055) / 1.055) ** 2.4 for u in mcolors.to_rgb(c)
        ]
        return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]

    for c in PALETTE + ["#F2F2F2", "#BBBBBB", "#555555"]:
        on_black, on_white = (lum(c) + 0.05) / 0.05, 1.05 / (lum(c) + 0.05)
        assert ink(c) == ("black" if on_black > on_white else "white"), c


def test_tint_is_a_lighter_shade():
    assert tint(BLUE, 0) == BLUE and tint(BLUE, 1) == "#FFFFFF"
    light = mcolors.to_rgb(tint(BLUE))
    assert all(a <= b for a, b in zip(mcolors.to_rgb(BLUE), light))
    with pytest.raises(ValueError, match="tint-amount"):
        tint(BLUE, 1.5)


def test_formatters():
    assert [tokens_label(t) for t in (512, 1024, 4096, 173507, 2**20, 3 * 2**19)] == [
        "512",
        "1K",
        "4K",
        "169K",
        "1M",
        "1.5M",
    ]
    assert tokens_label(2048, 0) == "2K"  # FuncFormatter's (value, position)
    assert [plain_label(v) for v in (20.0, 0.5, 1e-6)] == ["20", "0.5", "1e-06"]


def test_pcp_and_tpa_bars_use_only_palette_colours():
    for layout in ("zigzag", "contiguous", "striped"):
        assert _bar_colours(work_readout(layout, 4, 1000)) <= set(PALETTE)
    assert _bar_colours(decode_readout(131072, 15, 1)) <= set(PALETTE)


def test_chunked_bars_use_palette_colours_and_their_tints(monkeypatch):
    # the bytes themselves are tested with the formula; here only what colours they get
    def fake_bytes(strategy, *args, **kwargs):
        return (
            [("all_gather", 100), ("all_to_all", 50)]
            if strategy == "allgather_q"
            else [("all_gather", 80), ("all_gather", 40)]
        )

    monkeypatch.setattr(wchunked, "chunked_comm_bytes", fake_bytes)
    allowed = set(PALETTE) | {tint(c) for c in PALETTE}
    colours = _bar_colours(wchunked.bytes_readout(8, 2048, 16384))
    assert colours <= allowed
    assert len(colours) == 4  # two strategies, a colour and its light shade each
