"""Time of whole deployments: TTFT, TPOT and throughput (chapter 8)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from cpbook.core.errors import RuleError
from cpbook.costmodel import gpu_terms as gt
from cpbook.costmodel.decode import collective_time
from cpbook.costmodel.decode_step import DecodeTime, decode_step
from cpbook.costmodel.knobs import CostKnobs
from cpbook.costmodel.memory import Deployment, kv_bytes_per_token_per_gpu, weight_bytes_per_gpu
from cpbook.costmodel.moe_gather import ep_dispatch_rows, moe_gather_s
from cpbook.costmodel.nodes import group_link
from cpbook.costmodel.specs import (
    GPUSpec,
    LinkSpec,
    ModelSpec,
    check_moe_shape,
    check_tokens,
)
from cpbook.pcp.comm_bytes import pcp_comm_bytes, pcp_restore_bytes
from cpbook.pcp.ring_plan import RingShards, ring_comm_bytes
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


# ------------------------------------------------------------------- prefill (TTFT) of deployments

#: One MFU for every prefill FLOP, the book's assumption before the GPU-side terms of
#: :mod:`cpbook.costmodel.gpu_terms`; ``ttft(..., knobs=CostKnobs(mfu=DEFAULT_MFU))`` still
#: prices it so.  Meta
#: reports 63 % "FLOPS utilization" for its 1M-token prefill (arXiv 2411.01783, FP8 GEMMs).
DEFAULT_MFU = 0.5
PCP_COMM = ("allgather", "ring")


def prefill_gemm_flops(model: ModelSpec, tokens: int, requests: int = 1) -> tuple[float, float]:
    """GEMM FLOPs of prefilling ``tokens`` prompt tokens of ``requests`` requests:
    ``(dense, experts)``.  The embedding is a lookup (no FLOPs) and the LM head runs for each
    request's last token only; ``experts``: the routed experts the tokens use (0 for a dense
    model).  Compare :func:`prefill_flops`, the textbook ``2 · num_params · tokens``."""
    check_tokens("tokens", tokens)
    routed = model.params_per_token - (model.num_params - model.expert_params)
    routed = max(routed, 0.0) if model.expert_params else 0.0
    embed = model.lm_head_params * (1 if model.tie_word_embeddings else 2)
    body = model.params_per_token - routed - embed
    return 2.0 * (body * tokens + model.lm_head_params * requests), 2.0 * routed * tokens


@dataclass(frozen=True)
class PrefillTime:
    """Modelled seconds of one request's prefill on one replica.

    ``compute_s``: GEMMs and attention at their MFUs, split over ``tp * pcp`` GPUs;
    ``tp_comm_s``: two all-reduces per layer; ``cp_comm_s``: the context-parallel K/V exchange
    per layer (all-gathers, or ring steps not hidden behind attention) and the restore;
    ``elementwise_s``: norms and activations (HBM-bound); ``ep_comm_s``: EP's dispatch and
    combine all-to-alls; ``moe_comm_s``: without EP, the MoE layers' token all-gathers and
    reduce-scatters over DP and PCP (:mod:`cpbook.costmodel.moe_gather`).
    """

    compute_s: float
    tp_comm_s: float
    cp_comm_s: float
    elementwise_s: float = 0.0
    ep_comm_s: float = 0.0
    moe_comm_s: float = 0.0

    @property
    def total_s(self) -> float:
        comm = self.tp_comm_s + self.cp_comm_s + self.ep_comm_s + self.moe_comm_s
        return self.compute_s + comm + self.elementwise_s


def dense_gemm_mfu(model: ModelSpec, tp: int, rows: int) -> float:
    """Fraction of the weights' peak the dense (non-expert) prefill GEMMs reach on ``rows``
    tokens per GPU at TP ``tp``: BF16 and FP8 MLA models by
    :data:`~cpbook.costmodel.gpu_terms.GEMM_MFU`; FP8 GQA models each GEMM by its shape
    (:func:`~cpbook.costmodel.gpu_terms.fp8_gemm_mfu`: qkv, o, and the dense MLP's gate-up and
    down), combined by FLOPs (the harmonic mean the summed times give)."""
    wb = 1 if model.weight_bytes_per_param <= 1 else 2
    if wb == 2 or model.use_mla or not model.hidden_size:
        return gt.ramp(gt.GEMM_MFU[wb], rows)
    h, d = model.hidden_size, model.head_dim
    q, kv = max(model.num_q_heads // tp, 1) * d, max(model.num_kv_heads // tp, 1) * d
    shapes = [(q + 2 * kv, h, model.num_layers), (h, q, model.num_layers)]
    if model.intermediate_size:
        mlp, layers = model.intermediate_size // tp, model.num_layers - model.moe_layers
        shapes += [(2 * mlp, h, layers), (h, mlp, layers)]
    flops = [n * k * c for n, k, c in shapes]
    times = [f / gt.fp8_gemm_mfu(rows, n, k) for f, (n, k, _) in zip(flops, shapes, strict=True)]
    return sum(flops) / sum(times)


def _prefill_compute_s(
    model: ModelSpec, gpu: GPUSpec, deployment: Deployment, tokens: int, mfu: float | None
) -> tuple[float, float]:
    """``(compute, attention)`` seconds of one prompt's prefill on one GPU of ``deployment``'s
    replica; with ``mfu`` every FLOP at that one MFU (the former model).  Under PCP every
    efficiency is read at one rank's share of the prompt, the tokens its kernels see."""
    gpus = deployment.tp * deployment.pcp
    rows = padded_len(tokens, deployment.pcp) // deployment.pcp
    wb = 1 if model.weight_bytes_per_param <= 1 else 2
    dense, experts = prefill_gemm_flops(model, tokens)
    _, attn = prefill_flops(model, tokens)
    if model.use_mla:  # PV is v_head_dim (= qk_nope_head_dim) wide, not the 192 of QK
        attn *= (2 * model.head_dim - model.qk_rope_head_dim) / (2 * model.head_dim)
    peak = gpu.peak_flops(model.weight_bytes_per_param)
    if mfu is not None:  # the former model: prefill_flops' count, all at mfu of the BF16 peak
        mm, attn = prefill_flops(model, tokens)
        mm *= model.params_per_token / model.num_params
        return (mm + attn) / gpus / (gpu.bf16_flops * mfu), attn / gpus / (gpu.bf16_flops * mfu)
    attn_s = attn / gpus / (gpu.bf16_flops * gt.attention_mfu(rows))
    # every replica prefills at once (the loaded case): the experts see the tokens of the
    # dp x pcp ranks of the pool, each GPU one prompt's expert FLOPs
    expert_s = 0.0
    if experts:
        ep = deployment.ep and deployment.num_gpus > 1
        per_expert = rows * deployment.dp * deployment.pcp * model.num_experts_per_tok
        width = model.expert_size_params / (3 * model.hidden_size) / deployment.moe_tp
        eff = gt.moe_gemm_mfu(wb, per_expert / model.num_experts, width, ep)
        expert_s = experts / gpus / (peak * eff)
    gemm_s = dense / gpus / (peak * dense_gemm_mfu(model, deployment.tp, rows))
    return gemm_s + expert_s + attn_s, attn_s


