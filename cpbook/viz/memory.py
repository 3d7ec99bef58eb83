"""Chapter 1 figures: KV-cache memory per request, and per-GPU KV under TP vs TP + DCP."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..config import ConfigError
from ..costmodel import GB, GPUS, MODELS, kv_bytes_for_context, kv_bytes_per_token_per_gpu
from . import PALETTE, figure

__all__ = ["kv_memory_vs_context", "per_gpu_kv_bars", "max_context_bars"]


def kv_memory_vs_context(
    models: Sequence[str],
    gpus: Sequence[str] = ("H100", "H200", "B200"),
    max_tokens: int = 2**20,
    kv_dtype: str = "bf16",
):
    """One request's KV cache (GB, all layers, one copy) vs context length, log-log, with the
    HBM of each GPU drawn as a horizontal line."""
    fig, ax = figure(figsize=(8.6, 4.2))
    tokens = np.unique(np.geomspace(1024, max_tokens, 64).astype(int))
    for i, name in enumerate(models):
        gb = [kv_bytes_for_context(MODELS[name], int(t), kv_dtype) / GB for t in tokens]
        ax.plot(tokens, gb, color=PALETTE[i % len(PALETTE)], lw=2, label=name)
    for j, g in enumerate(gpus):
        hbm = GPUS[g].hbm_bytes / GB
        ax.axhline(
            hbm,
            color="0.3",
            lw=1,
            ls=[(0, (1, 1.5)), (0, (5, 2)), (0, (8, 2, 1, 2))][j % 3],
            label=f"{g} HBM ({hbm:.0f} GB)",
        )
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="context length (tokens)",
        ylabel="KV cache of one request (GB)",
        title=f"KV cache per request ({kv_dtype})",
    )
    ticks = [2**k for k in range(10, 21, 2)]
    ax.set_xticks(ticks, [f"{t // 1024}K" if t < 2**20 else "1M" for t in ticks])
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8)
    return fig


def _grouped_bars(ax, cases, value, fmt, reject_y: float) -> None:
    """Bars per (model, tp) group, one per DCP size; a size vLLM rejects gets its rule as text."""
    x = 0.0
    for name, tp, dcps in cases:
        xs = []
        for j, dcp in enumerate(dcps):
            try:
                v = value(MODELS[name], tp, dcp)
            except ConfigError as e:
                ax.text(
                    x,
                    reject_y,
                    f"DCP={dcp} rejected:\n{e.rule}",
                    ha="center",
                    va="bottom",
                    fontsize=7,
                    color="0.3",
                    rotation=90,
                )
            else:
                ax.bar(x, v, color=PALETTE[j % len(PALETTE)], width=0.8)
                ax.text(x, v * 1.03, fmt(v), ha="center", va="bottom", fontsize=8)
            xs.append(x)
            x += 1
        ax.text(
            sum(xs) / len(xs),
            -0.16,
            f"{name}\nTP={tp}",
            transform=ax.get_xaxis_transform(),
            ha="center",
            va="top",
            fontsize=8,
        )
        x += 0.7
    ax.set_xticks(
        [
            i + 0.7 * k
            for k, c in enumerate(cases)
            for i in range(
                sum(len(d) for _, _, d in cases[:k]), sum(len(d) for _, _, d in cases[: k + 1])
            )
        ],
        [f"DCP={d}" for _, _, ds in cases for d in ds],
        fontsize=8,
    )
    ax.grid(axis="x", visible=False)


def per_gpu_kv_bars(
    cases: Sequence[tuple[str, int, Sequence[int]]], tokens: int = 131072, kv_dtype: str = "bf16"
):
    """Per-GPU KV bytes of one ``tokens``-long request for each ``(model, tp, dcp sizes)``.

    A DCP size vLLM rejects for that model is drawn as an empty slot labelled with the violated
    rule, so the figure shows both the saving and its limit.
    """
    fig, ax = figure(figsize=(7.2, 4.0))
    _grouped_bars(
        ax,
        cases,
        lambda m, tp, dcp: kv_bytes_per_token_per_gpu(m, tp, dcp, kv_dtype) * tokens / GB,
        lambda v: f"{v:.1f}",
        reject_y=0.3,
    )
    ax.set(
        ylabel=f"KV per GPU for a {tokens // 1024}K-token request (GB)",
        title="Per-GPU KV cache: TP alone vs TP + DCP",
    )
    return fig


def max_context_bars(
    cases: Sequence[tuple[str, int, Sequence[int]]], gpu: str = "H200", kv_dtype: str = "bf16"
):
    """Longest single request (tokens, log scale) on ``tp`` GPUs for each DCP size of each model.

    The static companion of the chapter's explorer: DCP multiplies the longest request by its
    size, but only where vLLM's rules allow that size.
    """
    from ..costmodel import max_context_tokens

    fig, ax = figure(figsize=(7.2, 4.0))
    _grouped_bars(
        ax,
        cases,
        lambda m, tp, dcp: max_context_tokens(m, GPUS[gpu], tp, dcp, kv_dtype),
        lambda n: f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.0f}K",
        reject_y=1.3e4,
    )
    ax.set_yscale("log")
    ax.set_ylim(1e4, 3e7)
    ax.set(
        ylabel="longest request (tokens)",
        title=f"Longest single request on {cases[0][1]}×{gpu} ({kv_dtype} KV)",
    )
    return fig
