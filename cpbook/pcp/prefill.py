"""Prefill context parallelism (PCP): partial Q, full KV, balanced by DualChunkSwap.

vLLM's current design (``vllm/v1/worker/gpu/pcp_manager.py``, ``vllm/v1/attention/ops/pcp.py``):
every PCP rank holds two chunks of each prompt (:mod:`cpbook.pcp.zigzag`), computes Q, K, V for
them with RoPE at their true positions, all-gathers K and V in the PCP group, and attends its
queries causally to the keys they may see.  Chunk ``[s, e)`` of a request reads keys
``[0, e)``.  :func:`pcp_local_attention` does that chunk by chunk on keys in sequence order;
:func:`pcp_prefill_attention`, the per-rank path, attends the rank's own rows causally while
the keys are in flight and then each remote key block in full, merged exactly by the LSE.
Masked-out pairs are never computed.  :func:`pcp_restore` puts per-rank outputs back in
sequence order (vLLM's ``restore_hidden_states``).

Every function here talks only to :class:`cpbook.core.comm.Group`.  The partition and its metadata
live in :mod:`cpbook.pcp.zigzag`.
"""

from __future__ import annotations

from typing import Sequence

import torch

from cpbook.core.attention import (
    attention_with_lse,
    empty_attention,
    merge_attn_states_,
)
from cpbook.core.comm import Group
from cpbook.core.errors import RuleError
from cpbook.pcp.comm_bytes import pcp_comm_bytes, pcp_restore_bytes
from cpbook.pcp.zigzag import PCPMetadata, PCPPartition, Segment, pcp_partition

__all__ = [
    "pcp_shard",
    "pcp_restore",
    "pcp_local_attention",
    "pcp_prefill_attention",
    "pcp_comm_bytes",
    "pcp_restore_bytes",
]

_DTYPES = {"float64": torch.float64, "float32": torch.float32}


def pcp_shard(t: torch.Tensor, meta: PCPMetadata) -> torch.Tensor:
    """This rank's rows of ``t`` (``[sum(seq_lens), ...]``, request-major); padding rows 0."""
    rows = t.index_select(0, meta.token_index.clamp(min=0).to(t.device))
    mask = meta.is_padding.to(t.device).view(-1, *([1] * (t.dim() - 1)))
    return rows.masked_fill(mask, 0)


def _check_group(meta: PCPMetadata, group: Group) -> None:
    if group.size != meta.pcp or group.rank != meta.pcp_rank:
        raise RuleError(
            "pcp-group-matches-metadata",
            "group size/rank == pcp/pcp_rank",
            group=group.name,
            size=group.size,
            rank=group.rank,
            pcp=meta.pcp,
            pcp_rank=meta.pcp_rank,
        )


def pcp_restore(t: torch.Tensor, meta: PCPMetadata, group: Group) -> torch.Tensor:
    """All-gather every rank's local rows in ``group`` and return them in sequence order:
    ``[sum(seq_lens), ...]``, requests concatenated, padding dropped (one ``all_gather``)."""
    _check_group(meta, group)
    return group.all_gather(t, dim=0).index_select(0, meta.restore_index.to(t.device))


def pcp_local_attention(
    q: torch.Tensor,
    k_seq: torch.Tensor,
    v_seq: torch.Tensor,
    meta: PCPMetadata,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of this rank's queries ``q [num_tokens, Hq, D]`` to full, ordered keys.

    ``k_seq, v_seq`` hold every request's keys in sequence order (what vLLM's all-gather plus
    restore produces).  Segment ``[s, e)`` of request ``i`` attends keys ``[0, min(e, len_i))``
    of that request with its queries at absolute positions ``s, s+1, ...``
    (:func:`~cpbook.core.attention.attention_with_lse` splits that into a fully visible prefix and a
    causal diagonal block, merged by the LSE).  Returns ``(out, lse)`` in local row order;
    padding rows get 0 and ``-inf``.  Exact; no masked-out pair is computed.
    """
    if q.shape[0] != meta.num_tokens:
        raise RuleError(
            "pcp-local-rows",
            "q with num_tokens rows",
            q=tuple(q.shape),
            num_tokens=meta.num_tokens,
        )
    out, lse = empty_attention(q, q.shape[1], v_seq.shape[-1])
    cu = meta.cu_seq_lens
    for seg, qlen, klen in zip(meta.segments, meta.query_lens, meta.key_lens):
        if qlen:
            rows, base = slice(seg.row, seg.row + qlen), cu[seg.request]
            out[rows], lse[rows] = attention_with_lse(
                q[rows],
                k_seq[base : base + klen],
                v_seq[base : base + klen],
                causal=True,
                q_offset=seg.start,
                k_offset=0,
                scale=scale,
            )
    return out, lse


def _rows(head_major: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Rows ``[lo, hi)`` of a head-major ``[H, T, D]`` tensor, viewed as ``[hi - lo, H, D]``."""
    return head_major[:, lo:hi].transpose(0, 1)


