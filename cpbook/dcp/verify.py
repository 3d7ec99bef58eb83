"""Speculative verification under DCP: ``k + 1`` query rows per request against a sharded cache.

A speculative decode step scores, for each request, the last sampled token and its ``k``
draft tokens in one forward: rows at global positions ``s, s+1, …, s+k`` (``s`` = the tokens
already cached).  Their K/V is written first, through the interleaved slot mapping
(:func:`cpbook.kv.layout.slot_mapping`), so each row's key lands on the rank that owns its
position.  Then every rank attends its shard with the causal mask **by global position**: row
``j`` sees the local keys at positions ``≤ s + j``.  A rank's keys are stored in position order
(:func:`cpbook.kv.layout.local_positions`), so that is the first
``local_seq_len(s + j + 1)`` of them (:func:`verify_key_counts`); a row may see none
(an empty shard for that row, LSE ``-inf``).  The keys every row sees are attended once for
all rows, the few the step itself wrote row by row (:func:`local_verify_attention`), so a
request's KV is read once per step however large ``k``.  The collectives are chapter 3's
unchanged: AllGather Q over heads, then the ``ag_rs`` or ``a2a`` LSE combine
(:func:`cpbook.dcp.decode.dcp_combine`), on ``Σ (k_i + 1)`` rows instead of ``B``.

Bytes per rank per layer are :func:`cpbook.dcp.decode.decode_comm_bytes` with ``B = Σ (k_i + 1)``
rows (:func:`verify_comm_bytes`): the query all-gather and the combine grow with ``k + 1``; no
term grows with the context.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from cpbook.core.attention import attention_with_lse, merge_attn_states
from cpbook.core.comm import Group
from cpbook.core.config import ConfigError
from cpbook.dcp.decode import dcp_combine, decode_comm_bytes
from cpbook.dcp.mla import MLAWeights
from cpbook.kv.layout import DCPShard, local_seq_len

__all__ = [
    "verify_key_counts",
    "local_verify_attention",
    "dcp_verify_attention",
    "mla_verify_attention",
    "verify_comm_bytes",
]


def verify_key_counts(
    start: int, num_rows: int, dcp: int, dcp_rank: int, interleave: int
) -> list[int]:
    """Local keys each of the ``num_rows`` rows at positions ``start, start+1, …`` sees on rank
    ``dcp_rank``: ``local_seq_len(start + j + 1)`` (causal by global position)."""
    if num_rows < 1 or start < 0:
        raise ConfigError(
            "verify-rows", "num_rows >= 1 and start >= 0", num_rows=num_rows, start=start
        )
    return [local_seq_len(start + j + 1, dcp, dcp_rank, interleave) for j in range(num_rows)]


def local_verify_attention(
    q: torch.Tensor,
    ks: Sequence[torch.Tensor],
    vs: Sequence[torch.Tensor],
    starts: Sequence[int],
    num_rows: Sequence[int],
    shard: DCPShard = DCPShard(),
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every query row against this rank's keys, causal by global position; ``(out, lse)``.

    ``q [Σ num_rows, H, D]`` request by request; ``ks[i] [n_i, Hkv, D]`` / ``vs[i]``: this
    rank's keys of request ``i`` in position order, ``n_i = local_seq_len(starts[i] +
    num_rows[i])`` (the new rows already written).  Row ``j`` sees the first
    ``verify_key_counts(...)[j]`` keys.  The keys every row sees are attended in one call (the
    request's KV is read once, as one decode query would), the at most ``num_rows − 1`` keys
    written by the step's own rows one row at a time, and the two merged exactly.  ``shard``
    (the rank's place in the interleaved layout) decides which keys each row sees."""
    if not len(ks) == len(vs) == len(starts) == len(num_rows) or q.shape[0] != sum(num_rows):
        raise ConfigError(
            "verify-per-request",
            "one k, v, start and num_rows per request and sum(num_rows) query rows",
            ks=len(ks),
            vs=len(vs),
            starts=len(starts),
            num_rows=list(num_rows),
            q_rows=q.shape[0],
        )
    outs, lses, at = [], [], 0
    for k, v, s, n in zip(ks, vs, starts, num_rows):
        counts = verify_key_counts(s, n, shard.dcp, shard.dcp_rank, shard.interleave)
        if k.shape[0] != counts[-1] or v.shape[0] != counts[-1]:
            raise ConfigError(
                "verify-shard-length",
                "len(ks[i]) == len(vs[i]) == local_seq_len(starts[i] + num_rows[i])",
                got=k.shape[0],
                expected=counts[-1],
            )
        qi, c0 = q[at : at + n], counts[0]
        at += n
        o, lse = attention_with_lse(qi, k[:c0], v[:c0], scale=scale)  # seen by every row
        if counts[-1] > c0:
            tails = [
                attention_with_lse(qi[j : j + 1], k[c0:c], v[c0:c], scale=scale)
                for j, c in enumerate(counts)
            ]
            o, lse = merge_attn_states(
                [o, torch.cat([t[0] for t in tails])], [lse, torch.cat([t[1] for t in tails])]
            )
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def dcp_verify_attention(
    q: torch.Tensor,
    ks: Sequence[torch.Tensor],
    vs: Sequence[torch.Tensor],
    starts: Sequence[int],
    num_rows: Sequence[int],
    group: Group,
    interleave: int,
    dcp_comm_backend: str = "ag_rs",
    scale: float | None = None,
    shapes: dict[str, Any] | None = None,
) -> torch.Tensor:
    """GQA verification under DCP; returns ``[Σ num_rows, h, Dv]``, exact.

    ``q [Σ num_rows, h, D]``: this rank's heads of every query row, request by request;
    ``ks[i] [n_i, ·, D]`` / ``vs[i]``: this rank's keys of request ``i`` (see
    :func:`local_verify_attention`), KV heads laid out to match the gathered query heads.
    The collectives are chapter 3's: AllGather Q, then :func:`~cpbook.dcp.decode.dcp_combine`.

    More than eight parameters: :func:`local_verify_attention`'s inputs with the group (and its
    interleave) in place of the rank's shard, the combine's backend and the optional shapes."""
    q_all = group.all_gather(q, dim=1)  # [R, N·h, D]
    out, lse = local_verify_attention(
        q_all, ks, vs, starts, num_rows, DCPShard(group.size, group.rank, interleave), scale
    )
    final = dcp_combine(out, lse.to(out.dtype), group, dcp_comm_backend)
    if shapes is not None:
        shapes.update(
            q=tuple(q.shape),
            q_gathered=tuple(q_all.shape),
            kv_local=[tuple(k.shape) for k in ks],
            out=tuple(final.shape),
        )
    return final


