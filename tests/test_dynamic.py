"""cpbook.dynamic.router: the Router's thresholds, its defaults and the rules it enforces."""

from __future__ import annotations

import numpy as np
import pytest

from cpbook import costmodel as cm
from cpbook.dynamic.router import Router, cp_line, valid_cp_size

DSV3, H200 = cm.MODELS["DeepSeek-V3"], cm.GPUS["H200"]


@pytest.mark.parametrize("t", [1, 100, 4096, 65_536])
def test_thresholds_honoured_at_and_around_each_boundary(t):
    r = Router([t, 4 * t], [1, 2, 8])
    got = r.route_many(np.array([0, t - 1, t, t + 1, 4 * t - 1, 4 * t, 10 * t]))
    assert got.tolist() == [1, 1, 2, 2, 2, 8, 8]
    assert r.route(t - 1).cp_size == 1 and r.route(t).cp_size == 2
    assert r.route(t // 2, t - t // 2).cp_size == 2  # prompt + expected output


def test_capacity_moves_a_request_up_to_the_smallest_size_that_holds_it():
    r = Router([1000, 5000], [1, 2, 4], capacity_tokens=300)
    totals = np.array([200, 301, 600, 601, 1000, 1201, 5000])
    assert r.route_many(totals).tolist() == [1, 2, 2, 4, 4, 4, 4]
    assert "memory" in r.route(301).reason and "memory" in r.route(1000).reason
    assert "CP=4" in r.route(5000).reason and "DP" in r.route(200).reason


@pytest.mark.parametrize(
    "thresholds, sizes, extra, rule",
    [
        ([100, 100], [1, 2, 4], {}, "thresholds-increasing"),
        ([200, 100], [1, 2, 4], {}, "thresholds-increasing"),
        ([-1], [1, 2], {}, "thresholds-increasing"),
        ([100], [1, 2, 4], {}, "one-size-per-range"),
        ([100], [2, 4], {}, "cp-sizes-increasing"),
        ([100, 200], [1, 4, 2], {}, "cp-sizes-increasing"),
        ([100], [1, 3], {"pool_size": 8}, "cp-size-divides-pool"),
        ([100], [1, 3], {"model": DSV3}, "heads-divisible-by-tp"),
        ([100], [1, 2], {"model": cm.MODELS["Llama-3.1-8B"]}, "gqa-dcp"),
    ],
)
def test_invalid_thresholds_and_sizes_are_rejected(thresholds, sizes, extra, rule):
    with pytest.raises(ValueError, match=rule):
        Router(thresholds, sizes, **extra)


def test_tpa_admits_a_cp_size_plain_dcp_rejects():
    llama = cm.MODELS["Llama-3.1-8B"]
    with pytest.raises(ValueError):
        valid_cp_size(llama, 2)
    valid_cp_size(llama, 2, tpa=True)


def test_measured_default_is_chapter_6_break_even():
    assert Router.measured().thresholds == [30649.0]
    assert Router.measured(tpa=True).thresholds == [22351.0]
    assert Router.measured().cp_sizes == [1, 2]


def test_modelled_thresholds_are_the_lower_envelope():
    for tpa in (False, True):
        r = Router.modelled(DSV3, H200, (1, 2, 4, 8), tpa=tpa)
        lines = {n: cp_line(DSV3, H200, n, tpa=tpa) for n in (1, 2, 4, 8)}
        for length in [1, 1e3, 1e4, 1e5, 3e5, 1e6, 4e6]:
            best = min(lines, key=lambda n: lines[n][0] + lines[n][1] * length)
            chosen = int(r.route_many(np.array([length]))[0])
            t = {n: lines[n][0] + lines[n][1] * length for n in lines}
            assert t[chosen] <= t[best] * (1 + 1e-12)
    # TPA lowers the break-even; a batch sharing the collectives lowers it further
    plain, tpa = (Router.modelled(DSV3, H200, tpa=x).thresholds[0] for x in (False, True))
    assert tpa < plain
    assert Router.modelled(DSV3, H200, tpa=True, num_reqs=128).thresholds[0] < 4096
