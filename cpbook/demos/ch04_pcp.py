"""Chapter 4's per-rank demo: PCP prefill on the zigzag (DualChunkSwap) partition
(:func:`pcp_prefill_rank`), checked against the dense causal float64 reference
(:func:`cpbook.core.reference.pcp_prefill_reference`)."""

from __future__ import annotations

import dataclasses
import textwrap
from typing import Any, Sequence

import torch

from cpbook.core.attention import rope
from cpbook.core.config import ParallelConfig
from cpbook.core.context import RankContext
from cpbook.core.groups import RankGrid, make_groups, pcp_of_world
from cpbook.core.heads import kv_heads_of, q_heads_of
from cpbook.core.problems import pcp_prefill_problem
from cpbook.core.reference import pcp_prefill_reference
from cpbook.pcp.prefill import (
    _DTYPES,
    pcp_comm_bytes,
    pcp_prefill_attention,
    pcp_restore,
    pcp_restore_bytes,
    pcp_shard,
)
from cpbook.pcp.zigzag import pcp_partition

__all__ = ["pcp_prefill_rank"]


# ------------------------------------------------------------------------------------------
# Per-rank functions (run inline, under torchrun, and by the tests)
# ------------------------------------------------------------------------------------------
def pcp_prefill_rank(
    ctx: RankContext,
    *,
    parallel_config: ParallelConfig = ParallelConfig(num_q_heads=8, num_kv_heads=2, head_dim=16),
    seq_lens: Sequence[int] = (37, 64),
    hidden_size: int = 64,
    partition: str = "zigzag",
    seed: int = 0,
    dtype: str = "float64",
) -> dict[str, Any]:
    """Chapter 4: exact PCP prefill of a batch on a ``tp × pcp`` grid (``pcp = world // tp``).

    ``parallel_config``'s ``prefill_context_parallel_size`` is set to the world's (``world // tp``).
    Every rank draws the same hidden states and projection weights
    (:func:`~cpbook.core.problems.pcp_prefill_problem`),
    keeps its tokens (:func:`pcp_shard`) and its TP heads, applies RoPE at the true positions,
    runs :func:`pcp_prefill_attention` in its PCP group (one layer) and checks its rows against
    dense float64 attention.  Then :func:`pcp_restore` (once per forward) must put every rank's
    rows where the sequence has them.  Returns the max error, this rank's exact causal work,
    the layer's traced ``comm`` and formula ``expected`` (:func:`pcp_comm_bytes`: the K/V
    all-gathers), and apart from them the restore's ``restore_comm`` / ``restore_expected``.
    """
    tp = parallel_config.tp
    pcp = pcp_of_world(ctx.world_size, tp)
    cfg = dataclasses.replace(parallel_config, prefill_context_parallel_size=pcp)
    num_q_heads, num_kv_heads, head_dim = cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim
    part = pcp_partition(tuple(seq_lens), cfg.pcp, partition)
    groups = make_groups(ctx, RankGrid(tp, cfg.pcp))
    qh, kh = (
        q_heads_of(cfg, groups.coords.tp_rank),
        kv_heads_of(cfg, groups.coords.tp_rank),
    )
    dt = _DTYPES[dtype]
    x, w = pcp_prefill_problem(seq_lens, hidden_size, cfg, seed)

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
    ref_out, ref_lse = pcp_prefill_reference(q_ref, k_ref, v_ref, meta)
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
        f"{partition}: pcp {meta.pcp_rank} tp {groups.coords.tp_rank}, "
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
