"""Chapter 3's per-rank demos: DCP decode for GQA (:func:`gqa_decode_rank`) and MLA
(:func:`mla_decode_rank`), and MLA's cached-context prefill (:func:`mla_context_rank`).  Their
inputs come from :mod:`cpbook.core.problems` and their dense float64 references from
:mod:`cpbook.core.reference`.  Each returns ``max_abs_err``, the traced ``comm`` and the
``expected`` bytes of the mechanism's formula."""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch

from cpbook.core.config import ParallelConfig
from cpbook.core.context import RankContext
from cpbook.core.groups import make_groups
from cpbook.core.heads import kv_heads_of, q_heads_of
from cpbook.core.problems import gqa_decode_problem, mla_problem
from cpbook.core.reference import decode_reference, mla_reference
from cpbook.dcp.comm_bytes import check_v_up_proj_combine
from cpbook.dcp.decode import dcp_decode_attention, decode_comm_bytes
from cpbook.dcp.mla import (
    MLAShape,
    MLAWeights,
    mla_context_attention,
    mla_decode_attention,
    mla_decode_comm_bytes,
)
from cpbook.kv.gather import context_gather_comm_bytes
from cpbook.kv.paged import shard_kv_cache

__all__ = ["GQA_CONFIG", "MLA_CONFIG", "gqa_decode_rank", "mla_decode_rank", "mla_context_rank"]

#: chapter 3's GQA deployment (the article's example): TP 6, DCP 3, 12 query heads, 2 KV heads
GQA_CONFIG = ParallelConfig(
    tensor_parallel_size=6,
    decode_context_parallel_size=3,
    num_q_heads=12,
    num_kv_heads=2,
    head_dim=16,
    block_size=8,
)

#: chapter 3's MLA deployment: TP 4 = DCP 4, 8 query heads over one latent (``head_dim`` is
#: ``qk_nope_head_dim + qk_rope_head_dim`` of the :class:`~cpbook.dcp.mla.MLAShape`)
MLA_CONFIG = ParallelConfig(
    tensor_parallel_size=4,
    decode_context_parallel_size=4,
    num_q_heads=8,
    num_kv_heads=1,
    head_dim=24,
    use_mla=True,
    block_size=8,
)


# ------------------------------------------------------------------------------------------
# the per-rank demo: GQA decode under TP × DCP
# ------------------------------------------------------------------------------------------
def gqa_decode_rank(
    ctx: RankContext,
    *,
    parallel_config: ParallelConfig = GQA_CONFIG,
    seq_lens: Sequence[int] = (48,),
    dtype: str = "float64",
    seed: int = 0,
) -> dict[str, Any]:
    """One GQA decode step on this rank of a TP × DCP world, checked against dense attention.

    ``parallel_config`` was validated as it was built, before any collective.  Every rank draws
    the same inputs from ``seed``, writes only its tokens of its KV head into its paged cache,
    and runs :func:`dcp_decode_attention` on its query heads.
    Returns this rank's output, shapes, local token counts and positions, the step's traced
    ``(op, bytes_sent)``, the formula's prediction and the max error against float64 dense
    attention for this rank's heads.
    """
    cfg = parallel_config
    groups = make_groups(ctx, cfg)
    tp_rank, dcp_rank = groups.coords.tp_rank, groups.coords.dcp_rank
    q, ks, vs = gqa_decode_problem(
        cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim, seq_lens, seed, getattr(torch, dtype)
    )
    qh, kvh = q_heads_of(cfg, tp_rank), kv_heads_of(cfg, tp_rank)
    local, cache = shard_kv_cache(
        [k[:, kvh] for k in ks],
        [v[:, kvh] for v in vs],
        cfg.block_size,
        cfg.dcp,
        dcp_rank,
        cfg.interleave,
        ctx.device,
    )
    shapes = {}
    with ctx.traced() as step:
        out = dcp_decode_attention(
            q[:, qh].to(ctx.device),
            [k for k, _, _ in local],
            [v for _, v, _ in local],
            groups.dcp,
            cfg.dcp_comm_backend,
            shapes=shapes,
        )
    ref = decode_reference(q, ks, vs)[:, qh]
    err = (out.cpu().double() - ref).abs().max().item()
    local_tokens = [int(k.shape[0]) for k, _, _ in local]
    print(
        f"tp {tp_rank} dcp {dcp_rank}/{cfg.dcp} kv head {kvh.start} "
        f"q heads {qh.start}-{qh.stop - 1}: "
        f"Q {shapes['q']} -> {shapes['q_gathered']}"
    )
    print(
        f"local KV tokens {local_tokens} of {list(seq_lens)}, out {shapes['out']}, "
        f"exact: {err <= 1e-10}"
    )
    return {
        "out": out.cpu(),
        "max_abs_err": err,
        "shapes": shapes,
        "local_tokens": local_tokens,
        "kv_head": kvh.start,
        "positions": [p.cpu() for _, _, p in local],
        "q_heads": (qh.start, qh.stop),
        "kv_bytes": sum(local_tokens) * cache.bytes_per_token,
        "comm": step,
        "expected": decode_comm_bytes(
            len(seq_lens),
            cfg.q_heads_per_rank,
            cfg.head_dim,
            cfg.head_dim,
            cfg.dcp,
            cfg.dcp_comm_backend,
            q.element_size(),
        ),
    }


