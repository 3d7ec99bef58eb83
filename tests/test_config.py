"""config: every rule rejects what vLLM rejects, with the rule's name and the values."""

import pytest

from cpbook.core.config import ConfigError, ParallelConfig

P = ParallelConfig

INVALID = [
    # (kwargs, rule, a value that must appear in the message)
    (dict(tensor_parallel_size=0), "positive-sizes", "tensor_parallel_size=0"),
    (dict(decode_context_parallel_size=-2), "positive-sizes", "decode_context_parallel_size=-2"),
    (
        dict(prefill_context_parallel_size=1.5),
        "positive-sizes",
        "prefill_context_parallel_size=1.5",
    ),
    (dict(block_size=0), "positive-sizes", "block_size=0"),
    (dict(head_dim=True), "positive-sizes", "head_dim=True"),
    (dict(num_q_heads=8, num_kv_heads=3), "gqa-group-divisible-by-kv-heads", "num_kv_heads=3"),
    (
        dict(tensor_parallel_size=3, num_q_heads=8, num_kv_heads=8),
        "heads-divisible-by-tp",
        "num_q_heads=8",
    ),
    (
        dict(tensor_parallel_size=4, num_q_heads=12, num_kv_heads=6),
        "heads-divisible-by-tp",
        "num_kv_heads=6",
    ),
    (
        dict(
            tensor_parallel_size=6, decode_context_parallel_size=4, num_q_heads=12, num_kv_heads=2
        ),
        "tp-divisible-by-dcp",
        "decode_context_parallel_size=4",
    ),
    (
        dict(
            tensor_parallel_size=8, decode_context_parallel_size=3, num_q_heads=24, num_kv_heads=8
        ),
        "tp-divisible-by-dcp",
        "tensor_parallel_size=8",
    ),
    (
        dict(tensor_parallel_size=4, decode_context_parallel_size=2, num_q_heads=8, num_kv_heads=4),
        "gqa-dcp-needs-replicated-kv",
        "num_kv_heads=4",
    ),
    (
        dict(tensor_parallel_size=2, decode_context_parallel_size=2, num_q_heads=8, num_kv_heads=8),
        "gqa-dcp-needs-replicated-kv",
        "tensor_parallel_size=2",
    ),
    (
        dict(
            tensor_parallel_size=8, decode_context_parallel_size=4, num_q_heads=32, num_kv_heads=4
        ),
        "gqa-dcp-within-replicas",
        "decode_context_parallel_size=4",
    ),
    (
        dict(
            tensor_parallel_size=16, decode_context_parallel_size=4, num_q_heads=64, num_kv_heads=8
        ),
        "gqa-dcp-within-replicas",
        "num_kv_heads=8",
    ),  # Nemotron-49B-like: caps at DCP=2
    (
        dict(tensor_parallel_size=6, decode_context_parallel_size=2, num_q_heads=6, num_kv_heads=2),
        "gqa-q-per-kv-divisible-by-dcp",
        "num_q_heads=6",
    ),
    (
        dict(
            tensor_parallel_size=12, decode_context_parallel_size=4, num_q_heads=12, num_kv_heads=2
        ),
        "gqa-q-per-kv-divisible-by-dcp",
        "decode_context_parallel_size=4",
    ),
    (
        dict(
            tensor_parallel_size=4,
            decode_context_parallel_size=4,
            num_q_heads=4,
            num_kv_heads=1,
            block_size=16,
            cp_kv_cache_interleave_size=32,
        ),
        "interleave-le-block-size",
        "block_size=16",
    ),
    (
        dict(block_size=16, cp_kv_cache_interleave_size=6),
        "block-size-divisible-by-interleave",
        "cp_kv_cache_interleave_size=6",
    ),
    (
        dict(block_size=64, cp_kv_cache_interleave_size=24),
        "block-size-divisible-by-interleave",
        "block_size=64",
    ),
    (
        dict(
            tensor_parallel_size=2,
            prefill_context_parallel_size=2,
            decode_context_parallel_size=3,
            use_mla=True,
            num_kv_heads=1,
        ),
        "pcp-dcp-combination",
        "decode_context_parallel_size=3",
    ),
    (
        dict(
            tensor_parallel_size=4,
            prefill_context_parallel_size=2,
            decode_context_parallel_size=4,
            use_mla=True,
            num_kv_heads=1,
        ),
        "pcp-dcp-combination",
        "prefill_context_parallel_size=2",
    ),
    (dict(use_mla=True, num_kv_heads=2), "mla-single-latent", "num_kv_heads=2"),
    (dict(dcp_comm_backend="nccl"), "comm-backend", "dcp_comm_backend='nccl'"),
    (
        dict(
            tensor_parallel_size=4,
            prefill_context_parallel_size=2,
            decode_context_parallel_size=8,
            num_q_heads=8,
            num_kv_heads=4,
        ),
        "gqa-dcp-needs-replicated-kv",
        "num_kv_heads=4",
    ),
    (
        dict(
            tensor_parallel_size=4,
            num_q_heads=8,
            num_kv_heads=2,
            dcp_comm_backend="a2a",
            cp_kv_cache_interleave_size=0,
        ),
        "positive-sizes",
        "cp_kv_cache_interleave_size=0",
    ),
]


