"""Chunked prefill under PCP × DCP: move the queries (AllGather-Q) or the keys (AllGather-KV).

Request ``i`` brings ``T_i`` new tokens at positions ``C_i .. C_i+T_i−1`` after ``C_i`` cached
ones.  Each new query sees the whole context and, causally, the chunk.  Under PCP × DCP no rank
holds either side whole: the chunk is split zigzag over the PCP group (:mod:`cpbook.pcp.zigzag`;
``R`` local rows, padding included, ``h`` query heads per TP rank), and the context lies
DCP-interleaved in the paged cache (:mod:`cpbook.kv.layout`).  With ``dcp = 1`` every rank holds
the whole context (vLLM's current PCP keeps full KV on every PCP rank).  On the current vLLM
grid (:mod:`cpbook.core.groups`), the *attention group* ``G`` (the DCP group if ``dcp > 1``, else
the PCP group) is the smallest group holding one KV head's whole context and whole chunk:

=====================  ====================  =========================  =============
config                 context held by       new K/V held by            ``G``
=====================  ====================  =========================  =============
pcp 1, dcp N (N | tp)  N TP ranks (DCP)      every rank, whole chunk    DCP group
pcp P, dcp 1           every rank, whole     P PCP ranks, zigzag        PCP group
pcp P, dcp P           P PCP ranks (= DCP)   P PCP ranks, zigzag        PCP = DCP
pcp P, dcp tp·P        all ranks (DCP)       P PCP ranks, tp copies     world = DCP
=====================  ====================  =========================  =============

:func:`allgather_q_attention` (no KV moves): AllGather Q over ``G`` (block ``b`` = rank
``b``'s rows and heads); for every block this rank attends its context shard (only its own
block when ``dcp = 1``: the context is replicated) and, causally at absolute positions, the
new keys it holds (only for blocks of its own TP rank, so exactly one rank counts each key);
the ``|G|`` partials are combined exactly by the LSE, each rank keeping its block
(:func:`cpbook.dcp.decode.dcp_combine`: one all-to-all of output|LSE by default, or ``ag_rs``).

:func:`allgather_kv_attention` (no Q or output moves): start the AllGather of the new K/V
over PCP, walk the context in pieces of at most ``workspace_size`` gathered rows (rows padded
to rank 0's count, AllGather over DCP, :func:`cpbook.kv.gather.reorg_kvcache`), fold each piece
into the own queries' result by the LSE, then the chunk, causally.

In vLLM (as of v0.34): AllGather-Q is GQA's prefill-with-context under DCP
(``FlashAttentionImpl._forward_with_dcp``, ``vllm/v1/attention/backends/flash_attn.py``, PR
#24864), where every DCP rank holds the whole chunk and attends it locally; AllGather-KV is
MLA's ``_context_parallel_compute_prefill_context``
(``vllm/model_executor/layers/attention/mla_attention.py``) plus PCP's K/V gather before the
cache write (``vllm/v1/worker/gpu/pcp_manager.py``, PR #46570); ``dcp_comm_backend`` is
``"ag_rs"`` (default) or ``"a2a"`` (PR #34883).  vLLM picks by attention type and query
length, never by cost.

Neither strategy is always cheaper: AllGather-Q's bytes grow with the chunk and the query
heads, AllGather-KV's with the context and the KV heads.  :mod:`cpbook.pcp.chunked_plan` holds the
exact byte formulas (:func:`~cpbook.pcp.chunked_plan.chunked_comm_bytes`), the selector that
``strategy="auto"`` uses (:func:`~cpbook.pcp.chunked_plan.choose_strategy`) and
:class:`~cpbook.pcp.chunked_plan.ChunkedPrefillConfig`, how a layer runs (strategy, workspace,
combine backend, link model, softmax scale).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from cpbook.core.attention import (
    attention_with_lse,
    empty_attention,
    merge_attn_states_,
)
from cpbook.core.comm import Group
from cpbook.core.config import ConfigError, check_gqa_group
from cpbook.core.groups import ParallelGroups
from cpbook.dcp.decode import dcp_combine
from cpbook.kv.context import ContextShard
from cpbook.kv.gather import context_chunk_len, reorg_kvcache
from cpbook.kv.layout import local_seq_len
from cpbook.pcp.chunked_plan import (
    STRATEGIES,
    ChunkedPrefillConfig,
    RankSizes,
    comm_plan,
    select_strategy,
)
from cpbook.pcp.zigzag import PCPMetadata, Segment, pcp_partition

__all__ = [
    "attention_group",
    "allgather_q_attention",
    "allgather_kv_attention",
    "chunked_prefill_attention",
]

Attn = tuple[torch.Tensor, torch.Tensor]  # (out [R, h, Dv], lse [R, h])


def attention_group(groups: ParallelGroups) -> Group:
    """``G``: the DCP group when ``dcp > 1`` (it contains the PCP group), else the PCP group."""
    if groups.dcp.size == 1:
        return groups.pcp
    if not set(groups.pcp.ranks) <= set(groups.dcp.ranks):
        raise ConfigError(
            "chunked-dcp-spans-pcp",
            "a DCP group that contains its PCP group (vLLM's current layout)",
            dcp_ranks=list(groups.dcp.ranks),
            pcp_ranks=list(groups.pcp.ranks),
        )
    return groups.dcp


def _real(seg: Segment, lens: Sequence[int]) -> int:
    """Real (unpadded) tokens of a segment."""
    return max(0, min(seg.end, lens[seg.request]) - seg.start)


def _request_rows(segments: Sequence[Segment], lens: Sequence[int]) -> dict[int, tuple[int, int]]:
    """``request -> (first row, real rows)``: a rank's rows of a request are position-ordered
    and padding comes last, so its real rows are one contiguous run."""
    rows: dict[int, tuple[int, int]] = {}
    for s in segments:
        lo, n = rows.get(s.request, (s.row, 0))
        rows[s.request] = (lo, n + _real(s, lens))
    return rows


def _check(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None,
    context: ContextShard,
    meta: PCPMetadata,
    groups: ParallelGroups,
) -> None:
    pcp, dcp = groups.pcp, groups.dcp
    if (pcp.size, pcp.rank) != (meta.pcp, meta.pcp_rank):
        raise ConfigError(
            "pcp-group-matches-metadata",
            "PCP group size/rank == metadata's",
            pcp_group=(pcp.size, pcp.rank),
            metadata=(meta.pcp, meta.pcp_rank),
        )
    if (dcp.size, dcp.rank) != (context.dcp, context.dcp_rank):
        raise ConfigError(
            "dcp-group-matches-context",
            "DCP group size/rank == context shard's",
            dcp_group=(dcp.size, dcp.rank),
            context=(context.dcp, context.dcp_rank),
        )
    if len(context.context_lens) != len(meta.seq_lens):
        raise ConfigError(
            "one-context-per-request",
            "one context length per chunk request",
            context_lens=context.context_lens,
            query_lens=meta.seq_lens,
        )
    if not q.shape[0] == k.shape[0] == (k if v is None else v).shape[0] == meta.num_tokens:
        raise ConfigError(
            "chunked-local-rows",
            "q, k, v with meta.num_tokens rows",
            q=tuple(q.shape),
            k=tuple(k.shape),
            num_tokens=meta.num_tokens,
        )
    check_gqa_group(q.shape[1], k.shape[1])  # the heads this rank holds
    if (v is None) != (context.values is None):
        raise ConfigError(
            "latent-values",
            "values for both chunk and context, or for neither (MLA latent)",
            chunk_v=v is not None,
            context_v=context.values is not None,
        )


def _attend(
    out: torch.Tensor,
    lse: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None,
    causal: bool = False,
    q_offset: int = 0,
    k_offset: int = 0,
) -> None:
    """Fold ``q``'s attention to ``(k, v)`` into the accumulator ``(out, lse)`` (views), exactly."""
    if q.shape[0] and k.shape[0] and (not causal or k_offset <= q_offset + q.shape[0] - 1):
        part = attention_with_lse(q, k, v, causal, q_offset, k_offset, scale)
        merge_attn_states_(out, lse, *part)


