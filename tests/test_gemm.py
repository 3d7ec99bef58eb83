"""PackedLinear: the plain product in float64 and for small float32 weights (bit for bit),
oneDNN's to rounding for large float32 weights."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cpbook.engine.gemm import ONEDNN_MIN_WEIGHT_BYTES, PackedLinear


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
    w = torch.randn(512, 256, generator=g) / 16  # 512 KiB: reordered
    b = torch.randn(256, generator=g) if bias else None
    x = torch.randn(rows, 512, generator=g)
    lin = PackedLinear(w, b)
    assert lin.onednn == torch.backends.mkldnn.is_available()
    want = (x.double() @ w.double()) + (0 if b is None else b.double())
    assert lin(x).dtype == torch.float32 and lin(x).shape == (rows, 256)
    assert torch.allclose(lin(x).double(), want, rtol=1e-5, atol=1e-5)
    # a strided input (a transposed view) gives the same rows
    xt = x.t().contiguous().t()
    assert torch.allclose(lin(xt), lin(x), rtol=0, atol=1e-6)


@pytest.mark.parametrize("k,n", [(256, 256), (511, 256), (1, 1)])
def test_small_float32_weights_keep_the_plain_product(k: int, n: int) -> None:
    w = torch.randn(k, n, generator=torch.Generator().manual_seed(k))
    assert w.numel() * 4 < ONEDNN_MIN_WEIGHT_BYTES
    x = torch.randn(5, k)
    lin = PackedLinear(w)
    assert not lin.onednn and torch.equal(lin(x), x @ w)