def _request_rows(segments: Sequence[Segment]) -> dict[int, tuple[int, int]]:
    """``request -> (first row, end row)`` of a rank's local rows (request-major layout)."""
    rows: dict[int, tuple[int, int]] = {}
    for s in segments:
        lo, hi = rows.get(s.request, (s.row, s.row))
        rows[s.request] = (min(lo, s.row), max(hi, s.row + s.end - s.start))
    return rows


def _remote_blocks(
    meta: PCPMetadata, part: PCPPartition
) -> list[tuple[slice, list[tuple[int, slice]]]]:
    """The remote keys this rank's queries see in full, grouped by the queries that see them.

    A source segment ``t`` is visible, whole, to exactly the local queries at positions
    ``>= t.end`` of the same request; local rows are position-ordered within a request, so
    those queries are a suffix of the request's rows.  Returns ``(our rows, [(src rank, its
    rows), ...])`` per suffix, adjacent source rows fused: one kernel call per entry.
    """
    mine = [s for s in meta.segments if s.end > s.start]
    groups: dict[tuple[int, int], list[tuple[int, slice]]] = {}
    for src, segs in enumerate(part.segments):
        if src == meta.pcp_rank:
            continue
        for t in segs:
            later = [s.row for s in mine if s.request == t.request and s.start >= t.end]
            if not later or t.end == t.start:
                continue
            end = max(s.row + s.end - s.start for s in mine if s.request == t.request)
            blocks = groups.setdefault((min(later), end), [])
            if blocks and blocks[-1][0] == src and blocks[-1][1].stop == t.row:
                blocks[-1] = (src, slice(blocks[-1][1].start, t.row + t.end - t.start))
            else:
                blocks.append((src, slice(t.row, t.row + t.end - t.start)))
    return [(slice(lo, hi), blocks) for (lo, hi), blocks in groups.items()]


def pcp_prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: PCPMetadata,
    group: Group,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PCP prefill on one rank: all-gather K/V in the PCP ``group``, attend causally.

    ``q, k, v`` are this rank's local rows (``meta.num_tokens``, padding included).  The
    all-gathers of K and V are started first; while they are in flight each request's *local*
    rows attend their local keys in one causal call (local rows are position-ordered, so the
    top-left causal mask is exact).  Then every remote key block joins, in full, the suffix of
    local queries that lie after it (:func:`_remote_blocks`), folded in place by the LSE.  For
    zigzag on two ranks that is one causal and one non-causal call per rank (PyTorch's ring
    decomposition) with no reordering copy.  Returns ``(out [num_tokens, Hq, Dv],
    lse [num_tokens, Hq])`` for the local rows; exact.
    """
    _check_group(meta, group)
    if not q.shape[0] == k.shape[0] == v.shape[0] == meta.num_tokens:
        raise RuleError(
            "pcp-local-rows",
            "q, k, v with num_tokens rows",
            q=tuple(q.shape),
            k=tuple(k.shape),
            v=tuple(v.shape),
            num_tokens=meta.num_tokens,
        )
    # Head-major copies: the fused CPU kernel reads [H, T, D] rows ~6 % faster than the
    # strided [T, H, D] view, more than the copies cost.  ``_rows`` views them as [T, H, D].
    qh, kh, vh = (t.transpose(0, 1).contiguous() for t in (q, k, v))
    k_all = group.all_gather_async(kh, parts=True)  # every rank's [H, T, D]; ours not copied
    v_all = group.all_gather_async(vh, parts=True)
    local = [
        attention_with_lse(
            _rows(qh, lo, hi), _rows(kh, lo, hi), _rows(vh, lo, hi), causal=True, scale=scale
        )
        for lo, hi in _request_rows(meta.segments).values()
    ]
    out, lse = (
        local[0]
        if len(local) == 1
        else (torch.cat([o for o, _ in local]), torch.cat([l for _, l in local]))
    )
    k_all, v_all = k_all.wait(), v_all.wait()
    part = pcp_partition(meta.seq_lens, meta.pcp, meta.partition)
    for ours, blocks in _remote_blocks(meta, part):
        keys = [
            (_rows(k_all[src], rows.start, rows.stop), _rows(v_all[src], rows.start, rows.stop))
            for src, rows in blocks
        ]
        if len(keys) > 1:  # one call over every remote key these queries see (a small copy)
            keys = [(torch.cat([kk for kk, _ in keys]), torch.cat([vv for _, vv in keys]))]
        o, l = attention_with_lse(_rows(qh, ours.start, ours.stop), *keys[0], scale=scale)
        merge_attn_states_(out[ours], lse[ours], o, l)
    return out, lse