# ------------------------------------------------------------------------------------------
# the two strategies
# ------------------------------------------------------------------------------------------
def allgather_q_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None,
    context: ContextShard,
    meta: PCPMetadata,
    groups: ParallelGroups,
    config: ChunkedPrefillConfig = ChunkedPrefillConfig(),
    stats: dict[str, Any] | None = None,
) -> Attn:
    """AllGather-Q: ``q [R, h, D]``, ``k [R, k, D]``, ``v [R, k, Dv]`` (or ``None``) are this
    rank's chunk rows; returns ``(out [R, h, Dv], lse [R, h])`` over context and chunk, exact.

    Collectives: one AllGather of Q over ``G``, started first (this rank's own block is
    computed while it travels), then the combine of ``G`` partials ``[R, |G|·h, Dv]`` by
    ``config.dcp_comm_backend``; ``config.scale`` is the softmax scale.
    """
    _check(q, k, v, context, meta, groups)
    scale = config.scale
    grp, tp = attention_group(groups), groups.grid.tensor_parallel_size
    lens, h = meta.seq_lens, q.shape[1]
    vn = context.value(k, v)
    part = pcp_partition(lens, meta.pcp, meta.partition)
    pending = grp.all_gather_async(q, dim=1, parts=True) if grp.size > 1 else None
    out, lse = empty_attention(q, grp.size * h, vn.shape[-1])
    blocks = None
    for b in [grp.rank] + [b for b in range(grp.size) if b != grp.rank]:
        if b != grp.rank and blocks is None:
            blocks = pending.wait()
        qb = q if b == grp.rank else blocks[b]
        segs, hs = part.segments[grp.ranks[b] // tp], slice(b * h, (b + 1) * h)
        if context.dcp > 1 or b == grp.rank:  # context: local shard (replicated if dcp 1)
            for i, (lo, n) in _request_rows(segs, lens).items():
                kc = context.keys[i]
                vc = context.value(kc, None if context.values is None else context.values[i])
                _attend(out[lo : lo + n, hs], lse[lo : lo + n, hs], qb[lo : lo + n], kc, vc, scale)
        if grp.ranks[b] % tp != groups.coords.tp_rank:
            continue  # those heads' new keys are counted by the rank of their own TP rank
        for qs in segs:  # chunk: the new keys this rank holds, causal at absolute positions
            nq = _real(qs, lens)
            for ks in (s for s in meta.segments if s.request == qs.request):
                kr = slice(ks.row, ks.row + _real(ks, lens))
                _attend(
                    out[qs.row : qs.row + nq, hs],
                    lse[qs.row : qs.row + nq, hs],
                    qb[qs.row : qs.row + nq],
                    k[kr],
                    vn[kr],
                    scale,
                    True,
                    qs.start,
                    ks.start,
                )
    if stats is not None:
        stats.update(
            group=grp.name,
            group_size=grp.size,
            q=tuple(q.shape),
            q_gathered=(q.shape[0], grp.size * h, q.shape[2]),
            partial=tuple(out.shape),
        )
    if grp.size == 1:
        return out, lse
    return dcp_combine(out, lse.to(out.dtype), grp, config.dcp_comm_backend, return_lse=True)


def allgather_kv_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None,
    context: ContextShard,
    meta: PCPMetadata,
    groups: ParallelGroups,
    config: ChunkedPrefillConfig = ChunkedPrefillConfig(),
    stats: dict[str, Any] | None = None,
) -> Attn:
    """AllGather-KV: same inputs and result as :func:`allgather_q_attention`.

    Collectives: one AllGather of the packed new K/V over PCP, started first, then one
    AllGather over DCP per context piece.  A piece holds at most ``config.workspace_size`` gathered
    rows (:func:`cpbook.kv.gather.context_chunk_len`), so the temporary K/V is bounded by the
    workspace whatever the context length; ``stats["workspace_rows"]`` records the peak.
    """
    _check(q, k, v, context, meta, groups)
    n, me, il, lens = context.dcp, context.dcp_rank, context.interleave, context.context_lens
    chunk = context_chunk_len(sum(c > 0 for c in lens), config.workspace_size, n, il)
    scale = config.scale
    latent, d = v is None, k.shape[-1]

    def pack(kk: torch.Tensor, vv: torch.Tensor | None) -> torch.Tensor:
        return kk if latent else torch.cat([kk, vv], dim=-1)

    def unpack(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # (k, v) views
        return x[..., :d], (x[..., : context.v_head_dim] if latent else x[..., d:])

    new = pack(k, v)
    pending = groups.pcp.all_gather_async(new, parts=True) if groups.pcp.size > 1 else None
    out, lse = empty_attention(q, q.shape[1], unpack(new)[1].shape[-1])
    rows = _request_rows(meta.segments, meta.seq_lens)
    pieces, peak = max([-(-c // chunk) for c in lens] + [0]), 0
    for c in range(pieces):
        counts = [
            [local_seq_len(min(max(L - c * chunk, 0), chunk), n, r, il) for L in lens]
            for r in range(n)
        ]
        lo, mine = c * chunk // n, []
        for i, kc in enumerate(context.keys):
            x = pack(
                kc[lo : lo + counts[me][i]],
                None if latent else context.values[i][lo : lo + counts[me][i]],
            )
            mine += [x, x.new_zeros(counts[0][i] - x.shape[0], *x.shape[1:])]
        local = torch.cat(mine)  # [Σ rows₀, k, W/k]: this rank's rows, padded to rank 0's
        gathered = groups.dcp.all_gather(local, dim=0) if n > 1 else local
        peak = max(peak, gathered.shape[0])
        ws, cu = reorg_kvcache(gathered.flatten(1), counts, counts[0])
        ws = ws.view(-1, *local.shape[1:])
        for i, (r0, nq) in rows.items():
            _attend(
                out[r0 : r0 + nq],
                lse[r0 : r0 + nq],
                q[r0 : r0 + nq],
                *unpack(ws[cu[i] : cu[i + 1]]),
                scale,
            )
    kv_seq = new if pending is None else torch.cat(pending.wait())
    kv_seq = kv_seq[meta.restore_index.to(q.device)]
    ks, vs = unpack(kv_seq)  # every request's new K/V in sequence order, padding dropped
    cu = meta.cu_seq_lens
    for s in meta.segments:
        nq, end = _real(s, meta.seq_lens), cu[s.request] + min(s.end, meta.seq_lens[s.request])
        _attend(
            out[s.row : s.row + nq],
            lse[s.row : s.row + nq],
            q[s.row : s.row + nq],
            ks[cu[s.request] : end],
            vs[cu[s.request] : end],
            scale,
            True,
            s.start,
            0,
        )
    if stats is not None:
        stats.update(
            chunk_len=chunk, num_pieces=pieces, workspace_rows=peak, kv_gathered=tuple(kv_seq.shape)
        )
    return out, lse


def chunked_prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None,
    context: ContextShard,
    meta: PCPMetadata,
    groups: ParallelGroups,
    config: ChunkedPrefillConfig = ChunkedPrefillConfig(),
    stats: dict[str, Any] | None = None,
) -> Attn:
    """Run ``config.strategy``; ``"auto"`` asks
    :func:`~cpbook.pcp.chunked_plan.select_strategy` (link ``config.alpha``/``config.beta``)
    about this batch's exact bytes.  ``stats["strategy"]`` says which ran."""
    _check(q, k, v, context, meta, groups)
    strategy = config.strategy
    if strategy == "auto":
        sizes = RankSizes(
            q.shape[1],
            k.shape[1],
            k.shape[2],
            context.value(k, v).shape[2],
            v is None,
            meta.pcp,
            context.dcp,
            context.interleave,
            config.workspace_size,
            q.element_size(),
        )
        plans = {
            st: comm_plan(st, context.context_lens, meta.seq_lens, sizes, config.dcp_comm_backend)
            for st in STRATEGIES
        }
        strategy = select_strategy(plans, config.alpha, config.beta).strategy
    if stats is not None:
        stats["strategy"] = strategy
    run = allgather_q_attention if strategy == "allgather_q" else allgather_kv_attention
    return run(q, k, v, context, meta, groups, config, stats)