# ------------------------------------------------------------------------------------------
# MLA: absorbed decode and the cached-context prefill
# ------------------------------------------------------------------------------------------
def _latent_shards(ctx: RankContext, cfg: ParallelConfig, groups, lat):
    """This DCP rank's interleaved share of each request's latent rows (one "KV head", no V):
    :func:`~cpbook.kv.paged.shard_kv_cache`'s ``(local, cache)``."""
    return shard_kv_cache(
        [x[:, None] for x in lat],
        [None] * len(lat),
        cfg.block_size,
        cfg.dcp,
        groups.coords.dcp_rank,
        cfg.interleave,
        ctx.device,
    )


def _mla_setup(
    ctx: RankContext, config: ParallelConfig, shape: MLAShape, dtype: str, seed: int
) -> tuple[ParallelConfig, Any, MLAWeights, slice]:
    """The config (``head_dim`` set from ``shape``, MLA), its groups, random weights and this
    rank's query heads."""
    cfg = dataclasses.replace(config, head_dim=shape.head_dim, use_mla=True, num_kv_heads=1)
    groups = make_groups(ctx, cfg)
    mla = MLAWeights.random(cfg.num_q_heads, **dataclasses.asdict(shape), seed=seed)
    mla = mla.to(dtype=getattr(torch, dtype))
    return cfg, groups, mla, q_heads_of(cfg, groups.coords.tp_rank)


def mla_decode_rank(
    ctx: RankContext,
    *,
    parallel_config: ParallelConfig = MLA_CONFIG,
    mla_shape: MLAShape = MLAShape(),
    seq_lens: Sequence[int] = (40, 5, 2),
    v_up_proj_combine: bool = False,
    dtype: str = "float64",
    seed: int = 0,
) -> dict[str, Any]:
    """One absorbed MLA decode step on this rank, checked against float64 dense MHA attention.

    Each request's last token is the query; its latent row is cached (by its owner) with the
    rest, as vLLM writes the KV before attending.  ``parallel_config``'s ``head_dim`` is taken
    from ``mla_shape``.  ``v_up_proj_combine`` (``dcp_comm_backend="a2a"``, vLLM v0.34.0's
    MLA All2All): gather ``W_UV_dcp`` once before the step (``load_comm``) and up-project
    before the exchange from 8 tokens on.  Returns shapes, local token counts, traced
    ``(op, bytes_sent)``, the formula's prediction and the max error.
    """
    cfg, groups, mla, heads = _mla_setup(ctx, parallel_config, mla_shape, dtype, seed)
    ctx_lens = [n - 1 for n in seq_lens]
    qn, qp, lat = mla_problem(mla, [1] * len(seq_lens), ctx_lens, seed + 1)
    local, cache = _latent_shards(ctx, cfg, groups, lat)
    weights = mla.to(ctx.device)
    if v_up_proj_combine:
        check_v_up_proj_combine(cfg.dcp_comm_backend, cfg.pcp)
    with ctx.traced() as load:  # at load time in vLLM: once, not per step
        if v_up_proj_combine:
            weights = weights.with_w_uv_dcp(heads, groups.dcp)
    shapes = {}
    with ctx.traced() as step:
        out = mla_decode_attention(
            torch.cat(qn)[:, heads].to(ctx.device),
            torch.cat(qp)[:, heads].to(ctx.device),
            [k[:, 0] for k, _, _ in local],
            weights,
            heads,
            groups.dcp,
            cfg.dcp_comm_backend,
            shapes,
        )
    ref = torch.cat(mla_reference(mla, qn, qp, lat, ctx_lens, heads))
    err = (out.cpu().double() - ref).abs().max().item()
    local_tokens = [int(k.shape[0]) for k, _, _ in local]
    print(
        f"tp {groups.coords.tp_rank} dcp {groups.coords.dcp_rank}/{cfg.dcp} "
        f"heads {heads.start}-{heads.stop - 1}: "
        f"latent Q {shapes['q']} -> {shapes['q_gathered']}, out {shapes['out']}"
    )
    print(
        f"local latent rows {local_tokens} of {list(seq_lens)}, == dense (<= 1e-10): {err <= 1e-10}"
    )
    e, h, n = out.element_size(), cfg.q_heads_per_rank, cfg.dcp
    return {
        "max_abs_err": err,
        "shapes": shapes,
        "local_tokens": local_tokens,
        "kv_bytes": sum(local_tokens) * cache.bytes_per_token,
        "load_comm": load,
        "load_expected": (
            [("all_gather", mla_shape.kv_lora_rank * h * mla_shape.v_head_dim * e * (n - 1))]
            if v_up_proj_combine
            else []
        ),
        "comm": step,
        "expected": mla_decode_comm_bytes(
            len(seq_lens), h, mla_shape, n, cfg.dcp_comm_backend, v_up_proj_combine, e
        ),
    }


