"""The GPU side's efficiency terms: what TTFT and TPOT rest on (chapter 8).

No GPU has been lent to this project, so these terms are not measured here.  Each is read off
a peer built from GPU kernel measurements: NVIDIA's AIConfigurator 0.12.0 (``aiconfigurator``
in ``book/references.bib``), its ``h200_sxm`` tables for the vLLM backend (measured with vLLM
0.24.0), queried per operation (``get_context_latency_dict`` /
``get_generation_latency_dict``) on the cases of ``bench/vs_aiconfigurator.py``.  Each comment
names the operation and the case it was read from; where a term is a formula (the EP routing
imbalance) it says so.  The peer's tables stop near 128K tokens of context and at the batch
sizes it profiled: beyond them these terms are extrapolations, and chapter 8 says so.
"""

from __future__ import annotations

import math

#: where every fitted number of this module comes from (a key of ``book/references.bib``)
SOURCE = "aiconfigurator"

# ------------------------------------------------------------------------------------ prefill

#: Fraction of the peak a dense prefill GEMM reaches, by weight bytes (2: BF16 at the BF16
#: peak, 1: FP8 block-scaled MLA models at the FP8 peak), as ``((tokens, mfu), (tokens, mfu))``
#: points (see :func:`ramp`).  BF16: Llama-3.1-8B TP1 at 4K, the peer's qkv + o + gate/up +
#: down GEMMs take 78 ms for 5.7e13 FLOPs (0.74 of 989 TFLOP/s); Llama-3.1-70B TP8 at 32K the
#: same.  FP8 MLA: DeepSeek-V3 TP8's MLA projections and shared experts (its MLA block less
#: attention at the attention MFU), 0.18 of the FP8 peak at 4K tokens and 0.45 at 32K: narrow
#: per-GPU shards.  FP8 GQA models' GEMMs are priced by shape (:func:`fp8_gemm_mfu`).
GEMM_MFU: dict[int, tuple[tuple[int, float], ...]] = {
    2: ((4096, 0.74), (32768, 0.74)),
    1: ((4096, 0.18), (32768, 0.45)),
}
#: FP8 block-scaled GEMM ``(M tokens) x (K in) -> (N out)`` at the FP8 peak:
#: ``e / ((1 + n0/N) (1 + k0/K) (1 + w0/(M N K)))`` with ``(e, n0, k0, w0)`` below, fitted (log
#: least squares) on the peer's qkv / o / gate-up / down GEMMs of Llama-3.1-8B and -70B with
#: ``gemm_quant_mode="fp8_block"``, TP 1-8, 2K-64K tokens (192 GEMMs; each case's GEMM time
#: within 2.6 % median, 13 % worst).  Wide shards near 0.66 (70B TP1 at 2K: 0.59-0.70), narrow
#: ones far below (8B TP8's o_proj, K = 512, at 2K: 0.05).
FP8_GEMM_SHAPE = (0.709, 1007.0, 189.0, 1.87e10)
#: Fraction of the BF16 peak prefill attention (FlashAttention / FlashMLA prefill) reaches, by
#: prompt length: 0.49 at 4K (Llama-3.1-8B TP1), 0.65 at 32K (Llama-3.1-70B TP8) and at 128K
#: (Qwen3-235B TP8, DeepSeek-V3 TP8).
ATTENTION_MFU: tuple[tuple[int, float], ...] = ((4096, 0.49), (32768, 0.65))
#: Routed-expert GEMMs (fused MoE) in prefill, by expert shape (:func:`moe_gemm_mfu`): ``m``
#: tokens per expert, ``n`` the expert's intermediate width per GPU.  Read off the peer's
#: ``context_moe`` on Qwen3-235B (BF16) and DeepSeek-V3 (FP8 block-scaled) at TP 4 and 8, DP 8
#: with experts TP 8, and DP 8 x EP 8, 2K-64K tokens.  Width: TP 4 over TP 8 runs 1.46x
#: (Qwen3-235B) and 1.39x (DeepSeek-V3) the fraction, both ``n / (n + 325)``.  Tokens: ~0.6 of
#: the plateau at 128 (BF16) or 64 (FP8) tokens per expert, the plateau from ~1K.  By weight
#: bytes: the plateau at infinite width, and the tokens per expert at half of it.
MOE_GEMM_PLATEAU: dict[int, float] = {2: 0.764, 1: 0.331}
MOE_TOKENS_HALF: dict[int, float] = {2: 85.0, 1: 33.0}
MOE_WIDTH_HALF = 325.0
#: ... and with EP, per weight bytes at infinite width: the peer's DP 8 x EP 8 expert time is
#: flat in the tokens (0.162 of the BF16 peak for Qwen3-235B's 1,536-wide experts, 0.099 of
#: the FP8 peak for DeepSeek-V3's 2,048): the busiest rank's routed tokens set the pace.
MOE_EP_GEMM_MFU: dict[int, float] = {2: 0.196, 1: 0.114}
#: HBM bytes an add + RMSNorm kernel moves per hidden element (read residual and input, write
#: both, at the datasheet bandwidth): Llama-3.1-8B TP1 4K 38 µs per norm for 16.8M elements,
#: Llama-3.1-70B TP8 32K 10 B/element.  Not split by TP (vLLM keeps the residual whole).
NORM_BYTES_PER_ELEMENT = 10.5
#: HBM bytes the SiLU-and-multiply kernel moves per element of the (TP-sharded) MLP width: 7.7
#: for Llama-3.1-8B TP1 at 4K and Llama-3.1-70B TP8 at 32K.
ACT_BYTES_PER_ELEMENT = 7.7
#: Any elementwise kernel's floor: the peer's add + RMSNorm and activation at decode batch 1
#: take 3.0 µs each on every model and TP size.
ELEMENTWISE_FLOOR_S = 3.0e-6
#: vLLM's default ``max_num_batched_tokens`` for ``vllm serve`` on H100/H200-class GPUs
#: (v0.34.0, ``vllm/engine/arg_utils.py``, ``get_batch_defaults``): the prefill chunk budget
#: of one scheduler step.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192

