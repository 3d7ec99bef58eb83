"""Where context parallelism touches a serving engine: the system figure of the intro.

Five layers of one engine step, top to bottom, each named by the package object that implements
it and annotated with what DCP and PCP change there: the scheduler (CP-unaware), the KV-cache
manager (virtual blocks of ``block_size × dcp`` tokens), the model runner (PCP's zigzag
partition, DCP's slot mapping), the attention backend (local attention with its log-sum-exp,
then the exact merge) and the collectives of the :class:`~cpbook.core.comm.Group` interface.
The names and the worked numbers are read from the objects themselves (a rename breaks the
figure's test, not the figure's truth): the virtual block size from a real
:class:`~cpbook.kv.manager.KVCacheManager`, the slots from :func:`~cpbook.kv.layout.slot_mapping`.

Write the PNG the intro shows with ``python -m cpbook.viz.system --write book/figures/``.
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

from cpbook.core.attention import attention_with_lse, merge_attn_states
from cpbook.core.comm import Group
from cpbook.engine.runner import ModelRunner
from cpbook.engine.scheduler import Scheduler
from cpbook.kv.layout import slot_mapping
from cpbook.kv.manager import KVCacheManager
from cpbook.pcp.zigzag import PCPPartition
from cpbook.viz.style import BLUE, ORANGE, figure, tint, write_main, write_png

__all__ = ["system_figure", "layers", "FILENAME", "write"]

FILENAME = "cp_in_the_engine.png"
WIDTH = 7.0  # inches
DCP_COLOR, PCP_COLOR = BLUE, ORANGE


def _name(obj) -> str:
    """``module.path.Name`` without the package prefix: where the reader finds it."""
    return f"{obj.__module__.removeprefix('cpbook.')}.{obj.__qualname__}"


def layers(block_size: int = 4, dcp: int = 2, dcp_rank: int = 1, pcp: int = 2) -> list[dict]:
    """The five layers: ``title``, ``objects`` (package names), ``dcp`` and ``pcp`` (what each
    changes there, with numbers computed from the objects for the given sizes)."""
    kv = KVCacheManager(num_blocks=8, block_size=block_size, dcp=dcp)
    vb = kv.virtual_block_size
    slots = slot_mapping(range(vb), [5], block_size, dcp, dcp_rank, 1).tolist()
    prompt = 4 * pcp
    zig = [
        ", ".join(f"{s.start}–{min(s.end, prompt) - 1}" for s in segs)
        for segs in PCPPartition((prompt,), pcp).segments
    ]
    return [
        {
            "title": "Scheduler",
            "objects": [_name(Scheduler)],
            "dcp": f"sees block ids only: one id = {vb} tokens",
            "pcp": "schedules the prompt as without CP",
        },
        {
            "title": "KV-cache manager",
            "objects": [_name(KVCacheManager)],
            "dcp": f"block id b = {block_size} slots on each of {dcp} ranks",
            "pcp": "the same block ids on every PCP rank",
        },
        {
            "title": "Model runner",
            "objects": [_name(ModelRunner), _name(slot_mapping), _name(PCPPartition)],
            "dcp": f"rank {dcp_rank}: tokens 0–{vb - 1} → " + " ".join(map(str, slots)),
            "pcp": "queries " + "; ".join(f"rank {r}: {z}" for r, z in enumerate(zig)),
        },
        {
            "title": "Attention backend",
            "objects": [_name(attention_with_lse), _name(merge_attn_states)],
            "dcp": "local KV share → (out, LSE); exact merge",
            "pcp": "causal attention of the zigzag chunks",
        },
        {
            "title": "Collectives",
            "objects": [_name(Group), "  .all_gather  .reduce_scatter", "  .all_to_all"],
            "dcp": "all_gather Q + LSE, reduce_scatter out",
            "pcp": "all_gather K/V before the cache write",
        },
    ]


def system_figure(**sizes):
    """The five layers as stacked boxes, each with its package objects and, beside them, what
    DCP (blue) and PCP (orange) change in that layer; ``sizes`` go to :func:`layers`."""
    rows = layers(**sizes)
    n = len(rows)
    fig, ax = figure(figsize=(WIDTH, 1.28 * n + 0.55))
    fig.set_layout_engine(None)
    ax.set_position((0.0, 0.0, 1.0, 1.0))
    ax.axis("off")
    h, step = 1.0, 1.28
    ax.set_xlim(0, 10)
    ax.set_ylim(-0.25, step * n + 0.3)
    ax.text(
        0.05,
        step * n + 0.05,
        "One engine step, top to bottom: what DCP and PCP change in each layer",
        fontsize=10.5,
        va="bottom",
        weight="bold",
    )
    for i, row in enumerate(rows):
        y = step * (n - 1 - i)
        ax.add_patch(
            FancyBboxPatch(
                (0.05, y),
                9.9,
                h,
                boxstyle="round,pad=0,rounding_size=0.08",
                facecolor="#F7F7F7",
                edgecolor="0.35",
                lw=1.0,
            )
        )
        ax.text(0.18, y + h - 0.12, row["title"], fontsize=11, weight="bold", va="top")
        ax.text(
            0.18,
            y + h - 0.42,
            "\n".join(row["objects"]),
            fontsize=9.5,
            family="monospace",
            va="top",
            linespacing=1.15,
        )
        for j, key in enumerate(("dcp", "pcp")):
            color = DCP_COLOR if key == "dcp" else PCP_COLOR
            yy = y + h - 0.12 - 0.42 * j
            ax.add_patch(
                FancyBboxPatch(
                    (4.55, yy - 0.34),
                    5.3,
                    0.36,
                    boxstyle="round,pad=0,rounding_size=0.05",
                    facecolor=tint(color, 0.82),
                    edgecolor=color,
                    lw=1.0,
                )
            )
            ax.text(
                4.62,
                yy - 0.16,
                f"{key.upper()}  {row[key]}",
                fontsize=9.5,
                va="center",
            )
        if i < n - 1:
            ax.add_patch(
                FancyArrowPatch(
                    (2.0, y - 0.01),
                    (2.0, y - (step - h) + 0.01),
                    arrowstyle="-|>",
                    mutation_scale=11,
                    color="0.3",
                )
            )
    return fig


def write(folder: str | Path, dpi: int = 165) -> Path:
    """Draw :func:`system_figure` into ``folder`` / :data:`FILENAME`; returns the path."""
    return write_png(system_figure(), folder, FILENAME, dpi)


if __name__ == "__main__":
    write_main(system_figure, FILENAME, __doc__)
