"""cpbook.dynamic.simulator: deterministic, conserves requests and tokens, policies behave as
routed."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpbook.core.errors import RuleError
from cpbook.dynamic.router import Router
from cpbook.dynamic.simulator import DYNAMIC_CP, DYNAMIC_CP_TPA, POLICIES, Cluster, simulate
from cpbook.dynamic.workload import WorkloadMix, make_workload

CLUSTER = Cluster()


def _check_conservation(w, r):
    done = np.isfinite(r["finish_s"])
    assert r["completed"] + r["rejected"] == r["requests"] == len(w.arrival)
    assert int(done.sum()) == r["completed"]  # every admitted request finished once
    assert r["decode_tokens"] == int((w.output[done] - 1).sum())
    assert np.all(r["finish_s"][done] >= w.arrival[done])


@pytest.mark.parametrize("policy", POLICIES)
def test_same_seed_same_result_and_conservation(policy):
    w = make_workload(400, 4.0, seed=3)
    a, b = simulate(CLUSTER, w, policy), simulate(CLUSTER, make_workload(400, 4.0, seed=3), policy)
    for key, val in a.items():
        if isinstance(val, np.ndarray):
            assert np.array_equal(val, b[key], equal_nan=True)
        else:
            assert val == b[key]
    _check_conservation(w, a)


def test_policies_route_as_configured():
    w = make_workload(300, 2.0, seed=1, mix=WorkloadMix(long_fraction=0.3, long_median=200_000))
    res = {p: simulate(CLUSTER, w, p) for p in POLICIES}
    assert res["static_dp"]["cp_requests"] == 0 and res["static_cp"]["cp_requests"] == 300
    cap = CLUSTER.capacity_tokens()
    assert res["static_dp"]["rejected"] == int((w.total > cap).sum()) > 0
    assert res[DYNAMIC_CP]["rejected"] == res[DYNAMIC_CP_TPA]["rejected"] == 0
    assert 0 < res[DYNAMIC_CP]["cp_requests"] <= res[DYNAMIC_CP_TPA]["cp_requests"]


def test_growing_requests_migrate_and_are_conserved():
    w = make_workload(300, 0.5, seed=2, mix=WorkloadMix(output_median=6_000, max_output=200_000))
    router = Router([32_768], [1, 8], tpa=True, capacity_tokens=CLUSTER.capacity_tokens())
    oracle = simulate(CLUSTER, w, DYNAMIC_CP_TPA, router)
    moving = simulate(CLUSTER, w, DYNAMIC_CP_TPA, router, expected_output=0)
    grows = int(((w.prompt < 32_768) & (w.total > 32_768 + 1)).sum())
    assert oracle["migrations"] == 0 and moving["migrations"] == grows > 0
    assert moving["migrated_bytes"] > 0 and moving["cp_requests"] == oracle["cp_requests"]
    _check_conservation(w, moving)


@settings(max_examples=15, deadline=None)
@given(
    n=st.integers(1, 60),
    rate=st.floats(0.2, 50.0),
    long_fraction=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**16),
    policy=st.sampled_from(POLICIES),
    expected=st.sampled_from([None, 0, 400]),
)
def test_small_random_workloads_conserve(n, rate, long_fraction, seed, policy, expected):
    mix = WorkloadMix(long_fraction=long_fraction, max_prompt=800_000, max_output=60_000)
    w = make_workload(n, rate, mix=mix, seed=seed)
    _check_conservation(w, simulate(CLUSTER, w, policy, expected_output=expected))


def test_an_unknown_policy_names_the_rule():
    with pytest.raises(RuleError) as e:
        simulate(CLUSTER, make_workload(3, 1.0), "dynamic_cp_tpx")
    assert e.value.rule == "policy"