def mla_verify_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    latents: Sequence[torch.Tensor],
    starts: Sequence[int],
    num_rows: Sequence[int],
    mla: MLAWeights,
    heads: slice,
    group: Group,
    interleave: int,
    dcp_comm_backend: str = "ag_rs",
) -> torch.Tensor:
    """MLA (absorbed) verification under DCP: ``[Σ num_rows, h, Dv]`` for this rank's ``heads``.

    ``latents[i] [n_i, C+R]``: this rank's cached rows of request ``i`` in position order.  As
    :func:`cpbook.dcp.mla.mla_decode_attention`: absorb, AllGather the latent queries, attend
    the latent shard (MQA), combine, ``W_UV`` on local heads.

    More than eight parameters: :func:`dcp_verify_attention`'s inputs with MLA's two query
    parts, weights and heads in place of the keys and values."""
    q_all = group.all_gather(mla.absorb_q(q_nope, q_pe, heads), dim=1)  # [R, N·h, C+R]
    c = mla.kv_lora_rank
    o, lse = local_verify_attention(
        q_all,
        [x[:, None] for x in latents],
        [x[:, None, :c] for x in latents],
        starts,
        num_rows,
        DCPShard(group.size, group.rank, interleave),
        mla.scale,
    )
    return mla.v_up_proj(dcp_combine(o, lse.to(o.dtype), group, dcp_comm_backend), heads)


def verify_comm_bytes(
    num_speculative_tokens: Sequence[int],
    heads_per_rank: int,
    q_dim: int,
    out_dim: int,
    dcp: int,
    dcp_comm_backend: str = "ag_rs",
    elem_bytes: int = 8,
    lse_bytes: int | None = None,
) -> list[tuple[str, int]]:
    """``[(op, bytes sent per rank)]`` of one verification step: request ``i`` brings
    ``num_speculative_tokens[i] + 1`` rows; the decode formula with ``B = Σ (k_i + 1)``."""
    rows = sum(int(k) + 1 for k in num_speculative_tokens)
    return decode_comm_bytes(
        rows, heads_per_rank, q_dim, out_dim, dcp, dcp_comm_backend, elem_bytes, lse_bytes
    )
