"""Figures of chapter 9: what one engine step batches, and a run's step timeline.

Both take :class:`cpbook.engine.engine.StepRecord` lists from a real run (``Engine.history``).
"""

from __future__ import annotations

from typing import Mapping, Sequence

from matplotlib.patches import Patch, Rectangle

from cpbook.viz.style import PALETTE, figure, ink

__all__ = [
    "KIND_COLORS",
    "KIND_LETTERS",
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


#: the letter written in a timeline cell, so a cell reads without its colour
KIND_LETTERS = {"prefill": "P", "chunked_prefill": "C", "decode": "D"}


def timeline_figure(
    history: Sequence, request_ids: Sequence[str], arrivals: Mapping[str, int] | None = None
):
    """Requests (rows) by steps (columns): the kind of work each request got in each step
    (coloured and lettered, :data:`KIND_LETTERS`), waiting (light grey), preempted (red
    outline); a request enters the chart at its arrival step (``arrivals``, default 1) and
    leaves it when it finishes.  Cells are at least 0.3 in square at the text column's width."""
    n_req = len(request_ids)
    fig, ax = figure(figsize=(_WIDTH, 1.3 + 0.42 * n_req), layout="constrained")
    row = {rid: n_req - 1 - i for i, rid in enumerate(request_ids)}
    done: set[str] = set()
    for rec in history:
        x = rec.step - 1
        ran = {c[0]: c for c in rec.chunks}
        for rid in request_ids:
            if rid in done or rec.step < (arrivals or {}).get(rid, 1):
                continue
            kind = ran[rid][1] if rid in ran else None
            color = KIND_COLORS[kind] if kind else WAIT_COLOR
            ax.add_patch(Rectangle((x, row[rid] - 0.42), 0.92, 0.84, color=color, lw=0))
            if kind:
                ax.text(
                    x + 0.46,
                    row[rid],
                    KIND_LETTERS[kind],
                    ha="center",
                    va="center",
                    fontsize=9,
                    color=ink(color),
                )
            if rid in rec.preempted:
                ax.add_patch(
                    Rectangle(
                        (x, row[rid] - 0.42),
                        0.92,
                        0.84,
                        fill=False,
                        lw=2.2,
                        edgecolor=PREEMPT_COLOR,
                    )
                )
        done |= set(rec.finished)
    ax.set_xlim(0, len(history))
    every = max(1, len(history) // 25)
    ax.set_xticks(
        [i + 0.46 for i in range(0, len(history), every)],
        [str(i + 1) for i in range(0, len(history), every)],
        fontsize=10,
    )
    ax.grid(False)
    ax.set_ylim(-0.6, n_req - 0.4)
    ax.set_yticks(range(n_req), [f"req {r}" for r in reversed(request_ids)], fontsize=10.5)
    ax.set_xlabel("engine step", fontsize=10.5)
    handles = [
        Patch(color=KIND_COLORS[k], label=f"{KIND_LETTERS[k]} {KIND_NAMES[k]}") for k in KIND_COLORS
    ] + [
        Patch(color=WAIT_COLOR, label="waiting"),
        Patch(fill=False, edgecolor=PREEMPT_COLOR, lw=2.2, label="preempted"),
    ]
    fig.legend(handles=handles, fontsize=9.5, ncol=3, loc="outside lower center", frameon=False)
    ax.spines[["top", "right", "left"]].set_visible(False)
    ax.tick_params(axis="y", length=0)
    return fig
