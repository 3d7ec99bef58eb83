"""Attention that also returns its log-sum-exp, and the exact merge of partial results.

Conventions (all of cpbook): ``q`` is ``[tokens_q, num_q_heads, head_dim]``, ``k`` is
``[tokens_k, num_kv_heads, head_dim]``, ``v`` is ``[tokens_k, num_kv_heads, v_head_dim]``; query
head ``h`` reads KV head ``h // (num_q_heads // num_kv_heads)`` (GQA, as vLLM and HF).  The LSE
is ``[tokens_q, num_q_heads]`` in natural log: ``lse = log Σ_j exp(s_j)`` over the keys a query
sees.  A query that sees no key gets output 0 and LSE ``-inf``.

Causal masking uses absolute positions: query ``i`` is at ``q_offset + i``, key ``j`` at
``k_offset + j``, and the query sees the key iff ``k_offset + j <= q_offset + i``.  That lets a
rank attend a chunk of queries to any chunk of keys (PCP, chunked prefill) without a mask tensor.

Because ``softmax`` over a union of disjoint key sets is the LSE-weighted mix of the softmaxes
over each set, :func:`merge_attn_states` recombines partial results exactly:
``lse = log Σ_p exp(lse_p)`` and ``out = Σ_p exp(lse_p − lse) · out_p``.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from cpbook.core.errors import RuleError

__all__ = [
    "dense_attention",
    "attention_with_lse",
    "merge_attn_states",
    "merge_attn_states_",
    "empty_attention",
    "clean_lse",
    "rope",
    "merge_comm_bytes",
]


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> int:
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise RuleError(
            "attention-shapes",
            "3-D [tokens, heads, dim] tensors",
            q=tuple(q.shape),
            k=tuple(k.shape),
            v=tuple(v.shape),
        )
    if k.shape[:2] != v.shape[:2] or q.shape[2] != k.shape[2] or q.shape[1] % k.shape[1]:
        raise RuleError(
            "attention-shapes",
            "k, v with equal [tokens, heads], q/k equal head_dim and "
            "num_q_heads % num_kv_heads == 0",
            q=tuple(q.shape),
            k=tuple(k.shape),
            v=tuple(v.shape),
        )
    return q.shape[1] // k.shape[1]


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    q_offset: int = 0,
    k_offset: int = 0,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: materialised scores, float64 when any input is float64 (else float32).

    Returns ``(out [Tq, Hq, Dv] in q.dtype, lse [Tq, Hq])``.  Exact up to the compute dtype's
    rounding; this is what every distributed path is checked against.
    """
    group = _check(q, k, v)
    ct = torch.float64 if torch.float64 in (q.dtype, k.dtype, v.dtype) else torch.float32
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    kk = k.to(ct).repeat_interleave(group, dim=1)
    vv = v.to(ct).repeat_interleave(group, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.to(ct), kk) * scale
    if causal:
        qp = torch.arange(q.shape[0], device=q.device) + q_offset
        kp = torch.arange(k.shape[0], device=q.device) + k_offset
        s = s.masked_fill(kp[None, None, :] > qp[None, :, None], float("-inf"))
    lse = torch.logsumexp(s, dim=-1) if k.shape[0] else s.new_full(s.shape[:2], float("-inf"))
    p = torch.exp(s - lse.nan_to_num(neginf=0.0)[..., None])  # rows with no key: exp(-inf) = 0
    out = torch.einsum("hqk,khd->qhd", p, vv)
    return out.to(q.dtype), lse.T.contiguous()


