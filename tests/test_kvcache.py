"""cpbook.kv.layout and cpbook.kv.manager: vLLM's slot mapping, the paged store, the allocator."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cpbook.core.launch import run
from cpbook.demos import demo_kwargs
from cpbook.demos.ch02_kvcache import kvcache_rank
from cpbook.kv.layout import (
    PAD_SLOT_ID,
    DCPShard,
    block_fill,
    local_positions,
    local_seq_len,
    num_virtual_blocks,
    slot_mapping,
    token_owner,
)
from cpbook.kv.paged import PagedKVCache
from cpbook.kv.transfer import transfer_plan

PROPERTY = settings(max_examples=500, deadline=None)


@st.composite
def layouts(draw, max_len: int = 300):
    """(dcp, interleave, block_size, seq_len, dcp_rank) with interleave | block_size."""
    block_size = draw(st.sampled_from([1, 2, 4, 8, 16, 32]))
    interleave = draw(st.sampled_from([d for d in (1, 2, 4, 8, 16, 32) if block_size % d == 0]))
    dcp = draw(st.integers(1, 8))
    return dcp, interleave, block_size, draw(st.integers(0, max_len)), draw(st.integers(0, dcp - 1))


def _table(seq_len: int, block_size: int, dcp: int, seed: int) -> torch.Tensor:
    n = num_virtual_blocks(seq_len, block_size, dcp)
    return torch.randperm(2 * n + 3, generator=torch.Generator().manual_seed(seed))[:n]


# -- the examples the book quotes ---------------------------------------------------------
def test_vllm_hand_example():
    """tests/v1/worker/test_block_table_slot_mapping.py: dcp 2, rank 1, blocks [5, 6], B 16."""
    slots = slot_mapping(torch.arange(64), [5, 6], block_size=16, dcp=2, dcp_rank=1, interleave=1)
    assert slots[[1, 3, 5, 33]].tolist() == [80, 81, 82, 96]
    assert (slots[0::2] == PAD_SLOT_ID).all()


def mrv2_slot_mappings(positions, block_table, block_size, cp_size, cp_rank, cp_interleave):
    """The arithmetic of ``_compute_slot_mappings_kernel`` (Model Runner V2,
    ``vllm/v1/worker/gpu/block_table.py``, v0.34.0 and unchanged from v0.33.0), line for line in
    torch, for one real request and one DCP-sharded KV-cache group with slot mapping enabled."""
    positions, block_table = torch.as_tensor(positions), torch.as_tensor(block_table)
    kv_block_size = block_size
    if cp_size == 1:
        local_positions, is_local = positions, torch.ones_like(positions, dtype=torch.bool)
    else:
        virtual_block_size = kv_block_size * cp_size
        virtual_block_indices = positions // virtual_block_size
        virtual_block_offsets = positions % virtual_block_size
        is_local = virtual_block_offsets // cp_interleave % cp_size == cp_rank
        rounds = virtual_block_offsets // (cp_interleave * cp_size)
        remainder = virtual_block_offsets % cp_interleave
        local_offsets = rounds * cp_interleave + remainder
        local_positions = virtual_block_indices * kv_block_size + local_offsets
    block_indices = local_positions // kv_block_size
    block_offsets = local_positions % kv_block_size
    block_numbers = torch.where(
        is_local, block_table[block_indices.clamp(max=len(block_table) - 1)], 0
    )
    slot_ids = block_numbers * kv_block_size + block_offsets
    return torch.where(is_local, slot_ids, PAD_SLOT_ID)


@PROPERTY
@given(layouts(), st.integers(0, 2**16))
def test_slot_mapping_is_model_runner_v2s_kernel(layout, seed):
    dcp, interleave, block_size, seq_len, rank = layout
    table = _table(seq_len, block_size, dcp, seed)
    p = torch.arange(seq_len)
    want = mrv2_slot_mappings(p, table, block_size, dcp, rank, interleave)
    assert torch.equal(slot_mapping(p, table, block_size, dcp, rank, interleave), want)


def test_article_table_and_decode_tokens():
    owners = token_owner(torch.arange(20), dcp=4, interleave=4)
    assert owners.tolist() == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4 + [0] * 4
    assert token_owner([20, 27], 4, 4).tolist() == [1, 2]
    # D20 sits at offset 4 of its block on rank 1: slot 16*b + 4, never 384 with block size 16.
    for b in range(64):
        assert slot_mapping([20], [b], 16, 4, 1, 4).item() == 16 * b + 4 != 384


def test_article_memory_and_transfer_numbers():
    assert [local_seq_len(8192, 4, r, 1) for r in range(4)] == [2048] * 4
    p = transfer_plan(16, 16, 4, 1)
    assert p.fill_ratios == [[0.25]] * 4 and p.amplification == 4.0 and p.waste == 0.75
    q = transfer_plan(16, 16, 4, 16)
    assert q.blocks_sent == [[0], [], [], []] and q.amplification == 1.0 and q.waste == 0.0


@given(layouts(max_len=2000))
@PROPERTY
def test_interleave_equal_block_size_leaves_at_most_one_partial_block(layout):
    dcp, _, block_size, seq_len, _ = layout
    fill = transfer_plan(seq_len, block_size, dcp, block_size).fill
    assert int(((fill > 0) & (fill < block_size)).sum()) <= 1
    assert (
        transfer_plan(seq_len, block_size, dcp, block_size).bytes_sent
        <= transfer_plan(seq_len, block_size, dcp, 1).bytes_sent
    )


# -- properties of the layout -----------------------------------------------------------------
@given(layouts())
@PROPERTY
def test_every_token_owned_by_exactly_one_rank(layout):
    dcp, inter, bs, n, _ = layout
    pos, table = torch.arange(n), _table(n, bs, dcp, n)
    slots = torch.stack([slot_mapping(pos, table, bs, dcp, r, inter) for r in range(dcp)])
    assert ((slots != PAD_SLOT_ID).sum(0) == 1).all()
    assert torch.equal((slots != PAD_SLOT_ID).long().argmax(0), token_owner(pos, dcp, inter))


@given(layouts(max_len=2000), st.lists(st.integers(0, 10**6), min_size=1, max_size=40))
@PROPERTY
def test_token_owner_is_the_rank_whose_slot_is_not_pad(layout, raw):
    """``token_owner`` and ``slot_mapping`` compute ownership separately: on any positions
    (unsorted, repeated, decode tokens far into the table) rank ``r``'s slot is not -1 exactly
    where ``token_owner == r``, and the owner's slot lies in the position's block."""
    dcp, inter, bs, n, _ = layout
    n = max(n, 1)
    pos = torch.tensor([p % n for p in raw])
    table = _table(n, bs, dcp, 4)
    owner = token_owner(pos, dcp, inter)
    slots = torch.stack([slot_mapping(pos, table, bs, dcp, r, inter) for r in range(dcp)])
    assert torch.equal(slots != PAD_SLOT_ID, owner[None, :] == torch.arange(dcp)[:, None])
    mine = slots.gather(0, owner[None, :])[0]
    vb = bs * dcp
    assert torch.equal(torch.div(mine, bs, rounding_mode="floor"), table[pos // vb])


@given(layouts())
@PROPERTY
def test_local_lengths_sum_and_match_vllm(layout):
    dcp, inter, bs, n, _ = layout
    table = _table(n, bs, dcp, 1)
    counts = [
        int((slot_mapping(torch.arange(n), table, bs, dcp, r, inter) != PAD_SLOT_ID).sum())
        for r in range(dcp)
    ]
    assert counts == [local_seq_len(n, dcp, r, inter) for r in range(dcp)]
    assert sum(counts) == n and max(counts) - min(counts) <= inter
    lens = torch.arange(n + 1)
    assert torch.equal(sum(local_seq_len(lens, dcp, r, inter) for r in range(dcp)), lens)
    assert torch.equal(block_fill(n, bs, dcp, inter).sum(1), torch.tensor(counts, dtype=torch.long))


@given(layouts())
@PROPERTY
def test_slots_unique_dense_and_inside_request_blocks(layout):
    dcp, inter, bs, n, r = layout
    table = _table(n, bs, dcp, 2)
    slots = slot_mapping(torch.arange(n), table, bs, dcp, r, inter)
    mine = slots[slots != PAD_SLOT_ID]
    assert mine.unique().numel() == mine.numel()
    assert torch.isin(torch.div(mine, bs, rounding_mode="floor"), table).all()
    cache = PagedKVCache(int(table.max()) + 1 if n else 1, bs, 1, 1, shard=DCPShard(dcp, r, inter))
    assert torch.equal(
        mine, cache.local_slots(table, n)
    )  # position order == slot order, blocks filled densely
    assert torch.equal(
        torch.nonzero(slots != PAD_SLOT_ID).flatten(), local_positions(n, dcp, r, inter)
    )


@given(layouts(max_len=200), st.booleans())
@PROPERTY
def test_write_then_read_reconstructs_exactly(layout, mla):
    dcp, inter, bs, n, _ = layout
    gen = torch.Generator().manual_seed(n)
    heads, dim = (1, 5) if mla else (2, 3)
    k = torch.randn(n, heads, dim, generator=gen, dtype=torch.float64)
    v = None if mla else torch.randn(n, heads, 4, generator=gen, dtype=torch.float64)
    table = _table(n, bs, dcp, 3)
    num_blocks = int(table.max()) + 1 if n else 1
    got_k, got_v, seen = (
        torch.full_like(k, float("nan")),
        None if mla else torch.full_like(v, float("nan")),
        [],
    )
    for r in range(dcp):
        cache = PagedKVCache(
            num_blocks, bs, heads, dim, 0 if mla else 4, shard=DCPShard(dcp, r, inter)
        )
        assert cache.write(k, v, cache.slot_mapping(torch.arange(n), table)) == local_seq_len(
            n, dcp, r, inter
        )
        lk, lv, pos = cache.read(table, n)
        got_k[pos] = lk
        if not mla:
            got_v[pos] = lv
        else:
            assert lv is None
        seen.append(pos)
    assert torch.equal(torch.cat(seen).sort().values, torch.arange(n))
    assert torch.equal(got_k, k) and (mla or torch.equal(got_v, v))


# -- bad input --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "call, rule",
    [
        (lambda: slot_mapping([0], [0], 16, 4, 0, 3), "block-size-divisible-by-interleave"),
        (lambda: slot_mapping([0], [0], 16, 4, 0, 32), "interleave-le-block-size"),
        (lambda: slot_mapping([64], [0], 16, 4, 0, 1), "positions-within-block-table"),
        (lambda: slot_mapping([-1], [0], 16, 4, 0, 1), "positions-non-negative"),
        (lambda: slot_mapping([0], [0], 16, 4, 4, 1), "dcp-rank-in-range"),
        (lambda: slot_mapping([0.5], [0], 16, 4, 0, 1), "integer-positions"),
        (lambda: local_seq_len(-1, 4, 0, 1), "seq-len-non-negative"),
        (lambda: local_seq_len(10, 4, -1, 1), "dcp-rank-in-range"),
        (lambda: token_owner([1], 0, 1), "positive-sizes"),
        (
            lambda: PagedKVCache(2, 16, 1, 4).write(
                torch.zeros(1, 1, 4), torch.zeros(1, 1, 4), torch.tensor([32])
            ),
            "slot-in-cache",
        ),
        (
            lambda: PagedKVCache(2, 16, 1, 4, 0).write(
                torch.zeros(1, 1, 4), torch.zeros(1, 1, 4), torch.tensor([0])
            ),
            "kv-shape",
        ),
        (lambda: PagedKVCache(2, 16, 1, 4).read([0], 5), "read-written-slots"),
    ],
)
def test_bad_input_names_the_rule(call, rule):
    with pytest.raises(ValueError, match=rf"^\[{rule}\] requires"):
        call()


# -- distributed: the same per-rank function inline and on gloo ---------------------------------
@pytest.mark.parametrize(
    "backend, world, kwargs",
    [
        ("inline", 4, {"seq_len": 203, "cp_kv_cache_interleave_size": 4}),
        ("inline", 3, {"seq_len": 2, "cp_kv_cache_interleave_size": 1}),  # one rank stores nothing
        pytest.param(
            "torchrun",
            4,
            {"seq_len": 203, "cp_kv_cache_interleave_size": 16},
            marks=pytest.mark.torchrun,
        ),
    ],
)
def test_reconstruction_on_ranks(backend, world, kwargs):
    res = run(
        kvcache_rank,
        world,
        backend,
        demo_kwargs(kvcache_rank, kwargs),
        dist_backend="gloo",
        report=False,
    )
    n = kwargs["seq_len"]
    assert all(r["each_once"] and r["max_abs_err"] == 0.0 for r in res)
    assert sum(r["tokens"] for r in res) == n
    assert all(
        abs(r["tokens"] - n / world) <= 16 for r in res
    )  # 1/N of the tokens, within one block
    assert res.traces[0].count("all_gather") == 6
    assert all(r["comm"] == r["expected"] for r in res)
