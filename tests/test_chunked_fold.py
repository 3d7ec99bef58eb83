"""cpbook.pcp.chunked's fold of one causal part into an accumulator, at any offsets.

The strategies call it on aligned DualChunkSwap segments, where a key segment starts either at
the query segment's start or outside it; the fold itself promises exactness for any pair of
offsets (a key segment starting inside the query segment included), so a caller with other
segments (a ring step, a chunk of another size) may rely on it."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cpbook.core.attention import dense_attention, empty_attention
from cpbook.pcp.chunked import _attend


@given(
    tq=st.integers(1, 9),
    tk=st.integers(1, 9),
    q_offset=st.integers(0, 12),
    k_offset=st.integers(0, 12),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=150, deadline=None)
def test_causal_fold_equals_dense_at_any_offsets(tq, tk, q_offset, k_offset, seed):
    """Folding ``q`` (positions ``q_offset + i``) against ``k`` (positions ``k_offset + j``)
    into an empty accumulator equals dense causal attention; a row that sees no key keeps
    output 0 and LSE ``-inf``."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(tq, 4, 8, generator=g, dtype=torch.float64)
    k = torch.randn(tk, 2, 8, generator=g, dtype=torch.float64)
    v = torch.randn(tk, 2, 6, generator=g, dtype=torch.float64)
    out, lse = empty_attention(q, 4, 6)
    _attend(out, lse, q, k, v, None, True, q_offset, k_offset)
    ref, ref_lse = dense_attention(q, k, v, True, q_offset, k_offset)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    seen = torch.isfinite(ref_lse)
    assert ((lse - ref_lse)[seen].abs() <= 1e-12).all()
    assert (out - ref).abs().max() <= 1e-12
