"""Chapter 1 explorer: model, context length, DCP, TP and GPU -> per-GPU KV of one request, and
whether it fits the per-GPU KV budget (one node of TP GPUs; TP 8 on H200s by default)."""

from __future__ import annotations

from cpbook.costmodel import (
    GB,
    GPUS,
    MODELS,
    kv_budget_bytes_per_gpu,
    kv_bytes_per_token_per_gpu,
    max_context_tokens,
)
from cpbook.viz.style import BLUE, VERMILLION, tokens_label
from cpbook.widgets.explorer import Control, Explorer, pre

__all__ = ["CONTEXTS", "kv_capacity_html", "kv_explorer"]

CONTEXTS = [2**k for k in range(13, 21)]  # 8K .. 1M
_OK, _OVER = BLUE, VERMILLION


def kv_capacity_html(
    model: str, tokens: int, dcp: int, tp: int = 8, gpu: str = "H200", kv_dtype: str = "bf16"
) -> str:
    """A bar (one request's KV per GPU against the KV budget per GPU) and one paragraph.

    A configuration vLLM rejects shows the rule it breaks instead of numbers.
    """
    m, g = MODELS[model], GPUS[gpu]
    head = f"<b>{model}</b>, TP={tp}, DCP={dcp} on {tp}×{gpu}"
    try:
        per_gpu = kv_bytes_per_token_per_gpu(m, tp, dcp, kv_dtype) * tokens
        budget = kv_budget_bytes_per_gpu(m, g, tp)
        longest = max_context_tokens(m, g, tp, dcp, kv_dtype)
    except ValueError as e:  # a configuration vLLM rejects, or weights that do not fit
        why = (
            "the weights alone do not fit"
            if str(e).startswith("[model-fits]")
            else "rejected by vLLM's rules"
        )
        return f"<p>{head}: {why}.</p>" + pre(str(e))
    share = per_gpu / budget
    fits = share <= 1
    bar = (
        '<div aria-hidden="true" style="position:relative;height:1.4em;max-width:36em;'
        'background:#eaeef2;border-radius:3px;overflow:hidden">'
        f'<div style="width:{min(share, 1) * 100:.1f}%;height:100%;'
        f'background:{_OK if fits else _OVER}"></div></div>'
    )
    verdict = "fits" if fits else f"does <b>not</b> fit ({share:.1f}× the budget)"
    return (
        f"{bar}<p>{head}: one {tokens_label(tokens)}-token request needs "
        f"<b>{per_gpu / GB:.2f} GB</b> of KV per GPU, {100 * share:.0f} % of the "
        f"{budget / GB:.1f} GB KV budget per GPU, so it {verdict}. "
        f"Longest single request: <b>{longest:,}</b> tokens.</p>"
    )


def kv_explorer(
    models: tuple[str, ...] = ("DeepSeek-V3", "Qwen3-235B-A22B", "Llama-3.1-70B"),
    dcps: tuple[int, ...] = (1, 2, 4, 8),
    tps: tuple[int, ...] = (4, 8),
    gpus: tuple[str, ...] = tuple(GPUS),
    **value,
) -> Explorer:
    """Model × context (8K-1M) × DCP × TP × GPU: every state precomputed (HTML only).  Defaults
    to TP 8 on H200 unless ``value`` picks others."""
    value = {"tp": 8 if 8 in tps else tps[0], "gpu": "H200" if "H200" in gpus else gpus[0]} | value
    return Explorer(
        kv_capacity_html,
        {
            "model": list(models),
            "tokens": Control(CONTEXTS, names=[tokens_label(t) for t in CONTEXTS], label="context"),
            "dcp": Control(list(dcps), label="DCP"),
            "tp": Control(list(tps), label="TP", kind="select"),
            "gpu": Control(list(gpus), label="GPU"),
        },
        value=value,
        caption=(
            "One request's KV cache per GPU (bf16) on one node of TP GPUs: the bar is its share "
            "of the KV budget per GPU (cpbook.costmodel.kv_budget_bytes_per_gpu: a share of HBM "
            "less the weights and an activation reserve); orange: it does not fit."
        ),
    )
