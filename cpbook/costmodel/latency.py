"""Time of whole layouts: TTFT, TPOT and throughput (chapter 8)."""

from __future__ import annotations

from dataclasses import dataclass

from cpbook.costmodel.decode import (
    DEFAULT_HBM_EFFICIENCY,
    collective_time,
    decode_attention_calls,
    tpa_weight_costs,
)
from cpbook.costmodel.memory import (
    Layout,
    kv_bytes_per_token_per_gpu,
    layout_kv_bytes_per_token,
    layout_weight_bytes,
    weight_bytes_per_gpu,
)
from cpbook.costmodel.specs import (
    GPUSpec,
    LinkSpec,
    ModelSpec,
    check_hbm_efficiency,
    check_tokens,
    link_of,
)
from cpbook.pcp.prefill import pcp_comm_bytes, pcp_restore_bytes
from cpbook.pcp.ring_plan import ring_comm_bytes
from cpbook.pcp.zigzag import padded_len


def prefill_flops(model: ModelSpec, tokens: int) -> tuple[float, float]:
    """FLOPs of one causal prefill of ``tokens`` tokens: ``(matmul, attention)``.

    ``matmul = 2 * num_params * tokens`` (every weight used once per token; for an MoE model
    this counts all experts, so only use it for dense models) and
    ``attention = 2 * num_layers * num_q_heads * head_dim * tokens**2`` (QKᵀ and PV, each
    ``2·T²·H·d`` for the full square, halved by the causal mask).  The crossover where attention
    overtakes the matmuls is ``tokens = num_params / (num_layers * num_q_heads * head_dim)``.
    """
    check_tokens("tokens", tokens)
    attention = 2.0 * model.num_layers * model.num_q_heads * model.head_dim * tokens**2
    return 2.0 * model.num_params * tokens, attention


def decode_bytes_per_step(
    model: ModelSpec, context_tokens: int, tp: int = 1, dcp: int = 1, kv_dtype: str = "bf16"
) -> tuple[float, float]:
    """HBM bytes one GPU reads for one decode step of one request: ``(weights, kv)``.

    Decode is memory-bound: every step streams this GPU's weight shard and its share of the
    request's KV cache (``context_tokens`` tokens).  ``(weights + kv) / hbm_bw`` bounds TPOT
    from below.
    """
    kv = kv_bytes_per_token_per_gpu(model, tp, dcp, kv_dtype) * context_tokens
    return weight_bytes_per_gpu(model, tp), kv


# ------------------------------------------------------------------- prefill (TTFT) of layouts

#: Fraction of the dense BF16 peak that prefill GEMMs and attention reach together.  A round
#: assumption, not a fit: Meta reports 63 % "FLOPS utilization" for its 1M-token prefill
#: (arXiv 2411.01783, FP8 GEMMs and its own FLOP count); dense BF16 prefill usually lands lower.
DEFAULT_MFU = 0.5
PCP_COMM = ("allgather", "ring")


@dataclass(frozen=True)
class PrefillTime:
    """Modelled seconds of one request's prefill on one replica (no other load).

    ``compute_s``: GEMMs and attention at ``mfu`` of the peak, split over ``tp * pcp`` GPUs;
    ``tp_comm_s``: two all-reduces per layer; ``cp_comm_s``: the context-parallel K/V exchange
    per layer (all-gathers, or ring steps not hidden behind attention) and the restore.
    """

    compute_s: float
    tp_comm_s: float
    cp_comm_s: float

    @property
    def total_s(self) -> float:
        return self.compute_s + self.tp_comm_s + self.cp_comm_s


