"""Decode timings: one decode step's attention block three ways (no CP, DCP, DCP + TPA), the
speculative verification step against plain decode, and the engine's whole serving run (wall
seconds and tokens per second, what ``python -m cpbook serve`` reports)."""

from __future__ import annotations

import functools
from typing import Any, Sequence

import torch

from cpbook.core.context import RankContext
from cpbook.core.groups import make_groups
from cpbook.core.heads import attention_kv_heads, tpa_config
from cpbook.dcp.tpa import TPABlock, attention_block
from cpbook.dcp.verify import dcp_verify_attention, local_verify_attention
from cpbook.engine.engine import serve_rank
from cpbook.kv.layout import DCPShard
from cpbook.timing.clock import device_name, stopwatch, timed_rounds

__all__ = ["decode_step_timing", "serve_timing", "spec_decode_timing"]


def decode_step_timing(
    ctx: RankContext,
    *,
    contexts: Sequence[int] = (1024, 4096),
    num_q_heads: int = 16,
    head_dim: int = 128,
    hidden_size: int = 1024,
    repeats: int = 5,
    seed: int = 0,
) -> dict[int, dict[str, float]]:
    """Medians of one decode step of one request's attention block (float32, GQA with one KV
    head, ``tp = world``) per context length, three ways in turns from a common barrier:
    ``no_cp`` (TP only: every rank reads the whole KV), ``dcp`` (DCP = TP: 1/N of the KV, plus
    the query all-gather and the combine) and ``dcp_tpa`` (the same without the all-gather).

    Returns ``{context: {method: seconds, method + "_err": max error vs no_cp}}`` for this rank.
    """
    n, out = ctx.world_size, {}
    kw = dict(
        tensor_parallel_size=n,
        num_q_heads=num_q_heads,
        num_kv_heads=1,
        head_dim=head_dim,
        block_size=16,
    )
    cfgs = {
        "no_cp": tpa_config(False, **kw),
        "dcp": tpa_config(False, **kw, decode_context_parallel_size=n),
        "dcp_tpa": tpa_config(True, **kw, decode_context_parallel_size=n),
    }
    groups = {m: make_groups(ctx, c) for m, c in cfgs.items()}
    gen = torch.Generator().manual_seed(seed)
    s = hidden_size**-0.5
    block = TPABlock(
        torch.randn(hidden_size, num_q_heads * head_dim, generator=gen) * s,
        torch.randn(num_q_heads * head_dim, hidden_size, generator=gen) * s,
        num_q_heads,
    ).to(ctx.device)
    x = torch.randn(1, hidden_size, generator=gen).to(ctx.device)
    for c in contexts:
        k, v = (torch.randn(c, 1, head_dim, generator=gen).to(ctx.device) for _ in range(2))
        methods = {}
        for m, cfg in cfgs.items():
            kvh = attention_kv_heads(cfg, groups[m].coords.tp_rank)
            rank = groups[m].coords.dcp_rank
            mine = torch.arange(rank, c, cfg.dcp, device=ctx.device)  # interleave 1: its tokens
            kk, vv = k[mine][:, kvh].contiguous(), v[mine][:, kvh].contiguous()
            methods[m] = functools.partial(attention_block, x, block, [kk], [vv], cfg, groups[m])
        medians, last = timed_rounds(ctx, methods, repeats)
        out[c] = {m: medians[m] for m in methods}
        out[c].update({f"{m}_err": (last[m] - last["no_cp"]).abs().max().item() for m in methods})
    return out


def serve_timing(ctx: RankContext, **kwargs: Any) -> dict[str, Any]:
    """:func:`cpbook.engine.engine.serve_rank` (same arguments) plus ``wall_s``, this rank's seconds
    for the whole run (engine construction included), and ``tokens_per_s``, the new tokens
    over it.  ``python -m cpbook serve`` reports these."""
    with stopwatch(ctx.device) as watch:
        res = serve_rank(ctx, **kwargs)
    wall = watch.seconds
    new = sum(len(t) for t in res["tokens"])
    return {
        **res,
        "wall_s": wall,
        "tokens_per_s": new / wall if wall else None,
        "device": device_name(ctx.device),
        "dist_backend": ctx.backend,
    }


def spec_decode_timing(
    ctx: RankContext,
    *,
    contexts: Sequence[int] = (1024, 4096),
    num_speculative_tokens: Sequence[int] = (1, 3),
    num_q_heads: int = 16,
    head_dim: int = 128,
    repeats: int = 5,
    seed: int = 0,
) -> dict[int, dict[str, float]]:
    """Medians of one decode (or verification) step's attention for one request of each
    context (float32, one KV head, ``num_q_heads / world`` heads per rank), in turns from a
    common barrier: ``no_cp`` (TP only: the whole KV on every rank, one row), ``dcp`` (DCP =
    world: the interleaved shard, AllGather Q and the ``ag_rs`` combine, one row), and per ``k``
    ``dcp_spec{k}`` (the same with ``k + 1`` rows,
    :func:`cpbook.dcp.verify.dcp_verify_attention`) and ``no_cp_spec{k}`` (``k + 1`` rows over
    the whole KV).  Returns ``{context: {method: seconds}}`` for this rank."""
    n, r, out = ctx.world_size, ctx.rank, {}
    gen = torch.Generator().manual_seed(seed)
    h = num_q_heads // n
    for c in contexts:
        k, v = (torch.randn(c, 1, head_dim, generator=gen).to(ctx.device) for _ in range(2))
        mine = torch.arange(r, c, n, device=ctx.device)  # interleave 1: this rank's tokens
        ks, vs = k[mine].contiguous(), v[mine].contiguous()
        rows = [0, *num_speculative_tokens]
        q = {j: torch.randn(j + 1, h, head_dim, generator=gen).to(ctx.device) for j in rows}
        methods = {}
        for j in rows:
            name = "" if j == 0 else f"_spec{j}"
            start = c - j - 1  # the step's rows are the last j + 1 positions
            methods["no_cp" + name] = functools.partial(
                local_verify_attention, q[j], [k], [v], [start], [j + 1], DCPShard()
            )
            methods["dcp" + name] = functools.partial(
                dcp_verify_attention, q[j], [ks], [vs], [start], [j + 1], ctx.world, 1
            )
        medians, _ = timed_rounds(ctx, methods, repeats)
        out[c] = {m: medians[m] for m in methods}
    return out
