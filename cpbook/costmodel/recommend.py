"""The article's three-question decision path as code (chapter 8).

1. Does one request's KV fit without context parallelism?  No → enable DCP (the smallest that
   fits).  2. With that, is TTFT above the target while concurrency is moderate?  Yes → add PCP
   (the smallest that meets the target, within the GPUs).  3. Are requests short (< 32K) and
   very concurrent?  Yes → pure DP, no context parallelism.  Otherwise: the smallest TP that
   holds the weights, replicated by DP over the remaining GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cpbook.costmodel.latency import DecodeTime, PrefillTime, tpot, ttft
from cpbook.costmodel.memory import (
    Layout,
    layout_kv_budget,
    layout_max_context,
    max_concurrency,
)
from cpbook.costmodel.specs import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    GPUSpec,
    ModelSpec,
    get_gpu,
    get_model,
)

#: the article's "short" requests and the concurrency per GPU we call "very concurrent"
SHORT_CONTEXT_TOKENS = 32 * 1024
HIGH_CONCURRENCY_PER_GPU = 16


@dataclass(frozen=True)
class Workload:
    """What the deployment must serve: prompt length, requests in flight, a TTFT target."""

    context_tokens: int
    concurrency: int = 1
    ttft_target_s: float | None = None
    kv_dtype: str = "bf16"
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION

    def __post_init__(self) -> None:
        for name in ("context_tokens", "concurrency"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"[positive-workload] requires {name} >= 1; got {name}={v!r}")
        if self.ttft_target_s is not None and self.ttft_target_s <= 0:
            raise ValueError(f"[positive-workload] requires ttft_target_s > 0; got {self}")


@dataclass(frozen=True)
class Recommendation:
    """The chosen layout, its predicted memory and times, and why, in words."""

    layout: Layout
    longest_request: int
    max_concurrency: int
    ttft: PrefillTime
    tpot: DecodeTime
    reasons: list[str] = field(default_factory=list)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _fits(model: ModelSpec, gpu: GPUSpec, layout: Layout, w: Workload) -> bool:
    try:
        layout_kv_budget(model, gpu, layout, w.gpu_memory_utilization)
    except ValueError:
        return False
    return True


def _valid(model: ModelSpec, layout: Layout) -> bool:
    try:
        layout.config(model)
    except ValueError:
        return False
    return True


def recommend(
    model: str | ModelSpec, hardware: str | GPUSpec, workload: Workload, num_gpus: int = 8
) -> Recommendation:
    """Walk the decision path for ``workload`` on ``num_gpus`` GPUs of ``hardware``.

    Raises ValueError for an unknown model or GPU, a bad workload, or when no layout of
    ``num_gpus`` GPUs holds the weights plus one request's KV.
    """
    model, gpu = get_model(model), get_gpu(hardware)
    if isinstance(num_gpus, bool) or not isinstance(num_gpus, int) or num_gpus < 1:
        raise ValueError(f"[positive-gpus] requires num_gpus >= 1; got {num_gpus!r}")
    w, mem = workload, {"gpu_memory_utilization": workload.gpu_memory_utilization}
    reasons: list[str] = []
    tps = [
        t
        for t in _divisors(num_gpus)
        if _valid(model, Layout(tp=t)) and _fits(model, gpu, Layout(tp=t), w)
    ]
    if not tps:
        raise ValueError(
            f"[model-fits] requires the weights to fit; {model.name} does not fit "
            f"on {num_gpus} x {gpu.name} at any TP"
        )
    tp = tps[0]
    reasons.append(f"TP{tp} is the smallest TP whose weight shard fits on one {gpu.name}.")
    base = Layout(tp=tp, dp=num_gpus // tp)
    longest = layout_max_context(model, gpu, base, w.kv_dtype, **mem)
    if longest < w.context_tokens:  # question 1
        reasons.append(
            f"1. One request needs {w.context_tokens:,} tokens of KV; TP{tp} holds "
            f"{longest:,}: context parallelism is required (DCP)."
        )
        options = [
            Layout(tp=t, dcp=d, dp=num_gpus // t)
            for t in tps
            for d in _divisors(t)
            if d > 1 and _valid(model, Layout(tp=t, dcp=d))
        ]
        fitting = [
            o
            for o in options
            if layout_max_context(model, gpu, o, w.kv_dtype, **mem) >= w.context_tokens
        ]
        if not fitting:
            raise ValueError(
                f"[request-fits] requires one {w.context_tokens:,}-token request to "
                f"fit; no TP x DCP layout of {num_gpus} x {gpu.name} holds it"
            )
        base = min(fitting, key=lambda o: (o.dcp, o.tp))
        reasons.append(f"DCP{base.dcp} on TP{base.tp} shards the tokens over {base.dcp} ranks.")
    else:
        reasons.append(
            f"1. One {w.context_tokens:,}-token request fits in TP{tp}'s KV room "
            f"({longest:,} tokens): no DCP needed."
        )
    short = w.context_tokens < SHORT_CONTEXT_TOKENS
    crowded = w.concurrency >= HIGH_CONCURRENCY_PER_GPU * num_gpus
    first = ttft(model, gpu, base, w.context_tokens)
    if w.ttft_target_s is not None and first.total_s > w.ttft_target_s and not crowded:
        reasons.append(
            f"2. Predicted TTFT {first.total_s:.2f} s exceeds the target "
            f"{w.ttft_target_s:g} s at moderate concurrency: add PCP."
        )
        for p in _divisors(num_gpus // base.tp)[1:]:
            for d in sorted({1, p} | ({base.dcp} if base.dcp > 1 else set())):
                cand = Layout(tp=base.tp, pcp=p, dcp=d, dp=num_gpus // (base.tp * p))
                if not (_valid(model, cand) and _fits(model, gpu, cand, w)):
                    continue
                if layout_max_context(model, gpu, cand, w.kv_dtype, **mem) < w.context_tokens:
                    continue
                t = ttft(model, gpu, cand, w.context_tokens).total_s
                if t <= w.ttft_target_s or p == num_gpus // base.tp:
                    base, first = cand, ttft(model, gpu, cand, w.context_tokens)
                    reasons.append(f"PCP{p} predicts TTFT {t:.2f} s.")
                    break
            else:
                continue
            break
        if not model.use_mla:
            reasons.append(
                "vLLM v0.33 runs PCP for MLA models only (PCPManager.validate_config);"
                " for this GQA model the layout is a design option, not a shipped path."
            )
        elif base.pcp > 1 and base.dcp > 1:  # every MLA model of MODELS is dense
            reasons.append(
                "vLLM v0.33 runs PCP with DCP > 1 for sparse MLA models only"
                " (DeepSeek-V3.2-style; PCPManager.validate_config, PR #56157); for this dense"
                " MLA model the layout is a design option, not a shipped path."
            )
    elif base.dcp == 1 and short and crowded:  # question 3
        reasons.append(
            f"3. Short requests (< {SHORT_CONTEXT_TOKENS // 1024}K) at concurrency "
            f"{w.concurrency:,}: pure DP, no context parallelism."
        )
    else:
        reasons.append("2./3. Neither a TTFT problem nor short, crowded traffic: keep the layout.")
    conc = max_concurrency(model, gpu, base, w.context_tokens, w.kv_dtype, **mem)
    batch = max(1, min(w.concurrency, conc))
    return Recommendation(
        base,
        layout_max_context(model, gpu, base, w.kv_dtype, **mem),
        conc,
        first,
        tpot(model, gpu, base, w.context_tokens, batch, kv_dtype=w.kv_dtype),
        reasons,
    )
