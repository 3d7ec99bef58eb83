"""Chapter 2 explorer: DCP size, interleave, block size and length -> ownership grid and slots."""

from __future__ import annotations

import io

import ipywidgets as widgets
import matplotlib.pyplot as plt
import torch

from ..config import ConfigError
from ..kvcache import PagedKVCache, local_seq_len, num_virtual_blocks, slot_mapping
from ..viz.kvcache import ownership_figure

__all__ = ["layout_explorer", "slot_summary"]


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


def slot_summary(seq_len: int, dcp_size: int, interleave: int, block_size: int) -> str:
    """One line per rank: tokens stored, positions held, slots used (block table 0, 1, ...)."""
    table = torch.arange(num_virtual_blocks(seq_len, block_size, dcp_size))
    lines = []
    for r in range(dcp_size):
        slots = slot_mapping(torch.arange(seq_len), table, block_size, dcp_size, r, interleave)
        mine = slots[slots >= 0]
        blocks = torch.unique(torch.div(mine, block_size, rounding_mode="floor")).numel()
        assert mine.numel() == local_seq_len(seq_len, dcp_size, r, interleave)
        assert torch.equal(
            mine,
            PagedKVCache(
                max(len(table), 1),
                block_size,
                1,
                1,
                dcp_size=dcp_size,
                dcp_rank=r,
                interleave=interleave,
            ).local_slots(table, seq_len),
        )
        held = torch.nonzero(slots >= 0).flatten().tolist()
        lines.append(
            f"rank {r}: {mine.numel():3d} tokens in {blocks} block(s); positions {_runs(held)}"
            f" -> slots {_runs(mine.tolist())}"
        )
    return "\n".join(lines)


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def layout_explorer(
    dcp_size: int = 4, interleave: int = 4, block_size: int = 16, seq_len: int = 64
) -> widgets.VBox:
    """Sliders for the four knobs; redraws the ownership figure and the per-rank slot summary.

    Needs a running kernel: in the static book the controls would do nothing, so chapter 2
    hides this cell's output (tag ``remove-output``) and shows the first view as a figure.
    """
    dcp = widgets.IntSlider(dcp_size, min=1, max=8, description="dcp_size")
    inter = widgets.Dropdown(
        options=[1, 2, 4, 8, 16, 32], value=interleave, description="interleave"
    )
    block = widgets.Dropdown(options=[4, 8, 16, 32], value=block_size, description="block_size")
    length = widgets.IntSlider(seq_len, min=1, max=160, description="seq_len")
    image = widgets.Image(format="png", layout=widgets.Layout(max_width="760px"))
    text = widgets.HTML()

    def redraw(_=None) -> None:
        try:
            text.value = (
                "<pre>" + slot_summary(length.value, dcp.value, inter.value, block.value) + "</pre>"
            )
            image.value = _png(ownership_figure(length.value, dcp.value, inter.value, block.value))
        except ConfigError as e:  # e.g. interleave > block_size: show vLLM's rule instead
            text.value = f"<pre>{e}</pre>"

    for w in (dcp, inter, block, length):
        w.observe(redraw, names="value")
    redraw()
    return widgets.VBox([widgets.HBox([dcp, length]), widgets.HBox([inter, block]), text, image])
