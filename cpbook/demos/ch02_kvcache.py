"""Chapter 2's per-rank demo: every DCP rank writes its interleaved share of a request into
its :class:`~cpbook.kv.paged.PagedKVCache`, reads it back, and the group all-gathers and
reconstructs the request, checked bit-exact against the dense cache."""

from __future__ import annotations

from typing import Any

import torch

from cpbook.core.config import ParallelConfig
from cpbook.core.context import RankContext
from cpbook.core.problems import kvcache_problem
from cpbook.kv.layout import DCPShard, block_fill, check_layout
from cpbook.kv.paged import PagedKVCache
from cpbook.kv.transfer import kvcache_comm_bytes

__all__ = ["kvcache_rank"]


# ------------------------------------------------------------------------------------------
# the per-rank demo: write own tokens, read back, all-gather, reconstruct
# ------------------------------------------------------------------------------------------
def kvcache_rank(
    ctx: RankContext,
    *,
    parallel_config: ParallelConfig = ParallelConfig(
        block_size=16, cp_kv_cache_interleave_size=4, num_q_heads=2, num_kv_heads=2, head_dim=8
    ),
    seq_len: int = 200,
    num_blocks: int = 64,
    seed: int = 0,
    dtype: str = "float64",
) -> dict[str, Any]:
    """Each rank of the DCP group (the world) stores only its tokens; an all-gather rebuilds K/V.

    ``parallel_config`` gives the cache's ``block_size``, ``cp_kv_cache_interleave_size``,
    ``num_kv_heads`` and ``head_dim``; the DCP group is the world.  Every rank draws the same
    ``k, v`` and block table (:func:`~cpbook.core.problems.kvcache_problem`), writes through
    its :func:`slot_mapping`, reads its tokens back, and all-gathers them (uneven sizes) with
    their positions.  Returns this rank's token count and bytes, whether every position came
    back exactly once, the max error (exactly 0.0: data is only moved), the traced
    ``comm`` and the formula's ``expected`` (:func:`kvcache_comm_bytes`).
    """
    group, cfg = ctx.world, parallel_config
    n, r, interleave, block_size = group.size, group.rank, cfg.interleave, cfg.block_size
    num_kv_heads, head_dim = cfg.num_kv_heads, cfg.head_dim
    check_layout(n, interleave, block_size)
    k, v, table = kvcache_problem(seq_len, num_kv_heads, head_dim, num_blocks, block_size, n, seed)
    k, v = k.to(getattr(torch, dtype)), v.to(getattr(torch, dtype))
    cache = PagedKVCache(
        num_blocks,
        block_size,
        num_kv_heads,
        head_dim,
        shard=DCPShard(n, r, interleave),
        dtype=k.dtype,
        device=ctx.device,
    )
    wrote = cache.write(
        k.to(ctx.device), v.to(ctx.device), cache.slot_mapping(torch.arange(seq_len), table)
    )
    lk, lv, pos = cache.read(table, seq_len)
    with ctx.traced() as comm:
        all_k, sizes = group.all_gather_v(lk, dim=0)
        all_v, _ = group.all_gather_v(lv, dim=0)
        all_pos, _ = group.all_gather_v(pos.to(ctx.device), dim=0)
    all_pos = all_pos.cpu()
    once = bool((torch.bincount(all_pos, minlength=seq_len) == 1).all()) and sum(sizes) == seq_len
    full_k, full_v = torch.empty_like(k), torch.empty_like(v)
    full_k[all_pos], full_v[all_pos] = all_k.cpu(), all_v.cpu()
    err = max((full_k - k).abs().max().item(), (full_v - v).abs().max().item())
    blocks = int((block_fill(seq_len, block_size, n, interleave)[r] > 0).sum())
    stored = wrote * cache.bytes_per_token
    total = seq_len * cache.bytes_per_token
    print(
        f"stores {wrote} of {seq_len} tokens in {blocks} blocks: {stored:,} of {total:,} B "
        f"({stored / total:.3f})"
    )
    print(f"rebuilt: every token once: {once}; max err {err:.1f}")
    return {
        "tokens": wrote,
        "blocks": blocks,
        "bytes": stored,
        "total_bytes": total,
        "each_once": once,
        "max_abs_err": err,
        "comm": comm,
        "expected": kvcache_comm_bytes(
            seq_len, n, interleave, num_kv_heads, head_dim, k.element_size()
        ),
    }
