"""Figures of chapter 9: what one engine step batches, and a run's step timeline.

Both take :class:`cpbook.engine.engine.StepRecord` lists from a real run (``Engine.history``).
"""

from __future__ import annotations

from typing import Mapping, Sequence

from matplotlib.patches import Patch, Rectangle

from cpbook.viz.style import PALETTE, figure

__all__ = [
    "KIND_COLORS",
    "KIND_NAMES",
    "WAIT_COLOR",
    "PREEMPT_COLOR",
    "step_batch_figure",
    "timeline_figure",
]

_WIDTH = 6.25  # the book's text column at 110 dpi (see viz.chunked)
KIND_COLORS = {"prefill": PALETTE[0], "chunked_prefill": PALETTE[4], "decode": PALETTE[2]}
KIND_NAMES = {"prefill": "prefill", "chunked_prefill": "chunked prefill", "decode": "decode"}
#: a request that waits in a step (light grey) / is preempted in it (outline)
WAIT_COLOR, PREEMPT_COLOR = "#EEEEEE", PALETTE[5]
_CACHED = "#BBBBBB"


def step_batch_figure(record, budget: int):
    """One step's batch: per scheduled request, the tokens already in the KV cache (grey) and
    the tokens this step computes (coloured by kind), with the step's token budget."""
    fig, ax = figure(figsize=(_WIDTH, 1.2 + 0.42 * len(record.chunks)), layout="constrained")
    for row, (rid, kind, start, n) in enumerate(record.chunks):
        y = len(record.chunks) - 1 - row
        ax.barh(y, start, color=_CACHED, height=0.6)
        ax.barh(y, n, left=start, color=KIND_COLORS[kind], height=0.6)
        ax.text(start + n + 0.4, y, f"+{n}", va="center", fontsize=9)
    ax.set_yticks(
        range(len(record.chunks)), [f"req {c[0]}" for c in reversed(record.chunks)], fontsize=9
    )
    ax.set_xlabel("token position in the request")
    ax.set_title(
        f"step {record.step}: {record.num_batched_tokens} of {budget} budget tokens", fontsize=10
    )
    handles = [Patch(color=_CACHED, label="already cached")] + [
        Patch(color=KIND_COLORS[k], label=KIND_NAMES[k]) for k in KIND_COLORS
    ]
    fig.legend(handles=handles, fontsize=8, ncol=4, loc="outside lower center", frameon=False)
    ax.spines[["top", "right"]].set_visible(False)
    return fig


def timeline_figure(
    history: Sequence, request_ids: Sequence[str], arrivals: Mapping[str, int] | None = None
):
    """Requests (rows) by steps (columns): the kind of work each request got in each step,
    waiting (light grey), preempted (red outline); a request enters the chart at its arrival
    step (``arrivals``, default 1) and leaves it when it finishes."""
    fig, ax = figure(figsize=(_WIDTH, 1.0 + 0.32 * len(request_ids)), layout="constrained")
    row = {rid: len(request_ids) - 1 - i for i, rid in enumerate(request_ids)}
    done: set[str] = set()
    for rec in history:
        x = rec.step - 1
        ran = {c[0]: c for c in rec.chunks}
        for rid in request_ids:
            if rid in done or rec.step < (arrivals or {}).get(rid, 1):
                continue
            color = KIND_COLORS[ran[rid][1]] if rid in ran else WAIT_COLOR
            ax.add_patch(Rectangle((x, row[rid] - 0.4), 0.92, 0.8, color=color, lw=0))
            if rid in rec.preempted:
                ax.add_patch(
                    Rectangle(
                        (x, row[rid] - 0.4), 0.92, 0.8, fill=False, lw=1.6, edgecolor=PREEMPT_COLOR
                    )
                )
        done |= set(rec.finished)
    ax.set_xlim(0, len(history))
    every = max(1, len(history) // 20)
    ax.set_xticks(
        [i + 0.46 for i in range(0, len(history), every)],
        [str(i + 1) for i in range(0, len(history), every)],
        fontsize=8,
    )
    ax.grid(False)
    ax.set_ylim(-0.6, len(request_ids) - 0.4)
    ax.set_yticks(range(len(request_ids)), [f"req {r}" for r in reversed(request_ids)], fontsize=9)
    ax.set_xlabel("engine step")
    handles = [Patch(color=KIND_COLORS[k], label=KIND_NAMES[k]) for k in KIND_COLORS] + [
        Patch(color=WAIT_COLOR, label="waiting"),
        Patch(fill=False, edgecolor=PREEMPT_COLOR, lw=1.6, label="preempted"),
    ]
    fig.legend(handles=handles, fontsize=8, ncol=5, loc="outside lower center", frameon=False)
    ax.spines[["top", "right"]].set_visible(False)
    return fig
