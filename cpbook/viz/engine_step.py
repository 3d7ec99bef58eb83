"""Chapter 9's figure of one engine step across the ranks of a TP × DCP grid.

Drawn from :func:`cpbook.demos.ch09_engine.engine_step_rank`'s per-rank results: the
scheduler's batch (the step record every rank shares), each rank's slot mapping of the new
tokens, the keys each rank attends, the step's traced collectives, and the sampled tokens.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from matplotlib.patches import Rectangle

from cpbook.viz.style import figure, rank_color

__all__ = ["STAGES", "comm_totals", "engine_step_figure"]

#: the four per-rank stages, left to right (the scheduler's batch is the title row)
STAGES = (
    "② slot mapping",
    "③ attention,\nown keys",
    "④ LSE merge, TP sums\n(bytes sent, traced)",
    "⑤ sampled",
)
_EMPTY = "#F2F2F2"
_OPS = {"all_gather": "AllGather", "reduce_scatter": "ReduceScatter", "all_reduce": "AllReduce"}


def comm_totals(comm: Sequence[tuple[str, str, int]]) -> dict[tuple[str, str], tuple[int, int]]:
    """``(op, group) -> (calls, bytes sent)`` of one rank's traced step, in first-call order."""
    out: dict[tuple[str, str], tuple[int, int]] = {}
    for op, group, sent in comm:
        calls, total = out.get((op, group), (0, 0))
        out[(op, group)] = (calls + 1, total + sent)
    return out


def engine_step_figure(results: Sequence[Mapping[str, Any]]):
    """One row per rank: which of the step's new tokens it stores (its slot mapping: a filled
    cell is a slot on this rank, an empty one ``-1``), how many keys of each request it attends,
    the bytes it sends per collective (from its trace), and the tokens it samples.  Data units
    are inches of the 7.6 in wide figure."""
    rec = results[0]["record"]
    batch = " + ".join(
        f"req {rid} {kind.replace('_', ' ')} "
        + (f"(position {start})" if n == 1 else f"(positions {start}–{start + n - 1})")
        for rid, kind, start, n in rec.chunks
    )
    row_h, head = 0.95, 0.6
    height = head + row_h * len(results)
    fig, ax = figure(figsize=(7.6, height + 0.75))
    xs = (1.15, 3.1, 4.75, 6.9)  # left edge of each stage column
    w_slots, w_bar = 1.8, 0.45
    for x, name in zip(xs, STAGES):
        ax.text(x, height - 0.05, name, fontsize=10.5, weight="bold", va="top")
    for i, res in enumerate(results):
        y = height - head - (i + 1) * row_h  # bottom of this rank's row
        tp_rank, dcp_rank = res["coords"]
        color = rank_color(dcp_rank)
        h0, h1 = res["heads"]
        ax.text(
            1.0,
            y + row_h / 2,
            f"rank {i}\ntp {tp_rank}, dcp {dcp_rank}\nq heads {h0}–{h1 - 1}",
            ha="right",
            va="center",
            fontsize=9.5,
        )
        # ② slot mapping: one cell per new token of the step, filled where this rank stores it
        cells = [(k, s) for k, c in enumerate(res["chunks"]) for s in c["slots"]]
        gap = 0.08  # between two requests' tokens
        w = (w_slots - gap * (len(res["chunks"]) - 1)) / max(1, len(cells))
        for j, (k, slot) in enumerate(cells):
            ax.add_patch(
                Rectangle(
                    (xs[0] + j * w + k * gap, y + 0.45),
                    w,
                    0.3,
                    facecolor=color if slot >= 0 else _EMPTY,
                    edgecolor="#555555",
                    lw=0.4,
                )
            )
        labels = []
        for c in res["chunks"]:
            mine = [s for s in c["slots"] if s >= 0]
            span = "—" if not mine else str(mine[0]) if len(mine) == 1 else f"{mine[0]}–{mine[-1]}"
            labels.append(f"req {c['request_id']}: {span}")
        ax.text(xs[0], y + 0.38, "slots " + ", ".join(labels), fontsize=9, va="top")
        # ③ attention: the share of each request's keys on this rank
        bh = 0.7 / len(res["chunks"])
        for k, c in enumerate(res["chunks"]):
            yy = y + 0.82 - (k + 1) * bh
            frac = c["local_keys"] / c["keys"]
            ax.add_patch(Rectangle((xs[1], yy + 0.04), w_bar, bh - 0.08, facecolor=_EMPTY))
            ax.add_patch(Rectangle((xs[1], yy + 0.04), w_bar * frac, bh - 0.08, facecolor=color))
            ax.text(
                xs[1] + w_bar + 0.07,
                yy + bh / 2,
                f"req {c['request_id']}: {c['local_keys']}/{c['keys']}",
                fontsize=9,
                va="center",
            )
        # ④ the step's collectives, from the trace
        lines = [
            f"{_OPS.get(op, op)} {group} ×{calls}: {sent:,} B"
            for (op, group), (calls, sent) in comm_totals(res["comm"]).items()
        ]
        ax.text(xs[2], y + 0.82, "\n".join(lines), fontsize=8.5, va="top", family="monospace")
        # ⑤ sampling
        sampled = "\n".join(f"req {r} → {t}" for r, t in res["sampled"].items()) or "—"
        ax.text(xs[3], y + 0.82, sampled, fontsize=9.5, va="top")
        if i:
            ax.plot([0.1, 7.55], [y + row_h] * 2, color="#CCCCCC", lw=0.6)
    ax.set_xlim(0, 7.6)
    ax.set_ylim(0, height)
    ax.axis("off")
    ax.set_title(
        f"① scheduler, step {rec.step}: {rec.num_batched_tokens} tokens, the same batch on "
        f"every rank\n{batch}",
        fontsize=10.5,
        loc="left",
    )
    return fig
