"""Chapter 1 explorer: model, GPU, context length, TP and DCP → per-GPU KV and maximum context."""

from __future__ import annotations

import ipywidgets as w

from ..costmodel import (
    GB,
    GPUS,
    MODELS,
    kv_budget_bytes_per_gpu,
    kv_bytes_per_token_per_gpu,
    max_context_tokens,
)

__all__ = ["kv_capacity_text", "kv_explorer"]

CONTEXTS = [2**k for k in range(13, 21)]  # 8K .. 1M


def kv_capacity_text(
    model: str, gpu: str, tokens: int, tp: int, dcp: int, kv_dtype: str = "bf16"
) -> str:
    """One HTML paragraph: per-GPU KV of a ``tokens``-long request and the longest that fits."""
    m, g = MODELS[model], GPUS[gpu]
    try:
        per_gpu = kv_bytes_per_token_per_gpu(m, tp, dcp, kv_dtype) * tokens
        budget = kv_budget_bytes_per_gpu(m, g, tp)
        longest = max_context_tokens(m, g, tp, dcp, kv_dtype)
    except ValueError as e:  # a configuration vLLM rejects, or a model that does not fit
        return f"<p><b>{model}, TP={tp}, DCP={dcp} on {gpu}:</b> {e}</p>"
    verdict = "fits" if per_gpu <= budget else "does <b>not</b> fit"
    return (
        f"<p><b>{model}</b> on {tp}×{gpu} with DCP={dcp}: one {tokens:,}-token request needs "
        f"<b>{per_gpu / GB:.2f} GB</b> of KV per GPU; "
        f"the KV budget per GPU is {budget / GB:.1f} GB, "
        f"so it {verdict}. Longest single request: <b>{longest:,}</b> tokens.</p>"
    )


def kv_explorer(
    model: str = "DeepSeek-V3", gpu: str = "H200", tokens: int = 131072, tp: int = 8, dcp: int = 1
) -> w.VBox:
    """Dropdowns and a slider; the text below them updates.

    Live only with a kernel (Jupyter): a static page cannot run ``update``, so the book hides
    this widget's output and shows :func:`cpbook.viz.memory.max_context_bars` instead.
    """
    ctrl = dict(
        model=w.Dropdown(options=list(MODELS), value=model, description="model"),
        gpu=w.Dropdown(options=list(GPUS), value=gpu, description="GPU"),
        tokens=w.SelectionSlider(
            options=[(f"{t // 1024}K", t) for t in CONTEXTS], value=tokens, description="context"
        ),
        tp=w.Dropdown(options=[1, 2, 4, 8, 16], value=tp, description="TP"),
        dcp=w.Dropdown(options=[1, 2, 4, 8, 16], value=dcp, description="DCP"),
    )
    out = w.HTML(kv_capacity_text(model, gpu, tokens, tp, dcp))

    def update(_=None) -> None:
        out.value = kv_capacity_text(**{k: c.value for k, c in ctrl.items()})

    for c in ctrl.values():
        c.observe(update, names="value")
    return w.VBox(
        [
            w.HBox([ctrl["model"], ctrl["gpu"]]),
            ctrl["tokens"],
            w.HBox([ctrl["tp"], ctrl["dcp"]]),
            out,
        ]
    )
