"""cpbook.dynamic.migration: a running request moved from CP = N to CP = M decodes on exactly."""

from __future__ import annotations

import random

import pytest

from cpbook.core.launch import run
from cpbook.demos.ch07_migration import migration_rank
from cpbook.dynamic.migration import migration_bytes, migration_plan
from cpbook.kv.layout import local_seq_len

rng = random.Random(7)
CASES = (
    [  # (old, new, seq_len, old interleave, new interleave, block)
        (1, 2, rng.randint(1, 80), 1, rng.choice([1, 2, 4]), 4) for _ in range(3)
    ]
    + [(1, 4, rng.randint(1, 80), 1, rng.choice([1, 2, 4]), 4) for _ in range(3)]
    + [
        (1, 4, 3, 1, 1, 4),  # fewer tokens than ranks: empty shards
        (2, 4, 41, 2, 1, 4),  # grow a group
        (4, 2, 30, 1, 2, 2),  # shrink it
    ]
)


@pytest.mark.parametrize("old, new, seq_len, i_old, i_new, block", CASES)
def test_migration_exact_and_bytes_match(old, new, seq_len, i_old, i_new, block):
    kw = dict(
        src_context_parallel_size=old,
        decode_context_parallel_size=new,
        seq_len=seq_len,
        num_decode_steps=3,
        kv=dict(
            src_kv_cache_interleave_size=i_old, cp_kv_cache_interleave_size=i_new, block_size=block
        ),
    )
    res = run(migration_rank, max(old, new), fn_kwargs=kw, report=False)
    assert max(r["max_abs_err"] for r in res) <= 1e-10
    assert all(r["layout_exact"] for r in res)
    assert all(r["comm"] == r["expected"] for r in res)
    assert all(r["decode_comm"] == r["decode_expected"] for r in res)
    assert sum(r["bytes_sent"] for r in res) == res[0]["bytes_moved_formula"]
    assert sum(r["tokens_after"] for r in res) == seq_len


@pytest.mark.parametrize("seq_len, new, inter", [(0, 2, 1), (1, 4, 2), (37, 4, 2), (1000, 8, 16)])
def test_one_to_m_bytes_formula(seq_len, new, inter):
    e, kv, d = 8, 2, 8
    kept = local_seq_len(seq_len, new, 0, inter)
    assert migration_bytes(seq_len, 1, new, 1, inter, kv, d, e) == (seq_len - kept) * 2 * kv * d * e
    assert int(migration_plan(seq_len, 1, new, 1, inter).sum()) == seq_len


def test_bad_world_rejected_before_any_collective():
    with pytest.raises(RuntimeError, match="world-is-both-groups"):
        run(migration_rank, 2, fn_kwargs=dict(decode_context_parallel_size=4), report=False)
    with pytest.raises(RuntimeError, match="q-heads-divisible"):
        run(migration_rank, 4, fn_kwargs=dict(kv=dict(num_q_heads=6)), report=False)


@pytest.mark.torchrun
def test_migration_under_torchrun():
    kw = dict(decode_context_parallel_size=2, seq_len=29, kv=dict(cp_kv_cache_interleave_size=2))
    res = run(migration_rank, 2, "torchrun", kw, dist_backend="gloo", report=False)
    assert max(r["max_abs_err"] for r in res) <= 1e-10
    assert all(r["comm"] == r["expected"] for r in res)
    assert sum(r["bytes_sent"] for r in res) == res[0]["bytes_moved_formula"]
