"""Chapter 3's per-rank demos: DCP decode for GQA (:func:`gqa_decode_rank`) and MLA
(:func:`mla_decode_rank`), and MLA's cached-context prefill (:func:`mla_context_rank`); their
inputs (``*_problem``) and dense float64 references.  Each returns ``max_abs_err``, the traced
``comm`` and the ``expected`` bytes of the mechanism's formula."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from cpbook.core.attention import dense_attention
from cpbook.core.config import ParallelConfig
from cpbook.core.context import RankContext
from cpbook.core.groups import make_groups
from cpbook.core.heads import kv_heads_of, q_heads_of
from cpbook.dcp.decode import dcp_decode_attention, decode_comm_bytes
from cpbook.dcp.mla import TinyMLA, mla_context_attention, mla_decode_attention
from cpbook.kv.gather import context_gather_comm_bytes
from cpbook.kv.paged import shard_kv_cache

__all__ = [
    "gqa_decode_problem",
    "gqa_decode_rank",
    "mla_problem",
    "mla_decode_rank",
    "mla_context_rank",
]


# ------------------------------------------------------------------------------------------
# the per-rank demo: GQA decode under TP × DCP
# ------------------------------------------------------------------------------------------
def gqa_decode_problem(
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    seq_lens: Sequence[int],
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
):
    """Random decode inputs, identical on every rank: ``q [B, Hq, D]`` (one token per request)
    and per request ``k, v [L_i, Hkv, D]`` (its whole context, the current token included)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(len(seq_lens), num_q_heads, head_dim, generator=gen, dtype=torch.float64)
    ks = [
        torch.randn(n, num_kv_heads, head_dim, generator=gen, dtype=torch.float64) for n in seq_lens
    ]
    vs = [
        torch.randn(n, num_kv_heads, head_dim, generator=gen, dtype=torch.float64) for n in seq_lens
    ]
    return q.to(dtype), [k.to(dtype) for k in ks], [v.to(dtype) for v in vs]


def gqa_decode_rank(
    ctx: RankContext,
    *,
    tensor_parallel_size: int = 6,
    decode_context_parallel_size: int = 3,
    num_q_heads: int = 12,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    seq_lens: Sequence[int] = (48,),
    block_size: int = 8,
    cp_kv_cache_interleave_size: int = 1,
    dcp_comm_backend: str = "ag_rs",
    dtype: str = "float64",
    seed: int = 0,
) -> dict[str, Any]:
    """One GQA decode step on this rank of a TP × DCP world, checked against dense attention.

    The config is validated (:class:`ParallelConfig`) before any
    collective.  Every rank draws the same inputs from ``seed``, writes only its tokens of its
    KV head into its paged cache, and runs :func:`dcp_decode_attention` on its query heads.
    Returns this rank's output, shapes, local token counts and positions, the step's traced
    ``(op, bytes_sent)``, the formula's prediction and the max error against float64 dense
    attention for this rank's heads.
    """
    cfg = ParallelConfig(
        tensor_parallel_size=tensor_parallel_size,
        decode_context_parallel_size=decode_context_parallel_size,
        cp_kv_cache_interleave_size=cp_kv_cache_interleave_size,
        block_size=block_size,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dcp_comm_backend=dcp_comm_backend,
    )
    groups = make_groups(ctx, cfg)
    tp_rank, dcp_rank = groups.coords.tp_rank, groups.coords.dcp_rank
    q, ks, vs = gqa_decode_problem(
        num_q_heads, num_kv_heads, head_dim, seq_lens, seed, getattr(torch, dtype)
    )
    qh, kvh = q_heads_of(cfg, tp_rank), kv_heads_of(cfg, tp_rank)
    local, cache = shard_kv_cache(
        [k[:, kvh] for k in ks],
        [v[:, kvh] for v in vs],
        block_size,
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
            dcp_comm_backend,
            shapes=shapes,
        )
    ref = torch.cat(
        [
            dense_attention(q[i : i + 1].double(), ks[i].double(), vs[i].double())[0]
            for i in range(len(seq_lens))
        ]
    )[:, qh]
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
            head_dim,
            head_dim,
            cfg.dcp,
            dcp_comm_backend,
            q.element_size(),
        ),
    }


