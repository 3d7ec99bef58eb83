"""attention: dense reference == fused SDPA path == merge of split key sets."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cpbook.core.attention import (
    attention_with_lse,
    dense_attention,
    merge_attn_states,
    merge_attn_states_,
)


def _rand(seed, tq, tk, hq, hk, d, dv, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(tq, hq, d, generator=g, dtype=dtype),
        torch.randn(tk, hk, d, generator=g, dtype=dtype),
        torch.randn(tk, hk, dv, generator=g, dtype=dtype),
    )


def _err(a, b):
    (oa, la), (ob, lb) = a, b
    assert torch.equal(torch.isinf(la), torch.isinf(lb))
    fin = torch.isfinite(la)
    e = (oa - ob).abs().max().item() if oa.numel() else 0.0
    return max(e, (la[fin] - lb[fin]).abs().max().item() if fin.any() else 0.0)


shapes = st.tuples(
    st.integers(0, 9),
    st.integers(0, 40),
    st.sampled_from([(4, 1), (4, 2), (6, 3), (8, 8), (8, 2)]),
    st.sampled_from([8, 16]),
    st.sampled_from([8, 12, 16]),
    st.booleans(),
    st.integers(0, 40),
    st.integers(0, 40),
    st.integers(0, 2**31),
)


@settings(max_examples=300, deadline=None)
@given(shapes)
def test_fused_equals_dense_float64(s):
    tq, tk, (hq, hk), d, dv, causal, qo, ko, seed = s
    q, k, v = _rand(seed, tq, tk, hq, hk, d, dv)
    assert (
        _err(dense_attention(q, k, v, causal, qo, ko), attention_with_lse(q, k, v, causal, qo, ko))
        <= 1e-10
    )


@settings(max_examples=200, deadline=None)
@given(shapes, st.lists(st.integers(0, 40), min_size=1, max_size=4))
def test_merge_of_split_keys_equals_dense(s, cuts):
    tq, tk, (hq, hk), d, dv, causal, qo, ko, seed = s
    q, k, v = _rand(seed, tq, tk, hq, hk, d, dv)
    bounds = [0, *sorted(min(c, tk) for c in cuts), tk]  # repeated cuts make empty shards
    parts = [
        attention_with_lse(q, k[a:b], v[a:b], causal, qo, ko + a)
        for a, b in zip(bounds, bounds[1:])
    ]
    merged = merge_attn_states([p[0] for p in parts], [p[1] for p in parts])
    assert _err(dense_attention(q, k, v, causal, qo, ko), merged) <= 1e-10


def test_float32_close_to_float64():
    q, k, v = _rand(3, 7, 300, 8, 2, 64, 64)
    ref = dense_attention(q, k, v, causal=True, q_offset=293)
    got = attention_with_lse(q.float(), k.float(), v.float(), causal=True, q_offset=293)
    assert _err(ref, (got[0].double(), got[1].double())) <= 1e-5


def test_lse_is_natural_log_of_sum_of_exp_scores():
    q, k, v = _rand(1, 1, 5, 1, 1, 4, 4)
    s = (q[0, 0] @ k[:, 0].T) / math.sqrt(4)
    _, lse = attention_with_lse(q, k, v)
    assert abs(lse.item() - torch.logsumexp(s, 0).item()) < 1e-12


def test_empty_and_fully_masked():
    q, k, v = _rand(0, 3, 0, 4, 2, 8, 8)
    out, lse = attention_with_lse(q, k, v)
    assert out.shape == (3, 4, 8) and not out.any() and torch.isneginf(lse).all()
    q, k, v = _rand(0, 3, 5, 4, 2, 8, 8)
    out, lse = attention_with_lse(
        q, k, v, causal=True, q_offset=0, k_offset=10
    )  # all keys in the future
    assert not out.any() and torch.isneginf(lse).all()
    o, l = merge_attn_states([out, out], [lse, lse])
    assert not o.any() and torch.isneginf(l).all()


def test_merge_treats_nan_lse_as_empty():
    q, k, v = _rand(0, 2, 6, 2, 2, 8, 8)
    a = attention_with_lse(q, k, v)
    o, l = merge_attn_states(
        [a[0], torch.full_like(a[0], 7.0)], [a[1], torch.full_like(a[1], float("nan"))]
    )
    assert _err(a, (o, l)) == 0.0


NAN, INF = float("nan"), float("inf")


def test_empty_part_with_nan_output_contributes_zero_anywhere_in_the_list():
    """vLLM's ``correct_attn_out`` and a2a combine give an LSE ``-inf`` part weight 0 *and*
    output 0 (``where(factor == 0, 0, ·)``): its kernel output may hold NaN."""
    q, k, v = _rand(4, 3, 6, 2, 2, 8, 8)
    a = attention_with_lse(q, k, v)
    empty = (torch.full_like(a[0], NAN), torch.full_like(a[1], -INF))
    for parts in ([a, empty], [empty, a], [empty, a, empty]):
        o, l = merge_attn_states([p[0] for p in parts], [p[1] for p in parts])
        assert torch.equal(o, a[0]) and torch.equal(l, a[1])
    # row by row: only (token 1, head 0) of the second part is empty, and holds NaN
    o2, l2 = a[0].clone(), a[1].clone()
    o2[1, 0], l2[1, 0] = NAN, -INF
    o, l = merge_attn_states([a[0], o2], [a[1], l2])
    assert not torch.isnan(o).any()
    assert torch.equal(o[1, 0], a[0][1, 0]) and torch.equal(l[1, 0], a[1][1, 0])


def test_request_empty_on_every_part_gives_zero_and_minus_inf():
    """A request with no key anywhere (every part ``-inf``, NaN, or ``+inf``, outputs NaN):
    output 0 and LSE ``-inf``, as vLLM's three combines return."""
    out = torch.full((2, 3, 4), NAN, dtype=torch.float64)
    lses = [torch.full((2, 3), x, dtype=torch.float64) for x in (-INF, NAN, INF)]
    for n in (1, 2, 3):
        o, l = merge_attn_states([out] * n, lses[:n])
        assert torch.equal(o, torch.zeros_like(out)) and torch.isneginf(l).all()
    acc_o, acc_l = torch.full_like(out, NAN), torch.full((2, 3), -INF, dtype=torch.float64)
    merge_attn_states_(acc_o, acc_l, out, lses[2])  # in place, accumulator empty too
    assert torch.equal(acc_o, torch.zeros_like(out)) and torch.isneginf(acc_l).all()