# ------------------------------------------------------------------------------------- decode

#: Decode all-reduce latency: vLLM captures decode in CUDA graphs and its custom all-reduce
#: takes ~5.2 µs per call on 2-8 H200s (the peer's ``generation_ar_1``, Llama-3.1-70B TP8 and
#: Qwen3-235B TP8 batch 1), against NCCL's ~15 µs of prefill.
DECODE_ALLREDUCE_ALPHA_S = 5.2e-6
#: Fixed cost of one small decode GEMM (launch and tail): the peer's qkv / o / gate-up / down
#: GEMMs exceed their weight streaming at 0.8 of HBM by 2.5 µs each on average (Llama-3.1-70B
#: TP8, Llama-3.1-8B TP1, batch 1).
DECODE_GEMM_FIXED_S = 2.5e-6
#: ... and of one FP8 block-scaled decode GEMM of a GQA model, by requests in the step
#: (:func:`fp8_decode_gemm_s`): the peer's vLLM tables put each qkv / o / gate-up / down call
#: at ~58 µs with little weight to stream (Llama-3.1-70B TP8: 59.5 µs, Llama-3.1-8B TP1 qkv:
#: 59 µs, batch 1-16), ~86 µs from 32 requests (72 µs at 24), and overlap it with the weight
#: streaming rather than add to it: ``hypot(fixed, streaming)`` (Llama-3.1-70B TP1 batch 1:
#: gate-up 131 µs for 122 µs of streaming, down 88 µs for 61; TP2's gate-up 86 µs for 61).
#: MLA models' projections are in :data:`MLA_DECODE_FIXED_S`.
DECODE_FP8_GEMM_FIXED_S: tuple[tuple[int, float], ...] = ((16, 58e-6), (32, 86e-6))
#: Fixed cost of one GQA decode-attention call (FlashAttention split-KV): Llama-3.1-8B TP1 at 4K
#: batch 1, 16.6 µs per layer for 3.6 µs of KV streaming.
DECODE_ATTENTION_FIXED_S = 12e-6
#: HBM efficiency of decode attention per (request x KV head) on one GPU, up to
#: :data:`~cpbook.costmodel.decode.DEFAULT_HBM_EFFICIENCY`: one request with one KV head per GPU
#: streams its KV at ~0.35 of the bandwidth (Qwen3-235B TP8, 4K->128K at batch 1: 37 µs for
#: 65 MB; DeepSeek-V3 TP8's MLA likewise, 0.31), eight at ~0.85 (batch 8).
DECODE_ATTENTION_UNIT_EFFICIENCY = 0.35
#: MLA decode block (q/kv projections, absorbed attention, o_proj) beyond its weight and KV
#: streaming: DeepSeek-V3 TP8 batch 1 at 4K, 96 µs per layer of which ~6 µs weights; DP8
#: (TP1) 142 µs of which ~49 µs weights.  The small-batch MLA kernels are far from
#: bandwidth-bound.
MLA_DECODE_FIXED_S = 90e-6
#: ... and its growth per request in the batch (DeepSeek-V3 TP8 at 4K: 96 -> 186 µs from 1 to
#: 64 requests).
MLA_DECODE_PER_REQUEST_S = 1.4e-6
#: Routed-expert decode per MoE layer, by weight bytes: ``max(floor, fixed + bytes / bw)``
#: (bytes: the experts the batch touches on the busiest GPU, at 0.8 of HBM).  BF16 Qwen3-235B
#: TP8: 31.8 µs at batch 1 for 9.8 µs of streaming, 77 / 153 µs at 8 / 32; FP8 block-scaled
#: DeepSeek-V3 TP8: 126 µs at batch 1 (10 µs of streaming), 140 / 289 / 354 µs at 8 / 32 / 64.
#: A GQA model's FP8 block-scaled experts decode in the BF16 time of the same experts (the
#: peer's Qwen3-235B TP8 with ``gemm_quant_mode="fp8_block"``: 32 / 78 / 153 µs at batch 1 / 8
#: / 32, for 5 / 32 / 69 µs of FP8 streaming), see :func:`moe_decode_s`.
MOE_DECODE_FLOOR_S: dict[int, float] = {2: 32e-6, 1: 130e-6}
MOE_DECODE_FIXED_S: dict[int, float] = {2: 15e-6, 1: 45e-6}
#: EP all-to-all (dispatch and combine, each once per MoE layer): 14 µs per call at one token
#: per rank (Qwen3-235B DP8 x EP8 ``generation_moe_pre_dispatch``), and ~0.7 of the link
#: bandwidth at prefill sizes (DeepSeek-V3 DP8 x EP8 at 4K: 1.29 ms per call).
ALL_TO_ALL_ALPHA_S = 14e-6
ALL_TO_ALL_BW_EFFICIENCY = 0.7


