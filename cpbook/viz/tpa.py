"""Figures of chapter 6: the decode block with and without TPA, the measured per-step times,
the modelled per-layer times on 8×H200 and the break-even's sensitivity to each assumption.

Every function draws from numbers the chapter computed (shapes and traces of real runs, the
stored benchmark, :mod:`cpbook.costmodel`) and returns the ``Figure``.
"""

from __future__ import annotations

import math
from dataclasses import fields, replace
from typing import Any, Callable, Mapping, Sequence

from matplotlib.patches import FancyBboxPatch
from matplotlib.ticker import FuncFormatter, NullLocator

from cpbook import costmodel as cm
from cpbook.viz.style import PALETTE, figure, legible, plain_label, tokens_label

__all__ = [
    "tpa_dataflow",
    "measured_decode",
    "modelled_decode",
    "break_even_sensitivity",
    "alpha_break_even",
]

MODE_STYLE = {  # mode -> (label, colour, marker)
    "no_cp": ("no CP (TP only)", PALETTE[7], "o"),
    "dcp": ("DCP, standard", PALETTE[5], "s"),
    "dcp_tpa": ("DCP + TPA", PALETTE[0], "^"),
}
ARTICLE = {131072: "128K", 4096: "4K"}
_COMPUTE, _COLLECTIVE, _NONE = "#DCEBF7", "#FBE3C4", "#F2F2F2"
_PLAIN = FuncFormatter(plain_label)  # 20, not 2 x 10^1
_PLAIN_25 = FuncFormatter(lambda v, _p: plain_label(v) if plain_label(v)[0] in "25" else "")
_KNOB_FIELDS = {f.name for f in fields(cm.CostKnobs)}


def _log_tokens(axis, ticks: Sequence[int]) -> None:
    axis.set_ticks(list(ticks), [tokens_label(t) for t in ticks])
    axis.set_minor_locator(NullLocator())


def _box(ax, x, y, w, h, color, text, dashed=False):
    ax.add_patch(
        FancyBboxPatch(
            (x, y),
            w,
            h,
            boxstyle="round,pad=0.02,rounding_size=0.08",
            facecolor=color,
            edgecolor="#999999" if dashed else "#555555",
            lw=0.8,
            ls="--" if dashed else "-",
        )
    )
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=10.5, linespacing=1.3)


