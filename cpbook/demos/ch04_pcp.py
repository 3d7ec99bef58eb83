"""Chapter 4's per-rank demo: PCP prefill on the zigzag (DualChunkSwap) partition
(:func:`pcp_prefill_rank`), its inputs and dense causal float64 reference."""

from __future__ import annotations

import math
import textwrap
from typing import Any, Sequence

import torch

from cpbook.core.attention import (
    dense_attention,
    rope,
)
from cpbook.core.config import ParallelConfig
from cpbook.core.context import RankContext
from cpbook.core.groups import RankGrid, make_groups, pcp_of_world
from cpbook.core.heads import kv_heads_of, q_heads_of
from cpbook.pcp.prefill import (
    _DTYPES,
    pcp_comm_bytes,
    pcp_prefill_attention,
    pcp_restore,
    pcp_restore_bytes,
    pcp_shard,
)
from cpbook.pcp.zigzag import PCPMetadata, pcp_partition

__all__ = ["pcp_prefill_problem", "pcp_prefill_rank"]


# ------------------------------------------------------------------------------------------
# Per-rank functions (run inline, under torchrun, and by the tests)
# ------------------------------------------------------------------------------------------
def _reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: PCPMetadata, block: int = 256
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense float64 attention for this rank's real rows, in local row order (query blocks)."""
    out = torch.zeros(meta.num_tokens, q.shape[1], v.shape[-1], dtype=torch.float64)
    lse = torch.full((meta.num_tokens, q.shape[1]), float("-inf"), dtype=torch.float64)
    cu = meta.cu_seq_lens
    for seg, qlen, klen in zip(meta.segments, meta.query_lens, meta.key_lens):
        base = cu[seg.request]
        for i in range(0, qlen, block):
            n = min(block, qlen - i)
            rows = slice(base + seg.start + i, base + seg.start + i + n)
            o, l = dense_attention(
                q[rows].double(),
                k[base : base + klen].double(),
                v[base : base + klen].double(),
                causal=True,
                q_offset=seg.start + i,
                k_offset=0,
            )
            out[seg.row + i : seg.row + i + n], lse[seg.row + i : seg.row + i + n] = o, l
    return out, lse


def pcp_prefill_problem(
    seq_lens: Sequence[int],
    hidden_size: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    seed: int = 0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Float64 hidden states ``x [sum(seq_lens), hidden_size]`` and Q/K/V projection weights
    (``hidden_size x heads·head_dim``, scaled by ``hidden_size^-1/2``), from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(seq_lens), hidden_size, generator=gen, dtype=torch.float64)
    w = {
        n: torch.randn(hidden_size, h * head_dim, generator=gen, dtype=torch.float64)
        / math.sqrt(hidden_size)
        for n, h in (("q", num_q_heads), ("k", num_kv_heads), ("v", num_kv_heads))
    }
    return x, w


def pcp_prefill_rank(
    ctx: RankContext,
    *,
    seq_lens: Sequence[int] = (37, 64),
    tensor_parallel_size: int = 1,
    num_q_heads: int = 8,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    hidden_size: int = 64,
    layout: str = "zigzag",
    seed: int = 0,
    dtype: str = "float64",
) -> dict[str, Any]:
    """Chapter 4: exact PCP prefill of a batch on a ``tp × pcp`` grid (``pcp = world // tp``).

    Every rank draws the same hidden states and projection weights (:func:`pcp_prefill_problem`),
    keeps its tokens (:func:`pcp_shard`) and its TP heads, applies RoPE at the true positions,
    runs :func:`pcp_prefill_attention` in its PCP group (one layer) and checks its rows against
    dense float64 attention.  Then :func:`pcp_restore` (once per forward) must put every rank's
    rows where the sequence has them.  Returns the max error, this rank's exact causal work,
    the layer's traced ``comm`` and formula ``expected`` (:func:`pcp_comm_bytes`: the K/V
    all-gathers), and apart from them the restore's ``restore_comm`` / ``restore_expected``.
    """
    tp = tensor_parallel_size
    pcp = pcp_of_world(ctx.world_size, tp)
    cfg = ParallelConfig(
        tensor_parallel_size=tp,
        prefill_context_parallel_size=pcp,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
    )
    part = pcp_partition(tuple(seq_lens), cfg.pcp, layout)
    groups = make_groups(ctx, RankGrid(tp, cfg.pcp))
    qh, kh = (
        q_heads_of(cfg, groups.coords.tp_rank),
        kv_heads_of(cfg, groups.coords.tp_rank),
    )
    dt = _DTYPES[dtype]
    x, w = pcp_prefill_problem(seq_lens, hidden_size, num_q_heads, num_kv_heads, head_dim, seed)

    def qkv(hidden: torch.Tensor, positions: torch.Tensor, w: dict) -> tuple[torch.Tensor, ...]:
        t = hidden.shape[0]
        q = rope((hidden @ w["q"]).view(t, num_q_heads, head_dim), positions)[:, qh]
        k = rope((hidden @ w["k"]).view(t, num_kv_heads, head_dim), positions)[:, kh]
        v = (hidden @ w["v"]).view(t, num_kv_heads, head_dim)[:, kh]
        return tuple(a.to(dt).contiguous() for a in (q, k, v))

    q_ref, k_ref, v_ref = qkv(x, torch.cat([torch.arange(n) for n in seq_lens]), w)
    meta, dev = part.metadata(groups.coords.pcp_rank), ctx.device
    on_dev = {n: t.to(dev) for n, t in w.items()}
    q, k, v = qkv(pcp_shard(x.to(dev), meta), meta.positions.to(dev), on_dev)
    with ctx.traced() as comm:
        out, lse = pcp_prefill_attention(q, k, v, meta, groups.pcp)
    ref_out, ref_lse = _reference(q_ref, k_ref, v_ref, meta)
    real = ~meta.is_padding
    out_h, lse_h = out.cpu(), lse.cpu()  # compared on the host, with the float64 reference
    err = (
        max(
            (out_h[real].double() - ref_out[real]).abs().max().item(),
            (lse_h[real].double() - ref_lse[real]).abs().max().item(),
        )
        if bool(real.any())
        else 0.0
    )
    with ctx.traced() as restore_comm:
        restored = pcp_restore(out, meta, groups.pcp)
    placed = torch.equal(restored.cpu()[meta.token_index[real]], out_h[real])
    work = part.work()[meta.pcp_rank]
    chunks = " ".join(f"r{s.request}[{s.start},{s.end})" for s in meta.segments[:8])
    more = f" +{len(meta.segments) - 8} more" if len(meta.segments) > 8 else ""
    # three short lines (the report prefixes each with "[rank N] "): fits 84 columns
    print(
        f"{layout}: pcp {meta.pcp_rank} tp {groups.coords.tp_rank}, "
        f"{int(real.sum())} real tokens, {work:,} causal pairs/head"
    )
    print(textwrap.fill(chunks + more, 74, initial_indent="  chunks ", subsequent_indent=" " * 9))
    print(f"  == dense (<= 1e-10): {err <= 1e-10}, restored in place: {placed}")
    e = out.element_size()
    return {
        "pcp_rank": meta.pcp_rank,
        "tp_rank": groups.coords.tp_rank,
        "max_abs_err": err,
        "work": work,
        "restored": placed,
        "comm": comm,
        "expected": pcp_comm_bytes(
            meta.num_tokens, kh.stop - kh.start, head_dim, cfg.pcp, elem_bytes=e
        ),
        "restore_comm": restore_comm,
        "restore_expected": pcp_restore_bytes(meta.num_tokens, out[0].numel() * e, cfg.pcp),
    }