# ------------------------------------------------------------------------------------------
# per-rank demos
# ------------------------------------------------------------------------------------------
def mla_problem(
    mla: TinyMLA, query_lens: Sequence[int], context_lens: Sequence[int], seed: int = 0
):
    """Random queries and latent rows, identical on every rank.  Request ``i`` has
    ``context_lens[i]`` cached tokens followed by ``query_lens[i]`` new ones; returns per
    request ``q_nope [T_i, H, Dn]``, ``q_pe [T_i, H, R]`` and ``latent [ctx_i + T_i, C + R]``."""
    gen = torch.Generator().manual_seed(seed)
    dt, h = mla.W_UK.dtype, mla.num_heads
    dn, r = mla.W_UK.shape[2], mla.qk_rope_head_dim

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dt)

    qn = [randn(t, h, dn) for t in query_lens]
    qp = [randn(t, h, r) for t in query_lens]
    lat = [randn(c + t, mla.latent_dim) for c, t in zip(context_lens, query_lens)]
    return qn, qp, lat


def _reference(mla: TinyMLA, qn, qp, lat, context_lens, heads: slice) -> list[torch.Tensor]:
    """Float64 dense MHA-form attention (causal over the new tokens) for ``heads``, on the
    host (``mla`` may live on a device: its weights are copied)."""
    m64 = mla.to("cpu", torch.float64)
    outs = []
    for a, b, x, c in zip(qn, qp, lat, context_lens):
        k, v = m64.expand_kv(x.double(), heads)
        q = torch.cat([a, b], dim=-1)[:, heads].double()
        outs.append(dense_attention(q, k, v, causal=True, q_offset=c, scale=m64.scale)[0])
    return outs


def _latent_shards(ctx: RankContext, cfg: ParallelConfig, groups, lat, block_size: int):
    """This DCP rank's interleaved share of each request's latent rows (one "KV head", no V):
    :func:`~cpbook.kv.paged.shard_kv_cache`'s ``(local, cache)``."""
    return shard_kv_cache(
        [x[:, None] for x in lat],
        [None] * len(lat),
        block_size,
        cfg.dcp,
        groups.coords.dcp_rank,
        cfg.interleave,
        ctx.device,
    )


def _mla_setup(
    ctx: RankContext,
    tp: int,
    dcp: int,
    num_heads: int,
    kv_lora_rank: int,
    qk_nope_head_dim: int,
    qk_rope_head_dim: int,
    v_head_dim: int,
    block_size: int,
    interleave: int,
    dcp_comm_backend: str,
    dtype: str,
    seed: int,
):
    cfg = ParallelConfig(
        tensor_parallel_size=tp,
        decode_context_parallel_size=dcp,
        cp_kv_cache_interleave_size=interleave,
        block_size=block_size,
        num_q_heads=num_heads,
        num_kv_heads=1,
        head_dim=qk_nope_head_dim + qk_rope_head_dim,
        use_mla=True,
        dcp_comm_backend=dcp_comm_backend,
    )
    groups = make_groups(ctx, cfg)
    mla = TinyMLA.random(
        num_heads,
        kv_lora_rank,
        qk_nope_head_dim,
        qk_rope_head_dim,
        v_head_dim,
        seed,
        getattr(torch, dtype),
    )
    return cfg, groups, mla, q_heads_of(cfg, groups.coords.tp_rank)


