"""Chapter 5's per-rank demos: chunked prefill under PCP × DCP by AllGather-Q or AllGather-KV
(:func:`chunked_prefill_rank`) and ring pass-KV / pass-Q prefill (:func:`ring_prefill_rank`),
checked against dense float64 attention on inputs from :mod:`cpbook.core.problems`."""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch

from cpbook.core.attention import dense_attention
from cpbook.core.comm import comm_bytes
from cpbook.core.config import ConfigError, ParallelConfig
from cpbook.core.context import RankContext
from cpbook.core.groups import make_groups, pcp_of_world
from cpbook.core.heads import kv_heads_of, q_heads_of
from cpbook.core.problems import chunked_prefill_problem, ring_prefill_problem
from cpbook.kv.context import context_shard
from cpbook.pcp.chunked import chunked_prefill_attention
from cpbook.pcp.chunked_plan import ChunkedPrefillConfig, chunked_comm_bytes
from cpbook.pcp.prefill import pcp_shard
from cpbook.pcp.ring import ring_attention
from cpbook.pcp.ring_plan import RingShards, check_mode, ring_comm_bytes
from cpbook.pcp.zigzag import zigzag_partition

__all__ = ["CHUNKED_CONFIG", "chunked_prefill_rank", "ring_prefill_rank"]

#: chapter 5's chunked-prefill deployment: PCP 2 x DCP 2 (world 2, TP 1), 4 query heads, 1 KV head
CHUNKED_CONFIG = ParallelConfig(
    prefill_context_parallel_size=2,
    decode_context_parallel_size=2,
    num_q_heads=4,
    num_kv_heads=1,
    head_dim=16,
    block_size=8,
    dcp_comm_backend="a2a",
)


# ------------------------------------------------------------------------------------------
# the per-rank function: one chunked-prefill layer on a TP × PCP × DCP grid
# ------------------------------------------------------------------------------------------
def _lens(context_lens: Sequence[int], query_lens: Sequence[int]) -> None:
    ok = (
        len(context_lens) == len(query_lens) > 0
        and all(isinstance(c, int) and c >= 0 for c in context_lens)
        and all(isinstance(t, int) and t >= 1 for t in query_lens)
    )
    if not ok:
        raise ConfigError(
            "chunked-lens",
            "one context length >= 0 and one chunk length >= 1 per request",
            context_lens=list(context_lens),
            query_lens=list(query_lens),
        )


