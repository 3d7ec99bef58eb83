"""The decision page's flowchart: what vLLM v0.34 lets each model family do, then the
planner's filters and ranking.

Both parts are drawn from the planner's own rules: the grid is
:func:`cpbook.planner.vllm_rules.rule_probes` for one model of each family (a probe accepted,
or the rule that rejects it), the pipeline is :data:`cpbook.planner.plan_space.DROP_RULES` in
the order :func:`~cpbook.planner.plan_space.estimate` applies them.
"""

from __future__ import annotations

import textwrap
from typing import Mapping

from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Rectangle

from cpbook import costmodel as cm
from cpbook.planner.plan_space import DROP_RULES
from cpbook.planner.vllm_rules import rule_probes
from cpbook.viz.style import BLUE, GREEN, ORANGE, VERMILLION, figure, ink, legible, tint

__all__ = ["decision_flowchart", "DROP_TEXT", "PROBE_TEXT", "RULE_TEXT"]

#: what each drop rule asks of a deployment, as a short question in the pipeline
DROP_TEXT = {
    "model-fits": "do the weights fit?",
    "holds-concurrency": "do the requests fit?",
    "ttft-target": "TTFT within target?",
    "tpot-target": "TPOT within target?",
}
#: each probe of :func:`rule_probes` as a short row label
PROBE_TEXT = {
    "DCP = TP = 8": "DCP 8 on TP 8",
    "DCP 2 on TP = 2 x KV heads": "DCP 2",
    "PCP 2": "PCP 2",
    "PCP 2 x DCP 2": "PCP 2 × DCP 2",
    "query replication (DCP 8)": "query replication",
    "EP over DP 8": "EP over DP 8",
}
#: the vLLM rule that rejects a probe, as a short phrase (the rule ids are in the page's table)
RULE_TEXT = {
    "gqa-dcp-needs-replicated-kv": "needs TP > KV heads",
    "gqa-dcp-within-replicas": "DCP > KV copies",
    "pcp-mla-only": "MLA only",
    "pcp-dcp-sparse-mla-only": "sparse MLA only",
    "tpa-gqa-unreleased": "not in v0.34",
    "ep-needs-moe": "no experts",
}


def _wrap(text: str, width: int) -> str:
    """``text`` wrapped at spaces only: never inside a word or at a hyphen."""
    return textwrap.fill(text, width, break_long_words=False, break_on_hyphens=False)


def _box(ax, x, y, w, h, text, color, fs=9.5) -> None:
    ax.add_patch(
        FancyBboxPatch(
            (x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.08", fc=color, ec="0.35"
        )
    )
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fs, color=ink(color))


def _arrow(ax, xy0, xy1, text: str = "") -> None:
    ax.add_patch(
        FancyArrowPatch(xy0, xy1, arrowstyle="-|>", mutation_scale=12, color="0.3", lw=1.2)
    )
    if text:
        mx, my = (xy0[0] + xy1[0]) / 2, (xy0[1] + xy1[1]) / 2
        ax.text(mx + 0.08, my, text, fontsize=8.5, va="center", color="0.25")


def decision_flowchart(families: Mapping[str, cm.ModelSpec]):
    """Top: one column per family (its label, e.g. ``"GQA, 8 KV heads"``), one row per probe
    of :func:`rule_probes`, green with a tick when vLLM v0.34 serves it, vermillion with the
    rejecting rule in a short phrase (:data:`RULE_TEXT`) when not.  Bottom: the planner's
    pipeline, every deployment through the drop rules (:data:`DROP_TEXT`) to the ranking and its
    two outcomes.  Few, large labels: legible on a phone.  Returns the ``Figure``."""
    probes = {label: rule_probes(m) for label, m in families.items()}
    names = list(next(iter(probes.values())))
    fs = 12.5
    fig, (top, bottom) = figure(2, 1, figsize=(6.4, 10.0), height_ratios=[len(names) + 1.4, 6])
    cw, rh, left = 1.0, 1.0, 1.9
    for j, label in enumerate(families):
        top.text(left + (j + 0.5) * cw, len(names) + 0.1, _wrap(label.replace(",", ""), 8),
                 ha="center", va="bottom", fontsize=fs)  # fmt: skip
    for i, name in enumerate(names):
        y = len(names) - 1 - i
        top.text(left - 0.08, y + 0.46, _wrap(PROBE_TEXT.get(name, name), 13), ha="right",
                 va="center", fontsize=fs)  # fmt: skip
        for j, label in enumerate(families):
            rule = probes[label][name]
            color = tint(GREEN, 0.55) if rule is None else tint(VERMILLION, 0.55)
            top.add_patch(Rectangle((left + j * cw, y), cw * 0.96, rh * 0.92, color=color))
            text = "✓" if rule is None else _wrap(RULE_TEXT.get(rule, rule.replace("-", " ")), 8)
            top.text(left + (j + 0.48) * cw, y + 0.46, text, ha="center", va="center",
                     fontsize=fs if rule is None else fs - 1, color=ink(color))  # fmt: skip
    top.set_xlim(0, left + len(families) * cw)
    top.set_ylim(0, len(names) + 1.3)
    top.set_title("What vLLM v0.34 serves", fontsize=fs + 1)
    top.axis("off")

    ax = bottom
    w, h, x = 3.0, 0.62, 0.2
    _box(ax, x, 5.2, w, h, "every layout\nthe rules admit", tint(BLUE, 0.2), fs)
    y = 5.2
    for rule in DROP_RULES:
        _arrow(ax, (x + w / 2, y), (x + w / 2, y - 0.3))
        y -= 0.3 + h
        _box(ax, x, y, w, h, DROP_TEXT[rule], tint(ORANGE, 0.6), fs)
        _arrow(ax, (x + w, y + h / 2), (x + w + 0.4, y + h / 2))
        ax.text(x + w + 0.45, y + h / 2, "no: dropped", va="center", fontsize=fs)
    _arrow(ax, (x + w / 2, y), (x + w / 2, y - 0.3))
    y -= 0.3 + h
    _box(ax, x, y, w, h, "rank by tok/s\nper GPU", tint(BLUE, 0.2), fs)
    _box(ax, x + w + 0.5, y + 0.35, 2.5, h, "winner:\nvllm serve flags", tint(GREEN, 0.55), fs)
    _box(ax, x + w + 0.5, y - 0.45, 2.5, h, "none fits:\nwhat would", tint(VERMILLION, 0.55),
         fs)  # fmt: skip
    _arrow(ax, (x + w, y + h / 2), (x + w + 0.5, y + 0.35 + h / 2))
    _arrow(ax, (x + w, y + h / 2), (x + w + 0.5, y - 0.45 + h / 2))
    ax.set_xlim(0, 6.4)
    ax.set_ylim(y - 0.6, 6.0)
    ax.set_title("What the planner does with them", fontsize=fs + 1)
    ax.axis("off")
    return legible(fig, 11)
