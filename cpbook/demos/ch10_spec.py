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

import dataclasses
from typing import Any, Sequence

import torch

from cpbook.core.attention import dense_attention
from cpbook.core.config import ParallelConfig
from cpbook.core.context import RankContext
from cpbook.core.groups import make_groups
from cpbook.core.heads import kv_heads_of, q_heads_of
from cpbook.core.problems import gqa_decode_problem, mla_problem
from cpbook.core.reference import mla_reference, verify_reference
from cpbook.dcp.decode import dcp_decode_attention, local_attention
from cpbook.dcp.draft_placement import draft_comm_bytes, draft_kv_rows
from cpbook.dcp.mla import MLAShape
from cpbook.dcp.verify import (
    dcp_verify_attention,
    mla_verify_attention,
    verify_comm_bytes,
    verify_key_counts,
)
from cpbook.demos.ch03_decode import _latent_shards, _mla_setup
from cpbook.demos.ch09_engine import grid_runs
from cpbook.kv.paged import shard_kv_cache

__all__ = ["spec_verify_rank", "draft_placement_rank", "spec_grid_runs"]


def spec_verify_rank(
    ctx: RankContext,
    *,
    parallel_config: ParallelConfig = ParallelConfig(
        tensor_parallel_size=4,
        decode_context_parallel_size=4,
        num_q_heads=8,
        num_kv_heads=1,
        head_dim=16,
        block_size=4,
    ),
    context_lens: Sequence[int] = (13, 2, 0),
    num_speculative_tokens: Sequence[int] = (3, 1, 2),
    dtype: str = "float64",
    seed: int = 0,
) -> dict[str, Any]:
    """One speculative verification step on this rank, exact against dense float64.

    GQA: ``parallel_config``'s heads; MLA (``use_mla``): its query heads over one latent
    (32 + 8, :class:`~cpbook.dcp.mla.MLAShape`'s defaults).  Every rank draws the same K/V for
    positions ``0 … L_i + k_i`` (the new rows' K/V written first, as vLLM does), keeps its
    interleaved share, and runs :func:`~cpbook.dcp.verify.dcp_verify_attention` (or the MLA
    one) on its heads.  Returns ``max_abs_err``, the local key count each row saw, traced
    ``comm`` and ``expected``."""
    rows = [k + 1 for k in num_speculative_tokens]
    seq_lens = [c + r for c, r in zip(context_lens, rows)]
    backend = parallel_config.dcp_comm_backend
    if parallel_config.use_mla:
        cfg, groups, mla, heads = _mla_setup(ctx, parallel_config, MLAShape(), dtype, seed)
        qn, qp, lat = mla_problem(mla, rows, context_lens, seed + 1)
        local, _ = _latent_shards(ctx, cfg, groups, lat)
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
                backend,
            )
        ref = torch.cat(mla_reference(mla, qn, qp, lat, context_lens, heads))
        q_dim, out_dim = mla.latent_dim, mla.kv_lora_rank
    else:
        cfg = parallel_config
        groups = make_groups(ctx, cfg)
        qh, kvh = q_heads_of(cfg, groups.coords.tp_rank), kv_heads_of(cfg, groups.coords.tp_rank)
        hq, hkv, d = cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim
        _, ks, vs = gqa_decode_problem(hq, hkv, d, seq_lens, seed, getattr(torch, dtype))
        gen = torch.Generator().manual_seed(seed + 1)
        q = torch.randn(sum(rows), hq, d, generator=gen, dtype=torch.float64).to(ks[0].dtype)
        local, _ = shard_kv_cache(
            [k[:, kvh] for k in ks],
            [v[:, kvh] for v in vs],
            cfg.block_size,
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
                backend,
            )
        ref = verify_reference(q, ks, vs, context_lens, rows)[:, qh]
        q_dim = out_dim = d
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
            backend,
            out.element_size(),
        ),
    }


def draft_placement_rank(
    ctx: RankContext,
    *,
    parallel_config: ParallelConfig = ParallelConfig(
        num_q_heads=4, num_kv_heads=1, head_dim=8, block_size=4
    ),
    placement: str = "sharded",
    context_lens: Sequence[int] = (20, 7),
    num_speculative_tokens: int = 3,
    dtype: str = "float64",
    seed: int = 0,
) -> dict[str, Any]:
    """``k`` draft decode steps (one MQA draft layer, ``parallel_config``'s query heads split over
    the world) on this rank: each step's query row attends the request's draft KV up to its own
    position, over a replicated or a DCP-sharded (world-wide) draft KV.  The world is the TP and
    DCP group (``parallel_config``'s sizes are replaced by it).  Exact against dense; returns
    rows held, traced ``comm`` and :func:`draft_comm_bytes`."""
    n, r = ctx.world_size, ctx.rank
    cfg = dataclasses.replace(
        parallel_config, tensor_parallel_size=n, decode_context_parallel_size=n
    )
    num_q_heads, head_dim, block_size = cfg.num_q_heads, cfg.head_dim, cfg.block_size
    interleave, backend = cfg.interleave, cfg.dcp_comm_backend
    gen, dt = torch.Generator().manual_seed(seed), getattr(torch, dtype)
    k = num_speculative_tokens
    total = [c + k for c in context_lens]
    kv = [torch.randn(t, 1, head_dim, generator=gen, dtype=torch.float64).to(dt) for t in total]
    q = torch.randn(k, len(total), num_q_heads, head_dim, generator=gen, dtype=torch.float64)
    q = q.to(dt)
    h = num_q_heads // n
    mine = slice(r * h, (r + 1) * h)
    sharded = placement == "sharded"
    dcp, rank = (n, r) if sharded else (1, 0)
    local, _ = shard_kv_cache(kv, kv, block_size, dcp, rank, interleave, ctx.device)
    qd = q.to(ctx.device)
    err = 0.0
    with ctx.traced() as step:
        for s in range(k):
            lens = [c + s + 1 for c in context_lens]
            counts = [draft_kv_rows(placement, L, n, r, interleave) for L in lens]
            ks = [x[:m] for (x, _, _), m in zip(local, counts)]
            if sharded:
                ks = [x.repeat(1, n, 1) for x in ks]
                o = dcp_decode_attention(qd[s][:, mine], ks, ks, ctx.world, backend)
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
        "rows_held": [draft_kv_rows(placement, t, n, r, interleave) for t in total],
        "comm": step,
        "expected": draft_comm_bytes(
            placement, len(total), k, cfg, head_dim, head_dim, q.element_size()
        ),
    }


def spec_grid_runs(speculative_config: dict, **kwargs: Any) -> list[dict[str, Any]]:
    """:func:`~cpbook.demos.ch09_engine.grid_runs` (every valid grid of both models, both
    combines; ``kwargs`` as there) with ``speculative_config`` added to each run."""
    return grid_runs(speculative_config=speculative_config, **kwargs)