def chunked_prefill_rank(
    ctx: RankContext,
    *,
    parallel_config: ParallelConfig = CHUNKED_CONFIG,
    prefill_config: ChunkedPrefillConfig = ChunkedPrefillConfig(workspace_size=32),
    context_lens: Sequence[int] = (40, 13, 0),
    query_lens: Sequence[int] = (9, 5, 3),
    v_head_dim: int | None = None,
    seed: int = 0,
    dtype: str = "float64",
) -> dict[str, Any]:
    """One chunked-prefill attention layer on this rank, checked against dense float64.

    Builds the groups of ``parallel_config`` (``world = tp · pcp``), draws every request's inputs
    from ``seed``, stores this rank's share of the context in its paged cache
    (:func:`context_shard`), keeps its zigzag rows of the chunk and its TP heads, and runs
    :func:`chunked_prefill_attention` as ``prefill_config`` says (its combine backend is the
    parallel config's).  Bad input raises before any collective.  Returns the strategy,
    shapes, local rows, the traced ``comm`` and the formula's ``expected``
    (``[(op, bytes_sent), ...]``) and ``max_abs_err`` (output and LSE).
    """
    _lens(context_lens, query_lens)
    cfg = parallel_config
    run_cfg = dataclasses.replace(prefill_config, dcp_comm_backend=cfg.dcp_comm_backend)
    groups = make_groups(ctx, cfg)
    c = groups.coords
    qh, kvh = q_heads_of(cfg, c.tp_rank), kv_heads_of(cfg, c.tp_rank)
    qs, ks, vs = chunked_prefill_problem(
        cfg, context_lens, query_lens, v_head_dim, seed, getattr(torch, dtype)
    )
    dev = ctx.device
    context = context_shard(
        [k[:n, kvh] for k, n in zip(ks, context_lens)],
        None if vs is None else [v[:n, kvh] for v, n in zip(vs, context_lens)],
        cfg.block_size,
        cfg.dcp,
        c.dcp_rank,
        cfg.interleave,
        v_head_dim,
        dev,
    )
    meta = zigzag_partition(tuple(query_lens), cfg.pcp).metadata(c.pcp_rank)

    def chunk_rows(ts: list[torch.Tensor], heads: slice, skip: bool) -> torch.Tensor:
        new = [t[n:] if skip else t for t, n in zip(ts, context_lens)]
        return pcp_shard(torch.cat(new)[:, heads], meta).to(dev)

    q = chunk_rows(qs, qh, False)
    k = chunk_rows(ks, kvh, True)
    v = None if vs is None else chunk_rows(vs, kvh, True)
    stats = {}
    with ctx.traced() as comm:
        out, lse = chunked_prefill_attention(q, k, v, context, meta, groups, run_cfg, stats)
    err, real = 0.0, 0
    for s in meta.segments:  # dense float64 reference for this rank's real rows and heads
        n, cl = max(0, min(s.end, query_lens[s.request]) - s.start), context_lens[s.request]
        if n:
            keys = slice(0, cl + s.start + n)
            kk = ks[s.request][keys, kvh].double()
            vv = kk[..., :v_head_dim] if vs is None else vs[s.request][keys, kvh].double()
            o, lref = dense_attention(
                qs[s.request][s.start : s.start + n, qh].double(),
                kk,
                vv,
                causal=True,
                q_offset=cl + s.start,
            )
            err = max(
                err,
                (out[s.row : s.row + n].cpu().double() - o).abs().max().item(),
                (lse[s.row : s.row + n].cpu().double() - lref).abs().max().item(),
            )
            real += n
    expected = chunked_comm_bytes(
        stats["strategy"],
        context_lens,
        query_lens,
        cfg,
        workspace_size=run_cfg.workspace_size,
        v_head_dim=v_head_dim,
        elem_bytes=q.element_size(),
    )
    held = [int(x.shape[0]) for x in context.keys]
    sent = comm_bytes(comm)
    print(
        f"pcp {c.pcp_rank} tp {c.tp_rank} dcp {c.dcp_rank}/{cfg.dcp} {stats['strategy']}: "
        f"{meta.num_tokens} rows ({real} real), heads {qh.start}-{qh.stop - 1}"
    )
    print(
        f"  holds {sum(held)}/{sum(context_lens)} context tokens; == dense (<= 1e-10): "
        f"{err <= 1e-10}"
    )
    print(f"  sent {sent:,} B in {len(comm)} calls; == formula: {comm == expected}")
    return {
        "strategy": stats["strategy"],
        "max_abs_err": err,
        "comm": comm,
        "expected": expected,
        "stats": stats,
        "rows": meta.num_tokens,
        "real_rows": real,
        "context_rows": held,
        "q_heads": (qh.start, qh.stop),
        "out": out.cpu(),
        "lse": lse.cpu(),
    }


