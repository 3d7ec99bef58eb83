"""The engine's attention backend: one call per layer for every row of the step.

vLLM splits a step three ways: the scheduler decides, the model runner builds the step's
attention metadata once (``CommonAttentionMetadata`` in ``vllm/v1/attention/backend.py``,
v0.34.0: query start locations, sequence lengths, block table, slot mapping, DCP-local
sequence lengths), and the attention backend makes one call per layer for the whole batch,
reading the paged cache in place (``vllm/v1/attention/backends/cpu_attn.py`` on the CPU).
Here:

* :func:`build_attention_metadata` — on the host, once per step, for this rank's DCP shard:
  the slots of the step's new rows (``-1`` where another DCP rank owns the position), the
  slots of every request's local keys (a padded ``[num_reqs, max_keys]`` table) and the mask
  that makes row ``j`` of a request see exactly the local keys at global positions
  ``<= start + j`` (causal by global position: one decode row, a speculative step's ``k + 1``
  rows, or a prefill chunk's rows after its cached context).  Then one copy to the device.
* :func:`batched_attention` — per layer: write the new K/V through the slots, bring the
  batch's :class:`BatchKV` up to date (the keys of each request side by side, kept from step to
  step), one attention call (plain decode folds the query heads of a KV head into its query
  rows; otherwise the rows of a request are padded to the longest, the query heads of a KV
  head side by side, or a long step of uneven requests is cut into blocks,
  :mod:`cpbook.engine.blocks`), output and LSE; under DCP the query heads are all-gathered
  and the LSE combine of chapter 3 (:func:`cpbook.dcp.decode.dcp_combine`) merges the
  shards.  No host read and no per-request Python.

The paged cache stays ``[num_blocks, block_size, num_kv_heads, head_dim]``, the layout every
chapter's :class:`~cpbook.kv.paged.PagedKVCache` uses, and it is what the step writes and the
rule checks read.  vLLM v0.34.0's CPU backend reads its ``[num_blocks, num_kv_heads, block_size,
2 * head_size]`` cache in place, in its own kernel; a stock attention call needs each request's
keys contiguous, so gathering them would copy the whole context in every layer of every step.
:class:`BatchKV` is that gather kept: a copy of the batch's keys, one row per request, to
which a step appends only the slots it wrote (the whole context again only when the batch's
requests change).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from cpbook.core.comm import Group
from cpbook.dcp.decode import dcp_combine
from cpbook.engine.blocks import ATTN_BLOCK, AttentionBlocks, block_pairs, gather_pairs, merge_pairs
from cpbook.kv.layout import PAD_SLOT_ID, DCPShard
from cpbook.kv.paged import PagedKVCache

__all__ = [
    "AttentionMetadata",
    "BatchKV",
    "padded_block_tables",
    "batch_slot_mapping",
    "build_attention_metadata",
    "batched_attention",
]


def padded_block_tables(tables: Sequence[Sequence[int]]) -> torch.Tensor:
    """The requests' block tables as one int64 ``[num_reqs, max_blocks]`` tensor (0-padded)."""
    width = max(1, max(len(t) for t in tables))
    return torch.tensor([list(t) + [0] * (width - len(t)) for t in tables], dtype=torch.long)


def batch_slot_mapping(
    positions: torch.Tensor,
    request_index: torch.Tensor,
    block_tables: torch.Tensor,
    block_size: int,
    shard: DCPShard,
) -> torch.Tensor:
    """:func:`cpbook.kv.layout.slot_mapping` for many requests at once: row ``t`` at global
    position ``positions[t]`` of request ``request_index[t]`` (its table a row of
    ``block_tables``); ``-1`` where another DCP rank owns the position."""
    n, i = shard.dcp, shard.interleave
    vb = block_size * n
    blk = torch.div(positions, vb, rounding_mode="floor")
    off = positions - blk * vb
    stripe = torch.div(off, i, rounding_mode="floor")
    slot = (
        block_tables[request_index, blk] * block_size
        + torch.div(stripe, n, rounding_mode="floor") * i
        + (off - stripe * i)
    )
    return torch.where(stripe % n == shard.dcp_rank, slot, PAD_SLOT_ID)