def empty_attention(
    q: torch.Tensor, num_q_heads: int, v_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The result of attending ``q``'s rows to no key: output 0 ``[Tq, num_q_heads, v_dim]`` and
    LSE ``-inf`` ``[Tq, num_q_heads]`` (float64 for float64 ``q``, else float32).  Also the
    starting accumulator for :func:`merge_attn_states_`."""
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    lse = torch.full((q.shape[0], num_q_heads), float("-inf"), dtype=lse_dtype, device=q.device)
    return q.new_zeros(q.shape[0], num_q_heads, v_dim), lse


def _kernel(
    q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One fused call on ``[1, H, T, D]`` tensors; returns ``(out [1,H,Tq,Dv], lse [1,H,Tq])``.

    The fused kernels need one head size for q, k and v: zero-padding v (or q and k) to the
    larger size leaves scores and outputs unchanged, so MLA's 576/512 split works too.
    """
    dq, dv = q4.shape[-1], v4.shape[-1]
    if dq != dv:
        pad = torch.nn.functional.pad
        if dv < dq:
            out, lse = _kernel(q4, k4, pad(v4, (0, dq - dv)), causal, scale)
            return out[..., :dv], lse
        return _kernel(pad(q4, (0, dv - dq)), pad(k4, (0, dv - dq)), v4, causal, scale)
    if q4.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q4, k4, v4, 0.0, causal, scale=scale
        )
    if q4.dtype != torch.float64:  # CUDA: memory-efficient kernel returns the LSE (padded)
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
            q4, k4, v4, None, True, 0.0, causal, scale=scale
        )[:2]
        return out, lse[..., : q4.shape[2]]
    o, l = dense_attention(
        q4[0].transpose(0, 1),
        k4[0].transpose(0, 1),
        v4[0].transpose(0, 1),
        causal=causal,
        scale=scale,
    )
    return o.transpose(0, 1)[None], l.T[None]


