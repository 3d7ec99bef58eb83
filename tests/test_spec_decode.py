"""cpbook.engine.spec_decode and speculative serving: drafters, greedy acceptance, rollback of
rejected rows on every rank, and token-exact output on TP x DCP x PCP grids."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cpbook.core.config import ConfigError, ParallelConfig
from cpbook.core.launch import run
from cpbook.demos.ch09_engine import serve_grid_rank
from cpbook.demos.ch10_spec import draft_engine_rank, spec_grid_runs
from cpbook.engine.engine import Engine, make_prompts, serve_rank
from cpbook.engine.models import TinyModel, reference_generate
from cpbook.engine.spec_decode import (
    DraftModelProposer,
    NgramProposer,
    SpeculativeConfig,
    check_vllm_spec_interleave,
    first_layer_drafter,
    greedy_accept,
)
from cpbook.kv.layout import DCPShard, local_seq_len
from cpbook.kv.manager import KVCacheManager
from cpbook.kv.paged import PagedKVCache
from tests.test_engine import references, sizes

pytestmark = pytest.mark.usefixtures("one_torch_thread")
NGRAM = dict(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1)
DRAFT = dict(method="draft", num_speculative_tokens=2)  # vLLM's default: the target's DCP
DRAFT_REPLICATED = dict(DRAFT, draft_decode_context_parallel_size=1)
WORK = dict(num_requests=6, max_new_tokens=6)
CACHE = dict(num_gpu_blocks=16)  # preempts on one rank


# -- the pieces ---------------------------------------------------------------------------
def test_ngram_proposes_after_the_earliest_longest_match():
    p = NgramProposer(SpeculativeConfig("ngram", 3, 1, 3))
    assert p.propose("r", [1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 3], 3) == [9, 1, 2]
    assert p.propose("r", [5, 6, 7], 3) == []
    assert p.propose("r", [4, 4, 4, 4], 2) == [4]  # what followed [4, 4, 4] at position 0
    assert SpeculativeConfig("ngram", 2).prompt_lookup_min == 5  # vLLM's default pair


def test_greedy_accept_keeps_the_matching_prefix_and_the_bonus():
    assert greedy_accept([7, 8, 9], [7, 8, 9, 10]) == [7, 8, 9, 10]
    assert greedy_accept([7, 5, 9], [7, 8, 9, 10]) == [7, 8]
    assert greedy_accept([], [3]) == [3]
    with pytest.raises(ConfigError, match=r"\[targets-per-draft\]"):
        greedy_accept([1], [1])


@pytest.mark.parametrize(
    "kwargs, rule",
    [
        (dict(num_speculative_tokens=0), "num-speculative-tokens"),
        (dict(method="eagle"), "spec-method"),
        (dict(prompt_lookup_min=4, prompt_lookup_max=2), "prompt-lookup-range"),
    ],
)
def test_config_errors_name_the_rule(kwargs, rule):
    with pytest.raises(ConfigError, match=rf"\[{rule}\]"):
        SpeculativeConfig(**kwargs)


def test_draft_model_must_share_the_vocabulary():
    target = TinyModel.from_name("tiny-gqa")
    with pytest.raises(ConfigError, match=r"\[draft-vocab-matches\]"):
        DraftModelProposer(TinyModel.from_name("tiny-gqa", vocab_size=50), 96)
    d = DraftModelProposer(first_layer_drafter(target), 96)
    toks = make_prompts(1)[0]
    first = d.propose("a", toks, 3)
    assert d.propose("a", toks + first[:1], 3)[:2] == first[1:]  # its KV rolled back and reused
    assert len(d.cache["a"][0]) == len(toks) + 3


# -- rollback: the paged caches equal those of the accepted tokens alone --------------------
@settings(max_examples=25, deadline=None)
@given(
    dcp=st.sampled_from([1, 2, 4]),
    interleave=st.sampled_from([1, 2]),
    steps=st.lists(st.tuples(st.integers(0, 1), st.integers(0, 4), st.integers(0, 4)), max_size=12),
)
def test_rollback_leaves_exactly_the_accepted_tokens(dcp, interleave, steps):
    """Two requests; each step one of them verifies ``k`` drafts and accepts ``a <= k`` (bonus
    token included).  Every rank's cache then reads back exactly the K of the accepted tokens,
    holds no other written slot, local lengths equal the formula, no block id is owned twice and
    every prefix-cache entry names a block whose tokens are all accepted."""
    bs = 2
    kv = KVCacheManager(64, bs, dcp, interleave, enable_prefix_caching=True)
    caches = [PagedKVCache(64, bs, 1, 1, 0, shard=DCPShard(dcp, r, interleave)) for r in range(dcp)]
    tokens = {"x": [1, 2, 3], "y": [4, 5, 6, 7, 8]}  # no shared prefix: ids unshared

    def value(pos: int, tok: int) -> float:
        return pos * 1000.0 + tok

    def write(rid: str, start: int, toks: list[int]) -> None:
        table = kv.block_table(rid)
        pos = torch.arange(start, start + len(toks))
        k = torch.tensor([[[value(p, t)]] for p, t in zip(pos.tolist(), toks)], dtype=torch.float64)
        for c in caches:
            c.write(k, None, c.slot_mapping(pos, table))

    for rid, t in tokens.items():
        kv.allocate(rid, len(t), t)
        write(rid, 0, t)
    for who, k, a in steps:
        rid = "xy"[who]
        a = min(a, k)
        start = len(tokens[rid])
        real = [(start * 7 + j) % 11 for j in range(k + 1)]  # row 0 and the target's tokens
        rows = real[: a + 1] + [99] * (k - a)  # the first a drafts match, the rest do not
        kv.append(rid, k + 1, rows)
        write(rid, start, rows)
        table = kv.block_table(rid)
        keep = start + a + 1
        kv.truncate(rid, keep)
        pos = torch.arange(keep, start + k + 1)
        for c in caches:
            c.invalidate(c.slot_mapping(pos, table))
        tokens[rid] = tokens[rid] + real[: a + 1]
    owned = [b for rid in tokens for b in kv.block_table(rid).tolist()]
    assert len(owned) == len(set(owned))
    for rid, t in tokens.items():
        assert kv.num_tokens(rid) == len(t)
        table = kv.block_table(rid)
        for r, c in enumerate(caches):
            k, _, pos = c.read(table, len(t))
            assert k.shape[0] == local_seq_len(len(t), dcp, r, interleave)
            assert k[:, 0, 0].tolist() == [value(p, t[p]) for p in pos.tolist()]
    for r, c in enumerate(caches):
        assert int(c.written.sum()) == sum(
            local_seq_len(len(t), dcp, r, interleave) for t in tokens.values()
        )
    vb = bs * dcp
    for h, blk in kv.cached.items():
        rid = next(rid for rid in tokens if blk in kv.block_table(rid).tolist())
        b = kv.block_table(rid).tolist().index(blk)
        assert (b + 1) * vb <= len(tokens[rid])  # a cached block holds accepted tokens only


# -- the engine: speculative output equals non-speculative output -------------------------
@pytest.mark.parametrize("spec", [NGRAM, DRAFT], ids=["ngram", "draft"])
def test_one_rank_speculative_logits_match_the_reference(spec):
    """Preemption and prefix caching happen; every emitted token's logits row equals the
    contiguous-cache reference's (float64), and rejected rows were rolled back."""
    for name in ("tiny-gqa", "tiny-mla"):
        res = run(
            serve_rank,
            1,
            "inline",
            {"model": name, "workload": WORK, "cache_config": CACHE, "speculative_config": spec},
            report=False,
        )[0]
        m = TinyModel.from_name(name)
        assert res["preemptions"] >= 1 and res["prefix_hit_tokens"] > 0
        assert res["spec"]["drafted"] > res["spec"]["accepted"] > 0
        for p, toks, logits in zip(res["prompts"], res["tokens"], res["logits"]):
            ref, ref_logits = reference_generate(m, p, WORK["max_new_tokens"], True)
            assert toks == ref
            assert (logits - ref_logits).abs().max().item() <= 1e-10


