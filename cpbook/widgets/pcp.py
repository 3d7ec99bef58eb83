"""Chapter 4's explorer: each PCP rank's causal work, by split, PCP size and prompt length."""

from __future__ import annotations

from cpbook.pcp.zigzag import PARTITIONS, causal_work, pcp_partition
from cpbook.viz.style import BLUE, GREEN, ORANGE
from cpbook.widgets.bars import bar_chart
from cpbook.widgets.explorer import Control, Explorer, explorer, pre

__all__ = ["PCP_SIZES", "SEQ_LENS", "work_readout", "work_explorer"]

PCP_SIZES = (2, 3, 4, 8)
SEQ_LENS = (10, 100, 1000, 8192)
_COLOUR = {"zigzag": BLUE, "contiguous": ORANGE, "striped": GREEN}


def work_readout(partition: str, pcp: int, seq_len: int) -> str:
    """HTML: every rank's exact causal (query, key) pairs over the mean, and what they imply."""
    work = causal_work(seq_len, pcp, partition)
    mean = sum(work) / pcp
    ratios = [w / mean for w in work]
    rows = [(f"rank {r}", [(x, _COLOUR[partition])], f"{x:.3f}") for r, x in enumerate(ratios)]
    chart = bar_chart(
        rows,
        scale=max(2.0, max(ratios)),
        title=f"work of each rank / mean: {partition}, PCP = {pcp}, "
        f"{seq_len:,} tokens (full track = {max(2.0, max(ratios)):.2f})",
    )
    pad = pcp_partition(seq_len, pcp, partition).pad
    text = (
        f"busiest / mean  {max(ratios):.3f}\n"
        f"speed-up        {sum(work) / max(work):.2f}x (ideal {pcp}x)\n"
        f"padding         {pad} rows"
    )
    return chart + pre(text)


def work_explorer() -> Explorer:
    """Split × PCP size × prompt length: 48 precomputed states of :func:`work_readout`."""
    return explorer(
        work_readout,
        {
            "partition": Control(PARTITIONS, label="split"),
            "pcp": Control(PCP_SIZES, label="PCP size"),
            "seq_len": Control(SEQ_LENS, names=[f"{n:,}" for n in SEQ_LENS], label="prompt tokens"),
        },
        value={"partition": "contiguous", "pcp": 4, "seq_len": 1000},
        caption="Exact causal work per rank, counted by cpbook.pcp.zigzag.causal_work. "
        "Short prompts show the padding's cost; long ones the limits 2 - 1/K "
        "(contiguous) and 1 (zigzag, striped).",
    )
