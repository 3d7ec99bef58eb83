"""DCP's memory layer: which rank stores each token's K/V, and in which physical slot.

A DCP group of ``dcp`` ranks shares one block table.  One block id names one physical
block of ``block_size`` slots on *every* rank, so it stands for a *virtual block* of
``VB = block_size * dcp`` tokens.  Inside a virtual block the tokens are dealt out in
stripes of ``interleave`` (vLLM's ``cp_kv_cache_interleave_size``) consecutive tokens, rank by
rank.  With ``p`` a token's position, ``N = dcp``, ``I = interleave``, ``B = block_size``
(vLLM ``BlockTable.compute_slot_mapping``)::

    owner(p) = (p // I) % N                          # == ((p % VB) // I) % N since N*I divides VB
    slot(p)  = block_table[p // VB] * B + ((p % VB) // (N*I)) * I + p % I    on the owner
             = -1 (PAD_SLOT_ID)                                              on every other rank

The ``j``-th token a rank stores for a request sits at ``block_table[j // B] * B + j % B`` and
has global position ``(j // I) * N * I + rank * I + j % I``: a rank's tokens fill its physical
blocks densely, in position order.

Public names: :func:`check_layout`, :func:`token_owner`, :func:`slot_mapping`,
:func:`local_seq_len`, :func:`local_positions`, :func:`num_virtual_blocks`, :func:`block_fill`.
One rank's paged store is :class:`~cpbook.kv.paged.PagedKVCache`; the virtual-block allocator
with prefix caching is :class:`~cpbook.kv.manager.KVCacheManager`.  Bad input raises
:class:`~cpbook.core.config.ConfigError` (a ``ValueError``) naming the rule and the values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from cpbook.core.config import ConfigError, check_interleave, check_positive

__all__ = [
    "PAD_SLOT_ID",
    "DCPShard",
    "check_layout",
    "token_owner",
    "slot_mapping",
    "local_seq_len",
    "local_positions",
    "num_virtual_blocks",
    "block_fill",
]

PAD_SLOT_ID = -1


# ------------------------------------------------------------------------------------------
# validation
# ------------------------------------------------------------------------------------------
def check_layout(
    dcp: int, interleave: int, block_size: int | None = None, dcp_rank: int | None = None
) -> None:
    """Raise :class:`ConfigError` unless the sizes describe a valid DCP KV layout."""
    check_positive(dcp=dcp, interleave=interleave)
    if block_size is not None:
        check_positive(block_size=block_size)
        check_interleave(block_size, interleave)
    if dcp_rank is not None and (
        isinstance(dcp_rank, bool) or not isinstance(dcp_rank, int) or not 0 <= dcp_rank < dcp
    ):
        raise ConfigError("dcp-rank-in-range", "0 <= dcp_rank < dcp", dcp_rank=dcp_rank, dcp=dcp)


@dataclass(frozen=True)
class DCPShard:
    """The share of the DCP-interleaved KV layout one rank holds: rank ``dcp_rank`` of ``dcp``,
    in stripes of ``interleave`` tokens (``cp_kv_cache_interleave_size``).  Validated on
    construction; ``DCPShard()`` is the whole cache (no DCP)."""

    dcp: int = 1
    dcp_rank: int = 0
    interleave: int = 1

    def __post_init__(self) -> None:
        check_layout(self.dcp, self.interleave, None, self.dcp_rank)


def _as_long(x: torch.Tensor | Sequence[int] | int, name: str) -> torch.Tensor:
    t = torch.as_tensor(x)
    if t.dtype.is_floating_point or t.dtype == torch.bool or t.is_complex():
        raise ConfigError(
            "integer-positions", f"{name} to hold integers", **{f"{name}.dtype": t.dtype}
        )
    return t.to(torch.long)


def _seq_len(seq_len: int) -> None:
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 0:
        raise ConfigError("seq-len-non-negative", "seq_len to be an integer >= 0", seq_len=seq_len)


# ------------------------------------------------------------------------------------------
# the layout
# ------------------------------------------------------------------------------------------
def token_owner(positions: torch.Tensor | Sequence[int], dcp: int, interleave: int) -> torch.Tensor:
    """The DCP rank storing each position: ``(p // interleave) % dcp`` (same shape, int64)."""
    check_layout(dcp, interleave)
    p = _as_long(positions, "positions")
    if p.numel() and int(p.min()) < 0:
        raise ConfigError(
            "positions-non-negative", "every position >= 0", min_position=int(p.min())
        )
    return torch.div(p, interleave, rounding_mode="floor") % dcp


def slot_mapping(
    positions: torch.Tensor | Sequence[int],
    block_table: torch.Tensor | Sequence[int],
    block_size: int,
    dcp: int,
    dcp_rank: int,
    interleave: int,
) -> torch.Tensor:
    """vLLM's DCP slot mapping of one request on one rank: a slot per position, ``-1`` if foreign.

    ``positions``: 1-D global token positions; ``block_table``: the request's virtual block ids
    (the same ids on every rank of the DCP group), ``block_table[p // (block_size*dcp)]``
    holding position ``p``.  Returns int64, same shape as ``positions``; local slots are
    ``block_id * block_size + offset`` with ``0 <= offset < block_size``.
    """
    check_layout(dcp, interleave, block_size, dcp_rank)
    p = _as_long(positions, "positions")
    table = _as_long(block_table, "block_table").reshape(-1)
    if p.numel() and int(p.min()) < 0:
        raise ConfigError(
            "positions-non-negative", "every position >= 0", min_position=int(p.min())
        )
    vb = block_size * dcp
    block_idx = torch.div(p, vb, rounding_mode="floor")
    if p.numel() and int(block_idx.max()) >= table.numel():
        raise ConfigError(
            "positions-within-block-table",
            "max(position) < len(block_table) * block_size * dcp",
            max_position=int(p.max()),
            len_block_table=table.numel(),
            virtual_block_size=vb,
        )
    off = p - block_idx * vb
    stripe = torch.div(off, interleave, rounding_mode="floor")
    slot = (
        table[block_idx] * block_size
        + torch.div(stripe, dcp, rounding_mode="floor") * interleave
        + (off - stripe * interleave)
    )
    return torch.where(stripe % dcp == dcp_rank, slot, PAD_SLOT_ID)


def local_seq_len(
    seq_len: int | torch.Tensor, dcp: int, dcp_rank: int, interleave: int
) -> int | torch.Tensor:
    """How many of a request's first ``seq_len`` tokens rank ``dcp_rank`` stores.

    vLLM's ``get_dcp_local_seq_lens``: ``base = seq_len // (I*N) * I`` plus
    ``clip(seq_len - base*N - rank*I, 0, I)``.  An ``int`` gives an ``int``; an integer tensor of
    lengths gives a tensor of the same shape.
    """
    check_layout(dcp, interleave, dcp_rank=dcp_rank)
    if isinstance(seq_len, torch.Tensor):
        lens = _as_long(seq_len, "seq_len")
        if lens.numel() and int(lens.min()) < 0:
            raise ConfigError(
                "seq-len-non-negative", "every seq_len >= 0", min_seq_len=int(lens.min())
            )
        base = torch.div(lens, interleave * dcp, rounding_mode="floor") * interleave
        return base + (lens - base * dcp - dcp_rank * interleave).clamp(0, interleave)
    _seq_len(seq_len)
    base = seq_len // (interleave * dcp) * interleave
    return base + min(max(seq_len - base * dcp - dcp_rank * interleave, 0), interleave)


def local_positions(seq_len: int, dcp: int, dcp_rank: int, interleave: int) -> torch.Tensor:
    """Global positions of the tokens ``dcp_rank`` stores, in its slot order (sorted, int64)."""
    j = torch.arange(local_seq_len(seq_len, dcp, dcp_rank, interleave))
    return (
        torch.div(j, interleave, rounding_mode="floor") * (dcp * interleave)
        + dcp_rank * interleave
        + j % interleave
    )


def num_virtual_blocks(seq_len: int, block_size: int, dcp: int) -> int:
    """Block ids a request of ``seq_len`` tokens needs: ``ceil(seq_len / (block_size*dcp))``."""
    check_positive(block_size=block_size, dcp=dcp)
    _seq_len(seq_len)
    return -(-seq_len // (block_size * dcp))


def block_fill(seq_len: int, block_size: int, dcp: int, interleave: int) -> torch.Tensor:
    """Tokens per (rank, virtual block) of one request: int64 ``[dcp, num_virtual_blocks]``.

    Column sums are the tokens in each virtual block; row sums are :func:`local_seq_len`.
    """
    check_layout(dcp, interleave, block_size)
    vb = block_size * dcp
    in_block = (seq_len - torch.arange(num_virtual_blocks(seq_len, block_size, dcp)) * vb).clamp(
        0, vb
    )
    return torch.stack([local_seq_len(in_block, dcp, r, interleave) for r in range(dcp)])
