"""pcp / zigzag: partitions, exact causal work, exact PCP prefill inline and under torchrun."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cpbook.core.attention import dense_attention, rope
from cpbook.core.comm import comm_bytes
from cpbook.core.config import ParallelConfig
from cpbook.core.groups import RankGrid
from cpbook.core.launch import run
from cpbook.demos import demo_kwargs
from cpbook.demos.ch04_pcp import pcp_prefill_rank
from cpbook.pcp.prefill import (
    pcp_comm_bytes,
    pcp_local_attention,
    pcp_restore_bytes,
    pcp_shard,
)
from cpbook.pcp.zigzag import (
    PARTITIONS,
    PCPPartition,
    causal_pairs,
    causal_work,
    padded_len,
    pcp_partition,
    zigzag_partition,
)
from cpbook.timing import pcp_prefill_timing


# ------------------------------------------------------------------ the article's examples
def test_article_examples():
    chunks = [[t // 2 for t in toks[::2]] for toks in zigzag_partition(12, 3).rank_tokens]
    assert chunks == [[0, 5], [1, 4], [2, 3]]  # PCP=3: chunk pairs (0,5), (1,4), (2,3)
    p = zigzag_partition(8, 2)
    assert p.rank_tokens == [[0, 1, 6, 7], [2, 3, 4, 5]] and p.pad == 0
    assert zigzag_partition(10, 2).pad == 2 and padded_len(10, 2) == 12


def test_metadata_of_a_batch():
    part = zigzag_partition([8, 10], 2)
    m0, m1 = part.metadata(0), part.metadata(1)
    assert m0.positions.tolist() == [0, 1, 6, 7, 0, 1, 2, 9, 10, 11]
    assert m0.is_padding.tolist() == [False] * 8 + [True, True]
    assert m0.token_index.tolist() == [0, 1, 6, 7, 8, 9, 10, 17, -1, -1]
    assert m0.query_lens == [2, 2, 3, 1] and m1.query_lens == [2, 2, 3, 3]
    assert m0.num_computed_tokens == [0, 6, 0, 9] and m0.key_lens == [2, 8, 3, 10]
    assert m0.query_start_loc == [0, 2, 4, 7, 10] and m0.cu_seq_lens == [0, 8, 18]
    with pytest.raises(ValueError, match="single-request"):
        _ = part.pad


# ------------------------------------------------------------------ partition properties
lens_st = st.lists(st.integers(1, 96), min_size=1, max_size=3)


@settings(max_examples=600, deadline=None)
@given(lens=lens_st, pcp=st.integers(1, 8), partition=st.sampled_from(PARTITIONS))
def test_partition_properties(lens, pcp, partition):
    part = pcp_partition(lens, pcp, partition)
    offs = [0]
    for n in part.padded_lens:
        offs.append(offs[-1] + n)
    held = [t for toks in part.rank_tokens for t in toks]
    # every token (real or padding) is held exactly once, every rank holds as many rows
    assert sorted(held) == list(range(offs[-1]))
    assert {len(toks) for toks in part.rank_tokens} == {part.tokens_per_rank}
    # padding only at the end of each request, fewer than 2*pcp tokens of it
    for i, (n, pad) in enumerate(zip(part.seq_lens, part.pads)):
        assert 0 <= pad < 2 * pcp and (n + pad) % (2 * pcp) == 0
        pad_toks = sorted(
            t - offs[i] for t in held if offs[i] <= t < offs[i + 1] and t - offs[i] >= n
        )
        assert pad_toks == list(range(n, n + pad))
    # restore_index puts the rank-major gather back in (unpadded) sequence order
    gathered = torch.tensor(held)
    real = torch.cat([torch.arange(o, o + n) for o, n in zip(offs, part.seq_lens)])
    assert torch.equal(gathered[part.restore_index], real)
    # per-rank metadata agrees with the partition
    for r in range(pcp):
        m = part.metadata(r)
        assert m.num_tokens == part.tokens_per_rank == len(m.positions)
        assert int((~m.is_padding).sum()) == sum(m.query_lens)
        assert all(k == c + q for k, c, q in zip(m.key_lens, m.num_computed_tokens, m.query_lens))
        assert torch.equal(
            gathered[r * m.num_tokens + torch.nonzero(~m.is_padding)[:, 0]],
            real[m.token_index[~m.is_padding]],
        )
    # causal work: totals are the full triangle; zigzag balanced up to the padding rows
    work = part.work()
    assert sum(work) == sum(n * (n + 1) // 2 for n in lens)
    if partition == "zigzag":
        pad_rows = sum(
            causal_pairs(n, n + pad, n + pad) for n, pad in zip(part.seq_lens, part.pads)
        )
        assert max(work) - min(work) <= pad_rows
        if all(p == 0 for p in part.pads):
            assert max(work) == min(work)


@settings(max_examples=100, deadline=None)
@given(chunk=st.integers(1, 300), pcp=st.integers(1, 16))
def test_zigzag_work_closed_form(chunk, pcp):
    # rank r: chunk r and chunk 2P-1-r, each c rows: c²(2P-1) + c(c+1) pairs, for every r
    assert (
        causal_work(2 * pcp * chunk, pcp, "zigzag")
        == [chunk**2 * (2 * pcp - 1) + chunk * (chunk + 1)] * pcp
    )


@settings(max_examples=100, deadline=None)
@given(block=st.integers(1, 500), k=st.integers(1, 16))
def test_contiguous_imbalance_closed_form(block, k):
    # K contiguous blocks of b tokens: block i does i·b² + b(b+1)/2 pairs
    w = causal_work(2 * k * block, k, "contiguous")  # 2b tokens per rank
    b = 2 * block
    assert w == [i * b * b + b * (b + 1) // 2 for i in range(k)]
    assert w[-1] / w[0] == pytest.approx(1 + 2 * (k - 1) * b / (b + 1))  # -> 2K - 1
    assert max(w) / (sum(w) / k) == pytest.approx(((2 * k - 1) * b + 1) / (k * b + 1))  # -> 2 - 1/K


def test_bad_inputs():
    with pytest.raises(ValueError, match="pcp-seq-lens"):
        pcp_partition([8, 0], 2)
    with pytest.raises(ValueError, match="pcp-size"):
        pcp_partition(8, 0)
    with pytest.raises(ValueError, match="pcp-partition"):
        pcp_partition(8, 2, "ring")
    with pytest.raises(ValueError, match="pcp-rank"):
        pcp_partition(8, 2).metadata(2)
    with pytest.raises(ValueError, match="rope-shapes"):
        rope(torch.zeros(4, 2, 3), torch.arange(4))
    with pytest.raises(ValueError, match="pcp-local-rows"):
        m = pcp_partition(8, 2).metadata(0)
        pcp_local_attention(torch.zeros(3, 2, 4), torch.zeros(8, 2, 4), torch.zeros(8, 2, 4), m)
    assert PCPPartition((5,), 2).partition == "zigzag"


# ------------------------------------------------------------------ RoPE and local attention
def test_rope_depends_on_relative_position_only():
    g = torch.Generator().manual_seed(1)
    q, k = (
        torch.randn(1, 2, 8, generator=g, dtype=torch.float64),
        torch.randn(1, 2, 8, generator=g, dtype=torch.float64),
    )
    dot = [
        (rope(q, torch.tensor([3 + s])) * rope(k, torch.tensor([s]))).sum().item()
        for s in (0, 5, 1000)
    ]
    assert max(dot) - min(dot) < 1e-9  # query at s+3, key at s: the same score for every shift s
    assert (
        abs(
            (rope(q, torch.tensor([3])) * rope(k, torch.tensor([0]))).sum().item()
            - (rope(q, torch.tensor([4])) * rope(k, torch.tensor([0]))).sum().item()
        )
        > 1e-6
    )


@pytest.mark.parametrize("partition", PARTITIONS)
@pytest.mark.parametrize("lens,pcp", [((37, 64), 2), ((13,), 3), ((1, 9, 30), 4)])
def test_local_attention_matches_dense(partition, lens, pcp):
    """All ranks' attention to the full, ordered keys vs dense."""
    g = torch.Generator().manual_seed(2)
    n = sum(lens)
    q = torch.randn(n, 4, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(n, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
    part = pcp_partition(lens, pcp, partition)
    cu = part.metadata(0).cu_seq_lens
    ref = torch.cat(
        [dense_attention(q[a:b], k[a:b], v[a:b], causal=True)[0] for a, b in zip(cu, cu[1:])]
    )
    for r in range(pcp):
        m = part.metadata(r)
        ql = pcp_shard(q, m)
        out, lse = pcp_local_attention(ql, k, v, m)
        real = ~m.is_padding
        assert (out[real] - ref[m.token_index[real]]).abs().max() <= 1e-10
        assert torch.all(out[~real] == 0) and torch.all(lse[~real] == float("-inf"))


# ------------------------------------------------------------------ PCP prefill on ranks
def _check(res):
    for r in res:
        assert r["max_abs_err"] <= 1e-10 and r["restored"]
        assert r["comm"] == r["expected"] and r["restore_comm"] == r["restore_expected"]


@pytest.mark.parametrize("partition", PARTITIONS)
@pytest.mark.parametrize(
    "world,tp,lens",
    [(2, 1, (37, 64)), (3, 1, (50, 7, 1)), (4, 1, (1, 23)), (4, 2, (45, 16)), (8, 2, (31, 5))],
)
def test_pcp_prefill_inline(world, tp, lens, partition):
    kw = dict(seq_lens=lens, tensor_parallel_size=tp, partition=partition)
    res = run(pcp_prefill_rank, world, fn_kwargs=demo_kwargs(pcp_prefill_rank, kw), report=False)
    _check(res)
    pcp = world // tp
    assert [r["work"] for r in res] == [
        w for w in causal_work(lens, pcp, partition) for _ in range(tp)
    ]
    # every collective is an all-gather in a PCP group: K and V per layer, the output once (restore)
    assert {(op, g) for op, g in res.traces[0].summary()} == {("all_gather", "pcp")}
    assert [op for op, _ in res[0]["comm"]] == ["all_gather"] * 2 and len(
        res[0]["restore_comm"]
    ) == 1


@settings(max_examples=15, deadline=None)
@given(
    lens=st.lists(st.integers(1, 40), min_size=1, max_size=3),
    pcp=st.integers(2, 4),
    kv=st.sampled_from([1, 2, 4]),
    seed=st.integers(0, 100),
)
def test_pcp_prefill_random_shapes(lens, pcp, kv, seed):
    kw = dict(
        seq_lens=tuple(lens), num_q_heads=4, num_kv_heads=kv, head_dim=8, hidden_size=16, seed=seed
    )
    _check(run(pcp_prefill_rank, pcp, fn_kwargs=demo_kwargs(pcp_prefill_rank, kw), report=False))


def test_all_gather_bytes():
    kw = dict(seq_lens=(10,), num_q_heads=4, num_kv_heads=2, head_dim=8, hidden_size=16)
    res = run(pcp_prefill_rank, 2, fn_kwargs=demo_kwargs(pcp_prefill_rank, kw), report=False)
    rows = padded_len(10, 2) // 2
    kv_bytes = rows * 2 * (8 + 8) * 8  # rows x kv heads x (k dim + v dim) x float64, per layer
    out_bytes = rows * 4 * 8 * 8  # rows x q heads x v dim, once per forward (restore)
    assert comm_bytes(res[0]["comm"]) == kv_bytes == comm_bytes(pcp_comm_bytes(rows, 2, 8, 2))
    assert (
        pcp_restore_bytes(rows, 4 * 8 * 8, 2)
        == res[0]["restore_comm"]
        == [("all_gather", out_bytes)]
    )
    assert res.traces[0].bytes_sent("all_gather", "pcp") == kv_bytes + out_bytes


@pytest.mark.torchrun
def test_pcp_prefill_torchrun():
    kw = dict(seq_lens=(45, 16, 1), tensor_parallel_size=2, partition="contiguous")
    _check(
        run(
            pcp_prefill_rank,
            4,
            "torchrun",
            demo_kwargs(pcp_prefill_rank, kw),
            dist_backend="gloo",
            report=False,
        )
    )
    _check(
        run(
            pcp_prefill_rank,
            3,
            "torchrun",
            demo_kwargs(pcp_prefill_rank, dict(seq_lens=(50, 7))),
            dist_backend="gloo",
            report=False,
        )
    )


def test_pcp_prefill_timing_runs_inline():
    cfg = ParallelConfig(prefill_context_parallel_size=2, num_q_heads=2, num_kv_heads=2, head_dim=8)
    kw = dict(cfg=cfg, seq_len=96, repeats=1)
    res = run(pcp_prefill_timing, 2, fn_kwargs=kw, report=False)
    for r in res:
        assert r["zigzag_err"] < 1e-5 and r["contiguous_err"] < 1e-5
        assert {"single", "zigzag", "contiguous", "zigzag_cpu"} <= set(r)


def test_dcp_equals_pcp_group():
    for tp, pcp in ((1, 2), (2, 2), (4, 2), (2, 4)):
        assert RankGrid(tp, pcp, pcp).dcp_groups() == RankGrid(tp, pcp, pcp).pcp_groups()
    assert RankGrid(4, 2, 2, "v0.14").dcp_groups() != RankGrid(4, 2, 2, "v0.14").pcp_groups()


def test_work_formula_limit():
    # last/first -> 2K-1 as blocks grow
    for k in (2, 4, 8):
        w = causal_work(2 * k * 10_000, k, "contiguous")
        assert math.isclose(w[-1] / w[0], 2 * k - 1, rel_tol=1e-3)
