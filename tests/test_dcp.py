"""dcp: GQA decode under TP × DCP is exact, both combines, and moves exactly the bytes predicted."""

import math
import random

import pytest
import torch

from cpbook.core.attention import dense_attention, merge_attn_states
from cpbook.core.config import ConfigError, ParallelConfig
from cpbook.core.context import RankContext
from cpbook.core.groups import RankGrid
from cpbook.core.launch import run
from cpbook.dcp.decode import correct_attn_out, decode_comm_bytes
from cpbook.demos import demo_kwargs
from cpbook.demos.ch03_decode import gqa_decode_rank
from cpbook.kv.paged import shard_kv_cache
from tests.rank_fns import combine_rank, in_sequence
from tests.test_attention import LARGE, large_score_parts


def _check(res):
    """Every rank exact, and its traced step equals the formula, call by call."""
    assert max(r["max_abs_err"] for r in res) <= 1e-10
    for r, trace in zip(res, res.traces):
        assert r["comm"] == r["expected"]
        assert [(c.op, c.bytes_sent) for c in trace] == r["expected"]
        assert all(c.bytes_recv == c.bytes_sent and c.group == "dcp" for c in trace)


# (tp, dcp, num_q_heads, num_kv_heads): DCP sizes 1-4 and the article's TP=6, DCP=3, 2 KV heads
LAYOUTS = [
    (1, 1, 4, 2),
    (2, 1, 4, 2),
    (2, 2, 4, 1),
    (4, 2, 8, 2),
    (3, 3, 6, 1),
    (4, 4, 8, 1),
    (4, 4, 16, 1),
    (6, 3, 12, 2),
    (6, 2, 12, 3),
    (8, 4, 16, 2),
]


def _cases(n: int, seed: int = 0):
    rng = random.Random(seed)
    for i in range(n):
        tp, dcp, hq, hkv = LAYOUTS[i % len(LAYOUTS)]
        block = rng.choice([4, 8, 16])
        interleave = rng.choice([1, block, *[d for d in (2, 4) if block % d == 0]])
        lens = tuple(rng.choice([1, 2, 3, rng.randint(1, 90)]) for _ in range(rng.randint(1, 4)))
        yield dict(
            tensor_parallel_size=tp,
            decode_context_parallel_size=dcp,
            num_q_heads=hq,
            num_kv_heads=hkv,
            head_dim=rng.choice([8, 16]),
            seq_lens=lens,
            block_size=block,
            cp_kv_cache_interleave_size=interleave,
            dcp_comm_backend=rng.choice(["ag_rs", "a2a"]),
            seed=rng.randint(0, 2**31),
        )


