"""Chapter 1's per-rank demo: each rank attends one shard of the keys and the exact LSE merge
(:func:`cpbook.core.attention.merge_attn_states`) combines the partial results; checked
against dense float64 attention."""

from __future__ import annotations

from typing import Any

import torch

from cpbook.core.attention import (
    attention_with_lse,
    dense_attention,
    merge_attn_states,
    merge_comm_bytes,
)
from cpbook.core.context import RankContext
from cpbook.core.problems import merge_problem

__all__ = ["merge_rank"]


# ------------------------------------------------------------------------------------------
# chapter 1's per-rank function: split the keys, merge by the LSE
# ------------------------------------------------------------------------------------------
def merge_rank(
    ctx: RankContext,
    *,
    num_keys: int = 64,
    num_queries: int = 2,
    num_q_heads: int = 4,
    head_dim: int = 16,
    seed: int = 0,
    dtype: str = "float64",
) -> dict[str, Any]:
    """Chapter 1: split one attention's keys over the ranks, merge by the LSE.

    Every rank draws the same ``q, k, v``
    (:func:`~cpbook.core.problems.merge_problem`) and keeps a
    contiguous slice of the keys (``torch.tensor_split``: uneven, empty when
    ``num_keys < world_size``).  It computes ``(out, lse)`` on its slice,
    all-gathers both and merges them.  Returns this rank's key range, the merged
    result's max error against dense float64 attention on all keys (``<= 1e-10``
    in float64), the traced ``comm`` and the formula's ``expected``.
    """
    dev, dt = ctx.device, getattr(torch, dtype)
    qa, ka, va = merge_problem(num_keys, num_queries, num_q_heads, head_dim, seed)
    mine = torch.tensor_split(torch.arange(num_keys), ctx.world_size)[ctx.rank]
    lo, hi = (int(mine[0]), int(mine[-1]) + 1) if len(mine) else (0, 0)
    q, k, v = qa.to(dev, dt), ka[lo:hi].to(dev, dt), va[lo:hi].to(dev, dt)
    out, lse = attention_with_lse(q, k, v)
    with ctx.traced() as comm:
        outs = ctx.world.all_gather(out[None], dim=0)  # [world, Tq, H, D]
        lses = ctx.world.all_gather(lse[None].double(), dim=0)  # [world, Tq, H]
    merged, merged_lse = merge_attn_states(list(outs), list(lses))
    ref, ref_lse = dense_attention(qa, ka, va)
    err = max(
        (merged.cpu().double() - ref).abs().max().item(),
        (merged_lse.cpu() - ref_lse).abs().max().item(),
    )
    exact = err <= 1e-10
    print(f"keys [{lo}, {hi}): {hi - lo} of {num_keys}; merged == dense: {exact}")
    return {
        "keys": (lo, hi),
        "max_abs_err": err,
        "comm": comm,
        "expected": merge_comm_bytes(
            num_queries, num_q_heads, head_dim, ctx.world_size, out.element_size()
        ),
    }