def ramp(points: tuple[tuple[int, float], ...], tokens: int) -> float:
    """An efficiency given at two prompt lengths ``((t0, m0), (t1, m1))``, at ``tokens``:
    linear in ``log2(tokens)`` between them, flat outside (the peer's cases span 4K-128K)."""
    (t0, m0), (t1, m1) = points
    x = math.log2(max(tokens, 1))
    f = min(1.0, max(0.0, (x - math.log2(t0)) / (math.log2(t1) - math.log2(t0))))
    return m0 + f * (m1 - m0)


def fp8_gemm_mfu(m: float, n: float, k: float) -> float:
    """:data:`FP8_GEMM_SHAPE`'s efficiency of an ``m x k`` by ``k x n`` FP8 GEMM."""
    e, n0, k0, w0 = FP8_GEMM_SHAPE
    return e / ((1 + n0 / n) * (1 + k0 / k) * (1 + w0 / (m * n * k)))


def moe_gemm_mfu(weight_bytes: int, tokens_per_expert: float, width: float, ep: bool) -> float:
    """Fraction of the peak the routed experts reach in prefill (:data:`MOE_GEMM_PLATEAU`): a
    ``width``-wide expert slice on ``tokens_per_expert`` tokens, or under EP
    (:data:`MOE_EP_GEMM_MFU`) a whole expert whatever its tokens."""
    wide = width / (width + MOE_WIDTH_HALF)
    if ep:
        return MOE_EP_GEMM_MFU[weight_bytes] * wide
    half = MOE_TOKENS_HALF[weight_bytes]
    return MOE_GEMM_PLATEAU[weight_bytes] * wide * tokens_per_expert / (tokens_per_expert + half)