@pytest.mark.parametrize(
    "case",
    list(_cases(30)),
    ids=lambda c: (
        "tp{tensor_parallel_size}-dcp"
        "{decode_context_parallel_size}-I{cp_kv_cache_interleave_size}-"
        "{dcp_comm_backend}-{seq_lens}".format(**c)
    ),
)
def test_gqa_decode_exact_and_bytes_match_formula(case):
    res = run(
        gqa_decode_rank,
        case["tensor_parallel_size"],
        fn_kwargs=demo_kwargs(gqa_decode_rank, case),
        report=False,
    )
    _check(res)
    n = case["decode_context_parallel_size"]
    for i, L in enumerate(case["seq_lens"]):  # each token is stored once in its DCP group
        for g in range(case["tensor_parallel_size"] // n):
            assert sum(r["local_tokens"][i] for r in res[g * n : (g + 1) * n]) == L


def test_article_example_shapes_and_empty_shards():
    """TP=6, DCP=3, 2 KV heads, 12 query heads: (1, 2) -> (1, 6) -> (1, 2); a 2-token request
    leaves one rank of each group empty, and nothing turns into NaN."""
    for backend in ("ag_rs", "a2a"):
        res = run(
            gqa_decode_rank,
            6,
            fn_kwargs=demo_kwargs(
                gqa_decode_rank, dict(seq_lens=(48, 2), dcp_comm_backend=backend)
            ),
            report=False,
        )
        _check(res)
        assert [r["kv_head"] for r in res] == [0, 0, 0, 1, 1, 1]
        assert [r["local_tokens"] for r in res] == [[16, 1], [16, 1], [16, 0]] * 2
        s = res[0]["shapes"]
        assert (s["q"], s["q_gathered"], s["out_partial"], s["out"]) == (
            (2, 2, 16),
            (2, 6, 16),
            (2, 6, 16),
            (2, 2, 16),
        )
        assert s["kv_local"] == [(16, 1, 16), (1, 1, 16)]


def test_bytes_do_not_grow_with_context():
    sent = []
    for L in (8, 64, 512):
        res = run(
            gqa_decode_rank,
            6,
            fn_kwargs=demo_kwargs(gqa_decode_rank, dict(seq_lens=(L, L))),
            report=False,
        )
        _check(res)
        sent.append([c.bytes_sent for c in res.traces[0]])
    assert sent[0] == sent[1] == sent[2]
    assert len(sent[0]) == 3  # ag_rs: AllGather Q, AllGather LSE, ReduceScatter
    assert decode_comm_bytes(1, 2, 16, 16, 3, "a2a")[1] == ("all_to_all", 2 * 17 * 8 * 2)


def test_float32_inputs():
    res = run(
        gqa_decode_rank,
        4,
        fn_kwargs=demo_kwargs(
            gqa_decode_rank,
            dict(
                tensor_parallel_size=4,
                decode_context_parallel_size=4,
                num_q_heads=8,
                num_kv_heads=1,
                seq_lens=(300, 3),
                dtype="float32",
            ),
        ),
        report=False,
    )
    assert max(r["max_abs_err"] for r in res) <= 1e-5
    assert all(r["comm"] == r["expected"] for r in res)


@pytest.mark.torchrun
def test_article_example_under_torchrun():
    """Both combine backends on the article's 6 ranks, one torchrun launch."""
    calls = [
        ("cpbook.demos.ch03_decode:gqa_decode_rank", dict(seq_lens=(48, 5, 2), dcp_comm_backend=b))
        for b in ("ag_rs", "a2a")
    ]
    res = run(in_sequence, 6, "torchrun", dict(calls=calls), dist_backend="gloo", report=False)
    assert res.dist_backend == "gloo"
    for per_rank, trace in zip(res, res.traces):
        assert max(r["max_abs_err"] for r in per_rank) <= 1e-10
        assert all(r["comm"] == r["expected"] for r in per_rank)
        assert [(c.op, c.bytes_sent) for c in trace] == sum((r["comm"] for r in per_rank), [])
        assert all(c.bytes_recv == c.bytes_sent and c.group == "dcp" for c in trace)


def test_correct_attn_out_guards():
    g = torch.Generator().manual_seed(0)
    outs = torch.randn(3, 2, 4, 5, generator=g, dtype=torch.float64)
    lses = torch.randn(3, 2, 4, generator=g, dtype=torch.float64)
    lses[1, 0] = float("-inf")  # rank 1 empty for request 0
    lses[2, 1, 0] = float("nan")  # a NaN from an empty kernel output counts as empty
    lses[:, 1, 1] = float("-inf")  # every rank empty for (request 1, head 1)
    summed = sum(correct_attn_out(outs[r], lses, r)[0] for r in range(3))
    ref, ref_lse = merge_attn_states(list(outs), list(lses))
    assert not torch.isnan(summed).any()
    assert torch.allclose(summed, ref, atol=1e-14, rtol=0)
    assert torch.equal(summed[1, 1], torch.zeros(5, dtype=torch.float64))
    total = correct_attn_out(outs[0], lses, 0)[1]
    assert torch.isinf(total[1, 1]) and torch.allclose(total[0], ref_lse[0])


def test_correct_attn_out_equals_attention_over_union():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 8, generator=g, dtype=torch.float64)
    k = torch.randn(30, 1, 8, generator=g, dtype=torch.float64)
    v = torch.randn(30, 1, 8, generator=g, dtype=torch.float64)
    parts = [dense_attention(q, k[s], v[s]) for s in (slice(0, 7), slice(7, 7), slice(7, 30))]
    lses = torch.stack([p[1] for p in parts])
    out = sum(correct_attn_out(p[0], lses, r)[0] for r, p in enumerate(parts))
    assert (out - dense_attention(q, k, v)[0]).abs().max() <= 1e-14


