"""Chapter 2 explorer: DCP size and interleave -> the ownership grid and each rank's slots,
drawn in HTML (light and fast enough to precompute every state)."""

from __future__ import annotations

import torch

from cpbook.kv.layout import num_virtual_blocks, slot_mapping, token_owner
from cpbook.viz.style import rank_color
from cpbook.widgets.explorer import Control, Explorer, pre

__all__ = ["layout_explorer", "layout_html", "slot_summary"]

_EMPTY = "#eaeef2"


def _runs(values: list[int], limit: int = 4) -> str:
    """``[0, 1, 2, 7, 8]`` -> ``"0-2, 7-8"`` (the first ``limit`` runs)."""
    runs: list[list[int]] = []
    for v in values:
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    text = ", ".join(f"{a}-{b}" if b > a else str(a) for a, b in runs[:limit])
    return text + (", ..." if len(runs) > limit else "")


def slot_summary(
    seq_len: int, dcp: int, interleave: int, block_size: int, block_table: list[int]
) -> str:
    """One line per rank (tokens held, positions, slots), then where D20 and D27 land."""
    lines = []
    for r in range(dcp):
        slots = slot_mapping(torch.arange(seq_len), block_table, block_size, dcp, r, interleave)
        held = torch.nonzero(slots >= 0).flatten().tolist()
        mine = slots[slots >= 0].tolist()
        lines.append(
            f"rank {r}: {len(mine):2d} tokens, positions {_runs(held)} -> slots {_runs(mine)}"
        )
    for p in (20, 27):
        if p < seq_len:
            r = int(token_owner(torch.tensor([p]), dcp, interleave))
            s = slot_mapping([p], block_table, block_size, dcp, r, interleave).item()
            lines.append(f"D{p} -> rank {r}, slot {s}")
    return "\n".join(lines)


# one style per panel: the cells themselves carry only their colour
_STYLE = (
    "<style>.kvg{display:grid;gap:2px;max-width:38em;font:.8em monospace}"
    ".kvg>b{display:block;text-align:center;font-weight:normal;color:#fff;border-radius:2px;"
    "line-height:1.7em}.kvg>b.e{color:#57606a}.kvg>b.m{box-shadow:inset 0 0 0 2px #000}"
    ".kvg small{display:block;color:#57606a;font-size:.8em;line-height:1.2em;background:#fff}"
    ".kvr{margin:.3em 0 .1em;font-size:.85em}</style>"
)


def _cell(text: str, colour: str, mark: bool = False, sub: str = "") -> str:
    cls = " ".join(c for c, on in (("e", colour == _EMPTY), ("m", mark)) if on)
    attr = f' class="{cls}"' if cls else ""
    small = f"<small>{sub}</small>" if sub else ""
    return f'<b{attr} style="background:{colour}">{text or "&nbsp;"}{small}</b>'


def _grid(cells: list[str], columns: int) -> str:
    return (
        f'<div class="kvg" style="grid-template-columns:repeat({columns},minmax(0,1fr))">'
        f"{''.join(cells)}</div>"
    )


def layout_html(
    seq_len: int,
    dcp: int,
    interleave: int,
    block_size: int,
    block_table: list[int],
    highlight: tuple[int, ...] = (20, 27),
) -> str:
    """The ownership grid (tokens coloured by owner rank) and each rank's physical slots with
    the token stored in each, as HTML: the picture of ``viz.kvcache.ownership_figure``."""
    owners = token_owner(torch.arange(seq_len), dcp, interleave).tolist()
    width = min(16, block_size * dcp)
    out = [
        _STYLE,
        f"<p style='margin:.2em 0'>Owner of token p: (p // {interleave}) % {dcp}; "
        f"one block id holds {block_size} × {dcp} = {block_size * dcp} tokens</p>",
        _grid([_cell(str(p), rank_color(r), p in highlight) for p, r in enumerate(owners)], width),
        f"<p style='margin:.4em 0 .2em'>Physical slots per rank (block ids {block_table}): "
        "token stored, slot number below</p>",
    ]
    for r in range(dcp):
        slots = slot_mapping(torch.arange(seq_len), block_table, block_size, dcp, r, interleave)
        token_at = {int(s): p for p, s in enumerate(slots.tolist()) if s >= 0}
        cells = []
        for b in block_table:
            for s in range(b * block_size, (b + 1) * block_size):
                p = token_at.get(s)
                colour = rank_color(r) if p is not None else _EMPTY
                cells.append(_cell("" if p is None else str(p), colour, p in highlight, str(s)))
        out.append(f'<div class="kvr">rank {r}</div>')
        out.append(_grid(cells, min(16, block_size * len(block_table))))
    return "".join(out)


def layout_explorer(
    seq_len: int = 64,
    block_size: int = 16,
    interleaves: tuple[int, ...] = (1, 2, 4, 8, 16),
    dcp_sizes: tuple[int, ...] = (2, 4),
    first_block: int = 5,
    **value,
) -> Explorer:
    """Interleave × DCP size for one request: ownership grid, slots and slot summary (HTML).

    The block table is ``first_block, first_block + 1, ...`` (one id per virtual block).
    """

    def render(interleave: int, dcp: int) -> str:
        nb = num_virtual_blocks(seq_len, block_size, dcp)
        table = list(range(first_block, first_block + nb))
        return layout_html(seq_len, dcp, interleave, block_size, table) + pre(
            slot_summary(seq_len, dcp, interleave, block_size, table)
        )

    return Explorer(
        render,
        {
            "interleave": Control(list(interleaves), label="interleave size"),
            "dcp": Control(list(dcp_sizes), label="DCP size", kind="select"),
        },
        value=value,
        caption=(
            f"A {seq_len}-token request, block size {block_size}: move the interleave size and "
            "the DCP size; the token grid, each rank's slots (D20 and D27 outlined) and the "
            "lines below follow."
        ),
    )