def _check_grid(runs, worlds, backend, refs) -> int:
    checked = 0
    for world in worlds:
        res = run(
            serve_grid_rank, world, backend, {"runs": runs}, dist_backend="gloo", report=False
        )
        for j, r in enumerate(res[0]):
            for rank in res:
                assert rank[j]["tokens"] == refs[r["model"]], (
                    r["model"],
                    r["tp"],
                    r["dcp"],
                    r["pcp"],
                )
            assert r["spec"]["accepted"] > 0
            checked += 1
    return checked


def test_inline_grid_subset_token_exact():
    """DCP inside TP (GQA 4x2x1, MLA 2x2x1), over PCP (GQA 1x2x2) and world-wide MLA (2x4x2),
    n-gram and a draft at DCP = the target's (sharded) and at DCP 1 (replicated); all 23
    layouts x the three run in notebooks/10_spec_decode.ipynb."""
    pick = {
        ("tiny-gqa", 1, 2, 2),
        ("tiny-mla", 2, 2, 1),
        ("tiny-gqa", 4, 2, 1),
        ("tiny-mla", 2, 4, 2),
    }
    refs = references(WORK)
    n = 0
    for spec in (NGRAM, DRAFT, DRAFT_REPLICATED):
        runs = [
            r
            for r in spec_grid_runs(spec, workload=WORK, cache_config=CACHE)
            if (r["model"], *sizes(r)) in pick
        ]
        n += _check_grid(runs, [2, 4], "inline", refs)
    assert n == 12


