"""The context gather: rebuild a cached context from DCP shards, chunk by chunk.

A workspace holds ``chunk`` tokens; :func:`context_chunk_len` gives the chunk each step walks.
Each rank copies its rows of every request's chunk, padded to rank 0's count; the DCP group
all-gathers them and :func:`reorg_kvcache` drops the padding and lays each request out
contiguously, rank-major.  :func:`context_gather_comm_bytes` is the bytes one rank sends.  MLA's
context path (:mod:`cpbook.dcp.mla`) and GQA's AllGather-KV (:mod:`cpbook.pcp.chunked`) both use
it (vLLM ``MLACommonImpl._context_parallel_compute_prefill_context``)."""

from __future__ import annotations

from typing import Sequence

import torch

from cpbook.core.config import ConfigError
from cpbook.core.errors import RuleError
from cpbook.kv.layout import local_seq_len

__all__ = ["context_chunk_len", "reorg_kvcache", "context_gather_comm_bytes"]


# ------------------------------------------------------------------------------------------
# prefill with cached context: all-gather the latent KV in workspace chunks
# ------------------------------------------------------------------------------------------
def context_chunk_len(num_requests: int, workspace_size: int, dcp: int, interleave: int) -> int:
    """Context tokens per request per chunk: ``workspace_size // num_requests`` (requests that
    have a context) rounded down to a multiple of ``dcp·interleave``, so that every rank's rows
    of a chunk are contiguous in its cache and the gathered rows never exceed the workspace."""
    stripe = dcp * interleave
    chunk = workspace_size // max(1, num_requests) // stripe * stripe
    if chunk < stripe:
        raise ConfigError(
            "workspace-fits-requests",
            "workspace_size >= num_requests * dcp * cp_kv_cache_interleave_size",
            workspace_size=workspace_size,
            num_requests=num_requests,
            dcp=dcp,
            cp_kv_cache_interleave_size=interleave,
        )
    return chunk


def reorg_kvcache(
    gathered: torch.Tensor, counts: Sequence[Sequence[int]], padded: Sequence[int]
) -> tuple[torch.Tensor, list[int]]:
    """Turn the all-gathered, padded rows into one contiguous run per request.

    ``gathered [N·toks, W]`` is ``[rank 0 rows | rank 1 rows | ...]``, each rank's part being
    ``padded[i]`` rows per request ``i`` (real rows first); ``counts[r][i]`` are rank ``r``'s
    real rows.  Returns the workspace ``[Σ real rows, W]`` (request by request, rank-major inside
    a request) and the request offsets ``cu`` (``len(padded) + 1`` entries).
    """
    n, toks = len(counts), sum(padded)
    if gathered.shape[0] != n * toks:
        raise RuleError(
            "reorg-rows",
            "gathered rows == dcp * sum(padded)",
            rows=gathered.shape[0],
            dcp=n,
            padded_tokens=toks,
        )
    starts = [sum(padded[:i]) for i in range(len(padded))]
    pieces, cu = [], [0]
    for i, start in enumerate(starts):
        for r in range(n):
            if counts[r][i] > padded[i]:
                raise RuleError(
                    "reorg-counts",
                    "counts <= padded",
                    rank=r,
                    request=i,
                    count=counts[r][i],
                    padded=padded[i],
                )
            pieces.append(gathered[r * toks + start : r * toks + start + counts[r][i]])
        cu.append(cu[-1] + sum(counts[r][i] for r in range(n)))
    return torch.cat(pieces) if pieces else gathered[:0], cu


def context_gather_comm_bytes(
    context_lens: Sequence[int],
    workspace_size: int,
    dcp: int,
    interleave: int,
    latent_dim: int,
    elem_bytes: int = 8,
) -> list[tuple[str, int]]:
    """``[("all_gather", bytes sent per rank), ...]``, one call per chunk:
    ``toks·(C+R)·e·(N−1)``, where ``toks`` is rank 0's row count (every rank pads to it)."""
    chunk = context_chunk_len(sum(c > 0 for c in context_lens), workspace_size, dcp, interleave)
    num_chunks = max([-(-c // chunk) for c in context_lens] + [0])
    return [
        (
            "all_gather",
            sum(
                local_seq_len(min(max(L - c * chunk, 0), chunk), dcp, 0, interleave)
                for L in context_lens
            )
            * latent_dim
            * elem_bytes
            * (dcp - 1),
        )
        for c in range(num_chunks)
    ]