class BatchKV:
    """The batch's keys (and values), one contiguous row per request, kept from step to step:
    per layer ``keys[layer]``/``values[layer]`` ``[num_reqs, num_kv_heads, capacity, ·]`` on
    the device (``values[layer]`` ``None`` without a V cache; a KV head's keys of a request
    side by side, as the attention kernel reads them), row ``r`` holding request
    ``r``'s local keys in position order; on the host, which requests the rows hold
    (``request_ids``, ``block_tables``) and how many local keys of each are copied
    (``filled``)."""

    def __init__(self, num_layers: int) -> None:
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.capacity = 0
        self.request_ids: tuple[str, ...] = ()
        self.block_tables: tuple[tuple[int, ...], ...] = ()
        self.tables = np.zeros((0, 0), dtype=np.int64)  # the same, padded
        self.filled = np.zeros(0, dtype=np.int64)
        self._rows: tuple["AttentionMetadata", torch.Tensor] | None = None

    def forget(self) -> None:
        """Hold no request: the next step copies every key it reads."""
        self.request_ids, self.block_tables = (), ()

    def refresh(
        self,
        layer: int,
        cache: PagedKVCache,
        meta: "AttentionMetadata",
        new_rows: tuple[torch.Tensor, torch.Tensor | None],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Copy ``meta``'s fill slots from ``layer``'s ``cache`` (into fresh zeroed rows first
        if ``meta.kv_reset``) — or, when ``meta.fill_new`` (the fill is exactly this rank's new
        rows, in order), from ``new_rows`` (their K and V) without reading the cache; returns
        the keys and values ``[num_reqs, Hkv, width, ·]``."""
        if meta.kv_reset:
            k, v = cache.key_cache, cache.value_cache
            shape = (meta.num_reqs, k.shape[2], meta.kv_capacity)
            self.keys[layer] = k.new_zeros(*shape, k.shape[3])
            self.values[layer] = None if v is None else v.new_zeros(*shape, v.shape[3])
        bufs = (self.keys[layer], self.values[layer])
        src = new_rows if meta.fill_new else cache.gather(meta.fill_src)
        rows = self._fill_rows(meta, bufs[0].shape[1])
        for buf, new in zip(bufs, src):
            if buf is not None:  # one index_copy_ into the flattened rows
                d = buf.shape[-1]
                buf.view(-1, d).index_copy_(0, rows, new.reshape(-1, d).to(buf.dtype))
        width = meta.kv_width
        return tuple(None if x is None else x[:, :, :width] for x in bufs)

    def _fill_rows(self, meta: "AttentionMetadata", hkv: int) -> torch.Tensor:
        """The rows of the flattened ``[num_reqs * Hkv * capacity, ·]`` buffers that ``meta``'s
        fill writes, ordered (key, KV head); built once per step, every layer reuses them."""
        if self._rows is None or self._rows[0] is not meta:
            heads = torch.arange(hkv, device=meta.fill_req.device)
            rows = (meta.fill_req[:, None] * hkv + heads) * meta.kv_capacity
            self._rows = (meta, (rows + meta.fill_key[:, None]).reshape(-1))
        return self._rows[1]


@dataclass(frozen=True)
class AttentionMetadata:
    """One step's batched rows on one rank, built once and read by every layer.

    Host (``int``/host tensors, for checks and display): ``query_start_loc``
    ``[num_reqs + 1]``, ``positions`` (global position of each row), ``seq_lens`` (tokens a
    request holds after the step), ``local_seq_lens`` (this rank's keys of each),
    ``slot_mapping`` ``[num_rows]`` (this rank's slot of each new row, ``-1`` if foreign),
    ``max_keys`` (the most local keys of a request), ``read_slots`` (the slots the step copies
    into the :class:`BatchKV`: the new rows', and every key of a request its rows did not
    hold).  Device: ``fill_src`` (those slots) and ``fill_req``/``fill_key`` (their places in
    the :class:`BatchKV`: request row and local key; ``kv_reset``: fresh rows; ``fill_new``:
    the slots are exactly this rank's new rows, so the copy reads them, not the cache), the
    additive ``mask`` ``[num_reqs, 1, max_query_len, max_keys]`` (broadcast over heads;
    ``None`` with ``causal`` when every request's rows are its first tokens and no DCP: row
    ``j`` sees keys ``0..j``, the kernel's own causal mask; ``None`` without ``causal`` when
    every request has one row that sees all ``max_keys`` keys, or when a request has more
    than :data:`~cpbook.engine.blocks.ATTN_BLOCK` rows and blocks pay off: then ``blocks`` cuts
    the rows and keys into pairs of blocks, each with its own mask, read ``kv_width`` keys
    wide).
    """

    num_reqs: int
    max_query_len: int
    max_keys: int
    query_start_loc: torch.Tensor
    positions: torch.Tensor
    seq_lens: torch.Tensor
    local_seq_lens: torch.Tensor
    slot_mapping: torch.Tensor
    read_slots: torch.Tensor
    write_rows: torch.Tensor | None  # device: rows this rank stores (None: all of them)
    new_slots: torch.Tensor  # host: their slots (``slot_mapping`` without ``-1``)
    write_slots: torch.Tensor  # device: the same
    kv_capacity: int
    kv_reset: bool
    fill_new: bool  # the fill is exactly this rank's new rows, in order: copied from them
    fill_src: torch.Tensor  # device
    fill_req: torch.Tensor  # device
    fill_key: torch.Tensor  # device
    query_index: torch.Tensor | None  # device: row -> padded (request, row) slot; None: 1 row each
    mask: torch.Tensor | None  # device, additive; None: ``causal``, or every row sees all keys
    causal: bool  # no mask: every request's rows are its first keys, the kernel's causal mode
    blocks: AttentionBlocks | None  # a request of more than ATTN_BLOCK rows: attend in blocks
    kv_width: int  # keys per request the call reads: max_keys (in blocks: whole blocks)
    has_key: torch.Tensor  # device [num_rows, 1]: the row sees at least one local key

    @property
    def num_rows(self) -> int:
        return int(self.query_start_loc[-1])


#: the :class:`BatchKV`'s rows grow in steps of this many keys (a new buffer each time)
KV_CAPACITY_STEP = 256


def _kept_keys(
    kv: BatchKV | None,
    request_ids: Sequence[str],
    block_tables: tuple[tuple[int, ...], ...],
    before: np.ndarray,
    width: int,
) -> np.ndarray | None:
    """Local keys of each request that ``kv``'s rows still hold (``None``: start afresh): the
    same requests in the same order, block tables that agree, and room for ``width`` keys;
    keys at or after a step's first new row (``before`` of them precede it) are copied again."""
    if kv is None or tuple(request_ids) != kv.request_ids or width > kv.capacity:
        return None
    if block_tables == kv.block_tables:  # no request grew a block since the last step
        return np.minimum(kv.filled, before)
    for new, old in zip(block_tables, kv.block_tables):
        n = min(len(new), len(old))
        if new[:n] != old[:n]:
            return None
    return np.minimum(kv.filled, before)


def build_attention_metadata(
    starts: Sequence[int],
    num_rows: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    shard: DCPShard,
    dtype: torch.dtype,
    device: torch.device | str,
    request_ids: Sequence[str] = (),
    kv: BatchKV | None = None,
) -> AttentionMetadata:
    """The :class:`AttentionMetadata` of requests whose rows ``[starts[i], starts[i] +
    num_rows[i])`` decode (or verify drafts, or prefill) this step, on rank ``shard`` of the
    DCP group, and the keys to copy into ``kv`` (the :class:`BatchKV` of the last step's
    requests, or ``None``: copy every key).  Updates ``kv``'s host record.  Built with NumPy
    on the host (a few microseconds per array, as vLLM's input batch does), then copied to
    ``device`` once.

    More than eight parameters: the requests' rows, tables and ids, the cache layout, the
    tensors' dtype and device, and the copy kept from the last step."""
    n, i, rank = shard.dcp, shard.interleave, shard.dcp_rank
    start = np.asarray(starts, dtype=np.int64)
    rows = np.asarray(num_rows, dtype=np.int64)
    b, q = len(start), int(rows.max())
    held = tuple(map(tuple, block_tables))
    if kv is not None and held == kv.block_tables:  # the last step's padded tables
        tables = kv.tables
    else:
        tables = np.zeros((b, max(len(t) for t in held)), dtype=np.int64)
        for r, t in enumerate(held):
            tables[r, : len(t)] = t
    qsl = np.zeros(b + 1, dtype=np.int64)
    qsl[1:] = rows.cumsum()
    req = np.repeat(np.arange(b), rows)
    qi = np.arange(qsl[-1]) - qsl[req]
    positions = start[req] + qi
    vb = block_size * n
    blk, off = np.divmod(positions, vb)
    stripe, within = np.divmod(off, i)
    slots = tables[req, blk] * block_size + stripe // n * i + within
    slots = np.where(stripe % n == rank, slots, PAD_SLOT_ID)
    seq = start + rows

    def local_len(s: np.ndarray) -> np.ndarray:  # local_seq_len, vectorised
        if n == 1:
            return s
        base = s // (i * n) * i
        return base + np.minimum(np.maximum(s - base * n - rank * i, 0), i)

    local = local_len(seq)
    width = max(1, int(local.max()))
    # local keys sit in position order: row at position p sees the first local_len(p + 1)
    sees = local_len(start[:, None] + np.arange(q)[None] + 1)  # [b, q]
    before = local_len(start)
    kept = _kept_keys(kv, request_ids, held, before, width)
    reset = kept is None
    fill_new = not reset and bool((kept == before).all())
    cap = -(-width // KV_CAPACITY_STEP) * KV_CAPACITY_STEP if reset else kv.capacity
    first = np.zeros(b, dtype=np.int64) if reset else kept
    count = local - first  # keys each request copies into the BatchKV
    fr = np.repeat(np.arange(b), count)
    fj = np.arange(int(count.sum())) - np.repeat(count.cumsum() - count, count) + first[fr]
    fill_src = tables[fr, fj // block_size] * block_size + fj % block_size
    if kv is not None:
        kv.request_ids, kv.filled, kv.capacity = tuple(request_ids), local, cap
        kv.block_tables, kv.tables = held, tables
    mine = slots != PAD_SLOT_ID
    dev = torch.device(device)
    t = torch.from_numpy
    new_slots = t(slots[mine])
    mask, causal = None, n == 1 and not start.any()  # every request's rows its first keys
    blocks = block_pairs(rows, sees, dtype, dev, ATTN_BLOCK) if q > ATTN_BLOCK else None
    if blocks is not None:  # each pair has its own mask
        causal = False
    elif not causal and (q > 1 or (sees != width).any()):  # else each row sees every key
        mask = t(np.where(np.arange(width) >= sees[:, None, :, None], -np.inf, 0.0)).to(dtype)
    return AttentionMetadata(
        b,
        q,
        width,
        t(qsl),
        t(positions),
        t(seq),
        t(local),
        t(slots),
        t(fill_src),
        None if mine.all() else t(np.flatnonzero(mine)).to(dev),
        new_slots,
        new_slots.to(dev),
        cap,
        reset,
        fill_new,
        t(fill_src).to(dev),
        t(fr).to(dev),
        t(fj).to(dev),
        None if q == 1 or blocks is not None else t(req * q + qi).to(dev),
        None if mask is None else mask.to(dev),
        causal,
        blocks,
        width if blocks is None else -(-width // blocks.size) * blocks.size,
        t(sees[req, qi][:, None] > 0).to(dev),
    )


def _attend(
    q4: torch.Tensor,
    k4: torch.Tensor,
    v4: torch.Tensor,
    mask: torch.Tensor | None,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, H, Tq, D]`` queries against ``[B, Hkv, L, D]`` keys with an additive ``mask``
    (``None``: ``causal``, ``Tq == L``, or every key; query head ``h`` reads KV head
    ``h // (H / Hkv)``); ``(out, lse [B, H, Tq])``.  CPU: the fused flash kernel (it
    broadcasts the KV heads itself); elsewhere the same maths."""
    if q4.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q4, k4, v4, 0.0, causal, attn_mask=mask, scale=scale
        )
    if mask is None and causal:
        tq, length = q4.shape[2], k4.shape[2]
        mask = torch.full((tq, length), -math.inf, dtype=q4.dtype, device=q4.device).triu(1)
    if k4.shape[1] != q4.shape[1]:
        group = q4.shape[1] // k4.shape[1]
        k4, v4 = k4.repeat_interleave(group, dim=1), v4.repeat_interleave(group, dim=1)
    s = torch.matmul(q4, k4.transpose(-1, -2)) * scale
    s = s if mask is None else s + mask
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.nan_to_num(neginf=0.0)[..., None])
    return torch.matmul(p, v4), lse


def batched_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None,
    cache: PagedKVCache,
    meta: AttentionMetadata,
    scale: float | None,
    group: Group,
    dcp_comm_backend: str = "ag_rs",
    v_head_dim: int | None = None,
    kv: BatchKV | None = None,
    layer: int = 0,
) -> torch.Tensor:
    """Every batched row of the step in one call: returns ``[num_rows, h, Dv]``, exact.

    ``q [R, h, D]`` this rank's query heads of the ``R`` rows (request by request), ``k``/``v``
    ``[R, Hkv, ·]`` their new K/V (``v=None``: MLA's latent cache, values are the first
    ``v_head_dim`` columns of the keys).  The new K/V is stored through ``meta``'s slots
    first and copied with the keys ``meta`` names into ``layer``'s rows of ``kv`` (``None``:
    a copy for this call only); each row then attends this rank's keys it may see; under DCP
    (``group.size > 1``) the query heads are all-gathered and the per-rank ``(out, lse)``
    combined.

    More than eight parameters: the attention inputs, the cache and the step's metadata, the
    DCP group and its combine, MLA's value width, and the batch's kept keys."""
    if meta.write_rows is not None:  # the rows this rank stores
        k = k.index_select(0, meta.write_rows)
        v = None if v is None else v.index_select(0, meta.write_rows)
    else:  # one copy of the new rows (views of the projection) for the cache and the kept rows
        k, v = k.contiguous(), None if v is None else v.contiguous()
    cache.store(k, v, meta.write_slots)
    k4, values = (BatchKV(1) if kv is None else kv).refresh(layer, cache, meta, (k, v))
    b, hkv, d = meta.num_reqs, k4.shape[1], k4.shape[3]
    v4 = k4 if values is None else values
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    dcp, qlen = group.size, meta.max_query_len
    dv = v_head_dim if values is None and v_head_dim is not None else v4.shape[-1]
    if dcp > 1:
        q = group.all_gather(q, dim=1)  # [R, dcp*h, D]: rank r's heads are block r
    rows, heads = q.shape[0], q.shape[1]
    g = heads // (hkv * dcp)
    regroup = dcp > 1 and hkv > 1  # (rank, kv head, g) <-> (kv head, rank, g)
    if regroup:  # a KV head's query heads adjacent
        q = q.view(rows, dcp, hkv, g, d).transpose(1, 2).reshape(rows, heads, d)
    if qlen == 1:  # one row per request (decode): a KV head's query heads as its rows
        out, lse = _attend(q.view(b, hkv, -1, d), k4, v4, meta.mask, meta.causal, scale)
        out, lse = out[..., :dv].reshape(b, heads, dv), lse.reshape(b, heads)
    elif meta.blocks is not None:  # the (row block, key block) pairs in one call, then merged
        qp, kp, vp = gather_pairs(q, k4, v4, meta.blocks)
        out, lse = _attend(qp, kp, vp, meta.blocks.mask, False, scale)
        out, lse = merge_pairs(out[..., :dv], lse, meta.blocks)
    else:
        if meta.query_index is not None:  # a request's rows side by side, padded to the longest
            q = q.new_zeros(b * qlen, heads, d).index_copy_(0, meta.query_index, q)
        q4 = q.view(b, qlen, heads, d).transpose(1, 2)
        out, lse = _attend(q4, k4, v4, meta.mask, meta.causal, scale)
        out = out[..., :dv].transpose(1, 2).reshape(b * qlen, heads, dv)
        lse = lse.transpose(1, 2).reshape(b * qlen, heads)
        if meta.query_index is not None:
            out = out.index_select(0, meta.query_index)
            lse = lse.index_select(0, meta.query_index)
    if dcp == 1:
        return out
    if regroup:  # back to (rank, kv head, g)
        out = out.view(rows, hkv, dcp, g, dv).transpose(1, 2).reshape(rows, heads, dv)
        lse = lse.view(rows, hkv, dcp, g).transpose(1, 2).reshape(rows, heads)
    lse = lse.masked_fill(~meta.has_key, -math.inf)  # the kernel's LSE of no key is 0
    return dcp_combine(out.contiguous(), lse.to(out.dtype), group, dcp_comm_backend)