@pytest.mark.torchrun
def test_torchrun_world_2_subset_token_exact():
    small = dict(num_requests=4, max_new_tokens=6)
    runs = [
        r
        for r in spec_grid_runs(NGRAM, workload=small)
        if (r["model"], *sizes(r)) in {("tiny-gqa", 1, 2, 2), ("tiny-mla", 2, 2, 1)}
    ]
    assert _check_grid(runs, [2], "torchrun", references(small)) == 2


# -- the draft's DCP: vLLM v0.34.0's draft_decode_context_parallel_size ---------------------
def test_draft_dcp_is_one_or_the_targets():
    assert SpeculativeConfig("draft").draft_dcp(4) == 4  # default: the target's
    assert SpeculativeConfig("draft", draft_decode_context_parallel_size=1).draft_dcp(4) == 1
    assert SpeculativeConfig("draft", draft_decode_context_parallel_size=4).draft_dcp(4) == 4
    with pytest.raises(ConfigError, match=r"\[draft-dcp-one-or-target\].*=2.*=4"):
        SpeculativeConfig("draft", draft_decode_context_parallel_size=2).draft_dcp(4)
    with pytest.raises(ConfigError, match=r"\[draft-dcp-positive\]"):
        SpeculativeConfig("draft", draft_decode_context_parallel_size=0)
    with pytest.raises(RuntimeError, match=r"\[draft-dcp-one-or-target\]"):  # the engine asks
        run(
            draft_engine_rank,
            2,
            fn_kwargs=dict(draft_decode_context_parallel_size=4, num_requests=1),
            report=False,
        )


@pytest.mark.parametrize(
    "model, sizes, world",
    [
        ("tiny-mla", None, 2),
        ("tiny-mla", dict(tensor_parallel_size=2, decode_context_parallel_size=2,
                          prefill_context_parallel_size=2, dcp_comm_backend="a2a"), 4),
        ("tiny-gqa", dict(tensor_parallel_size=4, decode_context_parallel_size=2,
                          cp_kv_cache_interleave_size=2, block_size=4), 4),
    ],
)  # fmt: skip
@pytest.mark.parametrize("draft_dcp", [1, None])
def test_draft_placements_token_exact_rows_and_bytes(model, sizes, world, draft_dcp):
    """Replicated (draft DCP 1) and sharded (vLLM's default, the target's DCP): plain greedy
    tokens on every rank, the draft KV rows each rank holds = ``draft_kv_rows`` after every
    step, and the drafting's traced collectives = ``draft_step_comm_bytes``."""
    kw = dict(model=model, parallel_config=sizes, draft_decode_context_parallel_size=draft_dcp)
    res = run(draft_engine_rank, world, fn_kwargs=kw, report=False)
    for r in res:
        assert r["token_exact"] and r["rows_match"] and r["comm"] == r["expected"]
        assert r["placement"] == ("replicated" if draft_dcp == 1 else "sharded")
        dcp_ops = [op for op, _ in r["comm"] if op != "all_reduce"]
        assert (dcp_ops == []) == (draft_dcp == 1)
    peak = [r["peak_rows"] for r in res]
    if draft_dcp == 1:  # every rank holds every row
        assert len(set(peak)) == 1
    else:  # a share of them
        assert max(peak) < res[0]["longest"] * 4 and sum(peak) > 0


