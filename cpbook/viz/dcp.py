"""Figures of chapter 3: the GQA decode data flow, the two combines' traffic, MLA's
``reorg_kvcache`` workspace, and the move-Q / move-KV crossover.  Every function draws from
numbers the chapter computed (shapes and traces of real runs) and returns the ``Figure``."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from matplotlib.patches import Rectangle
from matplotlib.ticker import NullLocator

from cpbook.core.comm import comm_bytes
from cpbook.viz.style import PALETTE, figure, ink, rank_color

__all__ = ["gqa_dataflow", "combine_traffic", "reorg_layout", "move_q_or_kv"]

_EMPTY = "#F2F2F2"


def _cell(ax, x, y, w, h, color, hatch=None, alpha=1.0, text=None, fs=10.5):
    ax.add_patch(
        Rectangle(
            (x, y), w, h, facecolor=color, edgecolor="#555555", lw=0.6, hatch=hatch, alpha=alpha
        )
    )
    if text is not None:
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fs, color=ink(color))


def _plain_log_axis(axis, ticks: Sequence[int]) -> None:
    """Log scale with the given ticks written as plain numbers (1K, 1M for large ones)."""

    def name(t: int) -> str:
        return (
            f"{t // 10**6}M"
            if t >= 10**6 and t % 10**6 == 0
            else f"{t // 1000}K"
            if t >= 10**4 and t % 1000 == 0
            else str(t)
        )

    axis.set_ticks(list(ticks), [name(t) for t in ticks])
    axis.set_minor_locator(NullLocator())


def gqa_dataflow(results: Sequence[Mapping[str, Any]], group: Sequence[int], seq_len: int):
    """The decode step of one DCP group, one column per rank, from a real run's results.

    ``results[r]`` is :func:`cpbook.demos.ch03_decode.gqa_decode_rank`'s dict for global rank
    ``r`` (one request of ``seq_len`` tokens); ``group`` lists the DCP group's global ranks.
    Drawn for a page about 7.5 inches wide: data units are roughly inches.
    """
    n = len(group)
    h = results[group[0]]["shapes"]["q"][1]
    span, gap = 6.2, 0.3  # width of all columns, gap between two
    w_col = (span - gap * (n - 1)) / n
    bh, pitch = 0.34, 1.2  # box height, distance between stages
    names = ["Q: own heads", "AllGather Q", "local KV shard", "partial O', LSE", "combined O"]
    ys = [(len(names) - 1 - i) * pitch for i in range(len(names))]  # bottom of each row
    steps = {
        0: "\u2460 AllGather Q: every rank gets the group's N\u00b7h query heads",
        2: "\u2461 each rank attends its local shard with all N\u00b7h heads",
        3: "\u2462 combine: AllGather LSE + ReduceScatter (ag_rs), or one All2All (a2a)",
        1: "the KV cache does not move: each rank reads only its own shard",
    }
    top = ys[0] + bh + 0.55
    fig, ax = figure(figsize=(7.6, 0.95 * (top + 0.55)))
    mono = {"ha": "center", "va": "top", "fontsize": 10.5, "family": "monospace"}
    for c, r in enumerate(group):
        res, x0 = results[r], c * (w_col + gap)
        s = res["shapes"]
        hw = w_col / (n * h)
        for j in range(n * h):  # head slots of the whole group
            owner = j // h
            mine = owner == c
            _cell(ax, x0 + j * hw, ys[0], hw, bh, rank_color(group[owner]) if mine else _EMPTY)
            _cell(ax, x0 + j * hw, ys[1], hw, bh, rank_color(group[owner]))
            _cell(ax, x0 + j * hw, ys[3], hw, bh, rank_color(group[c]), hatch="///", alpha=0.45)
        own = [int(p) for p in res["positions"][0]]
        tw = w_col / seq_len
        for t in range(seq_len):
            _cell(ax, x0 + t * tw, ys[2], tw, bh, rank_color(group[c]) if t in own else _EMPTY)
        for j in range(h):
            _cell(ax, x0 + (c * h + j) * hw, ys[4], hw, bh, rank_color(group[c]))
        ax.text(
            x0 + w_col / 2,
            top - 0.25,
            f"rank {r} (dcp rank {c})",
            ha="center",
            va="center",
            fontsize=11,
            weight="bold",
        )
        labels = [
            f"{s['q']}",
            f"{s['q_gathered']}",
            f"{s['kv_local'][0]}\n{len(own)} of {seq_len} tokens",
            f"{s['out_partial']}\n+ LSE {s['lse']}",
            f"{s['out']}",
        ]
        for y, lab in zip(ys, labels):
            ax.text(x0 + w_col / 2, y - 0.05, lab, **mono)
    for name, y in zip(names, ys):
        ax.text(-0.15, y + bh / 2, name, ha="right", va="center", fontsize=11)
    for i, step in steps.items():
        y = ys[i + 1] + bh + 0.14
        ax.text(
            0,
            y,
            step,
            ha="left",
            va="bottom",
            fontsize=10.5,
            color="#333333" if i != 1 else "#777777",
            style="italic",
        )
    ax.set_xlim(-1.35, span + 0.05)
    ax.set_ylim(-0.45, top)
    ax.axis("off")
    ax.set_title(
        "One GQA decode step in a DCP group: query heads travel, KV stays\n"
        f"(shapes from the run, one request of {seq_len} tokens;\n"
        "the other DCP group does the same on its own KV head)",
        fontsize=11.5,
    )
    return fig


def combine_traffic(
    step_bytes: Mapping[str, Sequence[tuple[str, int]]],
    contexts: Sequence[int],
    sweep: Mapping[str, Sequence[int]],
    kv_bytes: Sequence[int],
):
    """Top: bytes one rank sends per step, call by call, per combine.  Bottom: those totals
    and the rank's KV-cache bytes against the context length."""
    fig, (a, b) = figure(2, 1, figsize=(7.4, 6.0), gridspec_kw={"height_ratios": [1, 1.4]})
    colors = {
        "AllGather Q": PALETTE[4],
        "AllGather LSE": PALETTE[6],
        "ReduceScatter": PALETTE[2],
        "All2All": PALETTE[1],
    }
    width = max(comm_bytes(c) for c in step_bytes.values()) * 1.3
    for i, (backend, calls) in enumerate(step_bytes.items()):
        left = 0
        for j, (op, nbytes) in enumerate(calls):
            label = {
                "all_gather": "AllGather LSE" if j else "AllGather Q",
                "reduce_scatter": "ReduceScatter",
                "all_to_all": "All2All",
            }[op]
            a.barh(i, nbytes, left=left, height=0.55, color=colors[label], edgecolor="white")
            narrow = nbytes < 0.12 * width
            a.text(
                left + nbytes / 2,
                i + (0.34 if narrow else 0),
                f"{label}\n{nbytes:,} B",
                ha="center",
                va="top" if narrow else "center",
                fontsize=10.5,
                color=ink(colors[label]) if not narrow else "black",
            )
            left += nbytes
        a.text(
            left + 0.02 * width, i, f"{left:,} B\n{len(calls)} calls", va="center", fontsize=10.5
        )
    a.set_yticks(range(len(step_bytes)), list(step_bytes))
    a.set_ylim(-0.45, len(step_bytes) - 0.5)
    a.invert_yaxis()
    a.set_xlabel("bytes one rank sends per decode step and layer")
    a.set_xlim(0, width)
    a.grid(axis="y", visible=False)
    a.set_title("What each combine moves")
    for j, (backend, totals) in enumerate(sweep.items()):
        b.plot(
            contexts, totals, marker="o", color=PALETTE[j], label=f"{backend}: bytes sent per step"
        )
        b.annotate(
            f"{totals[-1]:,} B",
            (contexts[-1], totals[-1]),
            textcoords="offset points",
            xytext=(8, 4 if j == 0 else -11),
            fontsize=10.5,
            color=PALETTE[j],
        )
    b.plot(contexts, kv_bytes, marker="s", color=PALETTE[5], label="KV cache bytes this rank reads")
    b.set_xscale("log")
    b.set_yscale("log")
    _plain_log_axis(b.xaxis, contexts)
    b.set_xlim(contexts[0] / 1.5, contexts[-1] * 3)
    b.set_ylim(min(min(v) for v in sweep.values()) / 2, max(kv_bytes) * 2)
    b.set_xlabel("context length (tokens per request)")
    b.set_ylabel("bytes per rank")
    b.set_title("Traffic does not grow with the context")
    b.legend(fontsize=10.5, loc="upper left")
    return fig


