"""Named demos: per-rank functions that run unchanged inline, under torchrun and from the CLI.

``python -m cpbook demo NAME --world-size N [--backend torchrun]`` runs one through
:func:`cpbook.launch.run`; ``torchrun --nproc-per-node N -m cpbook demo NAME`` runs it on the
processes torchrun started.  Chapters register their mechanisms in :data:`DEMOS`.
"""
from __future__ import annotations

import importlib
from typing import Any, Callable

import torch

from .attention import attention_with_lse, dense_attention, merge_attn_states
from .comm import RankContext

__all__ = ["DEMOS", "get_demo", "sharded_keys_attention"]


def sharded_keys_attention(ctx: RankContext, num_keys: int = 64,
                           num_queries: int = 2, num_heads: int = 4,
                           head_dim: int = 16, seed: int = 0) -> dict[str, Any]:
    """Chapter 1: split one attention's keys over the ranks, merge by the LSE.

    Every rank draws the same float64 ``q, k, v`` from ``seed`` and keeps a
    contiguous slice of the keys (``torch.tensor_split``: uneven, empty when
    ``num_keys < world_size``).  It computes ``(out, lse)`` on its slice,
    all-gathers both and merges them.  Returns this rank's key range and the
    merged result's maximum error against dense attention on all keys.
    """
    gen = torch.Generator().manual_seed(seed)
    f64, dev = torch.float64, ctx.device
    q = torch.randn(num_queries, num_heads, head_dim, generator=gen, dtype=f64)
    k = torch.randn(num_keys, num_heads, head_dim, generator=gen, dtype=f64)
    v = torch.randn(num_keys, num_heads, head_dim, generator=gen, dtype=f64)
    mine = torch.tensor_split(torch.arange(num_keys), ctx.world_size)[ctx.rank]
    lo, hi = (int(mine[0]), int(mine[-1]) + 1) if len(mine) else (0, 0)
    out, lse = attention_with_lse(q.to(dev), k[lo:hi].to(dev), v[lo:hi].to(dev))
    outs = ctx.world.all_gather(out[None], dim=0)  # [world, Tq, H, D]
    lses = ctx.world.all_gather(lse[None], dim=0)  # [world, Tq, H]
    merged, merged_lse = merge_attn_states(list(outs), list(lses))
    ref, ref_lse = dense_attention(q, k, v)
    err = max((merged.cpu() - ref).abs().max().item(),
              (merged_lse.cpu() - ref_lse).abs().max().item())
    print(f"keys [{lo}, {hi}): {hi - lo} of {num_keys}; "
          f"merged == dense: {err <= 1e-10}")
    return {"keys": (lo, hi), "max_abs_err": err}


DEMOS: dict[str, str] = {
    "merge": "cpbook.demos:sharded_keys_attention",
    "kvcache": "cpbook.kvcache:reconstruct_kv",
    "dcp-gqa": "cpbook.dcp:gqa_decode_rank",
    "dcp-mla": "cpbook.mla:mla_decode_rank",
    "dcp-mla-ctx": "cpbook.mla:mla_context_rank",
    "pcp": "cpbook.pcp:pcp_prefill_demo",
}


def get_demo(name: str) -> Callable[..., Any]:
    """The per-rank function registered under ``name``."""
    if name not in DEMOS:
        raise ValueError(f"[demo-name] requires one of {sorted(DEMOS)}; got {name!r}")
    mod, fn = DEMOS[name].split(":")
    return getattr(importlib.import_module(mod), fn)
