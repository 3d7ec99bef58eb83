"""Decode context parallelism (DCP) for GQA: every rank holds a slice of each request's KV.

A DCP group of ``N`` ranks is a contiguous slice of one TP group whose ranks would otherwise
hold copies of the same KV head.  Each rank stores only its interleaved share of every
request's tokens (:mod:`cpbook.kv.layout`).  One decode step per layer (vLLM
``FlashAttentionImpl._forward_with_dcp`` and ``vllm/v1/attention/ops/dcp.py``):

1. **AllGather Q** over the DCP group on the head dimension: ``(B, h, D) -> (B, N·h, D)``,
   where ``h = num_q_heads / tp``.  Every gathered head reads the group's one KV head.
2. **Local attention** of all ``N·h`` heads over the local shard, returning the LSE.
3. **Combine** the ``N`` partial results exactly, keeping this rank's ``h`` heads:

   * ``ag_rs`` (vLLM's usual default, :func:`cp_lse_ag_out_rs`): AllGather the LSE only, scale each
     partial output by ``exp(lse_r − lse_total)`` (:func:`correct_attn_out`), ReduceScatter
     (sum) the outputs over heads;
   * ``a2a`` (vLLM's ``dcp_comm_backend="a2a"``, Helix's choice, :func:`dcp_a2a_lse_reduce`):
     one All2All of outputs with the LSE packed as an extra channel, then a local
     LSE-weighted combine.

Bytes each rank sends per step (= bytes it receives), ``B`` decode requests, ``e`` bytes per
element, ``l`` bytes per LSE value (``e`` here, where the LSE travels in the output's dtype; 4 in
vLLM, which gathers it in fp32 and packs it into two 16-bit slots for ``a2a``), ``Dq`` the
gathered query width and ``Do`` the partial output width (``D`` for GQA):

=====================  ============================
AllGather Q            ``B·h·Dq·e·(N−1)``
ag_rs: AllGather LSE   ``B·N·h·l·(N−1)``
ag_rs: ReduceScatter   ``B·h·Do·e·(N−1)``
a2a: All2All           ``B·h·(Do·e+l)·(N−1)``
=====================  ============================

No term depends on the context length: DCP moves queries and partial outputs, never KV.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from cpbook.core.attention import attention_with_lse, clean_lse, merge_attn_states
from cpbook.core.comm import Group
from cpbook.core.config import check_comm_backend
from cpbook.core.errors import RuleError
from cpbook.dcp.comm_bytes import decode_comm_bytes

__all__ = [
    "correct_attn_out",
    "cp_lse_ag_out_rs",
    "dcp_a2a_lse_reduce",
    "dcp_combine",
    "local_attention",
    "dcp_decode_attention",
    "decode_comm_bytes",
]


# ------------------------------------------------------------------------------------------
# the combine: exact LSE correction, two ways
# ------------------------------------------------------------------------------------------
def correct_attn_out(
    out: torch.Tensor, lses: torch.Tensor, rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's ``correct_attn_out``: scale rank ``rank``'s partial output to its share of the total.

    ``out [B, H, D]`` is this rank's output over its keys, ``lses [N, B, H]`` every rank's LSE.
    Returns ``(out · exp(lse_rank − lse_total), lse_total [B, H])``; summing the corrected
    outputs of all ranks gives the exact attention over all keys.  NaN and ``+inf`` LSEs count
    as ``-inf`` (an empty shard).  As vLLM's kernel (``where(factor == 0, 0, out · factor)``,
    ``vllm/v1/attention/ops/dcp.py`` v0.34.0), a rank whose factor is 0 returns 0 even where its
    output holds NaN (an empty shard's kernel output); a row empty on every rank gets output 0
    and LSE ``-inf``.  The max LSE is subtracted before ``exp``, so LSEs far beyond ``exp``'s
    range (≈ 88 in float32, ≈ 709 in float64) combine exactly too.
    """
    lses = clean_lse(lses)
    total = torch.logsumexp(lses, dim=0)  # max-shifted; -inf where every shard is empty
    factor = torch.exp(lses[rank] - total).nan_to_num_(nan=0.0)  # -inf - -inf: no keys at all
    factor = factor[..., None].to(out.dtype)
    return torch.where(factor == 0, 0.0, out * factor), total


