"""Time of whole layouts: TTFT, TPOT and throughput (chapter 8)."""

from __future__ import annotations

from .memory import kv_bytes_per_token_per_gpu, weight_bytes_per_gpu
from .specs import ModelSpec


def prefill_flops(model: ModelSpec, tokens: int) -> tuple[float, float]:
    """FLOPs of one causal prefill of ``tokens`` tokens: ``(matmul, attention)``.

    ``matmul = 2 * num_params * tokens`` (every weight used once per token; for an MoE model
    this counts all experts, so only use it for dense models) and
    ``attention = 2 * num_layers * num_q_heads * head_dim * tokens**2`` (QKᵀ and PV, each
    ``2·T²·H·d`` for the full square, halved by the causal mask).  The crossover where attention
    overtakes the matmuls is ``tokens = num_params / (num_layers * num_q_heads * head_dim)``.
    """
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        raise ValueError(
            f"[non-negative-tokens] requires a non-negative int; got tokens={tokens!r}"
        )
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