def _fused(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float, group: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-empty q and k; causal means top-left aligned (query i sees keys 0..i)."""
    tq, hq, _ = q.shape
    if group > 1 and not causal:  # fold the query heads of a KV head into the query axis
        hk = k.shape[1]
        q4 = q.view(tq, hk, group, -1).permute(1, 2, 0, 3).reshape(1, hk, group * tq, -1)
        out, lse = _kernel(q4, k.transpose(0, 1)[None], v.transpose(0, 1)[None], False, scale)
        out = out[0].view(hk, group, tq, -1).permute(2, 0, 1, 3).reshape(tq, hq, -1)
        return out, lse[0].view(hk, group, tq).permute(2, 0, 1).reshape(tq, hq)
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out, lse = _kernel(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], causal, scale
    )
    return out[0].transpose(0, 1), lse[0].T


def attention_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    q_offset: int = 0,
    k_offset: int = 0,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`dense_attention`, on PyTorch's fused SDPA kernels.

    CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` (returns the LSE; float64 works).
    A causal chunk whose queries start after its keys is split into a fully visible prefix and
    a top-left-aligned diagonal part, merged exactly.  Empty shards return zeros and ``-inf``.
    """
    group = _check(q, k, v)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    tq, tk = q.shape[0], k.shape[0]
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    empty_out, empty_lse = empty_attention(q, q.shape[1], v.shape[2])
    d = q_offset - k_offset  # key j is visible to query i iff j <= i + d
    if tq == 0 or tk == 0 or (causal and d + tq - 1 < 0):
        return empty_out, empty_lse
    if not causal or d >= tk - 1:
        out, lse = _fused(q, k, v, False, scale, group)
        return out, lse.to(lse_dtype)
    if d < 0:  # the first -d queries see nothing; the rest are top-left aligned
        out, lse = attention_with_lse(q[-d:], k, v, True, 0, 0, scale)
        return torch.cat([empty_out[:-d], out]), torch.cat([empty_lse[:-d], lse])
    diag = _fused(q, k[d:], v[d:], True, scale, group)
    if d == 0:
        return diag[0], diag[1].to(lse_dtype)
    prefix = _fused(q, k[:d], v[:d], False, scale, group)
    return merge_attn_states([prefix[0], diag[0]], [prefix[1].to(lse_dtype), diag[1].to(lse_dtype)])


def clean_lse(lse: torch.Tensor) -> torch.Tensor:
    """NaN and ``+inf`` LSEs mean "no valid keys" (vLLM's guard): map them to ``-inf``.  The one
    copy of the guard: every combine (here and in :mod:`cpbook.dcp.decode`) applies it."""
    inf = float("inf")
    return lse.nan_to_num(nan=-inf, posinf=-inf, neginf=-inf)


def merge_attn_states_(
    out: torch.Tensor, lse: torch.Tensor, part_out: torch.Tensor, part_lse: torch.Tensor
) -> None:
    """In place: fold one more partial result into the accumulator ``(out, lse)``.

    ``(out, lse)`` become the attention over the union of both key sets (``out [T, H, D]``,
    ``lse [T, H]``; views are fine, e.g. a slice of rows).  Exact and ``-inf``-safe.  A side
    whose weight ``exp(lse_side − lse_new)`` is 0 (an empty part, LSE ``-inf``) contributes 0
    even if its output holds NaN or inf, as vLLM's ``correct_attn_out`` and a2a combine
    (``where(factor == 0, 0, out · factor)`` in ``vllm/v1/attention/ops/dcp.py``, v0.34.0).
    Host-wait free (no data-dependent branch, so it stays asynchronous on a GPU); one
    output-sized temporary, the weighted ``part_out``.
    """
    part_lse = clean_lse(part_lse)
    new = torch.logaddexp(lse, part_lse)  # -inf only where both sides are empty
    base = torch.where(torch.isfinite(new), new, torch.zeros_like(new))
    keep = torch.exp(lse - base).unsqueeze(-1).to(out.dtype)
    out.mul_(keep).masked_fill_(keep == 0, 0)
    add = torch.exp(part_lse - base).unsqueeze(-1).to(out.dtype)
    out.add_(part_out.masked_fill(add == 0, 0).mul_(add))
    lse.copy_(new)


def merge_attn_states(
    outs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine attention results over disjoint key sets into the result over their union.

    ``outs[p]`` is ``[T, H, D]``, ``lses[p]`` is ``[T, H]``.  Exact; a part with LSE ``-inf``
    (empty shard) gets weight 0 and contributes 0 whatever its output holds (NaN included, as
    vLLM's ``correct_attn_out`` and a2a combine); NaN or ``+inf`` LSEs are treated as ``-inf``
    (vLLM's guard: FA2 reports ``+inf`` for an empty row).  A row where every part is empty (a
    request with no key on any rank) gets output 0 and LSE ``-inf``, as all three of vLLM's
    combines (``correct_attn_out``, ``dcp_a2a_lse_reduce``, ``merge_attn_states``) return.
    (vLLM's two-way ``merge_attn_states`` zeroes only that all-empty case: one empty side with
    a NaN output would give NaN there; cpbook follows the DCP combines.)
    """
    if len(outs) != len(lses) or not outs:
        raise RuleError(
            "merge-parts",
            "as many outputs as LSEs (at least one)",
            outputs=len(outs),
            lses=len(lses),
        )
    lse = clean_lse(lses[0]).clone()
    out = outs[0].to(lse.dtype, copy=True)
    out.masked_fill_(torch.isneginf(lse)[..., None], 0)  # an empty first part leaks nothing
    for o, l in zip(outs[1:], lses[1:]):
        merge_attn_states_(out, lse, o, l)
    return out.to(outs[0].dtype), lse


def rope(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary embedding, rotate-half form (vLLM's ``is_neox_style``): ``x [T, H, D]``,
    ``positions [T]``.

    Rotates the pair ``(x[i], x[i + D/2])`` by ``positions * base^(-2i/D)``; the angles are
    computed in float64, so any position order gives bit-identical rows.
    """
    d = x.shape[-1]
    if x.dim() != 3 or d % 2 or positions.shape != x.shape[:1]:
        raise RuleError(
            "rope-shapes",
            "x [T, H, D] with even D and positions [T]",
            x=tuple(x.shape),
            positions=tuple(positions.shape),
        )
    half = d // 2
    inv = base ** (-torch.arange(half, dtype=torch.float64, device=x.device) / half)
    ang = positions.to(x.device, torch.float64)[:, None, None] * inv
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def merge_comm_bytes(
    num_queries: int, num_q_heads: int, head_dim: int, world_size: int, elem_bytes: int = 8
) -> list[tuple[str, int]]:
    """Bytes one rank sends: all-gather of its output ``[Tq, H, D]``, then of its LSE ``[Tq, H]``.

    Neither depends on ``num_keys``: splitting the keys moves results, never keys.
    """
    n, t, h = world_size, num_queries, num_q_heads
    return [
        ("all_gather", t * h * head_dim * elem_bytes * (n - 1)),
        ("all_gather", t * h * 8 * (n - 1)),
    ]
