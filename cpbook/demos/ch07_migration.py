"""Chapter 7's per-rank demo: a request decodes on CP = N, its paged KV migrates live to CP = M
(:func:`cpbook.dynamic.migration.migrate_kv`), and decoding continues; every step is checked
against dense float64 attention and the traced sends against the migration plan."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from cpbook.core.attention import dense_attention
from cpbook.core.comm import comm_bytes
from cpbook.core.config import ConfigError, check_positive
from cpbook.core.context import RankContext
from cpbook.dcp.decode import dcp_decode_attention, decode_comm_bytes
from cpbook.dynamic.migration import (
    migrate_kv,
    migration_bytes,
    migration_comm_bytes,
    migration_plan,
)
from cpbook.engine.config import config_of
from cpbook.kv.layout import DCPShard, check_layout, local_seq_len
from cpbook.kv.manager import KVCacheManager
from cpbook.kv.paged import PagedKVCache

__all__ = ["MigrationKV", "migration_problem", "migration_rank"]


def migration_problem(
    seq_len: int,
    num_decode_steps: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Float64 ``q [S, Hq, D]`` (one query per later decode step) and ``k, v [L + S, Hkv, D]``
    (the cached context, then one new token per step), identical on every rank."""
    gen = torch.Generator().manual_seed(seed)
    n = seq_len + num_decode_steps
    q = torch.randn(num_decode_steps, num_q_heads, head_dim, generator=gen, dtype=torch.float64)
    k = torch.randn(n, num_kv_heads, head_dim, generator=gen, dtype=torch.float64)
    v = torch.randn(n, num_kv_heads, head_dim, generator=gen, dtype=torch.float64)
    return q, k, v


def _cache(
    num_blocks: int,
    block_size: int,
    kv: tuple[int, int],
    size: int,
    rank: int,
    inter: int,
    dtype: torch.dtype,
    device: torch.device,
) -> PagedKVCache:
    return PagedKVCache(
        num_blocks,
        block_size,
        kv[0],
        kv[1],
        shard=DCPShard(size, rank, inter),
        dtype=dtype,
        device=device,
    )


@dataclass(frozen=True)
class MigrationKV:
    """The KV caches of both groups in :func:`migration_rank`: the old group's
    (``src_kv_cache_interleave_size``) and the new group's (``cp_kv_cache_interleave_size``)
    interleave, ``num_blocks`` blocks of ``block_size`` slots on every rank, and the attention
    shape (``num_q_heads`` over ``num_kv_heads`` KV heads of ``head_dim``)."""

    src_kv_cache_interleave_size: int = 1
    cp_kv_cache_interleave_size: int = 2
    block_size: int = 4
    num_blocks: int = 64
    num_q_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 8


