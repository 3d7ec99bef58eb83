"""cpbook.costmodel.speculative: the verification step in the decode cost model (modelled)."""

from __future__ import annotations

import math

import pytest

from cpbook.costmodel.decode import decode_break_even, decode_layer_time
from cpbook.costmodel.specs import get_gpu, get_model
from cpbook.costmodel.speculative import (
    expected_accepted_tokens,
    per_token_time,
    spec_break_even,
    spec_step_time,
)

DSV3, H200 = get_model("DeepSeek-V3"), get_gpu("H200")


def test_expected_accepted_tokens():
    assert expected_accepted_tokens(0.0, 3) == 1.0
    assert expected_accepted_tokens(1.0, 3) == 4.0
    assert math.isclose(expected_accepted_tokens(0.5, 2), 1.75)
    with pytest.raises(ValueError, match=r"\[acceptance-rate\]"):
        expected_accepted_tokens(1.5, 2)


def test_k0_is_chapter_6():
    for mode in ("no_cp", "dcp"):
        one = decode_layer_time(DSV3, H200, 65536, mode)
        assert math.isclose(spec_step_time(DSV3, H200, 65536, mode, 0), one.total_s)
    assert math.isclose(spec_break_even(DSV3, H200, 0, 1.0), decode_break_even(DSV3, H200, "dcp"))


def test_kv_read_once_collectives_grow_with_rows():
    one = decode_layer_time(DSV3, H200, 2**17, "dcp")
    four = spec_step_time(DSV3, H200, 2**17, "dcp", 3)
    wide = decode_layer_time(DSV3, H200, 2**17, "dcp", num_reqs=4)
    assert math.isclose(four - one.kv_read_s, wide.comm_s)
    assert math.isclose(per_token_time(DSV3, H200, 2**17, "dcp", 3, 2.0), four / 2)
    with pytest.raises(ValueError, match=r"\[mean-accepted-tokens\]"):
        per_token_time(DSV3, H200, 1024, "dcp", 1, 3.0)


def test_break_even_falls_only_against_a_plain_baseline():
    base = spec_break_even(DSV3, H200, 0, 1.0)
    m = expected_accepted_tokens(0.7, 3)
    assert spec_break_even(DSV3, H200, 3, m) < base / m
    fair = spec_break_even(DSV3, H200, 3, m, baseline_speculates=True)
    assert base < fair < 1.1 * base  # the k extra rows' bytes, nothing more
    same = spec_break_even(DSV3, H200, 3, 1.0, baseline_speculates=True)
    assert math.isclose(same, fair, rel_tol=1e-9)  # m cancels when both sides speculate
