"""Chapter 8 explorer: which deployment, and which ``vllm serve`` line, for a model, a context, a
number of requests in flight, a GPU count and a GPU type.

Every state is :func:`cpbook.planner.plan.plan`'s answer (its default objective: latency up
to the concurrency where decode throughput saturates, tokens/s per GPU above it; 16-bit KV,
1K output tokens, no target): the winner with its flags, capacity, TTFT, TPOT and output
tokens/s per GPU and the planner's one-line reason, or, where nothing fits, what would.
"""

from __future__ import annotations

import html

from cpbook.costmodel import DEFAULT_HBM_EFFICIENCY, GPUS, LINKS
from cpbook.costmodel import gpu_terms as gt
from cpbook.planner import Plan, ServingWorkload, headline, plan
from cpbook.planner.plan_advice import fmt_rate, fmt_s, plural
from cpbook.viz.style import tokens_label
from cpbook.widgets.explorer import Control, Explorer, pre

__all__ = [
    "CONCURRENCY",
    "CONTEXTS",
    "GPU_COUNTS",
    "GPU_TYPES",
    "MODELS",
    "OUTPUT_TOKENS",
    "plan_explorer",
    "plan_readout",
]

MODELS = ("DeepSeek-V3", "Qwen3-235B-A22B", "Llama-3.1-70B", "Llama-3.1-8B")
CONTEXTS = (4 * 1024, 32 * 1024, 128 * 1024, 1024 * 1024)
CONCURRENCY = (1, 16, 512)
GPU_COUNTS = (4, 8, 16)
GPU_TYPES = ("H100", "H200", "B200")
OUTPUT_TOKENS = 1024


def plan_readout(p: Plan) -> str:
    """The answer of ``p`` as HTML: the winner, the planner's headline, its ``vllm serve`` line
    and its numbers (modelled); or the rule every deployment fails and what would serve it."""
    w, best = p.workload, p.winner
    if best is None:
        f = p.would_fit
        lines = (f.lines[1:] or f.lines) if f else ("no deployment serves it",)
        items = "".join(f"<li>{html.escape(line)}</li>" for line in lines)
        rule = f" [{f.rule}]" if f else ""
        return (
            f"<p><b>Nothing fits</b> on {p.num_gpus} × {html.escape(p.gpu.name)}{rule}. "
            f"What would:</p><ul>{items}</ul>"
        )
    return (
        f"<p><b>{html.escape(best.label)}</b> on {best.num_gpus} of {p.num_gpus} GPUs: "
        f"{html.escape(headline(p))}.</p>"
        + pre(p.command())
        + f"<p>Holds {plural(best.capacity, 'request')} of {w.request_tokens:,} tokens "
        f"({w.concurrency:,} in flight) · TTFT {fmt_s(best.ttft_s)} · "
        f"TPOT {fmt_s(best.tpot_s)} with prefill interference · "
        f"{fmt_rate(best.tokens_per_s_per_gpu)} output tok/s per GPU (modelled, objective "
        f"{p.objective}).</p>"
    )


def _model_terms() -> str:
    """The cost model's GPU-side terms in a caption's words, read from
    :mod:`cpbook.costmodel.gpu_terms` so the caption cannot go stale."""
    (_, gemm), _ = gt.GEMM_MFU[2]
    (_, att_lo), (_, att_hi) = gt.ATTENTION_MFU
    one = gt.DECODE_ATTENTION_UNIT_EFFICIENCY
    return (
        f"prefill GEMMs at {gemm:.0%} of the BF16 peak, attention at {att_lo:.0%} to "
        f"{att_hi:.0%}; one request's KV read at {one:.0%} of HBM bandwidth, "
        f"{DEFAULT_HBM_EFFICIENCY:.0%} once the GPU is busy; decode all-reduce "
        f"{gt.DECODE_ALLREDUCE_ALPHA_S * 1e6:.1f} µs, α = "
        f"{LINKS['NVLink4'].alpha_s * 1e6:.0f} µs per other NVLink collective"
    ).replace("%", " %")


def plan_explorer(
    models: tuple[str, ...] = MODELS,
    contexts: tuple[int, ...] = CONTEXTS,
    in_flight: tuple[int, ...] = CONCURRENCY,
    gpu_counts: tuple[int, ...] = GPU_COUNTS,
    gpu_types: tuple[str, ...] = GPU_TYPES,
    **value,
) -> Explorer:
    """Model × context × requests in flight × GPU count × GPU type: every state one
    :func:`~cpbook.planner.plan.plan` call, precomputed (HTML only); ``value``: the initial
    state (control names ``model``, ``context``, ``concurrency``, ``gpus``, ``gpu``)."""

    def render(model: str, context: int, concurrency: int, gpus: int, gpu: str) -> str:
        w = ServingWorkload(context, OUTPUT_TOKENS, concurrency)
        return plan_readout(plan(model, gpu, gpus, w))

    return Explorer(
        render,
        {
            "model": list(models),
            "context": Control(list(contexts), names=[tokens_label(t) for t in contexts]),
            "concurrency": Control(list(in_flight), label="in flight"),
            "gpus": Control(list(gpu_counts), label="GPUs"),
            "gpu": Control(list(gpu_types), names=[GPUS[g].name for g in gpu_types]),
        },
        value=value,
        caption=(
            "The planner's answer (cpbook.planner.plan): every deployment vLLM v0.34 accepts for "
            "the model on at most this many GPUs, the ones that hold the requests (prompt plus "
            f"{tokens_label(OUTPUT_TOKENS)} output tokens, 16-bit KV) ranked by latency up to "
            "the concurrency where decode throughput saturates and by output tokens per second "
            "per GPU above it, no TTFT or TPOT target. Times and rates are modelled "
            f"({_model_terms()})."
        ),
    )
