"""cpbook.dcp.verify and cpbook.dcp.draft_placement: k + 1 query rows under DCP, exact vs dense."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpbook.core.config import ConfigError, ParallelConfig
from cpbook.core.launch import run
from cpbook.dcp.draft_placement import draft_comm_bytes, draft_kv_rows
from cpbook.dcp.verify import verify_comm_bytes, verify_key_counts
from cpbook.demos import demo_kwargs
from cpbook.demos.ch10_spec import draft_placement_rank, spec_verify_rank
from cpbook.kv.layout import local_seq_len, token_owner
from tests.rank_fns import in_sequence

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _check(res) -> None:
    assert max(r["max_abs_err"] for r in res) <= 1e-10
    assert all(r["comm"] == r["expected"] for r in res)
    for rank, trace in zip(res, res.traces):
        assert [(c.op, c.bytes_sent) for c in trace] == rank["comm"]


@settings(max_examples=12, deadline=None)
@given(
    mla=st.booleans(),
    backend=st.sampled_from(["ag_rs", "a2a"]),
    interleave=st.sampled_from([1, 2, 4]),
    dcp=st.sampled_from([2, 4]),
    reqs=st.lists(st.tuples(st.integers(0, 17), st.integers(1, 4)), min_size=1, max_size=3),
)
def test_verification_equals_dense_attention(mla, backend, interleave, dcp, reqs):
    """Random k per request, interleave, uneven and empty shards (contexts from 0), GQA and
    MLA absorbed, both combines: every rank's heads equal dense causal float64."""
    res = run(
        spec_verify_rank,
        4,
        fn_kwargs=demo_kwargs(
            spec_verify_rank,
            dict(
                use_mla=mla,
                num_kv_heads=1 if mla or dcp == 4 else 2,
                decode_context_parallel_size=dcp,
                context_lens=[c for c, _ in reqs],
                num_speculative_tokens=[k for _, k in reqs],
                block_size=4,
                cp_kv_cache_interleave_size=interleave,
                dcp_comm_backend=backend,
            ),
        ),
        report=False,
    )
    _check(res)


def test_rows_see_keys_by_global_position():
    """Request (13 cached, k = 3) on 4 ranks: row j at position 13 + j is owned by rank
    (13 + j) % 4 and every rank's count is local_seq_len(14 + j)."""
    res = run(spec_verify_rank, 4, report=False)
    _check(res)
    assert token_owner([13, 14, 15, 16], 4, 1).tolist() == [1, 2, 3, 0]
    assert [r["keys_seen"][0] for r in res] == [
        [4, 4, 4, 5],
        [4, 4, 4, 4],
        [3, 4, 4, 4],
        [3, 3, 4, 4],
    ]
    assert [r["keys_seen"][2] for r in res] == [[1, 1, 1], [0, 1, 1], [0, 0, 1], [0, 0, 0]]
    for r in range(4):
        assert res[r]["keys_seen"][0] == [local_seq_len(14 + j, 4, r, 1) for j in range(4)]


def test_bytes_grow_with_k_plus_1_not_with_context():
    one = verify_comm_bytes([0], 2, 16, 16, 4)
    four = verify_comm_bytes([3], 2, 16, 16, 4)
    assert [b for _, b in four] == [4 * b for _, b in one]
    assert verify_comm_bytes([3, 1], 2, 16, 16, 4, "a2a")[1] == ("all_to_all", 6 * 2 * 17 * 8 * 3)
    a = run(
        spec_verify_rank,
        4,
        fn_kwargs=demo_kwargs(spec_verify_rank, dict(context_lens=(5, 5, 5))),
        report=False,
    )
    b = run(
        spec_verify_rank,
        4,
        fn_kwargs=demo_kwargs(spec_verify_rank, dict(context_lens=(90, 40, 61))),
        report=False,
    )
    assert a[0]["comm"] == b[0]["comm"]


def test_verify_errors_name_the_rule():
    with pytest.raises(ConfigError, match=r"\[verify-rows\]"):
        verify_key_counts(3, 0, 2, 0, 1)


@pytest.mark.parametrize("placement", ["replicated", "sharded"])
def test_draft_placement_traced_equals_formula(placement):
    res = run(
        draft_placement_rank,
        2,
        fn_kwargs=demo_kwargs(draft_placement_rank, dict(placement=placement)),
        report=False,
    )
    _check(res)
    held = [r["rows_held"] for r in res]
    if placement == "replicated":
        assert held == [[23, 10], [23, 10]] and res[0]["comm"] == []
    else:
        assert held == [[12, 5], [11, 5]]
        assert len(res[0]["comm"]) == 3 * 3  # k = 3 draft steps of ag_rs' three collectives


def test_draft_placement_formulas():
    assert draft_kv_rows("replicated", 1000, 8, 3) == 1000
    assert draft_kv_rows("sharded", 1000, 8, 3) == 125
    cfg = ParallelConfig(
        tensor_parallel_size=8, decode_context_parallel_size=8, num_q_heads=16, num_kv_heads=1
    )  # 2 query heads per rank, DCP 8
    assert draft_comm_bytes("replicated", 4, 3, cfg, 16, 16) == []
    assert len(draft_comm_bytes("sharded", 4, 3, cfg, 16, 16, num_layers=2)) == 18
    with pytest.raises(ConfigError, match=r"\[draft-placement\]"):
        draft_kv_rows("mirrored", 10, 2, 0)


@pytest.mark.torchrun
def test_verification_under_torchrun():
    """GQA and MLA, ag_rs and a2a, interleave 2, and a sharded draft, in one 4-process launch."""
    calls = [
        (
            "cpbook.demos.ch10_spec:spec_verify_rank",
            dict(use_mla=m, dcp_comm_backend=b, cp_kv_cache_interleave_size=2),
        )
        for m, b in ((False, "ag_rs"), (True, "a2a"))
    ] + [("cpbook.demos.ch10_spec:draft_placement_rank", {})]
    res = run(in_sequence, 4, "torchrun", dict(calls=calls), dist_backend="gloo", report=False)
    for per_rank, trace in zip(res, res.traces):
        assert max(r["max_abs_err"] for r in per_rank) <= 1e-10
        assert all(r["comm"] == r["expected"] for r in per_rank)
        assert [(c.op, c.bytes_sent) for c in trace] == sum((r["comm"] for r in per_rank), [])