def cp_lse_ag_out_rs(
    out: torch.Tensor, lse: torch.Tensor, group: Group, return_lse: bool = False
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``ag_rs`` combine: AllGather the LSE, correct, ReduceScatter the outputs over heads.

    ``out [B, N·h, D]``, ``lse [B, N·h]`` over this rank's keys; returns ``[B, h, D]`` (this
    rank's heads, exact over the group's keys) and, with ``return_lse``, their LSE ``[B, h]``.
    Two collectives: ``all_gather`` of ``B·N·h`` LSE values and ``reduce_scatter`` of the output.
    """
    lses = group.all_gather(lse[None], dim=0)  # [N, B, N·h]: the LSE only
    out, total = correct_attn_out(out, lses, group.rank)
    out = group.reduce_scatter(out, dim=1)
    if return_lse:
        return out, total.chunk(group.size, dim=1)[group.rank]
    return out


def dcp_a2a_lse_reduce(
    out: torch.Tensor, lse: torch.Tensor, group: Group, return_lse: bool = False
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``a2a`` combine: one All2All of (output | LSE), then a local LSE-weighted combine.

    Same contract as :func:`cp_lse_ag_out_rs`.  The LSE travels as one extra channel of the
    output (vLLM packs it the same way, PR #41160), so ``out`` and ``lse`` share a dtype here.
    """
    if out.dtype != lse.dtype:
        raise RuleError(
            "a2a-pack-dtype", "out and lse of one dtype to pack them", out=out.dtype, lse=lse.dtype
        )
    packed = torch.cat([out, lse[..., None]], dim=-1)[None]  # [1, B, N·h, D+1]
    got = group.all_to_all(packed, scatter_dim=2, gather_dim=0)  # [N, B, h, D+1]
    merged, total = merge_attn_states(list(got[..., :-1]), list(got[..., -1]))
    return (merged, total) if return_lse else merged


def dcp_combine(
    out: torch.Tensor,
    lse: torch.Tensor,
    group: Group,
    dcp_comm_backend: str = "ag_rs",
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Dispatch to :func:`cp_lse_ag_out_rs` (``"ag_rs"``) or :func:`dcp_a2a_lse_reduce`
    (``"a2a"``)."""
    check_comm_backend(dcp_comm_backend)
    fn = cp_lse_ag_out_rs if dcp_comm_backend == "ag_rs" else dcp_a2a_lse_reduce
    return fn(out, lse, group, return_lse)


# ------------------------------------------------------------------------------------------
# one decode step
# ------------------------------------------------------------------------------------------
def local_attention(
    q: torch.Tensor,
    ks: Sequence[torch.Tensor],
    vs: Sequence[torch.Tensor],
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Request ``i``'s query ``q[i]`` against its local keys ``ks[i]`` (non-causal: decode).

    ``q [B, H, D]``; ``ks[i] [n_i, Hkv, D]``, ``vs[i] [n_i, Hkv, Dv]``, ``n_i`` possibly 0.
    Returns ``out [B, H, Dv]`` and ``lse [B, H]`` (``-inf`` and zeros for an empty shard).
    """
    if len(ks) != q.shape[0] or len(vs) != q.shape[0]:
        raise RuleError(
            "one-shard-per-request",
            "len(ks) == len(vs) == q.shape[0]",
            ks=len(ks),
            vs=len(vs),
            queries=q.shape[0],
        )
    parts = [
        attention_with_lse(q[i : i + 1], k, v, scale=scale) for i, (k, v) in enumerate(zip(ks, vs))
    ]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def dcp_decode_attention(
    q: torch.Tensor,
    ks: Sequence[torch.Tensor],
    vs: Sequence[torch.Tensor],
    group: Group,
    dcp_comm_backend: str = "ag_rs",
    scale: float | None = None,
    shapes: dict[str, Any] | None = None,
) -> torch.Tensor:
    """One DCP decode step: AllGather Q heads, attend the local shard, combine exactly.

    ``q [B, h, D]``: this rank's query heads (one decode token per request); ``ks[i]``/``vs[i]``:
    the local tokens of request ``i`` for the group's shared KV head(s).  Returns ``[B, h, Dv]``,
    the attention over every token of the group for this rank's heads.  If ``shapes`` is a
    dict, the shape of each stage is recorded in it.  Exact to the dtype's rounding.
    """
    q_all = group.all_gather(q, dim=1)  # [B, N·h, D]
    out, lse = local_attention(q_all, ks, vs, scale)
    lse = lse.to(out.dtype)  # the LSE travels in the output's dtype (float32/64 here)
    final = dcp_combine(out, lse, group, dcp_comm_backend)
    if shapes is not None:
        shapes.update(
            q=tuple(q.shape),
            q_gathered=tuple(q_all.shape),
            kv_local=[tuple(k.shape) for k in ks],
            out_partial=tuple(out.shape),
            lse=tuple(lse.shape),
            out=tuple(final.shape),
        )
    return final