def test_vllm_refuses_any_speculation_with_cp_interleave_above_one():
    """``check_attention_cp_compatibility`` (vllm/v1/worker/cp_utils.py, v0.34.0)."""
    cfg = dict(num_q_heads=8, num_kv_heads=1, head_dim=16, use_mla=True, block_size=4)
    ok = [
        ParallelConfig(tensor_parallel_size=2, decode_context_parallel_size=2, **cfg),
        ParallelConfig(tensor_parallel_size=2, cp_kv_cache_interleave_size=2, **cfg),
    ]
    for c in ok:
        check_vllm_spec_interleave(c)
    bad = ParallelConfig(
        tensor_parallel_size=2, decode_context_parallel_size=2, cp_kv_cache_interleave_size=2, **cfg
    )
    with pytest.raises(ConfigError, match=r"\[spec-cp-interleave-one\]"):
        check_vllm_spec_interleave(bad)
    check_vllm_spec_interleave(bad, backend_supports_interleave=True)  # FlashMLA sparse


@pytest.mark.torchrun
def test_torchrun_replicated_draft_token_exact():
    """The replicated draft under torchrun (2 processes, gloo): plain greedy tokens, no DCP
    collective, traced bytes = formula."""
    kw = dict(draft_decode_context_parallel_size=1, num_requests=2, max_new_tokens=6)
    res = run(draft_engine_rank, 2, "torchrun", fn_kwargs=kw, report=False)
    for r in res:
        assert r["token_exact"] and r["rows_match"] and r["comm"] == r["expected"]
        assert {op for op, _ in r["comm"]} == {"all_reduce"}


def test_engine_builds_a_separately_seeded_draft():
    eng = Engine(
        "tiny-gqa",
        speculative_config=dict(method="draft", num_speculative_tokens=2, model="tiny-gqa"),
    )
    assert eng.proposer.draft.config.num_hidden_layers == 2
    assert not torch.equal(eng.proposer.draft.embed, eng.model.embed)  # seed + 1


# -- the CLI ------------------------------------------------------------------------------
def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cpbook", *args], capture_output=True, text=True)


@pytest.mark.parametrize(
    "argv, rule",
    [
        (["--spec", "ngram", "--num-spec-tokens", "0"], "num-speculative-tokens"),
        (["--spec", "medusa"], "spec-method"),
        (["--spec", "draft", "--draft-model", "VOCAB50"], "draft-vocab-matches"),
    ],
)
def test_cli_errors_are_one_line_exit_2(argv, rule, tmp_path):
    (tmp_path / "config.json").write_text(
        '{"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 50, '
        '"hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 8, '
        '"num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 64, '
        '"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 256, '
        '"tie_word_embeddings": false}'
    )
    argv = [str(tmp_path) if a == "VOCAB50" else a for a in argv]
    p = _cli("serve", *argv)
    assert p.returncode == 2 and p.stdout == ""
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"cpbook: error: [{rule}] requires")


def test_cli_summary_reports_acceptance():
    p = _cli(
        "serve",
        "--tp",
        "4",
        "--dcp",
        "2",
        "--spec",
        "ngram",
        "--num-spec-tokens",
        "3",
        "--prompt-lookup-min",
        "1",
        "--requests",
        "3",
        "--max-new-tokens",
        "6",
        "--json",
    )
    assert p.returncode == 0, p.stderr
    import json

    summary = json.loads(p.stdout.strip().splitlines()[-1])
    assert summary["name"] == "engine_summary" and summary["dcp"] == 2
    assert 0 < summary["acceptance_rate"] <= 1 and summary["mean_accepted_tokens"] >= 1