def tpa_dataflow(std: Mapping[str, Any], tpa: Mapping[str, Any], tp: int, dcp: int):
    """The block on one rank, standard DCP (left) and TPA (right), from two real runs.

    ``std`` / ``tpa`` are rank 0's :func:`cpbook.demos.ch06_tpa.tpa_rank` results (same
    problem, the two modes); shapes and traced bytes are printed in the boxes.  Drawn for a page
    column about 7 inches wide: data units are roughly inches.
    """
    s, t = std["shapes"], tpa["shapes"]
    h, nh = s["q_proj"][1], s["q_gathered"][1]
    ag_q = std["comm"][0][1]
    lse, rs, ar = (n for _, n in std["comm"][1:])
    extra = tpa["costs"]["extra_weight_bytes"]

    def shape(x: Sequence[int]) -> str:
        return "(" + ", ".join(map(str, x)) + ")"

    combine = f"combine: AG LSE + RS\n→ {shape(s['attn_out'])}, sends {lse + rs:,} B"
    o_proj = f"o_proj + AllReduce over TP\n→ {shape(s['o_proj'])}, sends {ar:,} B"
    attend = f"attention: {nh} heads,\nlocal 1/{dcp} of the tokens"
    rows = [
        (
            f"q_proj: TP shard, {h} heads\n→ {shape(s['q_proj'])}",
            f"q_proj: TP/DCP shard, {nh} heads\n→ {shape(t['q_proj'])}",
            _COMPUTE,
        ),
        (
            f"AllGather Q over DCP, transpose\n→ {shape(s['q_gathered'])}, sends {ag_q:,} B",
            "no collective:\nthe heads are already local",
            _COLLECTIVE,
        ),
        (attend, attend, _COMPUTE),
        (combine, combine, _COLLECTIVE),
        (o_proj, o_proj, _COLLECTIVE),
    ]
    fig, ax = figure(figsize=(7.2, 6.3))
    w, bh, pitch, x_right = 3.25, 0.72, 1.02, 3.65
    top = len(rows) * pitch
    for i, (left, right, color) in enumerate(rows):
        y = top - (i + 1) * pitch
        _box(ax, 0, y, w, bh, color, left)
        _box(ax, x_right, y, w, bh, _NONE if i == 1 else color, right, dashed=i == 1)
        if i:
            for x in (w / 2, x_right + w / 2):
                ax.annotate(
                    "",
                    (x, y + bh + 0.02),
                    (x, y + pitch - 0.02),
                    arrowprops={"arrowstyle": "->", "color": "#555555", "lw": 1},
                )
    for x, title in ((w / 2, "standard DCP"), (x_right + w / 2, "TPA (query replication)")):
        ax.text(x, top + 0.12, title, ha="center", fontsize=11.5, weight="bold")
    notes = (
        (w / 2, f"rank 0 of TP = {tp}, DCP = {dcp};\nshapes (batch, heads, width)"),
        (x_right + w / 2, f"pays {dcp}x the q_proj weights\nand FLOPs (+{extra:,} B here)"),
    )
    for x, note in notes:
        ax.text(x, -0.12, note, ha="center", va="top", fontsize=10.5, style="italic")
    ax.set_xlim(-0.05, x_right + w + 0.05)
    ax.set_ylim(-0.75, top + 0.42)
    ax.axis("off")
    return legible(fig)


def _break_even_marks(ax, xs: Mapping[str, float | None], top: bool = False) -> None:
    """Dotted verticals at each mode's break-even, labelled at the bottom (or ``top``) of the
    panel: the smaller one to its left, the larger to its right, so the labels never meet."""
    marks = sorted((x, m) for m, x in xs.items() if x and math.isfinite(x))
    for j, (x, mode) in enumerate(marks):
        right = j == len(marks) - 1 and len(marks) > 1
        color = MODE_STYLE[mode][1]
        ax.axvline(x, color=color, ls=":", lw=1.5)
        ax.text(
            x * (1.1 if right else 1 / 1.1),
            0.97 if top else 0.03,
            f"break-even\n{tokens_label(x)}",
            transform=ax.get_xaxis_transform(),
            ha="left" if right else "right",
            va="top" if top else "bottom",
            fontsize=10,
            color=color,
        )


def measured_decode(records: Sequence[Mapping[str, Any]]):
    """Stored ``bench/decode_step.py`` lines: ms per step against context, one panel per
    world size (stacked), with the benchmark's own break-even points."""
    steps = [r for r in records if r["name"] == "decode_step"]
    evens = {r["ranks"]: r for r in records if r["name"] == "decode_break_even"}
    worlds = sorted({r["ranks"] for r in steps})
    fig, axes = figure(len(worlds), 1, figsize=(7.2, 4.2 * len(worlds)), squeeze=False)
    for ax, n in zip(axes[:, 0], worlds):
        rows = sorted((r for r in steps if r["ranks"] == n), key=lambda r: r["context"])
        ctx = [r["context"] for r in rows]
        for mode, (label, color, marker) in MODE_STYLE.items():
            ax.plot(ctx, [r[f"{mode}_ms"] for r in rows], marker=marker, color=color, label=label)
        marks = {m: evens.get(n, {}).get(f"{m}_tokens") for m in ("dcp", "dcp_tpa")}
        _break_even_marks(ax, marks, top=True)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(_PLAIN)
        ax.yaxis.set_minor_formatter(_PLAIN_25)
        _log_tokens(ax.xaxis, ctx)
        ax.set_xlabel("context (tokens of the request)")
        ax.set_ylabel("ms per decode step\n(slowest rank)")
        ax.set_title(f"{n} ranks, gloo, one attention block")
        ax.legend(loc="lower right", fontsize=10)
    return legible(fig)


