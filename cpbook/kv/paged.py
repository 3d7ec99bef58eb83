"""One rank's paged KV store and the sharding of a whole cache over a DCP group.

:class:`PagedKVCache` holds ``num_blocks`` physical blocks of ``block_size`` slots (K and V, or
MLA's latent) and writes / reads them through the slot mapping of :mod:`cpbook.kv.layout`.
:func:`shard_kv_cache` splits a dense per-request cache into each DCP rank's interleaved share,
the layout every decode path (GQA, MLA, TPA, migration, chunked prefill) reads."""

from __future__ import annotations

from typing import Sequence

import torch

from cpbook.core.config import ConfigError, check_positive
from cpbook.core.errors import RuleError
from cpbook.kv.layout import (
    PAD_SLOT_ID,
    DCPShard,
    _as_long,
    check_layout,
    local_positions,
    local_seq_len,
    num_virtual_blocks,
    slot_mapping,
)

__all__ = ["PagedKVCache", "shard_kv_cache"]


# ------------------------------------------------------------------------------------------
# one rank's paged store
# ------------------------------------------------------------------------------------------
class PagedKVCache:
    """One rank's paged K/V cache (vLLM's per-layer ``kv_cache``), with the DCP layout it serves.

    ``PagedKVCache(num_blocks, block_size, num_kv_heads, head_dim, v_head_dim=None, *,
    shard=DCPShard(dcp=1, dcp_rank=0, interleave=1), dtype=torch.float64, device="cpu")``

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
    * K/V (and the positions read back) live on ``device``; slot mappings, block tables and the
      record of written slots stay on the host, so no check waits on the device.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        v_head_dim: int | None = None,
        *,
        shard: DCPShard = DCPShard(),
        dtype: torch.dtype = torch.float64,
        device: torch.device | str = "cpu",
    ) -> None:
        check_positive(num_blocks=num_blocks, num_kv_heads=num_kv_heads, head_dim=head_dim)
        dcp, dcp_rank, interleave = shard.dcp, shard.dcp_rank, shard.interleave
        check_layout(dcp, interleave, block_size, dcp_rank)
        v_head_dim = head_dim if v_head_dim is None else v_head_dim
        if isinstance(v_head_dim, bool) or not isinstance(v_head_dim, int) or v_head_dim < 0:
            raise ConfigError(
                "positive-sizes",
                "v_head_dim to be an integer >= 0 (0: no V cache)",
                v_head_dim=v_head_dim,
            )
        self.num_blocks, self.block_size = num_blocks, block_size
        self.shard, self.dcp, self.dcp_rank, self.interleave = shard, dcp, dcp_rank, interleave
        shape = (num_blocks, block_size, num_kv_heads)
        self.key_cache = torch.zeros(*shape, head_dim, dtype=dtype, device=device)
        self.value_cache = (
            torch.zeros(*shape, v_head_dim, dtype=dtype, device=device) if v_head_dim else None
        )
        # which slots hold a token: bookkeeping on the host, so checks never wait on the device
        self.written = torch.zeros(num_blocks * block_size, dtype=torch.bool)

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
            positions, block_table, self.block_size, self.dcp, self.dcp_rank, self.interleave
        )

    def _slots_in_cache(self, mine: torch.Tensor) -> torch.Tensor:
        """``mine`` (slots other than ``-1``), checked to lie in this store."""
        lo, hi = torch.aminmax(mine) if mine.numel() else (0, 0)
        if int(lo) < 0 or int(hi) >= self.num_slots:
            raise ConfigError(
                "slot-in-cache",
                "every slot in [0, num_blocks*block_size) or -1",
                min_slot=int(mine.min()),
                max_slot=int(mine.max()),
                num_slots=self.num_slots,
            )
        return mine

    def write(self, k: torch.Tensor, v: torch.Tensor | None, slot_mapping: torch.Tensor) -> int:
        """Store ``k[t]`` (and ``v[t]``) in slot ``slot_mapping[t]``; skip ``-1``.

        Returns the number of tokens written."""
        slots = _as_long(slot_mapping, "slot_mapping").cpu().reshape(-1)
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
        mine = self._slots_in_cache(slots[keep])
        dev = self.key_cache.device
        rows = None if bool(keep.all()) else keep.nonzero().flatten().to(k.device)
        at = mine.to(dev)
        for cache, x in ((self.key_cache, k), (self.value_cache, v)):
            if cache is not None:
                x = x if rows is None else x.index_select(0, rows)
                cache.view(self.num_slots, *cache.shape[2:]).index_copy_(0, at, x.to(cache))
        self.written[mine] = True
        return int(mine.numel())

    # -- the batched path: the step checks its slots once, every layer reuses them ----------
    def store(
        self,
        k: torch.Tensor,
        v: torch.Tensor | None,
        slots: torch.Tensor,
        rows: torch.Tensor | None = None,
    ) -> None:
        """Store rows ``rows`` of ``k``/``v`` (all rows if ``None``) in ``slots`` (on the
        cache's device, already checked: :meth:`mark_written` does that once per step); no
        host work, so every layer of a step can call it."""
        for cache, x in ((self.key_cache, k), (self.value_cache, v)):
            if cache is not None:
                x = x if rows is None else x.index_select(0, rows)
                x = x if x.dtype == cache.dtype else x.to(cache.dtype)
                cache.view(self.num_slots, *cache.shape[2:]).index_copy_(0, slots, x)

    def gather(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """K and V (``None`` without a V cache) of ``slots`` (device, already checked by
        :meth:`check_written`), one ``index_select`` each."""
        return tuple(
            None if c is None else c.view(self.num_slots, *c.shape[2:]).index_select(0, slots)
            for c in (self.key_cache, self.value_cache)
        )

    def mark_written(self, slots: torch.Tensor) -> None:
        """Record host ``slots`` (no ``-1``) as holding a token, after checking they lie in
        the store (rule ``slot-in-cache``): the bookkeeping of :meth:`store`."""
        self.written[self._slots_in_cache(slots)] = True

    def check_written(self, slots: torch.Tensor) -> None:
        """Rule ``read-written-slots``: every host slot in ``slots`` holds a token."""
        if slots.numel() and not bool(self.written[self._slots_in_cache(slots)].all()):
            raise ConfigError(
                "read-written-slots",
                "every slot read to have been written",
                dcp_rank=self.dcp_rank,
                unwritten=int((~self.written[slots]).sum()),
            )

    def invalidate(self, slot_mapping: torch.Tensor | Sequence[int]) -> int:
        """Forget the tokens in ``slot_mapping``'s slots (skip ``-1``): a speculative step's
        rejected rows.  Their K/V stays in memory but the slots count as never written, so a
        read that reaches them raises until they are written again.  Returns the slots
        dropped."""
        slots = _as_long(slot_mapping, "slot_mapping").cpu().reshape(-1)
        mine = self._slots_in_cache(slots[slots != PAD_SLOT_ID])
        dropped = int(self.written[mine].sum())
        self.written[mine] = False
        return dropped

    def local_slots(self, block_table: torch.Tensor | Sequence[int], seq_len: int) -> torch.Tensor:
        """Slots of this rank's tokens of a request (``block_table[j // B] * B + j % B``),
        in slot order."""
        table = _as_long(block_table, "block_table").reshape(-1)
        n = local_seq_len(seq_len, self.dcp, self.dcp_rank, self.interleave)
        if num_virtual_blocks(seq_len, self.block_size, self.dcp) > table.numel():
            raise ConfigError(
                "positions-within-block-table",
                "seq_len <= len(block_table) * block_size * dcp",
                seq_len=seq_len,
                len_block_table=table.numel(),
                virtual_block_size=self.block_size * self.dcp,
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
        slots = self.local_slots(block_table, seq_len)
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
        at = slots.to(self.key_cache.device)
        k, v = (
            None if c is None else c.view(self.num_slots, *c.shape[2:]).index_select(0, at)
            for c in (self.key_cache, self.value_cache)
        )
        return (
            k,
            v,
            local_positions(seq_len, self.dcp, self.dcp_rank, self.interleave).to(at.device),
        )


# ------------------------------------------------------------------------------------------
# head layout and KV placement
# ------------------------------------------------------------------------------------------
def shard_kv_cache(
    ks: Sequence[torch.Tensor],
    vs: Sequence[torch.Tensor | None],
    block_size: int,
    dcp: int,
    dcp_rank: int,
    interleave: int,
    device: torch.device | str = "cpu",
) -> tuple[list[tuple], PagedKVCache]:
    """Write every request's full K/V through this rank's slot mapping, read its tokens back.

    Request ``i`` gets the next ``ceil(L_i / (block_size·dcp))`` virtual block ids (the same
    on every rank).  Only the tokens this rank owns land in its :class:`PagedKVCache`.  Returns
    ``[(k_local, v_local | None, positions), ...]`` per request and the cache.  ``vs[i] is None``
    for MLA (one latent per token, no V cache).
    """
    if not ks or len(ks) != len(vs) or len({v is None for v in vs}) != 1:
        raise RuleError(
            "kv-per-request",
            "one k and one v (all tensors or all None) per request, at least one request",
            ks=len(ks),
            vs=len(vs),
        )
    nblocks = [num_virtual_blocks(k.shape[0], block_size, dcp) for k in ks]
    k0 = ks[0]
    cache = PagedKVCache(
        max(1, sum(nblocks)),
        block_size,
        k0.shape[1],
        k0.shape[2],
        0 if vs[0] is None else vs[0].shape[2],
        shard=DCPShard(dcp, dcp_rank, interleave),
        dtype=k0.dtype,
        device=device,
    )
    tables, start = [], 0
    for k, v, nb in zip(ks, vs, nblocks):
        table = torch.arange(start, start + nb)
        start += nb
        positions = torch.arange(k.shape[0])
        cache.write(
            k.to(device), None if v is None else v.to(device), cache.slot_mapping(positions, table)
        )
        tables.append(table)
    return [cache.read(t, k.shape[0]) for t, k in zip(tables, ks)], cache
