"""cpbook.engine.attention: one step's metadata and one batched call, exact vs dense attention."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cpbook.core.attention import dense_attention
from cpbook.core.launch import run
from cpbook.engine import attention, blocks
from cpbook.engine.attention import (
    batch_slot_mapping,
    batched_attention,
    build_attention_metadata,
    padded_block_tables,
)
from cpbook.kv.layout import PAD_SLOT_ID, DCPShard, num_virtual_blocks, slot_mapping
from cpbook.kv.paged import PagedKVCache

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BLOCK = 4


@settings(max_examples=30, deadline=None)
@given(
    dcp=st.sampled_from([1, 2, 4]),
    interleave=st.sampled_from([1, 2, 4]),
    lens=st.lists(st.integers(1, 40), min_size=1, max_size=4),
    data=st.data(),
)
def test_batch_slot_mapping_is_the_per_request_slot_mapping(dcp, interleave, lens, data):
    rank = data.draw(st.integers(0, dcp - 1))
    shard = DCPShard(dcp, rank, interleave)
    tables, at = [], 0
    for n in lens:
        nb = num_virtual_blocks(n, BLOCK, dcp)
        tables.append(list(range(at, at + nb))[::-1])  # any ids, not in order
        at += nb
    req = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    pos = torch.cat([torch.arange(n) for n in lens])
    got = batch_slot_mapping(pos, req, padded_block_tables(tables), BLOCK, shard)
    want = torch.cat(
        [
            slot_mapping(torch.arange(n), t, BLOCK, dcp, rank, interleave)
            for n, t in zip(lens, tables)
        ]
    )
    assert got.tolist() == want.tolist()


def _problem(reqs, num_q_heads, num_kv_heads, dim, seed):
    """Per request ``(start, rows)``: whole K/V ``[start + rows, Hkv, D]`` and the rows' q."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for start, rows in reqs:
        n = start + rows
        k = torch.randn(n, num_kv_heads, dim, generator=gen, dtype=torch.float64)
        v = torch.randn(n, num_kv_heads, dim, generator=gen, dtype=torch.float64)
        q = torch.randn(rows, num_q_heads, dim, generator=gen, dtype=torch.float64)
        out.append((start, rows, k, v, q))
    return out


def batched_rank(ctx, *, reqs, num_q_heads, num_kv_heads, mla, interleave, seed):
    """One rank of a DCP group (the world): cache the contexts, then one batched call."""
    dim = 8
    prob = _problem(reqs, num_q_heads, num_kv_heads, dim, seed)
    shard = DCPShard(ctx.world.size, ctx.rank, interleave)
    cache = PagedKVCache(64, BLOCK, num_kv_heads, dim, 0 if mla else None, shard=shard)
    tables, at = [], 0
    for start, rows, k, v, _ in prob:
        nb = num_virtual_blocks(start + rows, BLOCK, shard.dcp)
        tables.append(tuple(range(at, at + nb)))
        at += nb
        slots = cache.slot_mapping(torch.arange(start), tables[-1])
        cache.write(k[:start], None if mla else v[:start], slots)
    meta = build_attention_metadata(
        [p[0] for p in prob],
        [p[1] for p in prob],
        tables,
        BLOCK,
        shard,
        torch.float64,
        "cpu",
    )
    cache.mark_written(meta.slot_mapping[meta.slot_mapping != PAD_SLOT_ID])
    cache.check_written(meta.read_slots)
    new_k = torch.cat([k[s:] for s, _, k, _, _ in prob])
    new_v = None if mla else torch.cat([v[s:] for s, _, _, v, _ in prob])
    q = torch.cat([p[4] for p in prob])
    out = batched_attention(q, new_k, new_v, cache, meta, None, ctx.world, "ag_rs", dim // 2)
    err, at = 0.0, 0
    for start, rows, k, v, qi in prob:
        vv = k[..., : dim // 2] if mla else v
        ref, _ = dense_attention(qi, k, vv, causal=True, q_offset=start)
        err = max(err, (out[at : at + rows] - ref).abs().max().item())
        at += rows
    return err


@settings(max_examples=15, deadline=None)
@given(
    dcp=st.sampled_from([1, 2, 4]),
    interleave=st.sampled_from([1, 2]),
    mla=st.booleans(),
    reqs=st.lists(st.tuples(st.integers(0, 20), st.integers(1, 6)), min_size=1, max_size=4),
)
def test_one_batched_call_equals_dense_causal_attention(dcp, interleave, mla, reqs):
    """Decode (one row), verification (k + 1 rows) and prompt chunks after a cached context, in
    one call per rank; uneven and empty shards; GQA heads or an MLA-like latent (values = the
    keys' first half); the DCP combine merges the ranks exactly."""
    assert _worst_error(dcp, interleave, mla, reqs, seed=len(reqs)) <= 1e-10


def _worst_error(dcp: int, interleave: int, mla: bool, reqs: list, seed: int) -> float:
    """The largest error of :func:`batched_rank` over the ``dcp`` ranks (4 query heads)."""
    res = run(
        batched_rank,
        dcp,
        fn_kwargs=dict(
            reqs=reqs,
            num_q_heads=4,
            num_kv_heads=1 if mla else 2,
            mla=mla,
            interleave=interleave,
            seed=seed,
        ),
        report=False,
    )
    return max(res)


@settings(max_examples=15, deadline=None)
@given(
    dcp=st.sampled_from([1, 2]),
    mla=st.booleans(),
    reqs=st.lists(st.tuples(st.integers(0, 12), st.integers(1, 14)), min_size=1, max_size=4),
)
def test_attention_in_blocks_equals_dense_causal_attention(dcp, mla, reqs):
    """With blocks of 4 rows and keys (used whatever they save), a step whose requests have up
    to 14 rows (after up to 12 cached keys) attends in (row block, key block) pairs merged by
    LSE: exact, on every rank."""
    with (
        mock.patch.object(attention, "ATTN_BLOCK", 4),
        mock.patch.object(blocks, "BLOCKS_PAY_OFF", 9),
    ):
        assert _worst_error(dcp, 1, mla, reqs, seed=len(reqs) + 7) <= 1e-10
