"""Figures of chapter 10: one verification step's owners and masks, and the break-even shift.

:func:`verify_mask_figure` draws, for one request, which rank owns each key position
(:func:`cpbook.kv.layout.token_owner`) and which keys each of the step's ``k + 1`` query rows
sees (causal by global position); the per-rank counts printed on the right are
:func:`cpbook.dcp.verify.verify_key_counts`.  :func:`break_even_figure` puts the measured time
per output token (stored rows of ``bench/spec_decode.py``) beside the modelled break-even of
:mod:`cpbook.costmodel.speculative`.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from matplotlib.patches import Patch, Rectangle

from cpbook.dcp.verify import verify_key_counts
from cpbook.kv.layout import token_owner
from cpbook.viz.style import BLACK, BLUE, GREEN, VERMILLION, figure, rank_color, tint

__all__ = ["verify_mask_figure", "break_even_figure"]

_WIDTH = 6.25  # the book's text column at 110 dpi (see viz.chunked)
# each panel's legend under its axes, clear of the curves
_BELOW = dict(fontsize=9, frameon=False, loc="upper center", bbox_to_anchor=(0.5, -0.25))


def verify_mask_figure(start: int, num_rows: int, dcp: int, interleave: int = 1):
    """Rows: the step's query rows (last sampled token, then the drafts) at positions
    ``start … start + num_rows − 1``; columns: key positions.  A visible key is filled with its
    owner's colour (the step's own keys hatched), a masked one left white."""
    total = start + num_rows
    owner = token_owner(list(range(total)), dcp, interleave).tolist()
    fig, ax = figure(figsize=(_WIDTH, 1.3 + 0.42 * num_rows), layout="constrained")
    for j in range(num_rows):
        y = num_rows - 1 - j
        for p in range(total):
            seen = p <= start + j
            face = rank_color(owner[p]) if seen else "white"
            ax.add_patch(
                Rectangle(
                    (p, y),
                    1,
                    1,
                    facecolor=face if p < start or not seen else tint(face, 0.45),
                    edgecolor="#666666",
                    hatch="//" if p >= start and seen else None,
                    lw=0.5,
                )
            )
        counts = [verify_key_counts(start, num_rows, dcp, r, interleave)[j] for r in range(dcp)]
        ax.text(total + 0.3, y + 0.5, " / ".join(map(str, counts)), va="center", fontsize=9)
    for p in range(total):
        ax.text(p + 0.5, num_rows + 0.25, str(p), ha="center", fontsize=9, color=BLACK)
    labels = ["last token"] + [f"draft {j}" for j in range(1, num_rows)]
    ax.set_yticks(
        [num_rows - 1 - j + 0.5 for j in range(num_rows)],
        [f"{lab} @ {start + j}" for j, lab in enumerate(labels)],
    )
    ax.set_xlim(0, total + 3.2)
    ax.set_ylim(0, num_rows + 0.8)
    ax.set_xticks([])
    ax.set_xlabel("key position (colour: owning DCP rank; hatched: written by this step)")
    ax.text(total + 0.3, num_rows + 0.25, "keys per rank", fontsize=9)
    for s in ("top", "right", "bottom"):
        ax.spines[s].set_visible(False)
    ax.legend(
        handles=[Patch(facecolor=rank_color(r), label=f"rank {r}") for r in range(dcp)],
        loc="upper center",
        bbox_to_anchor=(0.4, -0.18),
        ncol=dcp,
        fontsize=9,
        frameon=False,
    )
    return fig


def break_even_figure(
    measured: Sequence[Mapping], k: int, modelled: Mapping[str, Sequence[tuple[float, float]]]
):
    """Left: measured ms per output token against the context on 2 gloo ranks for no CP, DCP
    and DCP + spec at ``k`` (rows ``spec_decode`` of ``bench/spec_decode.py``).  Right: the
    modelled break-even context (K tokens) against the acceptance rate, one line per entry of
    ``modelled`` (``label -> [(acceptance, tokens)]``; a label with "k = 1" dashed, one whose
    baseline, after "vs", speculates green, else blue).  Each legend sits under its panel,
    outside the axes, so it covers no curve."""
    fig, (a, b) = figure(1, 2, figsize=(_WIDTH, 3.8), layout="constrained")
    rows = sorted((r for r in measured if r["k"] == k), key=lambda r: r["context"])
    ctx = [r["context"] for r in rows]
    for key, label, color in (
        ("no_cp_ms_per_token", "no CP", BLACK),
        ("dcp_ms_per_token", "DCP", VERMILLION),
        ("dcp_spec_ms_per_token", f"DCP + spec (k = {k})", BLUE),
        ("no_cp_spec_ms_per_token", f"no CP + spec (k = {k})", GREEN),
    ):
        a.plot(ctx, [r[key] for r in rows], marker="o", ms=3, color=color, label=label)
    a.set_xscale("log", base=2)
    a.set_yscale("log")
    a.set_xticks(ctx, [f"{c // 1024}K" for c in ctx])
    a.set_xlabel("context (tokens)")
    a.set_ylabel("ms per output token")
    a.set_title("measured, 2 gloo ranks", fontsize=10)
    a.legend(**_BELOW)
    for label, pts in modelled.items():
        color = GREEN if "spec" in label.split("vs", 1)[-1] else BLUE
        dashed = "k = 1" in label
        b.plot([x for x, _ in pts], [y / 1024 for _, y in pts], color=color,
               ls="--" if dashed else "-", label=label)  # fmt: skip
    b.set_xlabel("acceptance rate per draft")
    b.set_ylabel("break-even (K tokens)")
    b.set_title("modelled, DeepSeek-V3, 8 × H200", fontsize=10)
    b.legend(**_BELOW)
    return fig