@pytest.mark.parametrize(
    "kwargs,rule,value", INVALID, ids=[f"{i}-{r}" for i, (_, r, _) in enumerate(INVALID)]
)
def test_invalid_configs_name_their_rule(kwargs, rule, value):
    with pytest.raises(ConfigError) as err:
        P(**kwargs)
    assert err.value.rule == rule
    assert isinstance(err.value, ValueError)
    assert str(err.value).startswith(f"[{rule}] requires ")
    assert value in str(err.value)


def test_enough_distinct_invalid_cases():
    assert len(INVALID) >= 20
    assert len({r for _, r, _ in INVALID}) >= 12


VALID = [
    dict(),
    dict(tensor_parallel_size=8, decode_context_parallel_size=4, num_q_heads=64, num_kv_heads=2),
    dict(
        tensor_parallel_size=6, decode_context_parallel_size=3, num_q_heads=12, num_kv_heads=2
    ),  # the article's
    dict(
        tensor_parallel_size=6,
        decode_context_parallel_size=3,
        num_q_heads=18,
        num_kv_heads=2,
        cp_kv_cache_interleave_size=4,
        dcp_comm_backend="a2a",
    ),
    dict(
        tensor_parallel_size=8,
        decode_context_parallel_size=8,
        num_q_heads=128,
        num_kv_heads=1,
        use_mla=True,
    ),
    dict(
        tensor_parallel_size=8, decode_context_parallel_size=2, num_q_heads=64, num_kv_heads=4
    ),  # Qwen3-235B
    dict(tensor_parallel_size=16, decode_context_parallel_size=2, num_q_heads=64, num_kv_heads=8),
    dict(block_size=16, cp_kv_cache_interleave_size=16),
    dict(
        block_size=64,
        cp_kv_cache_interleave_size=4,
        tensor_parallel_size=2,
        decode_context_parallel_size=2,
        num_q_heads=4,
        num_kv_heads=1,
    ),
    dict(tensor_parallel_size=1, prefill_context_parallel_size=4, num_q_heads=8, num_kv_heads=2),
    dict(
        tensor_parallel_size=2,
        prefill_context_parallel_size=2,
        decode_context_parallel_size=2,
        use_mla=True,
        num_kv_heads=1,
        num_q_heads=16,
    ),
    dict(
        tensor_parallel_size=4,
        prefill_context_parallel_size=2,
        decode_context_parallel_size=8,
        use_mla=True,
        num_kv_heads=1,
        num_q_heads=16,
    ),
    dict(tensor_parallel_size=4, num_q_heads=8, num_kv_heads=2),  # replication without DCP is fine
]


@pytest.mark.parametrize("kwargs", VALID)
def test_valid_configs(kwargs):
    c = P(**kwargs)
    assert c.world_size == c.tp * c.pcp
    assert c.virtual_block_size == c.block_size * c.dcp


def test_derived_quantities():
    c = P(tensor_parallel_size=6, decode_context_parallel_size=3, num_q_heads=18, num_kv_heads=2)
    assert (c.q_heads_per_rank, c.kv_head_replicas, c.attention) == (3, 3, "gqa")
    m = P(
        tensor_parallel_size=8,
        decode_context_parallel_size=8,
        num_q_heads=128,
        num_kv_heads=1,
        use_mla=True,
    )
    assert (m.kv_head_replicas, m.attention) == (8, "mla")


def test_dcp_group_must_hold_one_kv_head():
    """Stricter than vLLM's listed checks: tp=12, kv=2, dcp=4 passes them, but the DCP group
    [4, 5, 6, 7] would straddle KV heads 0 (ranks 0-5) and 1 (ranks 6-11)."""
    with pytest.raises(ConfigError) as err:
        P(tensor_parallel_size=12, decode_context_parallel_size=4, num_q_heads=24, num_kv_heads=2)
    assert err.value.rule == "gqa-dcp-group-shares-kv-head"
    P(tensor_parallel_size=12, decode_context_parallel_size=3, num_q_heads=24, num_kv_heads=2)