def mla_context_rank(
    ctx: RankContext,
    *,
    parallel_config: ParallelConfig = MLA_CONFIG,
    mla_shape: MLAShape = MLAShape(),
    context_lens: Sequence[int] = (40, 13, 0),
    query_lens: Sequence[int] = (3, 2, 4),
    workspace_size: int = 48,
    dtype: str = "float64",
    seed: int = 0,
) -> dict[str, Any]:
    """Chunked prefill over a DCP-sharded latent context on this rank, checked against dense.

    Returns the chunking stats, traced ``(op, bytes_sent)``, the formula's prediction and the
    max error over every request's new tokens for this rank's heads.
    """
    cfg, groups, mla, heads = _mla_setup(ctx, parallel_config, mla_shape, dtype, seed)
    qn, qp, lat = mla_problem(mla, query_lens, context_lens, seed + 1)
    ctx_rows = [x[:c, None] for x, c in zip(lat, context_lens)]
    local, _ = shard_kv_cache(
        ctx_rows,
        [None] * len(lat),
        cfg.block_size,
        cfg.dcp,
        groups.coords.dcp_rank,
        cfg.interleave,
        ctx.device,
    )
    stats = {}
    with ctx.traced() as step:
        dev = ctx.device
        outs = mla_context_attention(
            [x[:, heads].to(dev) for x in qn],
            [x[:, heads].to(dev) for x in qp],
            [x[c:].to(dev) for x, c in zip(lat, context_lens)],
            context_lens,
            [k[:, 0] for k, _, _ in local],
            mla.to(dev),
            heads,
            groups.dcp,
            cfg.interleave,
            workspace_size,
            stats,
        )
    ref = mla_reference(mla, qn, qp, lat, context_lens, heads)
    err = max((o.cpu().double() - r).abs().max().item() for o, r in zip(outs, ref))
    print(
        f"tp {groups.coords.tp_rank} dcp {groups.coords.dcp_rank}/{cfg.dcp} "
        f"heads {heads.start}-{heads.stop - 1}: "
        f"{stats['num_chunks']} chunks of {stats['chunk_len']} context tokens per request"
    )
    print(
        f"gathered rows {stats['rows_per_chunk']} (workspace {workspace_size}), "
        f"== dense (<= 1e-10): {err <= 1e-10}"
    )
    return {
        "max_abs_err": err,
        "stats": stats,
        "comm": step,
        "expected": context_gather_comm_bytes(
            context_lens,
            workspace_size,
            cfg.dcp,
            cfg.interleave,
            mla.latent_dim,
            lat[0].element_size(),
        ),
    }