NAN, INF = float("nan"), float("inf")

# vLLM's CorrectAttnCPOutKernel by hand: 2 ranks, 2 requests, 2 heads, D = 2.  Rank 0 is empty
# for (request 0, head 1) and request 1 has no key on either rank (LSE -inf, NaN, +inf);
# every empty slot's output holds NaN, as an empty kernel output may.
EMPTY_CASE_OUTS = torch.tensor(
    [
        [[[4.0, 8.0], [NAN, NAN]], [[NAN, NAN], [NAN, NAN]]],
        [[[0.0, 4.0], [2.0, -2.0]], [[NAN, NAN], [NAN, NAN]]],
    ],
    dtype=torch.float64,
)
EMPTY_CASE_LSES = torch.tensor(
    [[[0.0, -INF], [-INF, -INF]], [[math.log(3.0), 1.0], [NAN, INF]]], dtype=torch.float64
)
# (request 0, head 0): weights 1/4, 3/4; (0, 1): rank 1 alone; request 1: 0 and -inf
EMPTY_CASE_OUT = torch.tensor([[[1.0, 5.0], [2.0, -2.0]], [[0.0, 0.0], [0.0, 0.0]]])
EMPTY_CASE_LSE = torch.tensor([[math.log(4.0), 1.0], [-INF, -INF]], dtype=torch.float64)


def _same(got, want, tol=1e-15):
    assert torch.equal(torch.isneginf(got), torch.isneginf(want)) and not got.isnan().any()
    fin = torch.isfinite(want)
    assert (got[fin] - want[fin]).abs().max() <= tol


def test_correct_attn_out_empty_shard_with_nan_output_gives_zero_as_vllm():
    corrected = [correct_attn_out(EMPTY_CASE_OUTS[r], EMPTY_CASE_LSES, r) for r in range(2)]
    assert torch.equal(corrected[0][0][0, 1], torch.zeros(2, dtype=torch.float64))  # not NaN
    assert torch.equal(corrected[1][0][1], torch.zeros(2, 2, dtype=torch.float64))
    _same(corrected[0][0] + corrected[1][0], EMPTY_CASE_OUT.double())
    for _, total in corrected:
        _same(total, EMPTY_CASE_LSE)
    o, l = merge_attn_states(list(EMPTY_CASE_OUTS), list(EMPTY_CASE_LSES))
    _same(o, EMPTY_CASE_OUT.double())
    _same(l, EMPTY_CASE_LSE)


@pytest.mark.parametrize("backend", ["ag_rs", "a2a"])
def test_dcp_combine_empty_shard_and_empty_request_as_vllm(backend):
    """The same case through both combines on 2 ranks (head r ends on rank r)."""
    res = run(
        combine_rank,
        2,
        fn_kwargs=dict(outs=EMPTY_CASE_OUTS, lses=EMPTY_CASE_LSES, dcp_comm_backend=backend),
        report=False,
    )
    for r, (out, lse) in enumerate(res):
        _same(out[:, 0], EMPTY_CASE_OUT[:, r].double())
        _same(lse[:, 0], EMPTY_CASE_LSE[:, r])


@pytest.mark.parametrize("dtype, shift, tol", LARGE)
def test_combines_are_exact_for_lses_beyond_exp_range(dtype, shift, tol):
    """Scores ≈ 100 (float32) / ≈ 800 (float64): without subtracting the max LSE, ``exp``
    overflows and ``correct_attn_out`` silently returns 0.  Both the sum of corrected outputs
    and both group combines equal ``merge_attn_states`` and the float64 dense reference."""
    parts, (ref_o, ref_l) = large_score_parts(dtype, shift)
    outs, lses = torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])
    assert torch.isinf(torch.exp(lses[lses.isfinite()])).all() and ref_o.abs().min() > 1e-3
    merged = merge_attn_states(list(outs), list(lses))
    corrected = [correct_attn_out(outs[r], lses, r) for r in range(3)]
    summed = sum(c[0] for c in corrected)
    assert (summed.double() - ref_o).abs().max() <= tol
    assert (summed.double() - merged[0].double()).abs().max() <= tol
    assert ((corrected[0][1].double() - ref_l).abs() / ref_l).max() <= tol
    for backend in ("ag_rs", "a2a"):
        res = run(
            combine_rank,
            3,
            fn_kwargs=dict(outs=outs, lses=lses, dcp_comm_backend=backend),
            report=False,
        )
        got = torch.cat([o for o, _ in res], dim=1)  # rank r holds heads [2r, 2r + 2)
        assert (got.double() - ref_o).abs().max() <= tol


