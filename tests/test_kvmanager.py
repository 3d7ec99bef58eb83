"""cpbook.kv.manager: the virtual-block allocator, prefix caching, running out of blocks."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpbook.core.config import ParallelConfig
from cpbook.kv.layout import local_seq_len, num_virtual_blocks
from cpbook.kv.manager import AllocationError, KVCacheManager
from tests.test_kvcache import layouts

PROPERTY = settings(max_examples=500, deadline=None)


# -- the allocator ----------------------------------------------------------------------------
ops = st.lists(
    st.tuples(
        st.sampled_from(["alloc", "append", "free"]),
        st.integers(0, 5),
        st.integers(0, 90),
        st.integers(0, 2),
    ),
    max_size=25,
)


@given(layouts(max_len=0), st.booleans(), ops)
@PROPERTY
def test_allocator_never_double_assigns(layout, caching, script):
    dcp, inter, bs, _, _ = layout
    m = KVCacheManager(24, bs, dcp, inter, enable_prefix_caching=caching)
    vb = m.virtual_block_size
    for op, rid, n, prefix in script:
        name = f"r{rid}"
        try:
            if op == "alloc" and name not in m.requests:
                m.allocate(name, n, [prefix] * n)  # three prompt families share prefixes
            elif op == "append" and name in m.requests:
                m.append(name, n % 7 + 1, [prefix] * (n % 7 + 1))
            elif op == "free" and name in m.requests:
                m.free(name)
        except AllocationError as e:
            assert e.rule == "enough-free-blocks"
        owners: dict[int, list] = {}
        for req in m.requests.values():
            assert len(req.blocks) == num_virtual_blocks(req.num_tokens, bs, dcp)
            for b, blk in enumerate(req.blocks):
                owners.setdefault(blk, []).append(req.token_ids[b * vb : (b + 1) * vb])
        for blk, contents in owners.items():
            assert m.ref_cnt[blk] == len(contents) and blk not in m.free_queue
            if len(contents) > 1:  # shared only through the prefix cache: full, identical blocks
                assert caching and all(c == contents[0] and len(c) == vb for c in contents)
        assert len(owners) + m.num_free_blocks == m.num_blocks
        # the prefix cache and the blocks' hashes name each other: one block per hash
        assert {h: b for b, h in enumerate(m.block_hash) if h is not None} == m.cached


def test_prefix_hits_come_in_whole_virtual_blocks():
    m = KVCacheManager.from_config(
        ParallelConfig(
            tensor_parallel_size=4,
            decode_context_parallel_size=4,
            cp_kv_cache_interleave_size=4,
            block_size=16,
            use_mla=True,
            num_q_heads=16,
            num_kv_heads=1,
        ),
        num_blocks=32,
        enable_prefix_caching=True,
    )
    system = list(range(1000, 1150))  # 150 shared tokens: two full 64-token virtual blocks + 22
    assert m.allocate("a", 200, system + [1] * 50).num_tokens == 0
    hit = m.allocate("b", 180, system + [2] * 30)
    assert (hit.num_blocks, hit.num_tokens) == (2, 128)
    assert m.block_table("b")[:2].tolist() == m.block_table("a")[:2].tolist()
    assert m.allocate("c", 128, system[:128]).num_blocks == 1  # the last token is always recomputed
    m.free("a")
    assert m.allocate("d", 200, system + [1] * 50).num_blocks == 3  # a's blocks stayed cached
    assert m.stats == {"requests": 4, "query_tokens": 708, "hit_tokens": 384, "hit_blocks": 6}


def test_allocator_memory_per_rank():
    m = KVCacheManager(256, 16, 4, 1)
    m.allocate("long", 8192)
    assert len(m.block_table("long")) == 128
    assert [u["tokens"] for u in m.rank_usage()] == [2048] * 4
    assert all(u["blocks"] == 128 and u["fill"] == 1.0 for u in m.rank_usage())
    assert m.append("long", 1) == [128] and m.rank_usage()[0]["tokens"] == 2049
    with pytest.raises(AllocationError, match=r"\[enough-free-blocks\]"):
        m.allocate("too-long", 128 * 64 + 1)
    assert m.num_free_blocks == 127


def test_unknown_request_names_the_rule():
    with pytest.raises(ValueError, match=r"^\[known-request-id\] requires"):
        KVCacheManager(4, 16, 2).free("nobody")


def test_cached_prefix_previews_the_hit_and_uncache_forgets_it():
    m = KVCacheManager(8, 4, 2, enable_prefix_caching=True)  # virtual blocks of 8 tokens
    prompt = list(range(20))
    m.allocate("a", 20, prompt)
    assert m.cached_prefix(prompt) == m.block_table("a").tolist()[:2]  # 2 full blocks in 19
    free = m.num_free_blocks
    assert m.cached_prefix(prompt) and m.num_free_blocks == free  # a preview changes nothing
    m.free("a")
    m.uncache(m.cached_prefix(prompt)[1:])
    assert len(m.cached_prefix(prompt)) == 1
    assert m.allocate("b", 20, prompt).num_blocks == 1


# -- rollback (a speculative step's rejected rows) --------------------------------------------
def _blocks_per_rank(num_tokens: int, bs: int, dcp: int, inter: int) -> list[int]:
    """Physical blocks each DCP rank needs for a request's first ``num_tokens`` tokens: its
    local tokens (vLLM's ``get_dcp_local_seq_lens``) in blocks of ``block_size`` slots."""
    return [-(-local_seq_len(num_tokens, dcp, r, inter) // bs) for r in range(dcp)]


@given(
    layouts(max_len=0),
    st.booleans(),
    st.integers(1, 120),
    st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), min_size=1, max_size=6),
)
@PROPERTY
def test_rollback_frees_exactly_the_blocks_no_rank_needs(layout, caching, prompt_len, steps):
    """Grow a request by ``k`` draft tokens, then roll back ``r`` of them: afterwards every DCP
    rank keeps exactly the physical blocks its local tokens need, the shared block table is as
    long as the neediest rank's, every other id is free again (no leak), and no prefix-cache
    entry names a block that is no longer full of the request's tokens."""
    dcp, inter, bs, _, _ = layout
    m = KVCacheManager(64, bs, dcp, inter, enable_prefix_caching=caching)
    vb = m.virtual_block_size
    tokens = [t % 3 for t in range(prompt_len)]
    if num_virtual_blocks(prompt_len, bs, dcp) > m.num_blocks:
        return
    m.allocate("a", prompt_len, tokens)
    for grow, back in steps:
        n = m.num_tokens("a")
        try:
            m.append("a", grow + 1, [(n + i) % 3 for i in range(grow + 1)])
        except AllocationError:
            continue
        before = m.block_table("a").tolist()
        keep = max(m.num_tokens("a") - back, 0)
        released = m.truncate("a", keep)
        need = _blocks_per_rank(keep, bs, dcp, inter)
        table = m.block_table("a").tolist()
        assert len(table) == max(need)
        assert table == before[: len(table)] and released == before[len(table) :][::-1]
        assert [u["used_blocks"] for u in m.rank_usage()] == need
        assert [u["tokens"] for u in m.rank_usage()] == [
            local_seq_len(keep, dcp, r, inter) for r in range(dcp)
        ]
        assert m.num_free_blocks == m.num_blocks - len(table)
        assert all(b in m.free_queue for b in released)
        for b, blk in enumerate(table):
            if m.block_hash[blk] is not None:
                assert (b + 1) * vb <= keep
        assert all(v in table[: keep // vb] for v in m.cached.values())


def test_eviction_takes_the_freed_requests_tail_first():
    """vLLM frees a request's blocks in reverse order and evicts the least recently freed first
    (``single_type_kv_cache_manager.py`` ``free``, v0.34.0), so a new request that needs one id
    of a full cache evicts the freed request's last block and its prefix stays cached."""
    m = KVCacheManager(4, 4, 2, enable_prefix_caching=True)  # virtual blocks of 8 tokens
    prompt = list(range(32))
    m.allocate("a", 32, prompt)
    m.free("a")
    m.allocate("x", 8, [99] * 8)  # one id: a's tail block
    m.free("x")
    assert m.allocate("b", 32, prompt).num_blocks == 3  # a's first three blocks hit