def ttft(
    model: ModelSpec,
    gpu: GPUSpec,
    layout: Layout,
    prompt_tokens: int,
    *,
    mfu: float = DEFAULT_MFU,
    link: LinkSpec | None = None,
    cp_link: LinkSpec | None = None,
    cp_comm: str = "allgather",
    act_bytes: int = 2,
    kv_bytes: int = 2,
) -> PrefillTime:
    """Time to first token of one ``prompt_tokens`` prompt on one replica of ``layout``.

    DCP adds nothing to a fresh prefill (every rank computes its heads over the whole prompt
    and keeps its share of the cache), DP none either (one replica serves the request).  PCP
    splits the tokens zigzag over ``pcp`` ranks: ``cp_comm="allgather"`` is vLLM's K/V
    all-gather before attention (:func:`cpbook.pcp.prefill.pcp_comm_bytes`, not overlapped),
    ``"ring"`` Meta's pass-KV ring (:func:`cpbook.pcp.ring_plan.ring_comm_bytes`), each step
    hidden behind that step's attention.  ``link`` is TP's, ``cp_link`` the CP group's
    (defaults: the GPU's scale-up link).  MoE models count active parameters only; attention
    FLOPs are :func:`prefill_flops`'s (for MLA, ``head_dim`` 192 for QK and PV alike: about
    20 % above the 128-wide PV product).
    """

    check_tokens("prompt_tokens", prompt_tokens, minimum=1)
    if not 0 < mfu <= 1:
        raise ValueError(f"[mfu] requires 0 < mfu <= 1; got {mfu=}")
    if cp_comm not in PCP_COMM:
        raise ValueError(f"[cp-comm] requires cp_comm in {PCP_COMM}; got {cp_comm=}")
    cfg = layout.config(model)
    link = link or link_of(gpu)
    cp_link = cp_link or link
    gpus, n, layers = cfg.tp * cfg.pcp, cfg.pcp, model.num_layers
    mm, attn = prefill_flops(model, prompt_tokens)
    mm *= model.params_per_token / model.num_params
    peak = gpu.bf16_flops * mfu
    rows = padded_len(prompt_tokens, n) // n
    allreduce = 2 * rows * model.hidden_size * act_bytes * (cfg.tp - 1) // cfg.tp
    tp_s = 2 * layers * collective_time("all_reduce", allreduce, cfg.tp, link)
    kvh = 1 if model.use_mla else max(model.num_kv_heads // cfg.tp, 1)
    if model.use_mla:  # the latent and the rotary key are gathered (no separate V)
        d, dv = model.kv_lora_rank, model.qk_rope_head_dim
    else:
        d = dv = model.head_dim
    cp_s = 0.0
    if n > 1 and cp_comm == "allgather":
        calls = pcp_comm_bytes(rows, kvh, d, n, dv, kv_bytes)
        cp_s = layers * sum(collective_time(op, b, n, cp_link) for op, b in calls)
    elif n > 1:
        # a pass-KV step sends K and V rows (2 x head_dim each); (d + dv) / 2 gives K + V widths
        steps = ring_comm_bytes(
            "pass_kv", [prompt_tokens], [0], 1, kvh, (d + dv) // 2, n, 0, kv_bytes
        )
        attn_step = attn / gpus / peak / layers / n
        cp_s = layers * sum(
            max(0.0, cp_link.alpha_s + b / cp_link.bw_bytes_per_s - attn_step) for _, b in steps
        )
    if n > 1:
        restore = pcp_restore_bytes(rows, model.hidden_size * act_bytes, n)
        cp_s += sum(collective_time(op, b, n, cp_link) for op, b in restore)
    return PrefillTime((mm + attn) / gpus / peak, tp_s, cp_s)


# -------------------------------------------------------------------- decode (TPOT) of layouts


@dataclass(frozen=True)
class DecodeTime:
    """Modelled seconds of one decode step on one GPU of a layout.

    Memory (weights, KV, TPA's extra ``q_proj`` and MLA ``W_UK_T`` shards, at ``hbm_efficiency``
    of the HBM bandwidth) and compute (at ``mfu``) overlap, so the step costs the larger of the
    two; the collectives (α–β, per layer) add to it.  ``batch_per_gpu``: requests this GPU's replica
    (or, PCP without DCP, this PCP rank) decodes in the step.
    """

    memory_s: float
    compute_s: float
    comm_s: float
    batch_per_gpu: int

    @property
    def total_s(self) -> float:
        return max(self.memory_s, self.compute_s) + self.comm_s


def _expert_fraction(model: ModelSpec, tokens: int) -> float:
    """Share of a MoE model's routed experts that ``tokens`` tokens touch, if each token picks
    its experts independently (1 for dense models)."""
    if not model.expert_params:
        return 1.0
    per_token = model.params_per_token - (model.num_params - model.expert_params)
    a = min(1.0, max(per_token, 0.0) / model.expert_params)
    return 1.0 - (1.0 - a) ** tokens


def tpot(
    model: ModelSpec,
    gpu: GPUSpec,
    layout: Layout,
    context_tokens: int,
    batch: int = 1,
    *,
    kv_dtype: str = "bf16",
    hbm_efficiency: float = DEFAULT_HBM_EFFICIENCY,
    mfu: float = DEFAULT_MFU,
    link: LinkSpec | None = None,
    dcp_comm_backend: str = "ag_rs",
    act_bytes: int = 2,
) -> DecodeTime:
    """One decode step of ``batch`` requests of ``context_tokens`` cached tokens each, spread
    evenly over the ``dp`` replicas (PCP without DCP: over the PCP ranks too, as vLLM's
    ``pcp_shard_decode_requests`` does).

    Per GPU: its weight shard (MoE: only the experts the batch touches), its share of the KV
    (:func:`~cpbook.costmodel.memory.layout_kv_bytes_per_token`), and per layer the
    collectives of :func:`cpbook.dcp.tpa.tpa_comm_bytes` (DCP's query all-gather unless TPA, the
    combine, the ``o_proj`` all-reduce) plus the MLP's all-reduce.  Expert-parallel all-to-alls
    are not modelled.
    """

    check_tokens("context_tokens", context_tokens, minimum=1)
    check_tokens("batch", batch, minimum=1)
    check_hbm_efficiency(hbm_efficiency)
    cfg = layout.config(model)
    link = link or link_of(gpu)
    shards = layout.dp * (cfg.pcp if cfg.dcp == 1 else 1)
    b = -(-batch // shards)
    weights = layout_weight_bytes(model, layout)
    if model.expert_params:
        local = (
            model.expert_params
            * model.weight_bytes_per_param
            / (layout.num_gpus if layout.ep else cfg.tp)
        )
        touched = b * layout.dp if layout.ep else b
        weights -= local * (1.0 - _expert_fraction(model, touched))
    kv = layout_kv_bytes_per_token(model, layout, kv_dtype) * context_tokens * b
    extra = tpa_weight_costs(model, cfg, b, act_bytes)
    tpa_bytes = extra["extra_weight_bytes"] + extra["extra_w_uk_t_bytes"]
    memory = (weights + kv + tpa_bytes * model.num_layers) / (
        gpu.hbm_bw_bytes_per_s * hbm_efficiency
    )
    q_dim = model.kv_lora_rank + model.qk_rope_head_dim if model.use_mla else model.head_dim
    attn_flops = 4 * cfg.q_heads_per_rank * q_dim * context_tokens * b / cfg.dcp
    compute = (2 * model.params_per_token * b / cfg.tp + attn_flops * model.num_layers) / (
        gpu.bf16_flops * mfu
    )
    calls = decode_attention_calls(model, cfg, layout.tpa, b, dcp_comm_backend, act_bytes)
    mlp = 2 * b * model.hidden_size * act_bytes * (cfg.tp - 1) // cfg.tp
    per_layer = sum(collective_time(op, nb, n, link) for op, n, nb in calls) + collective_time(
        "all_reduce", mlp, cfg.tp, link
    )
    return DecodeTime(memory, compute, per_layer * model.num_layers, b)


def tpot_break_even(
    model: ModelSpec,
    gpu: GPUSpec,
    layout: Layout,
    baseline: Layout,
    batch: int = 1,
    lo: int = 1024,
    hi: int = 2**19,
    resolution: int = 256,
) -> int:
    """The context length (within ``resolution`` tokens, bisected in ``[lo, hi]``) above which
    ``layout``'s whole-model TPOT beats ``baseline``'s at ``batch`` requests; ``hi`` if it
    never does below it.  Assumes one crossing (the DCP terms are linear in the context)."""

    def slower(c: int) -> bool:
        return (
            tpot(model, gpu, layout, c, batch).total_s
            > tpot(model, gpu, baseline, c, batch).total_s
        )

    while hi - lo > resolution:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if slower(mid) else (lo, mid)
    return hi


def decode_throughput(
    model: ModelSpec, gpu: GPUSpec, layout: Layout, context_tokens: int, batch: int, **kwargs
) -> float:
    """Output tokens per second per GPU with ``batch`` requests decoding at once
    (``kwargs``: those of :func:`tpot`)."""
    step = tpot(model, gpu, layout, context_tokens, batch, **kwargs)
    return batch / step.total_s / layout.num_gpus


def prefill_throughput(
    model: ModelSpec, gpu: GPUSpec, layout: Layout, prompt_tokens: int, **kwargs
) -> float:
    """Prompt tokens per second per GPU when every replica prefills one prompt after another
    (``kwargs``: those of :func:`ttft`)."""
    t = ttft(model, gpu, layout, prompt_tokens, **kwargs).total_s
    return prompt_tokens / t / (layout.tp * layout.pcp)
