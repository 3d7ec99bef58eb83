"""The decision page's flowchart: what vLLM v0.33 lets each model family do, then the
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

__all__ = ["decision_flowchart", "DROP_TEXT"]

#: what each drop rule asks of a deployment, in the pipeline's words
DROP_TEXT = {
    "model-fits": f"weights + {cm.DEFAULT_ACTIVATION_RESERVE_BYTES / cm.GIB:g} GiB reserve fit "
    "in\nHBM x gpu_memory_utilization",
    "holds-concurrency": "KV room holds `concurrency`\nrequests of prompt + output",
    "ttft-target": "TTFT of one prompt\n<= target (if any)",
    "tpot-target": "TPOT of the last token\n<= target (if any)",
}


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
    """Top: one row per family (its label, e.g. ``"GQA, 8 KV heads"``, and an example model),
    one column per probe of :func:`rule_probes`, green when vLLM v0.33 serves it, vermillion
    with the rejecting rule when not.  Bottom: the planner's pipeline, every deployment through
    the drop rules to the ranking and its two outcomes.  Returns the ``Figure``."""
    probes = {label: rule_probes(m) for label, m in families.items()}
    names = list(next(iter(probes.values())))
    fig, (top, bottom) = figure(2, 1, figsize=(7.2, 8.0), height_ratios=[len(families) + 1.2, 6])
    cw, rh, left = 1.0, 1.0, 2.1
    for j, name in enumerate(names):
        top.text(left + (j + 0.5) * cw, len(families) + 0.1, textwrap.fill(name, 11),
                 ha="center", va="bottom", fontsize=8.5)  # fmt: skip
    for i, (label, row) in enumerate(probes.items()):
        y = len(families) - 1 - i
        model = families[label]
        top.text(left - 0.08, y + 0.5, f"{label}\n({model.name})", ha="right", va="center",
                 fontsize=8.5)  # fmt: skip
        for j, name in enumerate(names):
            rule = row[name]
            color = tint(GREEN, 0.55) if rule is None else tint(VERMILLION, 0.55)
            top.add_patch(Rectangle((left + j * cw, y), cw * 0.96, rh * 0.92, color=color))
            text = "serves" if rule is None else textwrap.fill(rule, 10)
            top.text(left + (j + 0.48) * cw, y + 0.46, text, ha="center", va="center",
                     fontsize=7.5, color=ink(color))  # fmt: skip
    top.set_xlim(0, left + len(names) * cw)
    top.set_ylim(0, len(families) + 1.0)
    top.set_title("What vLLM v0.33 serves, by model family (cpbook.planner.vllm_rules)")
    top.axis("off")

    ax = bottom
    w, h, x = 3.2, 0.62, 0.4
    _box(ax, x, 5.2, w, h, "every DP x TP x PCP x DCP deployment\non <= N GPUs (x EP, x query "
         "replication,\nx KV dtype) that the rules above admit", tint(BLUE, 0.2), 8.5)  # fmt: skip
    y = 5.2
    for rule in DROP_RULES:
        _arrow(ax, (x + w / 2, y), (x + w / 2, y - 0.3))
        y -= 0.3 + h
        _box(ax, x, y, w, h, DROP_TEXT[rule], tint(ORANGE, 0.6), 8.5)
        _arrow(ax, (x + w, y + h / 2), (x + w + 0.45, y + h / 2))
        ax.text(x + w + 0.5, y + h / 2, f"no: dropped [{rule}]", va="center", fontsize=8.5)
    _arrow(ax, (x + w / 2, y), (x + w / 2, y - 0.3))
    y -= 0.3 + h
    _box(ax, x, y, w, h, "rank: output tok/s per GPU (or TTFT,\nTPOT) at 2 significant "
         "figures", tint(BLUE, 0.2), 8.5)  # fmt: skip
    _box(ax, x + w + 0.5, y + 0.35, 2.6, h, "winner: vllm serve flags,\nPareto "
         "frontiers, reasons", tint(GREEN, 0.55), 8.5)  # fmt: skip
    _box(ax, x + w + 0.5, y - 0.45, 2.6, h, "none: how many GPUs, FP8 KV,\nshorter prompt, "
         "fewer requests", tint(VERMILLION, 0.55), 8.5)  # fmt: skip
    _arrow(ax, (x + w, y + h / 2), (x + w + 0.5, y + 0.35 + h / 2))
    _arrow(ax, (x + w, y + h / 2), (x + w + 0.5, y - 0.45 + h / 2))
    ax.set_xlim(0, 7.2)
    ax.set_ylim(y - 0.6, 6.0)
    ax.set_title("What the planner does with them (cpbook.planner.plan)")
    ax.axis("off")
    return legible(fig, 8.5)
