"""PackedLinear: the plain product in float64 (bit for bit), oneDNN's to rounding in float32."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cpbook.engine.gemm import PackedLinear


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 70), k=st.integers(1, 40), n=st.integers(1, 40), bias=st.booleans())
def test_float64_is_the_plain_product(rows: int, k: int, n: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(rows * 1000 + k * 40 + n)
    w = torch.randn(k, n, generator=g, dtype=torch.float64)
    b = torch.randn(n, generator=g, dtype=torch.float64) if bias else None
    x = torch.randn(rows, k, generator=g, dtype=torch.float64)
    lin = PackedLinear(w, b)
    assert not lin.onednn
    want = x @ w if b is None else torch.addmm(b, x, w)
    assert torch.equal(lin(x), want)


@pytest.mark.parametrize("rows", [1, 3, 32, 257])
@pytest.mark.parametrize("bias", [False, True])
def test_float32_agrees_to_rounding(rows: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(256, 96, generator=g) / 16
    b = torch.randn(96, generator=g) if bias else None
    x = torch.randn(rows, 256, generator=g)
    lin = PackedLinear(w, b)
    assert lin.onednn == torch.backends.mkldnn.is_available()
    want = (x.double() @ w.double()) + (0 if b is None else b.double())
    assert lin(x).dtype == torch.float32 and lin(x).shape == (rows, 96)
    assert torch.allclose(lin(x).double(), want, rtol=1e-5, atol=1e-5)
    # a strided input (a transposed view) gives the same rows
    xt = x.t().contiguous().t()
    assert torch.allclose(lin(xt), lin(x), rtol=0, atol=1e-6)
