"""Tests for cpbook.planner.vllm_rules against vLLM v0.34.0's start-up checks, and the stored
run of ``bench/vllm_accepts.py`` (vLLM's own config classes on every printed line).

The stored run is the judge here, with no network and no vLLM: the candidates are rebuilt from
the package alone and cpbook's rules must reject exactly what vLLM rejected, rule by rule."""

from __future__ import annotations

import json
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpbook import costmodel as cm
from cpbook import planner as pl
from cpbook.core.config import ConfigError
from cpbook.costmodel import Deployment
from cpbook.planner.hf_config import model_from_hf_config
from cpbook.planner.vllm_rules import (
    check_max_model_len,
    check_nodes,
    check_sparse_mla_dcp,
    fp8_decode_padded_heads,
)

from .test_hf_config import DSV32

ROOT = Path(__file__).resolve().parents[1]
STORED = ROOT / "bench" / "results" / "vllm_accepts.jsonl"
V32 = model_from_hf_config(DSV32, name="DeepSeek-V3.2-Exp")


def _bench():
    sys.path.insert(0, str(ROOT / "bench"))
    import vllm_accepts

    return vllm_accepts


def test_stored_run_rejects_exactly_what_cpbook_rejects():
    rows = [json.loads(s) for s in STORED.read_text().splitlines() if s.strip()]
    summary = rows[0]
    assert summary["name"] == "vllm_accepts" and summary["vllm"] == "0.34.0"
    assert summary["failures"] == 0 == len(rows) - 1
    assert summary["printed_accepted"] == summary["printed"]
    cands = list(_bench().candidates())
    kinds = Counter(c.kind for c in cands)
    assert (len(cands), kinds["printed"], kinds["rejected"]) == (
        summary["candidates"],
        summary["printed"],
        summary["rejected"],
    )
    ours = Counter(c.cpbook_rule for c in cands if c.kind == "rejected")
    assert dict(ours) == summary["rejected_by_rule"]


# ------------------------------------------------------------------ FlashMLA-sparse (v0.34.0)


def _sizes(tp, pcp, dcp):
    return Deployment(tp=tp, pcp=pcp, dcp=dcp).config(V32)


@pytest.mark.parametrize(
    "tp, pcp, dcp, kv, rule",
    [
        (4, 2, 2, "bf16", "sparse-mla-pcp-dcp-fp8-ds-mla"),
        (1, 2, 2, "bf16", "sparse-mla-pcp-dcp-fp8-ds-mla"),
        (2, 1, 2, "fp8", "sparse-mla-dcp-fp8-heads"),  # 64 heads per rank
        (4, 1, 4, "fp8", "sparse-mla-dcp-fp8-heads"),  # 32 is not < 32
        (8, 1, 8, "fp8", "sparse-mla-dcp-fp8-head-padding"),  # 16 -> 64, 128 gathered -> 128
        (16, 1, 16, "fp8", "sparse-mla-dcp-fp8-head-padding"),
        (2, 2, 4, "fp8", "sparse-mla-dcp-fp8-head-padding"),  # dcp > pcp: 64 vs 128
        (2, 1, 2, "bf16", None),  # v0.34: the head rules bind only an FP8 cache
        (8, 1, 4, "fp8", None),  # 16 heads, 64 gathered: one kernel
        (4, 2, 2, "fp8", None),  # PCP x DCP over PCP: heads unchanged
        (1, 4, 4, "fp8", None),
    ],
)
def test_flashmla_sparse_rules(tp, pcp, dcp, kv, rule):
    if rule is None:
        check_sparse_mla_dcp(V32, _sizes(tp, pcp, dcp), kv)
        return
    with pytest.raises(ConfigError) as err:
        check_sparse_mla_dcp(V32, _sizes(tp, pcp, dcp), kv)
    assert err.value.rule == rule and f"[{rule}] requires" in str(err.value)


def test_sparse_rules_bind_only_sparse_mla_with_dcp():
    dsv3 = cm.MODELS["DeepSeek-V3"]
    for d in (Deployment(tp=2, dcp=2), Deployment(tp=8, dcp=8)):
        for kv in ("bf16", "fp8"):
            pl.check_deployment(dsv3, d, kv)  # dense MLA: FlashMLA, none of these rules
    pl.check_deployment(V32, Deployment(tp=4, pcp=2), "bf16")  # PCP alone


@settings(max_examples=60, deadline=None)
@given(heads=st.sampled_from([8, 16, 32, 64, 128, 256]), factor=st.sampled_from([1, 2, 4, 8]))
def test_padding_is_one_kernel_envelope(heads, factor):
    pad = fp8_decode_padded_heads
    assert pad(heads) in (64, 128) and pad(heads) >= min(heads, 128)
    assert (pad(heads) == pad(heads * factor)) == (heads * factor <= 64 or heads > 64)


def test_rule_probes_report_what_some_kv_dtype_serves():
    probes = pl.rule_probes(V32)
    assert probes["PCP 2 x DCP 2"] is None  # with fp8_ds_mla
    assert probes["DCP = TP = 8"] is None  # with a bf16 cache


# --------------------------------------------------------------------- launch-level rules


def test_max_model_len_within_positions():
    l70 = cm.MODELS["Llama-3.1-70B"]
    check_max_model_len(l70, 131072)
    with pytest.raises(ConfigError, match=r"\[max-model-len-within-positions\]"):
        check_max_model_len(l70, 131073)
    positions = {k: m.max_position_embeddings for k, m in cm.MODELS.items()}
    assert positions["DeepSeek-V3"] == 163840 and positions["Qwen3-235B-A22B"] == 40960
    assert positions["Qwen2.5-7B-1M"] == 1010000 and positions["Llama-3.1-405B"] == 131072
    assert V32.max_position_embeddings == 163840  # read from config.json
    check_max_model_len(replace(l70, max_position_embeddings=0), 10**7)  # unknown: passes


@pytest.mark.parametrize(
    "gpus, per_node, pool, nnodes",
    [(8, 8, 16, 1), (16, 8, 16, 2), (12, 8, 16, 2), (10, 8, 16, 2), (14, 8, 16, 2), (6, 8, 8, 1)],
)
def test_check_nodes_counts_vllm_nnodes(gpus, per_node, pool, nnodes):
    assert check_nodes(Deployment(tp=1, dp=gpus), per_node, pool) == nnodes


@pytest.mark.parametrize("gpus", [9, 11, 13, 15])
def test_check_nodes_rejects_what_two_nodes_cannot_split(gpus):
    with pytest.raises(ConfigError, match=r"\[nnodes-divides-world\]"):
        check_nodes(Deployment(tp=1, dp=gpus), 8, 16)
    assert check_nodes(Deployment(tp=1, dp=gpus), 8, 8 * gpus) >= 3  # more nodes would


def test_check_nodes_needs_room_on_each_node():
    with pytest.raises(ConfigError, match=r"\[nnodes-divides-world\]"):
        check_nodes(Deployment(tp=12), 8, 12)  # 6 + 6 on a pool of 8 + 4
    assert check_nodes(Deployment(tp=8), 8, 12) == 1
    assert check_nodes(Deployment(tp=4, dp=3), 8, 16) == 2
