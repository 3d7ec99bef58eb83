"""The problem generators the tests, benches and chapters draw their inputs from.

Each ``*_problem`` is a pure function of its sizes and ``seed``: float64 draws from one
``torch.Generator`` (then cast), identical on every rank, so a per-rank function, a test and a
bench see the same numbers.  Their dense references are in :mod:`cpbook.core.reference`.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from cpbook.core.config import ParallelConfig

__all__ = [
    "merge_problem",
    "kvcache_problem",
    "gqa_decode_problem",
    "mla_problem",
    "pcp_prefill_problem",
    "chunked_prefill_problem",
    "ring_prefill_problem",
]


def _randn(gen: torch.Generator, dtype: torch.dtype = torch.float64):
    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)

    return randn


def merge_problem(
    num_keys: int, num_queries: int, num_q_heads: int, head_dim: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Float64 ``q [Tq, H, D]``, ``k, v [num_keys, H, D]`` from ``seed`` (chapter 1)."""
    randn = _randn(torch.Generator().manual_seed(seed))
    q = randn(num_queries, num_q_heads, head_dim)
    return q, randn(num_keys, num_q_heads, head_dim), randn(num_keys, num_q_heads, head_dim)


def kvcache_problem(
    seq_len: int,
    num_kv_heads: int,
    head_dim: int,
    num_blocks: int,
    block_size: int,
    dcp: int,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Float64 ``k, v [seq_len, H, D]`` and a shuffled block table of
    ``ceil(seq_len / (block_size * dcp))`` distinct ids below ``num_blocks`` (chapter 2)."""
    gen = torch.Generator().manual_seed(seed)
    randn = _randn(gen)
    k, v = randn(seq_len, num_kv_heads, head_dim), randn(seq_len, num_kv_heads, head_dim)
    table = torch.randperm(num_blocks, generator=gen)[: -(-seq_len // (block_size * dcp))]
    return k, v, table


def gqa_decode_problem(
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    seq_lens: Sequence[int],
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
):
    """Random decode inputs: ``q [B, Hq, D]`` (one token per request) and per request
    ``k, v [L_i, Hkv, D]`` (its whole context, the current token included; chapter 3)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(len(seq_lens), num_q_heads, head_dim, generator=gen, dtype=torch.float64)
    ks = [
        torch.randn(n, num_kv_heads, head_dim, generator=gen, dtype=torch.float64) for n in seq_lens
    ]
    vs = [
        torch.randn(n, num_kv_heads, head_dim, generator=gen, dtype=torch.float64) for n in seq_lens
    ]
    return q.to(dtype), [k.to(dtype) for k in ks], [v.to(dtype) for v in vs]


def mla_problem(mla: Any, query_lens: Sequence[int], context_lens: Sequence[int], seed: int = 0):
    """Random queries and latent rows for the MLA weights ``mla``
    (:class:`~cpbook.dcp.mla.MLAWeights`).  Request ``i`` has ``context_lens[i]`` cached tokens
    followed by ``query_lens[i]`` new ones; returns per request ``q_nope [T_i, H, Dn]``,
    ``q_pe [T_i, H, R]`` and ``latent [ctx_i + T_i, C + R]`` in the weights' dtype."""
    randn = _randn(torch.Generator().manual_seed(seed), mla.W_UK.dtype)
    h, dn, r = mla.num_q_heads, mla.W_UK.shape[2], mla.qk_rope_head_dim
    qn = [randn(t, h, dn) for t in query_lens]
    qp = [randn(t, h, r) for t in query_lens]
    lat = [randn(c + t, mla.latent_dim) for c, t in zip(context_lens, query_lens)]
    return qn, qp, lat


def pcp_prefill_problem(
    seq_lens: Sequence[int], hidden_size: int, config: ParallelConfig, seed: int = 0
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Float64 hidden states ``x [sum(seq_lens), hidden_size]`` and Q/K/V projection weights of
    ``config``'s heads (``hidden_size x heads·head_dim``, scaled by ``hidden_size^-1/2``;
    chapter 4)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(seq_lens), hidden_size, generator=gen, dtype=torch.float64)
    heads = (("q", config.num_q_heads), ("k", config.num_kv_heads), ("v", config.num_kv_heads))
    w = {
        n: torch.randn(hidden_size, h * config.head_dim, generator=gen, dtype=torch.float64)
        / math.sqrt(hidden_size)
        for n, h in heads
    }
    return x, w


def chunked_prefill_problem(
    config: ParallelConfig,
    context_lens: Sequence[int],
    query_lens: Sequence[int],
    v_head_dim: int | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
):
    """Random chunked-prefill inputs for ``config``'s heads (chapter 5).  Per request: the
    chunk's queries ``q [T_i, Hq, D]``, the keys ``k [C_i + T_i, Hkv, D]`` of context and chunk,
    and values ``v [C_i + T_i, Hkv, Dv]`` (``None`` for MLA: the value is ``k[..., :Dv]``)."""
    randn = _randn(torch.Generator().manual_seed(seed), dtype)
    hq, hkv, d = config.num_q_heads, config.num_kv_heads, config.head_dim
    dv = v_head_dim or d
    qs = [randn(t, hq, d) for t in query_lens]
    ks = [randn(c + t, hkv, d) for c, t in zip(context_lens, query_lens)]
    if config.use_mla:
        return qs, ks, None
    return qs, ks, [randn(c + t, hkv, dv) for c, t in zip(context_lens, query_lens)]


def ring_prefill_problem(
    seq_lens: Sequence[int],
    context_lens: Sequence[int],
    config: ParallelConfig,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
):
    """Random ring-prefill inputs for ``config``'s heads (chapter 5): per request
    ``q [T_i, Hq, D]`` for its new tokens and ``k, v [C_i + T_i, Hkv, D]`` for its whole
    sequence (context first)."""
    randn = _randn(torch.Generator().manual_seed(seed), dtype)
    hq, hkv, d = config.num_q_heads, config.num_kv_heads, config.head_dim
    qs = [randn(t, hq, d) for t in seq_lens]
    ks = [randn(c + t, hkv, d) for c, t in zip(context_lens, seq_lens)]
    vs = [randn(c + t, hkv, d) for c, t in zip(context_lens, seq_lens)]
    return qs, ks, vs