def modelled_decode(
    model: cm.ModelSpec,
    gpu: cm.GPUSpec,
    contexts: Sequence[int],
    bars_at: Sequence[int] = (4096, 262144),
    **kwargs: Any,
):
    """Top: :func:`cpbook.costmodel.decode_layer_time` per mode against context, with the
    break-even points.  Bottom: its three parts at two contexts (linear scale)."""
    fig, (a, b) = figure(2, 1, figsize=(7.2, 7.8), gridspec_kw={"height_ratios": [1.1, 1]})
    for mode, (label, color, marker) in MODE_STYLE.items():
        us = [1e6 * cm.decode_layer_time(model, gpu, c, mode, **kwargs).total_s for c in contexts]
        a.plot(contexts, us, color=color, label=label, marker=marker, markevery=2, ms=5)
    _break_even_marks(
        a, {m: cm.decode_break_even(model, gpu, m, **kwargs) for m in ("dcp", "dcp_tpa")}
    )
    a.set_xscale("log")
    a.set_yscale("log")
    a.yaxis.set_major_formatter(_PLAIN)
    a.yaxis.set_minor_formatter(_PLAIN_25)
    _log_tokens(a.xaxis, [c for c in contexts if math.log2(c) % 2 == 0])
    a.set_xlabel("context (tokens per request)")
    a.set_ylabel("µs per layer and step")
    a.set_title("Modelled attention time of one layer")
    a.legend(loc="upper left", fontsize=10)
    parts = [
        ("kv_read_s", "KV read (HBM)", PALETTE[4]),
        ("comm_s", "collectives", PALETTE[1]),
        ("q_proj_extra_s", "extra q_proj", PALETTE[3]),
        ("w_uk_t_extra_s", "extra W_UK_T", PALETTE[2]),
    ]
    labels = []
    for i, (c, mode) in enumerate((c, m) for c in bars_at for m in MODE_STYLE):
        t = cm.decode_layer_time(model, gpu, c, mode, **kwargs)
        left = 0.0
        for attr, name, color in parts:
            v = 1e6 * getattr(t, attr)
            b.barh(i, v, left=left, color=color, label=name if i == 0 else None, edgecolor="white")
            left += v
        b.text(left + 1, i, f"{left:.0f}", va="center", fontsize=10)
        labels.append(f"{tokens_label(c)}: {MODE_STYLE[mode][0]}")
    b.set_yticks(range(len(labels)), labels, fontsize=10)
    b.set_ylim(len(labels) - 0.5, -1.5)
    b.set_xlabel("µs per layer and step")
    b.grid(axis="y", visible=False)
    b.legend(loc="upper center", fontsize=10, ncol=4, bbox_to_anchor=(0.5, 1.0))
    b.set_title("Where the time goes")
    return legible(fig)


def _article_lines(ax, labelled: bool) -> None:
    """Dashed lines at 128K and 4K on a log token axis."""
    for y, text in ARTICLE.items():
        ax.axhline(y, color="#777777", ls="--", lw=1)
        if labelled:
            below = y > 8192
            ax.text(
                0.97,
                y / 1.2 if below else y * 1.2,
                text,
                transform=ax.get_yaxis_transform(),
                ha="right",
                va="top" if below else "bottom",
                fontsize=10,
                color="#555555",
            )
    ax.set_yscale("log")
    ticks = [1024, 4096, 16384, 65536, 262144, 2**20, 2**22]
    ax.set_yticks(ticks, [tokens_label(t) for t in ticks])
    ax.yaxis.set_minor_locator(NullLocator())