def migration_rank(
    ctx: RankContext,
    *,
    src_context_parallel_size: int = 1,
    decode_context_parallel_size: int = 4,
    seq_len: int = 37,
    num_decode_steps: int = 3,
    kv: MigrationKV | dict[str, int] | None = None,
    seed: int = 0,
    dtype: str = "float64",
) -> dict[str, Any]:
    """Migrate a running request from CP = ``src_context_parallel_size`` to CP =
    ``decode_context_parallel_size`` on this rank, then decode ``num_decode_steps`` more tokens;
    ``kv`` (a :class:`MigrationKV` or a dict of its fields) shapes both groups' caches.

    The world is ``max(N, M)`` ranks.  Every rank keeps an identical block manager for the old
    and the new group; the old group holds ``seq_len`` cached tokens.  After :func:`migrate_kv`
    each new rank checks its cache against the original K/V (bit for bit), and every later
    step's DCP decode output (this rank's ``num_q_heads / M`` heads) is compared with dense
    float64 attention over all tokens so far: the un-migrated request's result.
    """
    shape = config_of(MigrationKV, kv)
    n_old, n_new = src_context_parallel_size, decode_context_parallel_size
    i_old, i_new = shape.src_kv_cache_interleave_size, shape.cp_kv_cache_interleave_size
    block_size, num_blocks = shape.block_size, shape.num_blocks
    num_q_heads, num_kv_heads, head_dim = shape.num_q_heads, shape.num_kv_heads, shape.head_dim
    check_positive(seq_len=seq_len, num_decode_steps=num_decode_steps, num_blocks=num_blocks)
    check_layout(n_old, i_old, block_size)
    check_layout(n_new, i_new, block_size)
    if ctx.world_size != max(n_old, n_new):
        raise ConfigError(
            "world-is-both-groups",
            "world_size == max(src_context_parallel_size, decode_context_parallel_size)",
            world_size=ctx.world_size,
            src_context_parallel_size=n_old,
            decode_context_parallel_size=n_new,
        )
    if num_q_heads % n_new or num_q_heads % num_kv_heads:
        raise ConfigError(
            "q-heads-divisible",
            "num_q_heads % decode_context_parallel_size == 0 and num_q_heads % num_kv_heads == 0",
            num_q_heads=num_q_heads,
            decode_context_parallel_size=n_new,
            num_kv_heads=num_kv_heads,
        )
    r, dt = ctx.rank, getattr(torch, dtype)
    q, k, v = migration_problem(
        seq_len, num_decode_steps, num_q_heads, num_kv_heads, head_dim, seed
    )
    q, k, v = q.to(dt), k.to(dt), v.to(dt)
    kv_shape = (num_kv_heads, head_dim)
    old_mgr = KVCacheManager(num_blocks, block_size, n_old, i_old)
    old_mgr.allocate("req", seq_len)
    old = None
    if r < n_old:
        cache = _cache(num_blocks, block_size, kv_shape, n_old, r, i_old, dt, ctx.device)
        table = old_mgr.block_table("req")
        cache.write(
            k[:seq_len].to(ctx.device),
            v[:seq_len].to(ctx.device),
            cache.slot_mapping(torch.arange(seq_len), table),
        )
        old = (cache, table)
    new_mgr = KVCacheManager(num_blocks, block_size, n_new, i_new)
    new_mgr.allocate("req", seq_len)
    new = None
    if r < n_new:
        cache = _cache(num_blocks, block_size, kv_shape, n_new, r, i_new, dt, ctx.device)
        new = (cache, new_mgr.block_table("req"))
    before = 0 if old is None else local_seq_len(seq_len, n_old, r, i_old)
    world = ctx.world
    with ctx.traced() as comm:
        wrote = migrate_kv(world, seq_len, old, new, n_old, n_new, i_old, i_new)
    blocks_before = old_mgr.num_blocks - old_mgr.num_free_blocks
    blocks_after = new_mgr.num_blocks - new_mgr.num_free_blocks
    old_mgr.free("req")
    layout_exact, errs, decode_comm = True, [], []
    if new is not None:
        lk, lv, pos = new[0].read(new[1], seq_len)
        layout_exact = bool(
            torch.equal(lk.cpu(), k[pos.cpu()]) and torch.equal(lv.cpu(), v[pos.cpu()])
        )
    rest = [list(range(n_new))] + ([list(range(n_new, ctx.world_size))] if n_old > n_new else [])
    grp = ctx.new_group(rest, "cp_new")
    if new is not None:
        h = num_q_heads // n_new
        heads = slice(r * h, (r + 1) * h)
        cache = new[0]
        for s in range(num_decode_steps):
            p = seq_len + s
            new_mgr.append("req", 1)
            table = new_mgr.block_table("req")
            cache.write(
                k[p : p + 1].to(ctx.device),
                v[p : p + 1].to(ctx.device),
                cache.slot_mapping([p], table),
            )
            lk, lv, _ = cache.read(table, p + 1)
            with ctx.traced() as decode_comm:
                out = dcp_decode_attention(q[s : s + 1, heads].to(ctx.device), [lk], [lv], grp)
            ref = dense_attention(q[s : s + 1].double(), k[: p + 1].double(), v[: p + 1].double())[
                0
            ][:, heads]
            errs.append((out.cpu().double() - ref).abs().max().item())
    err = max(errs, default=0.0)
    e = k.element_size()
    print(
        f"rank {r}: {before} -> {wrote} tokens, layout exact: {layout_exact}, "
        f"{len(errs)} later steps exact: {err <= 1e-10}"
    )
    return {
        "max_abs_err": err,
        "step_errs": errs,
        "layout_exact": layout_exact,
        "tokens_before": before,
        "tokens_after": wrote,
        "positions_before": [] if old is None else old[0].read(old[1], seq_len)[2].cpu().tolist(),
        "positions_after": [] if new is None else new[0].read(new[1], seq_len)[2].cpu().tolist(),
        "blocks_before": blocks_before,
        "blocks_after": blocks_after,
        "bytes_sent": comm_bytes(comm),
        "bytes_moved_formula": migration_bytes(
            seq_len, n_old, n_new, i_old, i_new, num_kv_heads, head_dim, e
        ),
        "comm": comm,
        "expected": migration_comm_bytes(
            r, migration_plan(seq_len, n_old, n_new, i_old, i_new), num_kv_heads * head_dim * e
        ),
        "decode_comm": decode_comm,
        "decode_expected": []
        if new is None
        else decode_comm_bytes(1, num_q_heads // n_new, head_dim, head_dim, n_new, "ag_rs", e),
    }
