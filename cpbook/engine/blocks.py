"""Attention in blocks: a long step's rows and keys cut into blocks, merged by their LSE.

One attention call over requests padded to the longest one does work for every padded row and
key: batch 8 prompts of 5 to 512 tokens cost eight 512 × 512 squares (the CPU kernel's
causal mode does not skip the blocks above the diagonal either, since it walks the keys 512 at
a time). Here a request's rows are cut into blocks of :data:`ATTN_BLOCK` rows and its keys into
blocks of :data:`ATTN_BLOCK` keys; each (row block, key block) pair that some row of the block
may see is one batch entry of a single kernel call (with its own mask), and the pairs of one
row block are merged exactly with their log-sum-exp, chapter 3's merge written as a scatter:

    m = max_p lse_p,   w_p = exp(lse_p - m),   out = Σ_p w_p · out_p / Σ_p w_p,
    lse = m + log Σ_p w_p

vLLM v0.34.0's CPU backend needs none of this: its own kernel takes every request's rows by
``query_start_loc`` and ``seq_lens`` and reads the paged cache in place, so no request pays
for another's length (``ops.cpu_attention_with_kv_cache`` in
``vllm/v1/attention/backends/cpu_attn.py``).  With a stock kernel, the pairs come closest:
only the blocks a row can see are computed.  :func:`block_pairs` builds the pairs once per
step on the host; :func:`gather_pairs` and :func:`merge_pairs` run in every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = [
    "ATTN_BLOCK",
    "BLOCKS_PAY_OFF",
    "AttentionBlocks",
    "block_pairs",
    "gather_pairs",
    "merge_pairs",
]

#: rows and keys per block; a step with a request of more rows attends in blocks (it divides
#: :data:`cpbook.engine.attention.KV_CAPACITY_STEP`, so the kept keys cut into whole blocks)
ATTN_BLOCK = 128


@dataclass(frozen=True)
class AttentionBlocks:
    """One step's pairs, on the device: ``num_blocks`` row blocks (request by request),
    ``pair_block``/``pair_req``/``pair_key_block`` ``[P]`` (each pair's row block, request and
    key block), ``mask`` ``[P, 1, B, B]`` (additive: row ``a`` of the pair's row block sees key
    ``c`` of its key block), ``has_key`` ``[P, 1, B]`` (the row sees a key of the pair),
    ``select`` ``[num_blocks, P]`` (1 where the pair belongs to the row block: the merge's sums
    as one matrix product) and ``row_slot`` ``[num_rows]`` (each row's place among the
    ``num_blocks * B`` block rows)."""

    size: int
    num_blocks: int
    pair_block: torch.Tensor
    pair_req: torch.Tensor
    pair_key_block: torch.Tensor
    mask: torch.Tensor
    has_key: torch.Tensor
    select: torch.Tensor
    row_slot: torch.Tensor


#: blocks pay off when their pairs hold at most this share of the padded call's scores (they
#: copy each pair's rows and keys, and merge)
BLOCKS_PAY_OFF = 0.5


def block_pairs(
    rows: np.ndarray,
    sees: np.ndarray,
    dtype: torch.dtype,
    device: torch.device | str,
    size: int,
) -> AttentionBlocks | None:
    """The pairs of requests with ``rows[r]`` rows this step, row ``j`` of request ``r`` seeing
    its first ``sees[r, j]`` local keys (non-decreasing in ``j``); blocks of ``size`` rows and
    keys.  A row block with no key to see still gets one (masked) pair.
    ``None`` when the pairs' scores exceed :data:`BLOCKS_PAY_OFF` of the padded call's
    (``len(rows) * max(rows) * max(sees)``: requests of about one length)."""
    ar = np.arange(size)
    nqb = -(-rows // size)
    first = np.cumsum(nqb) - nqb  # each request's first row block
    g_req = np.repeat(np.arange(len(rows)), nqb)
    g_i = np.arange(int(nqb.sum())) - first[g_req]
    last = np.minimum((g_i + 1) * size, rows[g_req]) - 1
    nkb = np.maximum(-(-sees[g_req, last] // size), 1)  # key blocks the block's last row needs
    if nkb.sum() * size * size > BLOCKS_PAY_OFF * len(rows) * rows.max() * max(sees.max(), 1):
        return None
    p_g = np.repeat(np.arange(len(g_req)), nkb)
    p_kb = np.arange(int(nkb.sum())) - np.repeat(np.cumsum(nkb) - nkb, nkb)
    p_req = g_req[p_g]
    row = np.minimum(g_i[p_g][:, None] * size + ar, rows[p_req][:, None] - 1)  # pad: last row
    vis = (p_kb[:, None] * size + ar)[:, None, :] < sees[p_req[:, None], row][:, :, None]
    req = np.repeat(np.arange(len(rows)), rows)
    qi = np.arange(int(rows.sum())) - np.repeat(np.cumsum(rows) - rows, rows)
    dev, t = torch.device(device), torch.from_numpy
    return AttentionBlocks(
        size,
        len(g_req),
        t(p_g).to(dev),
        t(p_req).to(dev),
        t(p_kb).to(dev),
        t(np.where(vis, 0.0, -np.inf)[:, None]).to(dev, dtype),
        t(vis.any(-1)[:, None]).to(dev),
        t(np.equal.outer(np.arange(len(g_req)), p_g)).to(dev, dtype),
        t((first[req] + qi // size) * size + qi % size).to(dev),
    )


def gather_pairs(
    q: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, blocks: AttentionBlocks
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each pair's rows ``[P, H, B, D]`` of ``q [rows, H, D]`` (zero rows past a request's end)
    and keys and values ``[P, Hkv, B, ·]`` of the kept ``k4``/``v4 [reqs, Hkv, width, ·]``
    (``width`` a multiple of ``B``)."""
    s, g = blocks.size, blocks.num_blocks
    qb = q.new_zeros(g * s, *q.shape[1:]).index_copy_(0, blocks.row_slot, q)
    qp = qb.view(g, s, *q.shape[1:])[blocks.pair_block].transpose(1, 2)
    ix = (blocks.pair_req, slice(None), blocks.pair_key_block)
    kp = k4.unflatten(2, (-1, s))[ix]
    return qp, kp, kp if v4 is k4 else v4.unflatten(2, (-1, s))[ix]


def merge_pairs(
    out: torch.Tensor, lse: torch.Tensor, blocks: AttentionBlocks
) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairs' ``out [P, H, B, Dv]`` and ``lse [P, H, B]`` merged per row block and put back
    in row order: ``[rows, H, Dv]`` and ``[rows, H]``, exact.  A row that sees no key of any
    pair gets output 0 and LSE ``-inf``."""
    g, pg = blocks.num_blocks, blocks.pair_block
    lse = lse.masked_fill(~blocks.has_key, -torch.inf)  # the kernel's LSE of no key is 0
    at = pg.view(-1, *[1] * (lse.dim() - 1)).expand_as(lse)
    m = lse.new_full((g, *lse.shape[1:]), -torch.inf).scatter_reduce_(0, at, lse, "amax")
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(lse - m[pg])
    den = (blocks.select @ w.flatten(1)).view_as(m)
    num = (blocks.select @ (out * w[..., None]).flatten(1)).view(g, *out.shape[1:])
    merged = num / den.masked_fill(den == 0, 1.0)[..., None]
    total = torch.log(den) + m
    h, dv = out.shape[1], out.shape[3]
    merged = merged.transpose(1, 2).reshape(-1, h, dv).index_select(0, blocks.row_slot)
    return merged, total.transpose(1, 2).reshape(-1, h).index_select(0, blocks.row_slot)