# ------------------------------------------------------------------------------------------
# the per-rank function (inline, torchrun and the tests)
# ------------------------------------------------------------------------------------------
def ring_prefill_rank(
    ctx: RankContext,
    *,
    parallel_config: ParallelConfig = ParallelConfig(num_q_heads=8, num_kv_heads=2, head_dim=16),
    seq_lens: Sequence[int] = (37, 64),
    context_lens: Sequence[int] = (0, 48),
    mode: str = "pass_kv",
    seed: int = 0,
    dtype: str = "float64",
) -> dict[str, Any]:
    """One ring prefill on this rank of a ``tp × pcp`` world (``pcp = world // tp`` replaces
    ``parallel_config``'s), checked.

    Validates the config before any collective, draws
    :func:`~cpbook.core.problems.ring_prefill_problem`, keeps this rank's new-token rows
    (zigzag), context shard and TP heads, runs :func:`ring_attention` in the PCP group and
    compares every real row with dense float64 attention.  Returns ``max_abs_err``, ``comm``
    (traced ``(op, bytes_sent)``), ``expected`` (:func:`ring_comm_bytes`), ``steps``,
    ``kernel_calls``, ``work`` and ``peak_temp_bytes``.
    """
    check_mode(mode)
    pcp = pcp_of_world(ctx.world_size, parallel_config.tp)
    cfg = dataclasses.replace(parallel_config, prefill_context_parallel_size=pcp)
    shards = RingShards(tuple(seq_lens), tuple(context_lens), cfg.pcp, cfg.interleave)
    groups = make_groups(ctx, cfg)
    r, tp_rank = groups.coords.pcp_rank, groups.coords.tp_rank
    qh, kvh = q_heads_of(cfg, tp_rank), kv_heads_of(cfg, tp_rank)
    lens, dt = (shards.seq_lens, shards.context_lens), getattr(torch, dtype)
    qs, ks, vs = ring_prefill_problem(*lens, cfg, seed, dt)
    meta = shards.metadata(r)
    q = pcp_shard(torch.cat(qs)[:, qh], meta)
    k, v = (
        pcp_shard(torch.cat([t[c:] for t, c in zip(ts, shards.context_lens)])[:, kvh], meta)
        for ts in (ks, vs)
    )
    pos = shards.context_positions(r)
    k_ctx, v_ctx = (torch.cat([t[p] for t, p in zip(ts, pos)])[:, kvh] for ts in (ks, vs))
    stats = {}
    with ctx.traced() as comm:
        dq, dk, dv, dkc, dvc = (t.to(ctx.device) for t in (q, k, v, k_ctx, v_ctx))
        out, lse = ring_attention(dq, dk, dv, shards, groups.pcp, mode, dkc, dvc, stats=stats)
    heads = (qh.stop - qh.start, kvh.stop - kvh.start)
    expected = ring_comm_bytes(mode, shards, r, *heads, cfg.head_dim, q.element_size())
    err = 0.0
    for seg, qlen in zip(meta.segments, meta.query_lens):
        c, i = shards.context_lens[seg.request], seg.request
        for j in range(0, qlen, 256):
            m, at = min(256, qlen - j), seg.start + j
            ro, rl = dense_attention(
                qs[i][at : at + m, qh].double(),
                ks[i][: c + at + m, kvh].double(),
                vs[i][: c + at + m, kvh].double(),
                causal=True,
                q_offset=c + at,
                k_offset=0,
            )
            rows = slice(seg.row + j, seg.row + j + m)
            err = max(
                err,
                (out[rows].cpu().double() - ro).abs().max().item(),
                (lse[rows].cpu().double() - rl).abs().max().item(),
            )
    real, sent = int((~meta.is_padding).sum()), comm_bytes(comm)
    print(
        f"{mode} pcp {r}/{cfg.pcp} tp {tp_rank}: {real} new rows, "
        f"{shards.num_context(r)} context rows"
    )
    print(
        f"  {stats['steps']} steps, {stats['kernel_calls']} kernel calls, "
        f"{stats['work']:,} pairs/head, peak temp {stats['peak_temp_bytes']:,} B"
    )
    print(f"  sent {sent:,} B, = formula: {comm == expected}; == dense (<= 1e-10): {err <= 1e-10}")
    return {
        "pcp_rank": r,
        "tp_rank": tp_rank,
        "mode": mode,
        "max_abs_err": err,
        "comm": comm,
        "expected": expected,
        "bytes_sent": sent,
        **stats,
    }