def reorg_layout(
    owners: Sequence[Sequence[int]],
    gathered: Sequence[int],
    padded: Sequence[int],
    dcp: int,
    workspace: Sequence[int],
    cu: Sequence[int],
):
    """``reorg_kvcache`` on positions: the context (coloured by owner), the all-gathered padded
    buffer (``-1`` = padding; each rank pads request ``i`` to ``padded[i]`` rows), and the
    workspace, one contiguous run per request.  One cell is one unit; each row is titled above
    itself, so the cells can use the whole width of the page."""
    toks = sum(padded)
    width = max(len(gathered) + (dcp - 1) * 0.5, sum(map(len, owners)) + 1.5 * (len(owners) - 1))
    y = {"ctx": 6.4, "gath": 3.4, "ws": 0.0}
    fig, ax = figure(figsize=(7.6, 7.6 * 9.4 / (width + 0.4) + 0.6))
    gray = {"ha": "center", "va": "top", "fontsize": 10.5, "color": "#444444"}
    x = 0.0
    for i, own in enumerate(owners):  # request i's context, position p coloured by its owner
        for p, r in enumerate(own):
            _cell(ax, x + p, y["ctx"], 1, 1, rank_color(r), text=str(p), fs=10.5)
        ax.text(x + len(own) / 2, y["ctx"] - 0.15, f"request {i}: {len(own)} tokens", **gray)
        x += len(own) + 1.5
    for j, p in enumerate(gathered):
        r = j // toks
        _cell(
            ax,
            j + r * 0.5,
            y["gath"],
            1,
            1,
            _EMPTY if p < 0 else rank_color(r),
            hatch="xx" if p < 0 else None,
            text="" if p < 0 else str(p),
            fs=10.5,
        )
    for r in range(dcp):
        x0 = r * (toks + 0.5)
        for i, pad in enumerate(padded):
            start = x0 + sum(padded[:i])
            ax.text(start + pad / 2, y["gath"] - 0.15, f"req {i}", **gray)
        ax.text(
            x0 + toks / 2, y["gath"] - 0.75, f"from rank {r}", ha="center", va="top", fontsize=10.5
        )
    x = 0.0
    for i in range(len(cu) - 1):
        for j in range(cu[i], cu[i + 1]):
            p = workspace[j]
            _cell(ax, x + j - cu[i], y["ws"], 1, 1, rank_color(owners[i][p]), text=str(p), fs=10.5)
        ax.text(x + (cu[i + 1] - cu[i]) / 2, y["ws"] - 0.15, f"request {i}", **gray)
        x += cu[i + 1] - cu[i] + 1.5
    for name, yy in (
        ("context, coloured by the rank that owns each position", y["ctx"]),
        ("after the AllGather: rank-major, padded (xx) to rank 0's count", y["gath"]),
        ("workspace after reorg_kvcache: no padding, one run per request", y["ws"]),
    ):
        ax.text(0, yy + 1.25, name, ha="left", va="bottom", fontsize=11)
    ax.set_xlim(-0.2, width + 0.2)
    ax.set_ylim(-0.8, y["ctx"] + 2.1)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(
        "reorg_kvcache: drop the padding, keep each request contiguous\n"
        "(rank-major order, not re-interleaved)",
        fontsize=12,
    )
    return fig