def mla_decode_rank(
    ctx: RankContext,
    *,
    tensor_parallel_size: int = 4,
    decode_context_parallel_size: int = 4,
    num_heads: int = 8,
    kv_lora_rank: int = 32,
    qk_nope_head_dim: int = 16,
    qk_rope_head_dim: int = 8,
    v_head_dim: int = 16,
    seq_lens: Sequence[int] = (40, 5, 2),
    block_size: int = 8,
    cp_kv_cache_interleave_size: int = 1,
    dcp_comm_backend: str = "ag_rs",
    dtype: str = "float64",
    seed: int = 0,
) -> dict[str, Any]:
    """One absorbed MLA decode step on this rank, checked against float64 dense MHA attention.

    Each request's last token is the query; its latent row is cached (by its owner) with the
    rest, as vLLM writes the KV before attending.  Returns shapes, local token counts, traced
    ``(op, bytes_sent)``, the formula's prediction and the max error.
    """
    cfg, groups, mla, heads = _mla_setup(
        ctx,
        tensor_parallel_size,
        decode_context_parallel_size,
        num_heads,
        kv_lora_rank,
        qk_nope_head_dim,
        qk_rope_head_dim,
        v_head_dim,
        block_size,
        cp_kv_cache_interleave_size,
        dcp_comm_backend,
        dtype,
        seed,
    )
    ctx_lens = [n - 1 for n in seq_lens]
    qn, qp, lat = mla_problem(mla, [1] * len(seq_lens), ctx_lens, seed + 1)
    local, cache = _latent_shards(ctx, cfg, groups, lat, block_size)
    shapes = {}
    with ctx.traced() as step:
        out = mla_decode_attention(
            torch.cat(qn)[:, heads].to(ctx.device),
            torch.cat(qp)[:, heads].to(ctx.device),
            [k[:, 0] for k, _, _ in local],
            mla.to(ctx.device),
            heads,
            groups.dcp,
            dcp_comm_backend,
            shapes,
        )
    ref = torch.cat(_reference(mla, qn, qp, lat, ctx_lens, heads))
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
    return {
        "max_abs_err": err,
        "shapes": shapes,
        "local_tokens": local_tokens,
        "kv_bytes": sum(local_tokens) * cache.bytes_per_token,
        "comm": step,
        "expected": decode_comm_bytes(
            len(seq_lens),
            cfg.q_heads_per_rank,
            mla.latent_dim,
            kv_lora_rank,
            cfg.dcp,
            dcp_comm_backend,
            out.element_size(),
        ),
    }


def mla_context_rank(
    ctx: RankContext,
    *,
    tensor_parallel_size: int = 4,
    decode_context_parallel_size: int = 4,
    num_heads: int = 8,
    kv_lora_rank: int = 32,
    qk_nope_head_dim: int = 16,
    qk_rope_head_dim: int = 8,
    v_head_dim: int = 16,
    context_lens: Sequence[int] = (40, 13, 0),
    query_lens: Sequence[int] = (3, 2, 4),
    workspace_size: int = 48,
    block_size: int = 8,
    cp_kv_cache_interleave_size: int = 1,
    dtype: str = "float64",
    seed: int = 0,
) -> dict[str, Any]:
    """Chunked prefill over a DCP-sharded latent context on this rank, checked against dense.

    Returns the chunking stats, traced ``(op, bytes_sent)``, the formula's prediction and the
    max error over every request's new tokens for this rank's heads.
    """
    cfg, groups, mla, heads = _mla_setup(
        ctx,
        tensor_parallel_size,
        decode_context_parallel_size,
        num_heads,
        kv_lora_rank,
        qk_nope_head_dim,
        qk_rope_head_dim,
        v_head_dim,
        block_size,
        cp_kv_cache_interleave_size,
        "ag_rs",
        dtype,
        seed,
    )
    qn, qp, lat = mla_problem(mla, query_lens, context_lens, seed + 1)
    ctx_rows = [x[:c, None] for x, c in zip(lat, context_lens)]
    local, _ = shard_kv_cache(
        ctx_rows,
        [None] * len(lat),
        block_size,
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
    ref = _reference(mla, qn, qp, lat, context_lens, heads)
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