def attention_mfu(tokens: int) -> float:
    """:data:`ATTENTION_MFU` at a prompt of ``tokens`` tokens."""
    return ramp(ATTENTION_MFU, tokens)


def touched_experts(num_experts: int, top_k: int, tokens: float) -> float:
    """Expected distinct experts ``tokens`` tokens pick, each ``top_k`` of ``num_experts``
    independently and uniformly: ``E · (1 − (1 − k/E)^tokens)``."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def busiest_rank_experts(num_experts: int, ep: int, top_k: int, tokens: float) -> float:
    """Expected distinct experts on the busiest of ``ep`` ranks holding ``num_experts / ep``
    experts each, when ``tokens`` tokens route uniformly: per rank the count is ~binomial
    (``n = E/ep``, ``p`` = one expert touched), its maximum over ``ep`` ranks ~``mean + σ ·
    sqrt(2 ln ep)`` (the Gaussian extreme-value approximation), capped at ``n``.  A formula,
    not a fit: on Qwen3-235B DP8 x EP8 at batch 1 it gives 1.62x the mean, the peer 1.54x."""
    n = num_experts / ep
    p = 1.0 - (1.0 - top_k / num_experts) ** tokens
    if ep == 1:
        return n * p
    return min(n, n * p + math.sqrt(n * p * (1 - p)) * math.sqrt(2 * math.log(ep)))


def elementwise_s(elements: float, bytes_per_element: float, hbm_bw: float) -> float:
    """Seconds of one elementwise kernel over ``elements`` values: its bytes at the datasheet
    bandwidth, at least :data:`ELEMENTWISE_FLOOR_S`."""
    return max(ELEMENTWISE_FLOOR_S, elements * bytes_per_element / hbm_bw)


def moe_decode_s(
    expert_bytes: float, weight_bytes: float, bw: float, gqa: bool = False
) -> tuple[float, float]:
    """One MoE layer's routed experts in decode, ``(streaming, fixed)`` seconds:
    ``max(floor, fixed + bytes / bw)`` split into the bytes' share and the rest.  FP8 experts
    of a GQA model (``gqa``) take the BF16 terms at two bytes per weight."""
    key = 1 if weight_bytes <= 1 and not gqa else 2
    stream = expert_bytes / bw
    paced = stream * 2 / weight_bytes if key == 2 else stream
    total = max(MOE_DECODE_FLOOR_S[key], MOE_DECODE_FIXED_S[key] + paced)
    return stream, total - stream


def fp8_decode_gemm_s(weight_bytes: float, bw: float, requests: int) -> float:
    """One FP8 block-scaled decode GEMM of ``weight_bytes`` per GPU for ``requests`` requests,
    beyond its streaming at ``bw``: ``hypot(fixed, streaming) - streaming`` with
    :data:`DECODE_FP8_GEMM_FIXED_S` (linear in ``log2(requests)`` between its points)."""
    stream = weight_bytes / bw
    return math.hypot(ramp(DECODE_FP8_GEMM_FIXED_S, requests), stream) - stream


def all_to_all_s(bytes_per_rank: float, ep: int, link_bw: float) -> float:
    """One EP all-to-all: :data:`ALL_TO_ALL_ALPHA_S` plus the bytes sent at
    :data:`ALL_TO_ALL_BW_EFFICIENCY` of the link; 0 without EP or with nothing to send."""
    if ep <= 1 or bytes_per_rank <= 0:
        return 0.0
    return ALL_TO_ALL_ALPHA_S + bytes_per_rank / (link_bw * ALL_TO_ALL_BW_EFFICIENCY)
