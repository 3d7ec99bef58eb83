"""Speculative verification under DCP: ``k + 1`` query rows per request against a sharded cache.

A speculative decode step scores, for each request, the last sampled token and its ``k``
draft tokens in one forward: rows at global positions ``s, s+1, …, s+k`` (``s`` = the tokens
already cached).  Their K/V is written first, through the interleaved slot mapping
(:func:`cpbook.kv.layout.slot_mapping`), so each row's key lands on the rank that owns its
position.  Then every rank attends its shard with the causal mask **by global position**: row
``j`` sees the local keys at positions ``≤ s + j``.  A rank's keys are stored in position order
(:func:`cpbook.kv.layout.local_positions`), so that is the first
``local_seq_len(s + j + 1)`` of them (:func:`verify_key_counts`); a row may see none
(an empty shard for that row, LSE ``-inf``).  The rows are then exactly ``Σ (k_i + 1)``
independent decode queries, and the DCP decode of chapter 3 does the rest unchanged:
AllGather Q over heads, local attention, the ``ag_rs`` or ``a2a`` LSE combine
(:func:`cpbook.dcp.decode.dcp_decode_attention`; MLA absorbed:
:func:`cpbook.dcp.mla.mla_decode_attention`).

Bytes per rank per layer are :func:`cpbook.dcp.decode.decode_comm_bytes` with ``B = Σ (k_i + 1)``
rows (:func:`verify_comm_bytes`): the query all-gather and the combine grow with ``k + 1``; no
term grows with the context.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from cpbook.core.comm import Group
from cpbook.core.config import ConfigError
from cpbook.dcp.decode import dcp_decode_attention, decode_comm_bytes
from cpbook.dcp.mla import TinyMLA, mla_decode_attention
from cpbook.kv.layout import local_seq_len

__all__ = [
    "verify_key_counts",
    "row_shards",
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


def row_shards(
    ks: Sequence[torch.Tensor],
    vs: Sequence[torch.Tensor],
    starts: Sequence[int],
    num_rows: Sequence[int],
    dcp: int,
    dcp_rank: int,
    interleave: int,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One (key, value) prefix view per query row, in row order.

    ``ks[i]``/``vs[i]``: this rank's keys of request ``i`` in position order, covering its first
    ``starts[i] + num_rows[i]`` tokens (the new rows already written).  Views, not copies."""
    if not len(ks) == len(vs) == len(starts) == len(num_rows):
        raise ConfigError(
            "verify-per-request",
            "one k, v, start and num_rows per request",
            ks=len(ks),
            vs=len(vs),
            starts=len(starts),
            num_rows=len(num_rows),
        )
    out_k, out_v = [], []
    for k, v, s, n in zip(ks, vs, starts, num_rows):
        counts = verify_key_counts(s, n, dcp, dcp_rank, interleave)
        if k.shape[0] != counts[-1]:
            raise ConfigError(
                "verify-shard-length",
                "len(ks[i]) == local_seq_len(starts[i] + num_rows[i])",
                got=k.shape[0],
                expected=counts[-1],
            )
        out_k += [k[:c] for c in counts]
        out_v += [v[:c] for c in counts]
    return out_k, out_v


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
    ``ks[i] [n_i, N·h/g, D]`` / ``vs[i]``: this rank's keys of request ``i`` (see
    :func:`row_shards`), KV heads laid out to match the gathered query heads."""
    rk, rv = row_shards(ks, vs, starts, num_rows, group.size, group.rank, interleave)
    return dcp_decode_attention(q, rk, rv, group, dcp_comm_backend, scale, shapes)


def mla_verify_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    latents: Sequence[torch.Tensor],
    starts: Sequence[int],
    num_rows: Sequence[int],
    mla: TinyMLA,
    heads: slice,
    group: Group,
    interleave: int,
    dcp_comm_backend: str = "ag_rs",
    shapes: dict[str, Any] | None = None,
) -> torch.Tensor:
    """MLA (absorbed) verification under DCP: ``[Σ num_rows, h, Dv]`` for this rank's ``heads``.

    ``latents[i] [n_i, C+R]``: this rank's cached rows of request ``i`` in position order."""
    rows, _ = row_shards(latents, latents, starts, num_rows, group.size, group.rank, interleave)
    return mla_decode_attention(q_nope, q_pe, rows, mla, heads, group, dcp_comm_backend, shapes)


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
