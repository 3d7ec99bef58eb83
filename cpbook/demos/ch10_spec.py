"""Chapter 10: speculative decoding under DCP — the verification step, draft placement, the
token-exact grid.

* :func:`spec_verify_rank` — one verification step (request ``i``: ``L_i`` cached tokens and
  ``k_i + 1`` new rows) on this rank of a TP × DCP world, GQA or MLA (absorbed), checked against
  dense float64 causal attention; traced bytes against
  :func:`cpbook.dcp.verify.verify_comm_bytes`.
* :func:`draft_placement_rank` — ``k`` draft decode steps over a replicated or a DCP-sharded
  draft KV, traced against :func:`cpbook.dcp.draft_placement.draft_comm_bytes`.
* :func:`draft_engine_rank` — the engine with a draft model at DCP 1 (replicated draft KV) or
  at the target's DCP (sharded): token-exact against plain greedy decoding, draft KV rows held
  and the drafting's traced bytes against :func:`cpbook.dcp.draft_placement.draft_step_comm_bytes`.
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
from cpbook.dcp.draft_placement import draft_comm_bytes, draft_kv_rows, draft_step_comm_bytes
from cpbook.dcp.mla import MLAShape
from cpbook.dcp.verify import (
    dcp_verify_attention,
    mla_verify_attention,
    verify_comm_bytes,
    verify_key_counts,
)
from cpbook.demos.ch03_decode import _latent_shards, _mla_setup
from cpbook.demos.ch09_engine import grid_runs
from cpbook.engine.engine import Engine, make_prompts
from cpbook.engine.models import reference_generate
from cpbook.kv.paged import shard_kv_cache

__all__ = ["spec_verify_rank", "draft_placement_rank", "draft_engine_rank", "spec_grid_runs"]


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


def draft_engine_rank(
    ctx: RankContext,
    *,
    model: str = "tiny-mla",
    parallel_config: dict[str, Any] | None = None,
    draft_decode_context_parallel_size: int | None = None,
    num_speculative_tokens: int = 3,
    num_requests: int = 4,
    max_new_tokens: int = 8,
    seed: int = 0,
) -> dict[str, Any]:
    """Greedy generation with a ``"draft"`` speculative config (the model's first layer as the
    draft) on this rank of ``parallel_config`` (default: TP = DCP = the world); the draft runs
    at ``draft_decode_context_parallel_size`` (``None``: vLLM's default, the target's DCP).
    Returns whether every request's tokens equal :func:`reference_generate`'s, the draft
    ``placement``, the most draft KV rows per layer held at once (``peak_rows``), whether after
    every step each request's rows equal :func:`draft_kv_rows` (``rows_match``), the drafting's
    traced ``comm`` and ``expected`` (:func:`draft_step_comm_bytes` of the forwards' rows)."""
    n = ctx.world_size
    sizes = parallel_config or dict(tensor_parallel_size=n, decode_context_parallel_size=n)
    spec = dict(
        method="draft",
        num_speculative_tokens=num_speculative_tokens,
        draft_decode_context_parallel_size=draft_decode_context_parallel_size,
    )
    eng = Engine(model, sizes, speculative_config=spec, ctx=ctx)
    prompts = make_prompts(num_requests, seed, eng.model.config.vocab_size)
    ids = [eng.add_request(p, max_new_tokens) for p in prompts]
    prop, mc, rows_match = eng.proposer, eng.model.config, True
    while eng.has_unfinished:
        eng.step()
        for rid, (held, _) in prop.cache.items():  # rows held = the placement's formula
            s = prop.shard
            want = draft_kv_rows(prop.placement, len(held), s.dcp, s.dcp_rank, s.interleave)
            rows_match &= prop.rows_held(rid) == want
    outs = [eng.output(i) for i in ids]
    ref = [reference_generate(eng.model, p, max_new_tokens) for p in prompts]
    q_dim = mc.kv_cache_dim if mc.use_mla else mc.head_dim
    out_dim = mc.kv_lora_rank if mc.use_mla else mc.head_dim
    return {
        "token_exact": [list(o.tokens) for o in outs] == ref,
        "placement": prop.placement,
        "draft_dcp": prop.config.dcp,
        "peak_rows": prop.peak_rows,
        "rows_match": rows_match,
        "longest": max(len(p) for p in prompts) + max_new_tokens,
        "comm": prop.comm,
        "expected": draft_step_comm_bytes(
            prop.rows_per_call,
            prop.config,
            q_dim,
            out_dim,
            mc.hidden_size,
            eng.model.embed.element_size(),
            prop.draft.config.num_hidden_layers,
        ),
        "spec": eng.spec_metrics,
    }
