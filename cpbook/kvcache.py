"""DCP's memory layer: which rank stores each token's K/V, and in which physical slot.

A DCP group of ``dcp_size`` ranks shares one block table.  One block id names one physical
block of ``block_size`` slots on *every* rank, so it stands for a *virtual block* of
``VB = block_size * dcp_size`` tokens.  Inside a virtual block the tokens are dealt out in
stripes of ``interleave`` (vLLM's ``cp_kv_cache_interleave_size``) consecutive tokens, rank by
rank.  With ``p`` a token's position, ``N = dcp_size``, ``I = interleave``, ``B = block_size``
(vLLM ``BlockTable.compute_slot_mapping``)::

    owner(p) = (p // I) % N                          # == ((p % VB) // I) % N since N*I divides VB
    slot(p)  = block_table[p // VB] * B + ((p % VB) // (N*I)) * I + p % I    on the owner
             = -1 (PAD_SLOT_ID)                                              on every other rank

The ``j``-th token a rank stores for a request sits at ``block_table[j // B] * B + j % B`` and
has global position ``(j // I) * N * I + rank * I + j % I``: a rank's tokens fill its physical
blocks densely, in position order.

Public names: :func:`check_layout`, :func:`owner_rank`, :func:`slot_mapping`, :func:`local_seq_len`,
:func:`local_positions`, :func:`num_virtual_blocks`, :func:`block_fill`, :class:`PagedKVCache`
(one rank's paged store), :func:`transfer_plan` / :class:`TransferPlan` (P/D block transfer),
:func:`kvcache_rank` (the per-rank demo).  The virtual-block allocator with prefix caching,
:class:`~cpbook.kvmanager.KVCacheManager`, lives in :mod:`cpbook.kvmanager`.  Bad input raises
:class:`~cpbook.config.ConfigError` (a ``ValueError``) naming the rule and the values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from .comm import RankContext
from .config import ConfigError, check_interleave, check_positive

__all__ = [
    "PAD_SLOT_ID",
    "check_layout",
    "owner_rank",
    "slot_mapping",
    "local_seq_len",
    "local_positions",
    "num_virtual_blocks",
    "block_fill",
    "PagedKVCache",
    "TransferPlan",
    "transfer_plan",
    "kvcache_problem",
    "kvcache_comm_bytes",
    "kvcache_rank",
]

PAD_SLOT_ID = -1


# ------------------------------------------------------------------------------------------
# validation
# ------------------------------------------------------------------------------------------
def check_layout(
    dcp_size: int, interleave: int, block_size: int | None = None, dcp_rank: int | None = None
) -> None:
    """Raise :class:`ConfigError` unless the sizes describe a valid DCP KV layout."""
    check_positive(dcp_size=dcp_size, interleave=interleave)
    if block_size is not None:
        check_positive(block_size=block_size)
        check_interleave(block_size, interleave)
    if dcp_rank is not None and (
        isinstance(dcp_rank, bool) or not isinstance(dcp_rank, int) or not 0 <= dcp_rank < dcp_size
    ):
        raise ConfigError(
            "dcp-rank-in-range", "0 <= dcp_rank < dcp_size", dcp_rank=dcp_rank, dcp_size=dcp_size
        )


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
def owner_rank(
    positions: torch.Tensor | Sequence[int], dcp_size: int, interleave: int
) -> torch.Tensor:
    """The DCP rank storing each position: ``(p // interleave) % dcp_size`` (same shape, int64)."""
    check_layout(dcp_size, interleave)
    p = _as_long(positions, "positions")
    if p.numel() and int(p.min()) < 0:
        raise ConfigError(
            "positions-non-negative", "every position >= 0", min_position=int(p.min())
        )
    return torch.div(p, interleave, rounding_mode="floor") % dcp_size


def slot_mapping(
    positions: torch.Tensor | Sequence[int],
    block_table: torch.Tensor | Sequence[int],
    block_size: int,
    dcp_size: int,
    dcp_rank: int,
    interleave: int,
) -> torch.Tensor:
    """vLLM's DCP slot mapping of one request on one rank: a slot per position, ``-1`` if foreign.

    ``positions``: 1-D global token positions; ``block_table``: the request's virtual block ids
    (the same ids on every rank of the DCP group), ``block_table[p // (block_size*dcp_size)]``
    holding position ``p``.  Returns int64, same shape as ``positions``; local slots are
    ``block_id * block_size + offset`` with ``0 <= offset < block_size``.
    """
    check_layout(dcp_size, interleave, block_size, dcp_rank)
    p = _as_long(positions, "positions")
    table = _as_long(block_table, "block_table").reshape(-1)
    if p.numel() and int(p.min()) < 0:
        raise ConfigError(
            "positions-non-negative", "every position >= 0", min_position=int(p.min())
        )
    vb = block_size * dcp_size
    block_idx = torch.div(p, vb, rounding_mode="floor")
    if p.numel() and int(block_idx.max()) >= table.numel():
        raise ConfigError(
            "positions-within-block-table",
            "max(position) < len(block_table) * block_size * dcp_size",
            max_position=int(p.max()),
            len_block_table=table.numel(),
            virtual_block_size=vb,
        )
    off = p - block_idx * vb
    stripe = torch.div(off, interleave, rounding_mode="floor")
    slot = (
        table[block_idx] * block_size
        + torch.div(stripe, dcp_size, rounding_mode="floor") * interleave
        + (off - stripe * interleave)
    )
    return torch.where(stripe % dcp_size == dcp_rank, slot, PAD_SLOT_ID)


def local_seq_len(
    seq_len: int | torch.Tensor, dcp_size: int, dcp_rank: int, interleave: int
) -> int | torch.Tensor:
    """How many of a request's first ``seq_len`` tokens rank ``dcp_rank`` stores.

    vLLM's ``get_dcp_local_seq_lens``: ``base = seq_len // (I*N) * I`` plus
    ``clip(seq_len - base*N - rank*I, 0, I)``.  An ``int`` gives an ``int``; an integer tensor of
    lengths gives a tensor of the same shape.
    """
    check_layout(dcp_size, interleave, dcp_rank=dcp_rank)
    if isinstance(seq_len, torch.Tensor):
        lens = _as_long(seq_len, "seq_len")
        if lens.numel() and int(lens.min()) < 0:
            raise ConfigError(
                "seq-len-non-negative", "every seq_len >= 0", min_seq_len=int(lens.min())
            )
        base = torch.div(lens, interleave * dcp_size, rounding_mode="floor") * interleave
        return base + (lens - base * dcp_size - dcp_rank * interleave).clamp(0, interleave)
    _seq_len(seq_len)
    base = seq_len // (interleave * dcp_size) * interleave
    return base + min(max(seq_len - base * dcp_size - dcp_rank * interleave, 0), interleave)


def local_positions(seq_len: int, dcp_size: int, dcp_rank: int, interleave: int) -> torch.Tensor:
    """Global positions of the tokens ``dcp_rank`` stores, in its slot order (sorted, int64)."""
    j = torch.arange(local_seq_len(seq_len, dcp_size, dcp_rank, interleave))
    return (
        torch.div(j, interleave, rounding_mode="floor") * (dcp_size * interleave)
        + dcp_rank * interleave
        + j % interleave
    )


def num_virtual_blocks(seq_len: int, block_size: int, dcp_size: int) -> int:
    """Block ids a request of ``seq_len`` tokens needs: ``ceil(seq_len / (block_size*dcp))``."""
    check_positive(block_size=block_size, dcp_size=dcp_size)
    _seq_len(seq_len)
    return -(-seq_len // (block_size * dcp_size))


def block_fill(seq_len: int, block_size: int, dcp_size: int, interleave: int) -> torch.Tensor:
    """Tokens per (rank, virtual block) of one request: int64 ``[dcp_size, num_virtual_blocks]``.

    Column sums are the tokens in each virtual block; row sums are :func:`local_seq_len`.
    """
    check_layout(dcp_size, interleave, block_size)
    vb = block_size * dcp_size
    in_block = (
        seq_len - torch.arange(num_virtual_blocks(seq_len, block_size, dcp_size)) * vb
    ).clamp(0, vb)
    return torch.stack([local_seq_len(in_block, dcp_size, r, interleave) for r in range(dcp_size)])


# ------------------------------------------------------------------------------------------
# one rank's paged store
# ------------------------------------------------------------------------------------------
class PagedKVCache:
    """One rank's paged K/V cache (vLLM's per-layer ``kv_cache``), with the DCP layout it serves.

    ``PagedKVCache(num_blocks, block_size, num_kv_heads, head_dim, v_head_dim=None, *,
    dcp_size=1, dcp_rank=0, interleave=1, dtype=torch.float64, device="cpu")``

    * Storage: ``key_cache [num_blocks, block_size, num_kv_heads, head_dim]`` and
      ``value_cache [num_blocks, block_size, num_kv_heads, v_head_dim]``; slot
      ``s = block_id * block_size + offset``.  ``v_head_dim=None`` means ``head_dim``;
      ``v_head_dim=0`` means no V cache (MLA: one latent per token, ``num_kv_heads=1``,
      ``head_dim = kv_lora_rank + rope_dim``; pass ``v=None`` and read back ``v is None``).
    * :meth:`write` ``(k [T, H, D], v [T, H, Dv] | None, slot_mapping [T])`` stores token ``t`` in
      slot ``slot_mapping[t]`` and skips ``-1``: every rank can be handed the whole batch.
    * :meth:`read` ``(block_table, seq_len) -> (k [n, H, D], v [n, H, Dv] | None, positions [n])``
      returns the ``n = local_seq_len(seq_len, ...)`` tokens this rank holds for a request whose
      first ``seq_len`` tokens were written, in slot order, with their global positions.
      Reading a slot never written raises ``ValueError``.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        v_head_dim: int | None = None,
        *,
        dcp_size: int = 1,
        dcp_rank: int = 0,
        interleave: int = 1,
        dtype: torch.dtype = torch.float64,
        device: torch.device | str = "cpu",
    ) -> None:
        check_positive(num_blocks=num_blocks, num_kv_heads=num_kv_heads, head_dim=head_dim)
        check_layout(dcp_size, interleave, block_size, dcp_rank)
        v_head_dim = head_dim if v_head_dim is None else v_head_dim
        if isinstance(v_head_dim, bool) or not isinstance(v_head_dim, int) or v_head_dim < 0:
            raise ConfigError(
                "positive-sizes",
                "v_head_dim to be an integer >= 0 (0: no V cache)",
                v_head_dim=v_head_dim,
            )
        self.num_blocks, self.block_size = num_blocks, block_size
        self.dcp_size, self.dcp_rank, self.interleave = dcp_size, dcp_rank, interleave
        shape = (num_blocks, block_size, num_kv_heads)
        self.key_cache = torch.zeros(*shape, head_dim, dtype=dtype, device=device)
        self.value_cache = (
            torch.zeros(*shape, v_head_dim, dtype=dtype, device=device) if v_head_dim else None
        )
        self.written = torch.zeros(num_blocks * block_size, dtype=torch.bool, device=device)

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def bytes_per_token(self) -> int:
        """Bytes one slot occupies (K plus V, if any)."""
        caches = [self.key_cache] + ([self.value_cache] if self.value_cache is not None else [])
        return sum(c[0, 0].numel() * c.element_size() for c in caches)

    def slot_mapping(
        self, positions: torch.Tensor | Sequence[int], block_table: torch.Tensor | Sequence[int]
    ) -> torch.Tensor:
        """:func:`slot_mapping` with this store's layout."""
        return slot_mapping(
            positions, block_table, self.block_size, self.dcp_size, self.dcp_rank, self.interleave
        )

    def write(self, k: torch.Tensor, v: torch.Tensor | None, slot_mapping: torch.Tensor) -> int:
        """Store ``k[t]`` (and ``v[t]``) in slot ``slot_mapping[t]``; skip ``-1``.

        Returns the number of tokens written."""
        slots = _as_long(slot_mapping, "slot_mapping").to(self.written.device).reshape(-1)
        if k.shape[1:] != self.key_cache.shape[2:] or k.shape[0] != slots.numel():
            raise ConfigError(
                "kv-shape",
                "k of shape [len(slot_mapping), num_kv_heads, head_dim]",
                k_shape=tuple(k.shape),
                len_slot_mapping=slots.numel(),
                per_token=tuple(self.key_cache.shape[2:]),
            )
        if (v is None) != (self.value_cache is None) or (
            v is not None and v.shape != (slots.numel(), *self.value_cache.shape[2:])
        ):
            raise ConfigError(
                "kv-shape",
                "v of shape [len(slot_mapping), num_kv_heads, v_head_dim], "
                "or None exactly when v_head_dim == 0",
                v_shape=None if v is None else tuple(v.shape),
                v_head_dim=0 if self.value_cache is None else self.value_cache.shape[-1],
            )
        keep = slots != PAD_SLOT_ID
        mine = slots[keep]
        if mine.numel() and (int(mine.min()) < 0 or int(mine.max()) >= self.num_slots):
            raise ConfigError(
                "slot-in-cache",
                "every slot in [0, num_blocks*block_size) or -1",
                min_slot=int(mine.min()),
                max_slot=int(mine.max()),
                num_slots=self.num_slots,
            )
        keep = keep.to(k.device)
        self.key_cache.view(self.num_slots, *self.key_cache.shape[2:])[mine] = k[keep].to(
            self.key_cache
        )
        if v is not None:
            self.value_cache.view(self.num_slots, *self.value_cache.shape[2:])[mine] = v[keep].to(
                self.value_cache
            )
        self.written[mine] = True
        return int(mine.numel())

    def local_slots(self, block_table: torch.Tensor | Sequence[int], seq_len: int) -> torch.Tensor:
        """Slots of this rank's tokens of a request (``block_table[j // B] * B + j % B``),
        in slot order."""
        table = _as_long(block_table, "block_table").reshape(-1)
        n = local_seq_len(seq_len, self.dcp_size, self.dcp_rank, self.interleave)
        if num_virtual_blocks(seq_len, self.block_size, self.dcp_size) > table.numel():
            raise ConfigError(
                "positions-within-block-table",
                "seq_len <= len(block_table) * block_size * dcp_size",
                seq_len=seq_len,
                len_block_table=table.numel(),
                virtual_block_size=self.block_size * self.dcp_size,
            )
        j = torch.arange(n)
        return (
            table[torch.div(j, self.block_size, rounding_mode="floor")] * self.block_size
            + j % self.block_size
        )

    def read(
        self, block_table: torch.Tensor | Sequence[int], seq_len: int
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """This rank's K, V (``None`` without a V cache) and global positions for a request."""
        slots = self.local_slots(block_table, seq_len).to(self.written.device)
        if slots.numel() and (
            int(slots.max()) >= self.num_slots or not bool(self.written[slots].all())
        ):
            raise ConfigError(
                "read-written-slots",
                "every slot read to have been written",
                seq_len=seq_len,
                dcp_rank=self.dcp_rank,
                unwritten=int((~self.written[slots.clamp(max=self.num_slots - 1)]).sum()),
            )
        k = self.key_cache.view(self.num_slots, *self.key_cache.shape[2:])[slots]
        v = (
            None
            if self.value_cache is None
            else self.value_cache.view(self.num_slots, *self.value_cache.shape[2:])[slots]
        )
        return (
            k,
            v,
            local_positions(seq_len, self.dcp_size, self.dcp_rank, self.interleave).to(
                slots.device
            ),
        )


# ------------------------------------------------------------------------------------------
# P/D disaggregation: which blocks a decode node must receive
# ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TransferPlan:
    """Whole-block KV transfer of one request from a prefill node to a DCP decode group.

    ``fill[r, b]`` = tokens rank ``r`` holds in virtual block ``b``.  A rank sends every physical
    block holding at least one of its tokens, whole; empty blocks are not sent.
    """

    seq_len: int
    block_size: int
    dcp_size: int
    interleave: int
    bytes_per_token: int
    fill: torch.Tensor

    @property
    def blocks_sent(self) -> list[list[int]]:
        """Per rank, the request's virtual-block indices whose physical block it sends."""
        return [torch.nonzero(row).flatten().tolist() for row in self.fill]

    @property
    def fill_ratios(self) -> list[list[float]]:
        """Per rank, the fill ratio (tokens / block_size) of each block it sends."""
        return [
            [int(row[b]) / self.block_size for b in blocks]
            for row, blocks in zip(self.fill, self.blocks_sent)
        ]

    @property
    def rank_bytes(self) -> list[int]:
        return [len(b) * self.block_size * self.bytes_per_token for b in self.blocks_sent]

    @property
    def bytes_sent(self) -> int:
        return sum(self.rank_bytes)

    @property
    def useful_bytes(self) -> int:
        return self.seq_len * self.bytes_per_token

    @property
    def no_dcp_bytes(self) -> int:
        """Whole blocks a DCP-less decode node would receive: ``ceil(L / B)`` blocks."""
        return -(-self.seq_len // self.block_size) * self.block_size * self.bytes_per_token

    @property
    def amplification(self) -> float:
        """``bytes_sent / no_dcp_bytes`` (1 = no overhead from DCP)."""
        return self.bytes_sent / self.no_dcp_bytes if self.seq_len else 1.0

    @property
    def waste(self) -> float:
        """Fraction of the bytes sent that are empty slots: ``1 - useful / sent``."""
        return 1 - self.useful_bytes / self.bytes_sent if self.seq_len else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "seq_len": self.seq_len,
            "block_size": self.block_size,
            "dcp_size": self.dcp_size,
            "interleave": self.interleave,
            "blocks_sent": sum(map(len, self.blocks_sent)),
            "bytes_sent": self.bytes_sent,
            "useful_bytes": self.useful_bytes,
            "amplification": round(self.amplification, 6),
            "waste": round(self.waste, 6),
        }


def transfer_plan(
    seq_len: int, block_size: int, dcp_size: int, interleave: int, bytes_per_token: int = 1
) -> TransferPlan:
    """The :class:`TransferPlan` of a request of ``seq_len`` tokens (bytes in units of
    ``bytes_per_token``)."""
    check_positive(bytes_per_token=bytes_per_token)
    return TransferPlan(
        seq_len,
        block_size,
        dcp_size,
        interleave,
        bytes_per_token,
        block_fill(seq_len, block_size, dcp_size, interleave),
    )


# ------------------------------------------------------------------------------------------
# the per-rank demo: write own tokens, read back, all-gather, reconstruct
# ------------------------------------------------------------------------------------------
def kvcache_problem(
    seq_len: int,
    num_kv_heads: int,
    head_dim: int,
    num_blocks: int,
    block_size: int,
    dcp_size: int,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Float64 ``k, v [seq_len, H, D]`` and a shuffled block table of
    ``ceil(seq_len / (block_size * dcp_size))`` distinct ids below ``num_blocks``, from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen, dtype=torch.float64)
    v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen, dtype=torch.float64)
    table = torch.randperm(num_blocks, generator=gen)[
        : num_virtual_blocks(seq_len, block_size, dcp_size)
    ]
    return k, v, table


def kvcache_comm_bytes(
    seq_len: int,
    dcp_size: int,
    interleave: int,
    num_kv_heads: int,
    head_dim: int,
    elem_bytes: int = 8,
) -> list[tuple[str, int]]:
    """Bytes one rank sends to rebuild the request from its shards, in call order.

    Three uneven all-gathers (K, V, positions), each a size exchange (one int64) and the rows
    padded to the largest shard, ``ceil``-stripe rank 0's ``local_seq_len``:
    ``[("all_gather", 8·(N−1)), ("all_gather", rows·H·D·e·(N−1))] × 2`` then positions at 8 B.
    """
    n = dcp_size
    rows = local_seq_len(seq_len, n, 0, interleave)  # rank 0 holds the most tokens
    kv = [
        ("all_gather", 8 * (n - 1)),
        ("all_gather", rows * num_kv_heads * head_dim * elem_bytes * (n - 1)),
    ]
    return kv + kv + [("all_gather", 8 * (n - 1)), ("all_gather", rows * 8 * (n - 1))]


def kvcache_rank(
    ctx: RankContext,
    *,
    seq_len: int = 200,
    block_size: int = 16,
    cp_kv_cache_interleave_size: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 8,
    num_blocks: int = 64,
    seed: int = 0,
    dtype: str = "float64",
) -> dict[str, Any]:
    """Each rank of the DCP group (the world) stores only its tokens; an all-gather rebuilds K/V.

    Every rank draws the same ``k, v`` and block table (:func:`kvcache_problem`), writes through
    its :func:`slot_mapping`, reads its tokens back, and all-gathers them (uneven sizes) with
    their positions.  Returns this rank's token count and bytes, whether every position came
    back exactly once, the max error (exactly 0.0: data is only moved), the traced
    ``comm`` and the formula's ``expected`` (:func:`kvcache_comm_bytes`).
    """
    group, interleave = ctx.world, cp_kv_cache_interleave_size
    n, r = group.size, group.rank
    check_layout(n, interleave, block_size)
    k, v, table = kvcache_problem(seq_len, num_kv_heads, head_dim, num_blocks, block_size, n, seed)
    k, v = k.to(getattr(torch, dtype)), v.to(getattr(torch, dtype))
    cache = PagedKVCache(
        num_blocks,
        block_size,
        num_kv_heads,
        head_dim,
        dcp_size=n,
        dcp_rank=r,
        interleave=interleave,
        dtype=k.dtype,
        device=ctx.device,
    )
    wrote = cache.write(
        k.to(ctx.device), v.to(ctx.device), cache.slot_mapping(torch.arange(seq_len), table)
    )
    lk, lv, pos = cache.read(table, seq_len)
    first = len(ctx.trace)
    all_k, sizes = group.all_gather_v(lk, dim=0)
    all_v, _ = group.all_gather_v(lv, dim=0)
    all_pos, _ = group.all_gather_v(pos.to(ctx.device), dim=0)
    comm = [(rec.op, rec.bytes_sent) for rec in ctx.trace[first:]]
    all_pos = all_pos.cpu()
    once = bool((torch.bincount(all_pos, minlength=seq_len) == 1).all()) and sum(sizes) == seq_len
    full_k, full_v = torch.empty_like(k), torch.empty_like(v)
    full_k[all_pos], full_v[all_pos] = all_k.cpu(), all_v.cpu()
    err = max((full_k - k).abs().max().item(), (full_v - v).abs().max().item())
    blocks = int((block_fill(seq_len, block_size, n, interleave)[r] > 0).sum())
    stored = wrote * cache.bytes_per_token
    total = seq_len * cache.bytes_per_token
    print(
        f"stores {wrote} of {seq_len} tokens in {blocks} blocks: {stored:,} of {total:,} B "
        f"({stored / total:.3f})"
    )
    print(f"rebuilt: every token once: {once}; max err {err:.1f}")
    return {
        "tokens": wrote,
        "blocks": blocks,
        "bytes": stored,
        "total_bytes": total,
        "each_once": once,
        "max_abs_err": err,
        "comm": comm,
        "expected": kvcache_comm_bytes(
            seq_len, n, interleave, num_kv_heads, head_dim, k.element_size()
        ),
    }