def test_plus_inf_lse_counts_as_an_empty_part():
    """FA2 reports ``+inf`` for a row with no key; vLLM (``merge_attn_states``,
    ``correct_attn_out``) maps it to ``-inf``.  Taken at face value it would win the whole
    weight (or make NaN)."""
    q, k, v = _rand(5, 2, 6, 2, 2, 8, 8)
    a = attention_with_lse(q, k, v)
    for junk in (7.0, NAN):
        o, l = merge_attn_states(
            [a[0], torch.full_like(a[0], junk)], [a[1], torch.full_like(a[1], INF)]
        )
        assert torch.equal(o, a[0]) and torch.equal(l, a[1])
        o, l = merge_attn_states(
            [torch.full_like(a[0], junk), a[0]], [torch.full_like(a[1], INF), a[1]]
        )
        assert torch.equal(o, a[0]) and torch.equal(l, a[1])
    acc = (a[0].clone(), a[1].clone())
    merge_attn_states_(*acc, torch.full_like(a[0], 7.0), torch.full_like(a[1], INF))
    assert torch.equal(acc[0], a[0]) and torch.equal(acc[1], a[1])


def large_score_parts(dtype, shift, cuts=(0, 17, 17, 40)):
    """Attention whose scores are all near ``shift`` (where ``exp`` overflows ``dtype``), split
    into key shards (one empty), and the float64 dense reference over every key."""
    g = torch.Generator().manual_seed(7)
    q = 1 + 0.05 * torch.randn(3, 6, 8, generator=g, dtype=torch.float64)
    k = 1 + 0.05 * torch.randn(cuts[-1], 1, 8, generator=g, dtype=torch.float64)
    v = torch.randn(cuts[-1], 1, 8, generator=g, dtype=torch.float64)
    scale = shift / 8  # q·k ≈ 8
    ref = dense_attention(q, k, v, scale=scale)
    qd, kd, vd = q.to(dtype), k.to(dtype), v.to(dtype)
    parts = [dense_attention(qd, kd[a:b], vd[a:b], scale=scale) for a, b in zip(cuts, cuts[1:])]
    return parts, ref


LARGE = [(torch.float32, 100.0, 1e-5), (torch.float64, 800.0, 1e-12)]


@pytest.mark.parametrize("dtype, shift, tol", LARGE)
def test_merge_is_exact_for_lses_beyond_exp_range(dtype, shift, tol):
    """LSEs ≈ 100 (float32) and ≈ 800 (float64): ``exp(lse)`` overflows, so a merge that does
    not work relative to the largest LSE returns inf, NaN or 0 here."""
    parts, (ref_o, ref_l) = large_score_parts(dtype, shift)
    lses = torch.stack([p[1] for p in parts])
    assert torch.isinf(torch.exp(lses[lses.isfinite()])).all()  # the test is meaningful
    o, l = merge_attn_states([p[0] for p in parts], list(lses))
    assert o.dtype == dtype and ref_o.abs().min() > 1e-3
    assert (o.double() - ref_o).abs().max() <= tol
    assert ((l.double() - ref_l).abs() / ref_l).max() <= tol


def test_shape_errors():
    q, k, v = _rand(0, 2, 6, 3, 2, 8, 8)
    with pytest.raises(ValueError, match="attention-shapes"):
        attention_with_lse(q, k, v)
    with pytest.raises(ValueError, match="merge-parts"):
        merge_attn_states([], [])