def ttft(
    model: ModelSpec,
    gpu: GPUSpec,
    deployment: Deployment,
    prompt_tokens: int,
    *,
    knobs: CostKnobs = CostKnobs(),
    cp_link: LinkSpec | None = None,
    cp_comm: str = "allgather",
    kv_bytes: int = 2,
) -> PrefillTime:
    """Time to first token of one ``prompt_tokens`` prompt on one replica of ``deployment``.

    GEMMs (:func:`prefill_gemm_flops`: no embedding FLOPs, the LM head for the last token) at
    :func:`dense_gemm_mfu` of the weights' peak (FP8 weights: the FP8 peak), routed experts
    at :func:`~cpbook.costmodel.gpu_terms.moe_gemm_mfu` of their shape, attention
    at :func:`~cpbook.costmodel.gpu_terms.attention_mfu` of the BF16 peak.  ``knobs.mfu`` instead
    gives the former model: :func:`prefill_flops`' count (MoE: active share), every FLOP at
    ``mfu`` of the BF16 peak, no elementwise or EP terms.  Norms and activations stream their
    bytes; TP all-reduces and EP all-to-alls use the link's α–β (EP's dispatch carries each GPU's
    :func:`~cpbook.costmodel.moe_gather.ep_dispatch_rows`).  DCP adds nothing to a fresh
    prefill (every rank computes its heads over the whole prompt and keeps its share of the
    cache), DP nothing to a dense model's; a MoE model's experts span every GPU of the pool, so
    without EP each MoE layer gathers the tokens over DP and PCP and scatters them back
    (:func:`~cpbook.costmodel.moe_gather.moe_gather_s`, ``moe_comm_s``: every replica prefilling
    a prompt of the same length, the loaded case).
    PCP splits the tokens zigzag over ``pcp`` ranks: ``cp_comm="allgather"`` is vLLM's K/V
    all-gather before attention (:func:`cpbook.pcp.prefill.pcp_comm_bytes`, not overlapped),
    ``"ring"`` Meta's pass-KV ring (:func:`cpbook.pcp.ring_plan.ring_comm_bytes`), each step
    hidden behind that step's attention.  ``knobs.link`` is TP's, ``cp_link`` the CP group's
    (defaults: the GPU's scale-up link); with ``knobs.nodes``, a TP, PCP or EP group that spans
    nodes (a DP group too) runs on the inter-node link instead
    (:func:`~cpbook.costmodel.nodes.group_link`);
    activations are ``knobs.act_bytes`` wide, the gathered
    K/V ``kv_bytes`` (the other knobs are decode's).
    """

    check_tokens("prompt_tokens", prompt_tokens, minimum=1)
    if cp_comm not in PCP_COMM:
        raise RuleError("cp-comm", f"cp_comm in {PCP_COMM}", cp_comm=cp_comm)
    mfu, act_bytes = knobs.mfu, knobs.act_bytes
    if mfu is None:
        check_moe_shape(model)
    cfg = deployment.config(model)
    link = group_link(gpu, deployment, "tp", knobs.nodes, knobs.link)
    cp_link = group_link(gpu, deployment, "pcp", knobs.nodes, cp_link or knobs.link)
    nodes = knobs.nodes
    ep_link_bw = group_link(gpu, deployment, "ep", nodes, knobs.link).bw_bytes_per_s
    n, layers = cfg.pcp, model.num_layers
    compute, attn_s = _prefill_compute_s(model, gpu, deployment, prompt_tokens, mfu)
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
        ring = RingShards((prompt_tokens,), (0,), n)
        steps = ring_comm_bytes("pass_kv", ring, 0, 1, kvh, (d + dv) // 2, kv_bytes)
        attn_step = attn_s / layers / n
        cp_s = layers * sum(
            max(0.0, cp_link.alpha_s + b / cp_link.bw_bytes_per_s - attn_step) for _, b in steps
        )
    if n > 1:
        restore = pcp_restore_bytes(rows, model.hidden_size * act_bytes, n)
        cp_s += sum(collective_time(op, b, n, cp_link) for op, b in restore)
    if mfu is not None:
        return PrefillTime(compute, tp_s, cp_s)
    bw = gpu.hbm_bw_bytes_per_s
    dense_layers = layers - model.moe_layers if model.expert_params else layers
    elem = 2 * layers * gt.elementwise_s(rows * model.hidden_size, gt.NORM_BYTES_PER_ELEMENT, bw)
    if model.intermediate_size:
        width = rows * model.intermediate_size / cfg.tp
        elem += dense_layers * gt.elementwise_s(width, gt.ACT_BYTES_PER_ELEMENT, bw)
    ep_s = moe_s = 0.0
    if model.expert_params:
        ep = deployment.num_gpus
        row_bytes = model.hidden_size * act_bytes
        sent = ep_dispatch_rows(deployment, rows) * model.num_experts_per_tok * row_bytes
        ep_s = 2 * model.moe_layers * gt.all_to_all_s(sent * (ep - 1) / ep, ep, ep_link_bw)
        dp_link = group_link(gpu, deployment, "dp", nodes, knobs.link)
        gather_link = {"dp": dp_link, "pcp": cp_link}
        moe_s = model.moe_layers * moe_gather_s(deployment, rows, row_bytes, gather_link.get)
    return PrefillTime(compute, tp_s, cp_s, elem, ep_s, moe_s)


def batch_ttft(
    model: ModelSpec,
    gpu: GPUSpec,
    deployment: Deployment,
    prompt_tokens: int,
    requests: int,
    *,
    knobs: CostKnobs = CostKnobs(),
) -> PrefillTime:
    """Prefill of ``requests`` prompts of ``prompt_tokens`` tokens together on one replica (a
    static batch in one scheduler step): every GEMM, norm and collective on the batch's
    ``requests × prompt_tokens`` tokens at once (:func:`ttft` of one prompt that long, the
    efficiencies read at its width), attention per prompt (no token attends to another
    prompt's)."""
    check_tokens("requests", requests, minimum=1)
    wide = ttft(model, gpu, deployment, prompt_tokens * requests, knobs=knobs)
    _, attn_wide = _prefill_compute_s(model, gpu, deployment, prompt_tokens * requests, knobs.mfu)
    _, attn_one = _prefill_compute_s(model, gpu, deployment, prompt_tokens, knobs.mfu)
    return replace(wide, compute_s=wide.compute_s - attn_wide + requests * attn_one)


# -------------------------------------------------------------------- decode (TPOT) of deployments


@dataclass(frozen=True)
class ContinuousBatching:
    """The steady state :func:`tpot` prices prefill chunks for: every request a prompt of
    ``prompt_len`` tokens and ``output_len`` output tokens, the chunks of one step at most
    ``max_num_batched_tokens`` (vLLM's ``SchedulerConfig`` budget).  Guarantees: all three are
    positive ints (rule ``positive-tokens``)."""

    prompt_len: int
    output_len: int
    max_num_batched_tokens: int = gt.DEFAULT_MAX_NUM_BATCHED_TOKENS

    def __post_init__(self) -> None:
        check_tokens("prompt_len", self.prompt_len, minimum=1)
        check_tokens("output_len", self.output_len, minimum=1)
        check_tokens("max_num_batched_tokens", self.max_num_batched_tokens, minimum=1)


def tpot(
    model: ModelSpec,
    gpu: GPUSpec,
    deployment: Deployment,
    context_tokens: int,
    batch: int = 1,
    *,
    knobs: CostKnobs = CostKnobs(),
    batching: ContinuousBatching | None = None,
) -> DecodeTime:
    """One decode step of ``batch`` requests (the planner's concurrency) of ``context_tokens``
    cached tokens each, spread evenly over the ``dp`` replicas (PCP without DCP: over the PCP
    ranks too, as vLLM's ``pcp_shard_decode_requests`` does); see
    :func:`cpbook.costmodel.decode_step.decode_step` for its terms and ``knobs``.

    Continuous batching: with ``batching``, each step also carries the prefill chunks of the
    requests that replace finished ones: in steady state each of the other ``r − 1`` requests
    of the replica (``r = ceil(batch / dp)``) is replaced every ``output_len`` steps, so
    ``(r − 1) · prompt_len / output_len`` tokens per step, at most ``max_num_batched_tokens``,
    each at one prompt's TTFT per token (``prefill_s``): the aggregated TPOT.  AIConfigurator's
    aggregated mode counts ``r`` (a request's own prefill too); a request's own prefill ends
    before its first token.
    """
    step = decode_step(model, gpu, deployment, context_tokens, batch, knobs=knobs)
    if batching is None:
        return step
    others = -(-batch // deployment.dp) - 1  # a request's own prefill precedes its first token
    b = batching
    chunk = min(others * b.prompt_len / b.output_len, b.max_num_batched_tokens)
    prefill_knobs = replace(knobs, mfu=None)  # the chunks at the GPU-side terms
    per_token = ttft(model, gpu, deployment, b.prompt_len, knobs=prefill_knobs).total_s
    return replace(step, prefill_s=chunk * per_token / b.prompt_len)


def tpot_break_even(
    model: ModelSpec,
    gpu: GPUSpec,
    deployment: Deployment,
    baseline: Deployment,
    batch: int = 1,
    lo: int = 1024,
    hi: int = 2**19,
    resolution: int = 256,
    *,
    knobs: CostKnobs = CostKnobs(),
) -> int:
    """The context length (within ``resolution`` tokens, bisected in ``[lo, hi]``) above which
    ``deployment``'s whole-model TPOT beats ``baseline``'s at ``batch`` requests (both priced
    with ``knobs``); ``hi`` if it never does below it.  Assumes one crossing (the DCP terms
    are linear in the context).

    More than eight parameters: the two deployments and the batch are the question, the
    bisection's bracket and resolution its numerics, and ``knobs`` the one assumptions object
    every time function takes (the break-even table passes a measured KV-read efficiency).
    """

    def slower(c: int) -> bool:
        return (
            tpot(model, gpu, deployment, c, batch, knobs=knobs).total_s
            > tpot(model, gpu, baseline, c, batch, knobs=knobs).total_s
        )

    while hi - lo > resolution:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if slower(mid) else (lo, mid)
    return hi


def decode_throughput(
    model: ModelSpec,
    gpu: GPUSpec,
    deployment: Deployment,
    context_tokens: int,
    batch: int,
    **kwargs,
) -> float:
    """Output tokens per second per GPU with ``batch`` requests decoding at once
    (``kwargs``: those of :func:`tpot`)."""
    step = tpot(model, gpu, deployment, context_tokens, batch, **kwargs)
    return batch / step.total_s / deployment.num_gpus


def prefill_throughput(
    model: ModelSpec, gpu: GPUSpec, deployment: Deployment, prompt_tokens: int, **kwargs
) -> float:
    """Prompt tokens per second per GPU when every replica prefills one prompt after another
    (``kwargs``: those of :func:`ttft`)."""
    t = ttft(model, gpu, deployment, prompt_tokens, **kwargs).total_s
    return prompt_tokens / t / (deployment.tp * deployment.pcp)