def _sweep(
    ax,
    xs,
    fn: Callable[[Any], Mapping[str, Any]],
    model,
    gpu,
    xlabel,
    base_x,
    ticks=None,
    fmt=None,
    labelled=False,
) -> None:
    """Both DCP variants' break-even over ``xs`` (``fn(x)``: the decode-model keywords)."""
    for mode in ("dcp", "dcp_tpa"):
        label, color, marker = MODE_STYLE[mode]
        ys = [cm.decode_break_even(model, gpu, mode, **fn(x)) for x in xs]
        ax.plot(xs, ys, color=color, marker=marker, ms=4, label=label)
    _article_lines(ax, labelled)
    ax.axvline(base_x, color="#BBBBBB", lw=5, alpha=0.6, zorder=0)
    if ticks is not None:
        ax.set_xscale("log")
        ax.set_xticks(ticks)
        ax.xaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_major_formatter(FuncFormatter(fmt or plain_label))
    ax.set_xlabel(xlabel)


def break_even_sensitivity(model: cm.ModelSpec, gpu: cm.GPUSpec, base: Mapping[str, Any]):
    """Break-even context of DCP and DCP + TPA against one assumption at a time, the others at
    ``base`` (keyword arguments of :func:`cpbook.costmodel.decode_layer_time`, ``knobs``
    included: a :class:`~cpbook.costmodel.knobs.CostKnobs` whose ``link`` is the base link);
    the grey band marks the base value, dashed lines at 128K and 4K."""
    knobs: cm.CostKnobs = base.get("knobs", cm.CostKnobs())
    link: cm.LinkSpec = knobs.link or cm.LINKS["NVLink4"]
    fig, axes = figure(3, 2, figsize=(7.2, 9.0), sharey=True)
    (a, b), (c, d), (e, f) = axes

    def kw(**over: Any) -> dict[str, Any]:
        """``base`` with ``over``; the knob fields among ``over`` go into ``knobs``."""
        knob = {k: over.pop(k) for k in list(over) if k in _KNOB_FIELDS}
        return {**base, **over, "knobs": replace(knobs, **knob)}

    def with_link(alpha: float | None = None, bw: float | None = None) -> cm.LinkSpec:
        return cm.LinkSpec(
            link.name,
            link.alpha_s if alpha is None else alpha,
            link.bw_bytes_per_s if bw is None else bw,
            link.source,
        )

    alphas = [x * 1e-6 for x in (0.5, 1, 2, 4, 8, 15, 30)]
    _sweep(
        a,
        alphas,
        lambda x: kw(link=with_link(alpha=x)),
        model,
        gpu,
        "α per collective (µs)",
        link.alpha_s,
        ticks=[x * 1e-6 for x in (0.5, 2, 8, 30)],
        fmt=lambda v, _p: f"{v * 1e6:g}",
        labelled=True,
    )
    _sweep(
        b,
        [1, 2, 4, 8, 16, 32, 64, 128],
        lambda x: kw(num_reqs=x),
        model,
        gpu,
        "batch (requests decoding together)",
        base.get("num_reqs", 1),
        ticks=[1, 4, 16, 64],
    )
    _sweep(
        c,
        [0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0],
        lambda x: kw(hbm_efficiency=x),
        model,
        gpu,
        "HBM efficiency η of the KV read",
        knobs.hbm_efficiency,
        labelled=True,
    )
    _sweep(
        d,
        [x * 1e9 for x in (50, 100, 200, 450, 900)],
        lambda x: kw(link=with_link(bw=x)),
        model,
        gpu,
        "link bandwidth β (GB/s per direction)",
        link.bw_bytes_per_s,
        ticks=[x * 1e9 for x in (50, 200, 900)],
        fmt=lambda v, _p: f"{v / 1e9:g}",
    )
    _sweep(
        e,
        [2, 4, 8],
        lambda x: kw(dcp=x),
        model,
        gpu,
        "DCP size N (TP = 8)",
        base.get("dcp", 8),
        ticks=[2, 4, 8],
        labelled=True,
    )
    cats = [("bf16", "ag_rs"), ("bf16", "a2a"), ("fp8", "ag_rs"), ("fp8", "a2a")]
    for mode in ("dcp", "dcp_tpa"):
        label, color, marker = MODE_STYLE[mode]
        ys = [
            cm.decode_break_even(model, gpu, mode, **kw(kv_dtype=k, dcp_comm_backend=bk))
            for k, bk in cats
        ]
        f.plot(range(len(cats)), ys, color=color, marker=marker, ls="none", ms=8)
    _article_lines(f, False)
    f.set_xticks(range(len(cats)), [f"{k}\n{bk}" for k, bk in cats])
    f.set_xlim(-0.5, len(cats) - 0.5)
    f.set_xlabel("KV dtype and combine backend")
    for ax in (a, c, e):
        ax.set_ylabel("break-even context")
    a.set_ylim(700, 6 * 2**20)
    b.legend(loc="upper right", fontsize=10)
    return legible(fig)


