"""Chapter 10: speculative decoding under DCP — the verification step, draft placement, the
token-exact grid.

* :func:`spec_verify_rank` — one verification step (request ``i``: ``L_i`` cached tokens and
  ``k_i + 1`` new rows) on this rank of a TP × DCP world, GQA or MLA (absorbed), checked against
  dense float64 causal attention; traced bytes against
  :func:`cpbook.dcp.verify.verify_comm_bytes`.
* :func:`draft_placement_rank` — ``k`` draft decode steps over a replicated or a DCP-sharded
  draft KV, traced against :func:`cpbook.dcp.draft_placement.draft_comm_bytes`.
* :func:`spec_grid_runs` — chapter 9's grid of engine runs with a ``speculative_config``.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from cpbook.core.attention import dense_attention
from cpbook.core.config import ParallelConfig
from cpbook.core.context import RankContext
from cpbook.core.groups import make_groups
from cpbook.core.heads import kv_heads_of, q_heads_of
from cpbook.dcp.decode import dcp_decode_attention, local_attention
from cpbook.dcp.draft_placement import draft_comm_bytes, draft_kv_rows
from cpbook.dcp.verify import (
    dcp_verify_attention,
    mla_verify_attention,
    verify_comm_bytes,
    verify_key_counts,
)
from cpbook.demos.ch03_decode import (
    _latent_shards,
    _mla_setup,
    _reference,
    gqa_decode_problem,
    mla_problem,
)
from cpbook.demos.ch09_engine import grid_runs
from cpbook.kv.paged import shard_kv_cache

__all__ = ["spec_verify_rank", "draft_placement_rank", "spec_grid_runs"]


def spec_verify_rank(
    ctx: RankContext,
    *,
    tensor_parallel_size: int = 4,
    decode_context_parallel_size: int = 4,
    use_mla: bool = False,
    num_kv_heads: int = 1,
    context_lens: Sequence[int] = (13, 2, 0),
    num_speculative_tokens: Sequence[int] = (3, 1, 2),
    block_size: int = 4,
    cp_kv_cache_interleave_size: int = 1,
    dcp_comm_backend: str = "ag_rs",
    dtype: str = "float64",
    seed: int = 0,
) -> dict[str, Any]:
    """One speculative verification step on this rank, exact against dense float64.

    GQA: 8 query heads, ``num_kv_heads`` KV heads, head_dim 16; MLA: 8 heads over one latent
    (32 + 8).  Every rank draws the same K/V for positions ``0 … L_i + k_i`` (the new rows'
    K/V written first, as vLLM does), keeps its interleaved share, and runs
    :func:`~cpbook.dcp.verify.dcp_verify_attention` (or the MLA one) on its heads.  Returns
    ``max_abs_err``, the local key count each row saw, traced ``comm`` and ``expected``."""
    rows = [k + 1 for k in num_speculative_tokens]
    seq_lens = [c + r for c, r in zip(context_lens, rows)]
    if use_mla:
        cfg, groups, mla, heads = _mla_setup(
            ctx,
            tensor_parallel_size,
            decode_context_parallel_size,
            8,
            32,
            16,
            8,
            16,
            block_size,
            cp_kv_cache_interleave_size,
            dcp_comm_backend,
            dtype,
            seed,
        )
        qn, qp, lat = mla_problem(mla, rows, context_lens, seed + 1)
        local, _ = _latent_shards(ctx, cfg, groups, lat, block_size)
        with ctx.traced() as step:
            out = mla_verify_attention(
                torch.cat(qn)[:, heads].to(ctx.device),
                torch.cat(qp)[:, heads].to(ctx.device),
                [k[:, 0] for k, _, _ in local],
                context_lens,
                rows,
                mla.to(ctx.device),
                heads,
                groups.dcp,
                cfg.interleave,
                dcp_comm_backend,
            )
        ref = torch.cat(_reference(mla, qn, qp, lat, context_lens, heads))
        q_dim, out_dim = mla.latent_dim, mla.kv_lora_rank
    else:
        cfg = ParallelConfig(
            tensor_parallel_size=tensor_parallel_size,
            decode_context_parallel_size=decode_context_parallel_size,
            cp_kv_cache_interleave_size=cp_kv_cache_interleave_size,
            block_size=block_size,
            num_q_heads=8,
            num_kv_heads=num_kv_heads,
            head_dim=16,
            dcp_comm_backend=dcp_comm_backend,
        )
        groups = make_groups(ctx, cfg)
        qh, kvh = q_heads_of(cfg, groups.coords.tp_rank), kv_heads_of(cfg, groups.coords.tp_rank)
        _, ks, vs = gqa_decode_problem(8, num_kv_heads, 16, seq_lens, seed, getattr(torch, dtype))
        gen = torch.Generator().manual_seed(seed + 1)
        q = torch.randn(sum(rows), 8, 16, generator=gen, dtype=torch.float64).to(ks[0].dtype)
        local, _ = shard_kv_cache(
            [k[:, kvh] for k in ks],
            [v[:, kvh] for v in vs],
            block_size,
            cfg.dcp,
            groups.coords.dcp_rank,
            cfg.interleave,
            ctx.device,
        )
        with ctx.traced() as step:
            out = dcp_verify_attention(
                q[:, qh].to(ctx.device),
                [k for k, _, _ in local],
                [v for _, v, _ in local],
                context_lens,
                rows,
                groups.dcp,
                cfg.interleave,
                dcp_comm_backend,
            )
        parts, at = [], 0
        for i, (c, r) in enumerate(zip(context_lens, rows)):
            qi = q[at : at + r].double()
            parts.append(dense_attention(qi, ks[i].double(), vs[i].double(), True, c)[0])
            at += r
        ref = torch.cat(parts)[:, qh]
        q_dim = out_dim = 16
    err = (out.cpu().double() - ref).abs().max().item()
    saw = [
        verify_key_counts(c, r, cfg.dcp, groups.coords.dcp_rank, cfg.interleave)
        for c, r in zip(context_lens, rows)
    ]
    return {
        "max_abs_err": err,
        "keys_seen": saw,
        "local_positions": [p.tolist() for _, _, p in local],
        "comm": step,
        "expected": verify_comm_bytes(
            num_speculative_tokens,
            cfg.q_heads_per_rank,
            q_dim,
            out_dim,
            cfg.dcp,
            dcp_comm_backend,
            out.element_size(),
        ),
    }


def draft_placement_rank(
    ctx: RankContext,
    *,
    placement: str = "sharded",
    context_lens: Sequence[int] = (20, 7),
    num_speculative_tokens: int = 3,
    num_heads: int = 4,
    head_dim: int = 8,
    block_size: int = 4,
    cp_kv_cache_interleave_size: int = 1,
    dcp_comm_backend: str = "ag_rs",
    dtype: str = "float64",
    seed: int = 0,
) -> dict[str, Any]:
    """``k`` draft decode steps (one MQA draft layer, ``num_heads`` query heads split over the
    world) on this rank: each step's query row attends the request's draft KV up to its own
    position, over a replicated or a DCP-sharded (world-wide) draft KV.  Exact against dense;
    returns rows held, traced ``comm`` and :func:`draft_comm_bytes`."""
    n, r = ctx.world_size, ctx.rank
    gen, dt = torch.Generator().manual_seed(seed), getattr(torch, dtype)
    k = num_speculative_tokens
    total = [c + k for c in context_lens]
    kv = [torch.randn(t, 1, head_dim, generator=gen, dtype=torch.float64).to(dt) for t in total]
    q = torch.randn(k, len(total), num_heads, head_dim, generator=gen, dtype=torch.float64)
    q = q.to(dt)
    h = num_heads // n
    mine = slice(r * h, (r + 1) * h)
    sharded = placement == "sharded"
    dcp, rank = (n, r) if sharded else (1, 0)
    local, _ = shard_kv_cache(
        kv, kv, block_size, dcp, rank, cp_kv_cache_interleave_size, ctx.device
    )
    qd = q.to(ctx.device)
    err = 0.0
    with ctx.traced() as step:
        for s in range(k):
            lens = [c + s + 1 for c in context_lens]
            counts = [draft_kv_rows(placement, L, n, r, cp_kv_cache_interleave_size) for L in lens]
            ks = [x[:m] for (x, _, _), m in zip(local, counts)]
            if sharded:
                ks = [x.repeat(1, n, 1) for x in ks]
                o = dcp_decode_attention(qd[s][:, mine], ks, ks, ctx.world, dcp_comm_backend)
            else:
                o = local_attention(qd[s][:, mine], ks, ks)[0]
            ref = torch.cat(
                [
                    dense_attention(q[s][i : i + 1, mine].double(), x[:L].double(), x[:L].double())[
                        0
                    ]
                    for i, (x, L) in enumerate(zip(kv, lens))
                ]
            )
            err = max(err, (o.cpu().double() - ref).abs().max().item())
    return {
        "max_abs_err": err,
        "rows_held": [
            draft_kv_rows(placement, t, n, r, cp_kv_cache_interleave_size) for t in total
        ],
        "comm": step,
        "expected": draft_comm_bytes(
            placement,
            len(total),
            k,
            h,
            head_dim,
            head_dim,
            n,
            dcp_comm_backend,
            q.element_size(),
        ),
    }


def spec_grid_runs(speculative_config: dict, **kwargs: Any) -> list[dict[str, Any]]:
    """:func:`~cpbook.demos.ch09_engine.grid_runs` (every valid grid of both models, both
    combines; ``kwargs`` as there) with ``speculative_config`` added to each run."""
    return grid_runs(speculative_config=speculative_config, **kwargs)
