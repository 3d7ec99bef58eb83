"""cpbook.dcp.draft_placement: the draft's bytes per forward (traced by the engine's drafter in
tests/test_spec_decode.py) and vLLM v0.34.0's default draft DCP per drafter."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpbook.core.comm import comm_bytes
from cpbook.core.config import ParallelConfig
from cpbook.dcp.decode import decode_comm_bytes
from cpbook.dcp.draft_placement import draft_step_comm_bytes, vllm_default_draft_dcp


def _cfg(tp: int, dcp: int, backend: str = "ag_rs") -> ParallelConfig:
    return ParallelConfig(
        tensor_parallel_size=tp,
        decode_context_parallel_size=dcp,
        num_q_heads=8,
        num_kv_heads=1,
        head_dim=40,
        use_mla=True,
        dcp_comm_backend=backend,
    )


@settings(max_examples=40, deadline=None)
@given(
    rows=st.lists(st.integers(1, 30), min_size=1, max_size=5),
    tp=st.sampled_from([1, 2, 4]),
    backend=st.sampled_from(["ag_rs", "a2a"]),
    layers=st.integers(1, 3),
)
def test_step_bytes_are_per_forward_and_layer(rows, tp, backend, layers):
    """Replicated (draft DCP 1): only the TP all-reduces; sharded (draft DCP = TP): a DCP
    decode of each forward's rows before them, per layer; bytes are linear in the rows."""
    rep = draft_step_comm_bytes(rows, _cfg(tp, 1), 40, 32, 64, 2, layers)
    shd = draft_step_comm_bytes(rows, _cfg(tp, tp, backend), 40, 32, 64, 2, layers)
    assert all(op == "all_reduce" for op, _ in rep)
    assert len(rep) == (2 * len(rows) * layers if tp > 1 else 0)
    dcp_part = [c for r in rows for c in decode_comm_bytes(r, 8 // tp, 40, 32, tp, backend, 2)]
    assert comm_bytes(shd) == comm_bytes(rep) + (layers * comm_bytes(dcp_part) if tp > 1 else 0)
    if tp > 1:
        one = draft_step_comm_bytes([1], _cfg(tp, tp, backend), 40, 32, 64, 2, 1)
        assert comm_bytes(shd) == layers * sum(rows) * comm_bytes(one)


@pytest.mark.parametrize(
    "method, use_mla, sliding, want",
    [
        ("draft_model", False, False, 8),  # SpeculatorConfig's default: the target's DCP
        ("eagle", False, False, 8),
        ("mtp", True, False, 8),
        ("dflash", False, False, 1),  # a GQA DFlash draft stays replicated
        ("dflash", True, True, 1),  # windowed layers cannot run under DCP
        ("dflash", True, False, 8),  # full-attention MLA shards with the target
        ("dspark", False, False, 1),
        ("dspark", True, False, 8),
        ("ngram", False, False, 1),  # no draft model
    ],
)
def test_vllm_default_draft_dcp(method, use_mla, sliding, want):
    assert vllm_default_draft_dcp(method, 8, use_mla, sliding) == want