def alpha_break_even(
    model: cm.ModelSpec,
    gpu: cm.GPUSpec,
    link: cm.LinkSpec,
    measured: Mapping[str, Mapping[int, float]],
    alphas: Sequence[float],
    num_reqs: Sequence[int] = (1,),
):
    """Break-even context of DCP and DCP + TPA against the latency α of one collective
    (``alphas`` in seconds, the link's bandwidth kept), for each batch of ``num_reqs``.  The
    measured all-reduces (``measured[kind][group size]``, seconds, converted to α by
    :func:`cpbook.costmodel.alpha_from_allreduce` at the benchmark's size) are marked on the
    DCP curve of the first batch: NCCL filled, the custom all-reduce DCP does not use hollow.
    The dashed line marks 128K, the grey band the model's base α."""
    fig, ax = figure(figsize=(7.2, 4.6))

    def at(mode: str, alpha: float, b: int) -> float:
        lk = cm.LinkSpec(link.name, alpha, link.bw_bytes_per_s, link.source)
        return cm.decode_break_even(model, gpu, mode, num_reqs=b, knobs=cm.CostKnobs(link=lk))

    us = [a * 1e6 for a in alphas]
    for j, b in enumerate(num_reqs):
        for mode in ("dcp", "dcp_tpa"):
            label, color, _ = MODE_STYLE[mode]
            ys = [at(mode, a, b) / 1024 for a in alphas]
            name = f"{label}, batch {b}" if len(num_reqs) > 1 else label
            ax.plot(us, ys, color=color, ls=("-", "--", ":")[j % 3], label=name)
    ax.axhline(131072 / 1024, color="#777777", ls="--", lw=1)
    ax.text(us[0], 131072 / 1024 * 1.03, "128K", fontsize=10, color="#555555")
    ax.axvline(link.alpha_s * 1e6, color="#BBBBBB", lw=5, alpha=0.6, zorder=0)
    for kind, points in measured.items():
        nccl = kind == "pynccl"
        for n, seconds in points.items():
            a = cm.alpha_from_allreduce(seconds, n, cm.ALLREDUCE_BENCH_BYTES, link)
            y = at("dcp", a, num_reqs[0]) / 1024
            face = MODE_STYLE["dcp"][1] if nccl else "white"
            ax.plot(a * 1e6, y, "o", ms=8, mfc=face, mec=MODE_STYLE["dcp"][1], mew=1.5)
            tag = f"{'NCCL' if nccl else 'custom AR'} {n} GPUs"
            ax.annotate(
                tag, (a * 1e6, y), (6, -14 if nccl else 6), textcoords="offset points", fontsize=9
            )
    ax.set_xlabel("α, latency of one collective (µs)")
    ax.set_ylabel("break-even context (K tokens)")
    ax.set_xlim(min(us), max(us))
    ax.set_ylim(0, None)
    ax.legend(loc="upper left", fontsize=10)
    ax.set_title(f"Break-even against α: {model.name}, 8 x {gpu.name}")
    return legible(fig)
