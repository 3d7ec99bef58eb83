"""cpbook.dcp.tpa and the TPA rules of cpbook.core.config: exact blocks, one all-gather fewer."""

from __future__ import annotations

import pytest

from cpbook.core.config import ConfigError, ParallelConfig
from cpbook.core.heads import attention_kv_heads, q_proj_heads, tpa_config
from cpbook.core.launch import run
from cpbook.dcp.tpa import tpa_costs
from cpbook.demos import demo_kwargs
from cpbook.demos.ch06_tpa import tpa_rank
from tests.rank_fns import in_sequence

LAYOUTS = [  # (attention, tp, dcp, q heads, kv heads, modes)
    ("gqa", 2, 2, 4, 1, ("standard", "tpa")),
    ("gqa", 4, 2, 8, 2, ("standard", "tpa")),
    ("gqa", 4, 4, 8, 1, ("standard", "tpa")),
    ("gqa", 4, 4, 8, 2, ("tpa",)),  # plain DCP rejects it: gqa-dcp-within-replicas
    ("gqa", 4, 2, 8, 4, ("tpa",)),  # 2 KV heads per DCP group
    ("mla", 2, 2, 4, 1, ("standard", "tpa")),
    ("mla", 4, 4, 8, 1, ("standard", "tpa")),
    ("mla", 4, 2, 8, 1, ("standard", "tpa")),
]
CASES = [(a, tp, dcp, q, kv, m) for a, tp, dcp, q, kv, modes in LAYOUTS for m in modes]


def _kw(attention, tp, dcp, q, kv, mode, **extra):
    """``tpa_rank``'s flat (CLI) parameters: TPA is the config's ``tensor_parallel_size_attention``
    (GQA) or ``dcp_q_replicate`` (MLA)."""
    tpa, mla = mode == "tpa", attention == "mla"
    return dict(
        use_mla=mla,
        tensor_parallel_size_attention=tp // dcp if tpa and not mla else None,
        dcp_q_replicate=tpa and mla,
        tensor_parallel_size=tp,
        decode_context_parallel_size=dcp,
        num_q_heads=q,
        num_kv_heads=kv,
        **extra,
    )


@pytest.mark.parametrize(
    "attention, tp, dcp, q, kv, mode, backend",
    [c + ("ag_rs",) for c in CASES] + [c + ("a2a",) for c in CASES[1::4]],
)
def test_block_is_exact_and_bytes_match(attention, tp, dcp, q, kv, mode, backend):
    kw = _kw(
        attention,
        tp,
        dcp,
        q,
        kv,
        mode,
        seq_lens=(33, 5, 1, 0 + 2),
        cp_kv_cache_interleave_size=2,
        dcp_comm_backend=backend,
    )
    res = run(tpa_rank, tp, fn_kwargs=demo_kwargs(tpa_rank, kw), report=False)
    assert max(r["max_abs_err"] for r in res) <= 1e-10
    assert all(r["comm"] == r["expected"] for r in res)


@pytest.mark.parametrize("attention", ["gqa", "mla"])
def test_tpa_has_exactly_one_all_gather_fewer(attention):
    kv = 2 if attention == "gqa" else 1
    std = run(tpa_rank, 4, fn_kwargs=demo_kwargs(tpa_rank, _kw(attention, 4, 2, 8, kv, "no")))
    tpa = run(tpa_rank, 4, fn_kwargs=demo_kwargs(tpa_rank, _kw(attention, 4, 2, 8, kv, "tpa")))
    for s, t in zip(std.traces, tpa.traces):
        assert s.count("all_gather") - t.count("all_gather") == 1
        assert [r.op for r in s][1:] == [r.op for r in t]  # the query all-gather is the first
    assert std[0]["comm"][1:] == tpa[0]["comm"]


def test_heads_and_costs():
    std = ParallelConfig(
        tensor_parallel_size=4, decode_context_parallel_size=2, num_q_heads=8, num_kv_heads=2
    )
    tpa = tpa_config(
        True, tensor_parallel_size=4, decode_context_parallel_size=2, num_q_heads=8, num_kv_heads=2
    )
    assert tpa.tensor_parallel_size_attention == 2
    assert [q_proj_heads(std, r) for r in range(4)] == [slice(2 * r, 2 * r + 2) for r in range(4)]
    assert [q_proj_heads(tpa, r) for r in range(4)] == [slice(0, 4)] * 2 + [slice(4, 8)] * 2
    assert [attention_kv_heads(tpa, r) for r in range(4)] == [slice(0, 1)] * 2 + [slice(1, 2)] * 2
    c_std, c_tpa = tpa_costs(std, 64, 3, 16), tpa_costs(tpa, 64, 3, 16)
    assert c_tpa["q_proj_flops"] == 2 * c_std["q_proj_flops"] == 2 * (2 * 3 * 64 * 2 * 16)
    assert c_tpa["extra_weight_bytes"] == c_std["q_proj_weight_bytes"] and c_std["extra_flops"] == 0


