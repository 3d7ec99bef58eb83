"""Chapter 2's per-rank demo: every DCP rank writes its interleaved share of a request into
its :class:`~cpbook.kv.paged.PagedKVCache`, reads it back, and the group all-gathers and
reconstructs the request, checked bit-exact against the dense cache."""

from __future__ import annotations

from typing import Any

import torch

from cpbook.core.context import RankContext
from cpbook.kv.layout import block_fill, check_layout, num_virtual_blocks
from cpbook.kv.paged import PagedKVCache
from cpbook.kv.transfer import kvcache_comm_bytes

__all__ = ["kvcache_problem", "kvcache_rank"]


# ------------------------------------------------------------------------------------------
# the per-rank demo: write own tokens, read back, all-gather, reconstruct
# ------------------------------------------------------------------------------------------
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
    ``ceil(seq_len / (block_size * dcp))`` distinct ids below ``num_blocks``, from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen, dtype=torch.float64)
    v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen, dtype=torch.float64)
    table = torch.randperm(num_blocks, generator=gen)[
        : num_virtual_blocks(seq_len, block_size, dcp)
    ]
    return k, v, table


def kvcache_rank(
    ctx: RankContext,
    *,
    seq_len: int = 200,
    block_size: int = 16,
    cp_kv_cache_interleave_size: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 8,
    num_blocks: int = 64,
    seed: int = 0,
    dtype: str = "float64",
) -> dict[str, Any]:
    """Each rank of the DCP group (the world) stores only its tokens; an all-gather rebuilds K/V.

    Every rank draws the same ``k, v`` and block table (:func:`kvcache_problem`), writes through
    its :func:`slot_mapping`, reads its tokens back, and all-gathers them (uneven sizes) with
    their positions.  Returns this rank's token count and bytes, whether every position came
    back exactly once, the max error (exactly 0.0: data is only moved), the traced
    ``comm`` and the formula's ``expected`` (:func:`kvcache_comm_bytes`).
    """
    group, interleave = ctx.world, cp_kv_cache_interleave_size
    n, r = group.size, group.rank
    check_layout(n, interleave, block_size)
    k, v, table = kvcache_problem(seq_len, num_kv_heads, head_dim, num_blocks, block_size, n, seed)
    k, v = k.to(getattr(torch, dtype)), v.to(getattr(torch, dtype))
    cache = PagedKVCache(
        num_blocks,
        block_size,
        num_kv_heads,
        head_dim,
        dcp=n,
        dcp_rank=r,
        interleave=interleave,
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