def test_shard_kv_cache_stores_each_token_once():
    g = torch.Generator().manual_seed(2)
    ks = [torch.randn(n, 1, 4, generator=g, dtype=torch.float64) for n in (37, 0, 5)]
    vs = [torch.randn(n, 1, 4, generator=g, dtype=torch.float64) for n in (37, 0, 5)]
    for interleave in (1, 4):
        got = [shard_kv_cache(ks, vs, 8, 3, r, interleave)[0] for r in range(3)]
        for i, k in enumerate(ks):
            pos = torch.cat([got[r][i][2] for r in range(3)])
            assert sorted(pos.tolist()) == list(range(k.shape[0]))
            for r in range(3):
                lk, lv, p = got[r][i]
                assert torch.equal(lk, k[p]) and torch.equal(lv, vs[i][p])
                assert bool(((p // interleave) % 3 == r).all())


def test_invalid_layouts_rejected_before_any_collective():
    ctx = RankContext(
        0, 4, "inline", torch.device("cpu")
    )  # no simulated world: a collective would fail
    bad = [
        dict(tensor_parallel_size=4, decode_context_parallel_size=4, num_q_heads=8, num_kv_heads=2),
        dict(
            tensor_parallel_size=4, decode_context_parallel_size=3, num_q_heads=12, num_kv_heads=1
        ),
        dict(tensor_parallel_size=4, decode_context_parallel_size=2, num_q_heads=4, num_kv_heads=4),
        dict(
            tensor_parallel_size=12, decode_context_parallel_size=4, num_q_heads=12, num_kv_heads=2
        ),
        dict(
            tensor_parallel_size=4,
            decode_context_parallel_size=2,
            num_q_heads=8,
            num_kv_heads=1,
            cp_kv_cache_interleave_size=3,
            block_size=8,
        ),
        dict(
            tensor_parallel_size=4,
            decode_context_parallel_size=2,
            num_q_heads=8,
            num_kv_heads=1,
            dcp_comm_backend="ring",
        ),
    ]
    rules = [
        "gqa-dcp-within-replicas",
        "tp-divisible-by-dcp",
        "gqa-dcp-needs-replicated-kv",
        "gqa-q-per-kv-divisible-by-dcp",
        "block-size-divisible-by-interleave",
        "comm-backend",
    ]
    for kwargs, rule in zip(bad, rules):
        with pytest.raises(ConfigError) as e:
            gqa_decode_rank(ctx, **demo_kwargs(gqa_decode_rank, kwargs))
        assert e.value.rule == rule
    assert len(ctx.trace) == 0


def test_dcp_group_must_share_one_kv_head():
    """vLLM's listed rules admit tp=12, kv=2, dcp=4, q=24; its DCP group [4..7] would mix KV heads
    0 and 1.  ParallelConfig rejects it before any collective runs."""
    grid = RankGrid(12, 1, 4)
    assert grid.group_of("dcp", 4) == [4, 5, 6, 7]
    assert [t // (12 // 2) for t in (4, 5, 6, 7)] == [0, 0, 1, 1]  # KV head of each TP rank
    with pytest.raises(ConfigError, match=r"\[gqa-dcp-group-shares-kv-head\]"):
        ParallelConfig(
            tensor_parallel_size=12, decode_context_parallel_size=4, num_q_heads=24, num_kv_heads=2
        )
    ctx = RankContext(0, 12, "inline", torch.device("cpu"))
    with pytest.raises(ConfigError, match="gqa-dcp-group-shares-kv-head"):
        flat = dict(
            tensor_parallel_size=12, decode_context_parallel_size=4, num_q_heads=24, num_kv_heads=2
        )
        gqa_decode_rank(ctx, **demo_kwargs(gqa_decode_rank, flat))
    assert len(ctx.trace) == 0