@pytest.mark.torchrun
def test_tpa_under_torchrun():
    """GQA and MLA TPA on 4 processes, one torchrun launch."""
    calls = [
        (
            "cpbook.demos.ch06_tpa:tpa_rank",
            _kw(a, 4, 4, 8, 2 if a == "gqa" else 1, "tpa", seq_lens=(21, 3)),
        )
        for a in ("gqa", "mla")
    ]
    res = run(in_sequence, 4, "torchrun", dict(calls=calls), dist_backend="gloo", report=False)
    for per_rank in res:
        assert max(r["max_abs_err"] for r in per_rank) <= 1e-10
        assert all(r["comm"] == r["expected"] for r in per_rank)


def test_plain_dcp_rejects_what_tpa_admits():
    kw = dict(tensor_parallel_size=4, decode_context_parallel_size=4, num_q_heads=8, num_kv_heads=2)
    with pytest.raises(ConfigError, match=r"^\[gqa-dcp-within-replicas\]"):
        ParallelConfig(**kw)
    assert ParallelConfig(**kw, tensor_parallel_size_attention=1).attention_tp == 1
    # vLLM PR #36287's own example: Nemotron-49B, 8 KV heads, 16 GPUs: DCP 4 needs TPA 4
    nemo = dict(tensor_parallel_size=16, num_q_heads=64, num_kv_heads=8)
    with pytest.raises(ConfigError, match=r"^\[gqa-dcp-within-replicas\]"):
        ParallelConfig(**nemo, decode_context_parallel_size=4)
    assert ParallelConfig(**nemo, decode_context_parallel_size=2).dcp == 2
    assert (
        ParallelConfig(
            **nemo, decode_context_parallel_size=4, tensor_parallel_size_attention=4
        ).attention_tp
        == 4
    )


@pytest.mark.parametrize(
    "kw, rule",
    [
        (
            dict(
                tensor_parallel_size=16,
                tensor_parallel_size_attention=3,
                num_q_heads=48,
                num_kv_heads=8,
            ),
            "tpa-divides-tp",
        ),
        (
            dict(
                tensor_parallel_size=16,
                tensor_parallel_size_attention=4,
                num_q_heads=64,
                num_kv_heads=8,
            ),
            "tpa-dcp-is-tp-over-tpa",
        ),
        (
            dict(
                tensor_parallel_size=16,
                tensor_parallel_size_attention=4,
                decode_context_parallel_size=2,
                num_q_heads=64,
                num_kv_heads=8,
            ),
            "tpa-dcp-is-tp-over-tpa",
        ),
        (
            dict(
                tensor_parallel_size=8,
                tensor_parallel_size_attention=4,
                decode_context_parallel_size=2,
                num_q_heads=8,
                num_kv_heads=8,
                prefill_context_parallel_size=2,
            ),
            "tpa-requires-pcp-1",
        ),
        (
            dict(
                tensor_parallel_size=8,
                tensor_parallel_size_attention=4,
                decode_context_parallel_size=2,
                num_q_heads=24,
                num_kv_heads=6,
            ),
            "tpa-heads-divisible",
        ),
        (
            dict(
                tensor_parallel_size=4,
                tensor_parallel_size_attention=0,
                decode_context_parallel_size=4,
                num_q_heads=8,
                num_kv_heads=2,
            ),
            "positive-sizes",
        ),
        (
            dict(
                tensor_parallel_size=4,
                decode_context_parallel_size=2,
                num_q_heads=8,
                num_kv_heads=2,
                dcp_q_replicate=True,
            ),
            "dcp-q-replicate-mla-only",
        ),
        (
            dict(
                tensor_parallel_size=4,
                num_q_heads=8,
                num_kv_heads=1,
                use_mla=True,
                dcp_q_replicate=True,
            ),
            "dcp-q-replicate-mla-only",
        ),
    ],
)
def test_tpa_rules_name_themselves(kw, rule):
    with pytest.raises(ConfigError, match=rf"^\[{rule}\] requires"):
        ParallelConfig(**kw)


def test_vllm_tpa_examples_are_valid():
    """The valid cases of vLLM's TPA config tests (tests/distributed/test_dcp_a2a.py, PR #36287)."""
    assert (
        ParallelConfig(
            tensor_parallel_size=8, tensor_parallel_size_attention=8, num_q_heads=32, num_kv_heads=8
        ).dcp
        == 1
    )
    assert (
        ParallelConfig(
            tensor_parallel_size=8,
            tensor_parallel_size_attention=1,
            decode_context_parallel_size=8,
            num_q_heads=16,
            num_kv_heads=1,
            use_mla=True,
        ).attention_tp
        == 1
    )


def test_bad_tpa_config_before_any_collective():
    with pytest.raises(ConfigError, match=r"\[tpa-divides-tp\]"):
        flat = dict(tensor_parallel_size=2, decode_context_parallel_size=2)
        run(
            tpa_rank,
            2,
            fn_kwargs=demo_kwargs(tpa_rank, {**flat, "tensor_parallel_size_attention": 3}),
        )
