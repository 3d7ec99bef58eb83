"""attention: dense reference == fused SDPA path == merge of split key sets."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cpbook.core.attention import attention_with_lse, dense_attention, merge_attn_states


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


def test_shape_errors():
    q, k, v = _rand(0, 2, 6, 3, 2, 8, 8)
    with pytest.raises(ValueError, match="attention-shapes"):
        attention_with_lse(q, k, v)
    with pytest.raises(ValueError, match="merge-parts"):
        merge_attn_states([], [])