def move_q_or_kv(
    contexts: Sequence[int],
    q_bytes: Mapping[int, int],
    kv_bytes: Sequence[int],
    kv_curve: Sequence[int],
    crossover: Mapping[int, int],
    query_tokens: Sequence[int],
    model_crossover: Mapping[str, Sequence[float]],
    marks: Mapping[int, str],
):
    """Top: bytes per rank of the tiny MLA, moving Q (one line per local head count) vs moving
    the latent context KV (measured at ``contexts``; ``kv_curve[L - contexts[0]]`` is the
    traced formula at every ``L``), measured crossovers marked.  Bottom: the crossover context
    length against the number of query tokens for real model shapes; ``marks`` labels points
    of the first model (query tokens -> text)."""
    fig, (a, b) = figure(2, 1, figsize=(7.4, 7.6))
    a.plot(
        range(contexts[0], contexts[0] + len(kv_curve)),
        kv_curve,
        drawstyle="steps-post",
        lw=1.2,
        color=PALETTE[5],
    )
    a.plot(
        contexts,
        kv_bytes,
        marker="s",
        ls="none",
        color=PALETTE[5],
        label="move the latent context KV",
    )
    for j, (h, qb) in enumerate(sorted(q_bytes.items())):
        a.axhline(
            qb,
            color=PALETTE[j],
            ls="--",
            lw=1.2,
            label=f"move Q, {h} head{'s' if h > 1 else ''} per rank",
        )
        a.plot([crossover[h]], [qb], marker="*", ms=11, color=PALETTE[j], zorder=5)
        # below the dashed line, right of the star: the staircase is above the line there
        a.annotate(
            f"L = {crossover[h]}",
            (crossover[h], qb),
            textcoords="offset points",
            xytext=(7, -5),
            ha="left",
            va="top",
            fontsize=10.5,
            color=PALETTE[j],
        )
    a.set_xscale("log")
    a.set_yscale("log")
    _plain_log_axis(a.xaxis, contexts)
    a.set_xlabel("context length L (tokens)")
    a.set_ylabel("bytes one rank sends,\none decode token")
    a.set_title("Tiny MLA, DCP = 4: measured (stars: first L where KV costs more)", fontsize=11.5)
    a.legend(fontsize=10.5, loc="upper left")
    first = next(iter(model_crossover.values()))
    for j, (name, xs) in enumerate(model_crossover.items()):
        b.plot(query_tokens, xs, color=PALETTE[j], marker="o", ms=3, label=name)
    for t, text in marks.items():
        x = first[list(query_tokens).index(t)]
        left = t > query_tokens[len(query_tokens) // 2]
        # right half: text up-left of the point; left half: text well above it, with a
        # leader line, clear of both curves (they rise to the right)
        b.annotate(
            text,
            (t, x),
            textcoords="offset points",
            xytext=(-8, 6) if left else (4, 34),
            fontsize=10.5,
            ha="right" if left else "left",
            va="bottom",
            arrowprops=None if left else {"arrowstyle": "-", "color": "#555555", "lw": 0.8},
        )
        b.plot([t], [x], marker="o", ms=6, color=PALETTE[0])
    b.set_xscale("log")
    b.set_yscale("log")
    _plain_log_axis(
        b.xaxis, [t for t in query_tokens if t in (1, 16, 256, 4096) or t == query_tokens[-1]]
    )
    _plain_log_axis(b.yaxis, [10**k for k in range(2, 8)])
    b.text(
        0.03,
        0.62,
        "above a line: moving Q is cheaper",
        transform=b.transAxes,
        fontsize=10.5,
        color="#333333",
    )
    b.text(
        0.97,
        0.08,
        "below: moving the latent KV is cheaper",
        transform=b.transAxes,
        fontsize=10.5,
        color="#333333",
        ha="right",
    )
    b.set_xlabel("query tokens per request (1 = decode)")
    b.set_ylabel("crossover context\nlength (tokens)")
    b.set_title("Real shapes, TP = DCP = 8, bf16 (formula)", fontsize=11.5)
    b.legend(fontsize=10.5, loc="upper left")
    return fig
