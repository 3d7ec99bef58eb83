"""Chapter 1 figures: KV-cache memory per request, and per-GPU KV under TP vs TP + DCP.

Sized for the book's text column at a 1280-px window (about 690 px): 6.6 inches wide at the
style's 110 dpi (726 px), so they render at 95 % or more and no text is smaller than 9.5 pt.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from cpbook.core.config import ConfigError
from cpbook.costmodel import (
    GB,
    GPUS,
    MODELS,
    kv_bytes_for_context,
    kv_bytes_per_token,
    kv_bytes_per_token_per_gpu,
    max_context_tokens,
)
from cpbook.viz.style import PALETTE, figure, tokens_label

__all__ = ["kv_memory_vs_context", "per_gpu_kv_bars", "max_context_bars", "rejection_reason"]

SMALL = 9.5  # the smallest font size in these figures (pt)
WIDTH = 6.6  # inches
_HBM_STYLES = [(0, (1, 1.5)), (0, (5, 2)), (0, (8, 2, 1, 2))]
_LINE_STYLES = ["-", "--", "-.", (0, (3, 1, 1, 1, 1, 1))]


def kv_memory_vs_context(
    models: Sequence[str],
    gpus: Sequence[str] = ("H100", "H200", "B200"),
    max_tokens: int = 2**20,
    kv_dtype: str = "bf16",
):
    """One request's KV cache (GB, all layers, one copy) vs context length, log-log, with the
    HBM of each GPU drawn as a horizontal line.

    Models with the same KV bytes per token (DeepSeek-V3 and Kimi-K2) share one line and one
    legend entry, so no line hides another.
    """
    fig, ax = figure(figsize=(WIDTH, 5.2))
    tokens = np.unique(np.geomspace(1024, max_tokens, 64).astype(int))
    groups: dict[int, list[str]] = {}
    for name in models:
        groups.setdefault(kv_bytes_per_token(MODELS[name], kv_dtype), []).append(name)
    for i, (per_token, names) in enumerate(sorted(groups.items(), reverse=True)):
        rep = MODELS[names[0]]
        gb = [kv_bytes_for_context(rep, int(t), kv_dtype) / GB for t in tokens]
        label = " = ".join(names) + (" (same cache)" if len(names) > 1 else "")
        ax.plot(
            tokens,
            gb,
            color=PALETTE[i % len(PALETTE)],
            ls=_LINE_STYLES[i % len(_LINE_STYLES)],
            lw=2.2,
            label=label,
        )
    for j, g in enumerate(gpus):
        hbm = GPUS[g].hbm_bytes / GB
        ax.axhline(
            hbm, color="0.35", lw=1.2, ls=_HBM_STYLES[j % 3], label=f"{g} HBM ({hbm:.0f} GB)"
        )
    ax.set(xscale="log", yscale="log")
    ax.set_xlabel("context length (tokens)", fontsize=10.5)
    ax.set_ylabel("KV cache of one request (GB)", fontsize=10.5)
    ax.set_title(f"KV cache of one request ({kv_dtype}, all layers)", fontsize=11)
    ticks = [2**k for k in range(10, 21, 2)]
    ax.set_xticks(ticks, [tokens_label(t) for t in ticks])
    ax.tick_params(labelsize=10)
    ax.legend(
        loc="upper center",
        bbox_to_anchor=(0.45, -0.13),
        ncol=2,
        fontsize=SMALL,
        handlelength=2.4,
        columnspacing=1.2,
    )
    return fig


_REASONS: dict[str, Callable[[dict], str]] = {
    "gqa-dcp-needs-replicated-kv": lambda v: (
        f"TP {v['tensor_parallel_size']} is not\n> {v['num_kv_heads']} KV heads"
    ),
    "gqa-dcp-within-replicas": lambda v: (
        f"DCP {v['decode_context_parallel_size']} > TP/KV\n"
        f"heads = {v['tensor_parallel_size'] // v['num_kv_heads']}"
    ),
    "gqa-q-per-kv-divisible-by-dcp": lambda v: (
        f"DCP {v['decode_context_parallel_size']} does not\n"
        f"divide Q/KV = {v['num_q_heads'] // v['num_kv_heads']}"
    ),
    "tp-divisible-by-dcp": lambda v: (
        f"DCP {v['decode_context_parallel_size']} does not\ndivide TP {v['tensor_parallel_size']}"
    ),
}


def rejection_reason(err: ConfigError) -> str:
    """A short, line-broken, human-readable form of a violated rule (for figure labels)."""
    fmt = _REASONS.get(err.rule)
    return fmt(err.values) if fmt else err.rule.replace("-", " ")


def _grouped_bars(ax, cases, value, fmt, left: float) -> None:
    """Horizontal bars, one row per DCP size under a heading row per ``(model, tp)``.

    A size vLLM rejects gets no bar but a dashed box in its row saying which rule it breaks.
    ``left`` is where bars start (0, or the lower end of a log axis).
    """
    y, ticks, labels = 0.0, [], []
    trans = ax.get_yaxis_transform()  # x in axes fraction, y in data
    for name, tp, dcps in cases:
        ax.text(
            -0.02,
            y,
            f"{name}, TP={tp}",
            transform=trans,
            ha="right",
            va="center",
            fontsize=10.5,
            fontweight="bold",
        )
        y -= 1
        for j, dcp in enumerate(dcps):
            try:
                v = value(MODELS[name], tp, dcp)
            except ConfigError as e:
                ax.text(
                    0.02,
                    y,
                    "rejected: " + rejection_reason(e).replace("\n", " "),
                    transform=trans,
                    ha="left",
                    va="center",
                    fontsize=SMALL,
                    color="0.15",
                    bbox=dict(boxstyle="round,pad=0.3", fc="white", ec="0.45", ls="--"),
                )
            else:
                ax.barh(y, v - left, left=left, color=PALETTE[j % len(PALETTE)], height=0.72)
                ax.text(v, y, " " + fmt(v), ha="left", va="center", fontsize=10)
            ticks.append(y)
            labels.append(f"DCP={dcp}")
            y -= 1
        y -= 0.35
    ax.set_ylim(y + 0.6, 0.6)
    ax.set_yticks(ticks, labels, fontsize=10)
    ax.tick_params(axis="x", labelsize=10)
    ax.grid(axis="y", visible=False)


def per_gpu_kv_bars(
    cases: Sequence[tuple[str, int, Sequence[int]]], tokens: int = 131072, kv_dtype: str = "bf16"
):
    """Per-GPU KV bytes of one ``tokens``-long request for each ``(model, tp, dcp sizes)``.

    A DCP size vLLM rejects for that model gets a dashed box naming the violated rule instead
    of a bar, so the figure shows both the saving and its limit.
    """
    rows = sum(len(d) + 1.35 for _, _, d in cases)
    fig, ax = figure(figsize=(WIDTH, 0.9 + 0.3 * rows))
    _grouped_bars(
        ax,
        cases,
        lambda m, tp, dcp: kv_bytes_per_token_per_gpu(m, tp, dcp, kv_dtype) * tokens / GB,
        lambda v: f"{v:.1f} GB",
        left=0.0,
    )
    ax.set_xlim(0, ax.get_xlim()[1] * 1.12)
    ax.set_xlabel(f"KV per GPU for one {tokens // 1024}K-token request (GB)", fontsize=10.5)
    ax.set_title("Per-GPU KV cache: TP alone vs TP + DCP", fontsize=11)
    return fig


def max_context_bars(
    cases: Sequence[tuple[str, int, Sequence[int]]], gpu: str = "H200", kv_dtype: str = "bf16"
):
    """Longest single request (tokens, log scale) on ``tp`` GPUs for each DCP size of each model.

    The static companion of the chapter's explorer: DCP multiplies the longest request by its
    size, but only where vLLM's rules allow that size.
    """
    rows = sum(len(d) + 1.35 for _, _, d in cases)
    fig, ax = figure(figsize=(WIDTH, 0.9 + 0.3 * rows))
    ax.set_xscale("log")
    _grouped_bars(
        ax,
        cases,
        lambda m, tp, dcp: max_context_tokens(m, GPUS[gpu], tp, dcp, kv_dtype),
        lambda n: f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.0f}K",
        left=1e4,
    )
    ax.set_xlim(1e4, 4e7)
    ax.set_xticks([1e4, 1e5, 1e6, 1e7], ["10K", "100K", "1M", "10M"])
    ax.set_xlabel("longest request (tokens, log scale)", fontsize=10.5)
    ax.set_title(f"Longest single request on {cases[0][1]}×{gpu} ({kv_dtype} KV)", fontsize=11)
    return fig
