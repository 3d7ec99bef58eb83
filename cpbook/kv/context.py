"""A rank's DCP shard of every request's cached context, as the prefill paths read it.

Chunked prefill (:mod:`cpbook.pcp.chunked`), the engine's runner and the chapter demos hand the
attention the tokens this rank stores of each request's context, in position order, read from
its paged cache (:func:`context_shard` writes them through the slot mapping of
:mod:`cpbook.kv.layout` with :func:`cpbook.kv.paged.shard_kv_cache`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from cpbook.kv.paged import shard_kv_cache

__all__ = ["ContextShard", "context_shard"]


@dataclass(frozen=True)
class ContextShard:
    """This rank's DCP shard of every request's cached context, read from its paged cache.

    ``keys[i] [n_i, k, D]`` (and ``values[i] [n_i, k, Dv]``) are its ``n_i = local_seq_len(
    context_lens[i], dcp, dcp_rank, interleave)`` tokens of request ``i``, position order.
    ``values is None``: MLA's latent cache, the value is the key's first ``v_head_dim`` columns
    (all of them if ``None``).
    """

    context_lens: tuple[int, ...]
    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...] | None
    dcp: int = 1
    dcp_rank: int = 0
    interleave: int = 1
    v_head_dim: int | None = None

    def value(self, k: torch.Tensor, v: torch.Tensor | None) -> torch.Tensor:
        """``v``, or the latent view ``k[..., :v_head_dim]`` when the cache has no values."""
        return k[..., : self.v_head_dim] if v is None else v


def context_shard(
    ks: Sequence[torch.Tensor],
    vs: Sequence[torch.Tensor] | None,
    block_size: int,
    dcp: int,
    dcp_rank: int,
    interleave: int,
    v_head_dim: int | None = None,
    device: torch.device | str = "cpu",
) -> ContextShard:
    """Write every request's context ``ks[i] [C_i, k, D]`` through this rank's slot mapping and
    read back its share (:func:`cpbook.kv.paged.shard_kv_cache`); ``vs=None`` for MLA's latent."""
    local, _ = shard_kv_cache(
        ks, [None] * len(ks) if vs is None else vs, block_size, dcp, dcp_rank, interleave, device
    )
    return ContextShard(
        tuple(k.shape[0] for k in ks),
        tuple(k for k, _, _ in local),
        None if vs is None else tuple(v for _, v, _ in local),
        dcp,
        dcp_rank,
        interleave,
        v_head_dim,
    )
