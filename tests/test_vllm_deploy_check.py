"""Chapter 11's lines against the stored run of ``bench/vllm_deploy_check.py`` (vLLM v0.34.0's
own config, engine and worker code on a CPU), without importing vLLM: the planner still prints
the stored lines, cpbook's rules reject exactly the lines vLLM rejected, and the book's
KV-cache capacity agrees with vLLM's own."""

from __future__ import annotations

import pytest

from cpbook.core.config import ConfigError, ParallelConfig
from cpbook.costmodel.memory import Deployment
from cpbook.data import HF_CONFIGS, hf_config_json
from cpbook.planner import deploy_examples as de
from cpbook.planner.vllm_rules import check_pcp_dcp_comm_backend

STORED = de.vllm_verdicts()


def test_stored_run_is_the_anchored_release_and_covers_every_example():
    assert STORED["name"] == "vllm_deploy_check" and STORED["vllm"] == "0.34.0"
    assert set(STORED["questions"]) == set(de.QUESTIONS)
    assert set(STORED["violations"]) == set(de.VIOLATIONS)


@pytest.mark.parametrize("key", sorted(de.QUESTIONS))
def test_stored_lines_are_what_the_planner_prints(key):
    stored = STORED["questions"][key]
    lines = de.serve_lines(key)
    assert [row["line"] for row in stored["lines"]] == lines
    assert lines[0] == de.answer(key).command()
    assert all(row["accepted"] for row in stored["lines"])
    assert all(de.cpbook_rule(line) is None for line in lines)


def test_the_questions_answers_use_dcp_and_span_the_nodes_asked():
    for key in de.QUESTIONS:
        assert de.answer(key).winner.deployment.dcp > 1, key
    nodes = de.serve_lines("mla-two-nodes")
    assert len(nodes) == 2 and all("--nnodes 2" in line for line in nodes)
    assert "--headless" in nodes[1] and "--headless" not in nodes[0]
    assert all(len(de.serve_lines(k)) == 1 for k in ("small-mla", "gqa-node"))


@pytest.mark.parametrize("key", sorted(de.VIOLATIONS))
def test_every_violation_is_rejected_by_vllm_and_by_the_named_cpbook_rule(key):
    v, stored = de.VIOLATIONS[key], STORED["violations"][key]
    assert stored["line"] == v.line and stored["cpbook_rule"] == v.cpbook_rule
    assert not stored["accepted"]
    assert stored["message"] and stored["raised_at"].startswith("vllm/")
    assert de.cpbook_rule(v) == v.cpbook_rule
    assert de.cpbook_rule(v.line) == v.cpbook_rule  # the model read from the line's repository
    assert stored["fix"]["line"] == v.fix and stored["fix"]["accepted"]
    assert de.cpbook_rule(v.fix) is None


def test_cpbook_rejects_exactly_the_lines_vllm_rejected():
    rows = [r for q in STORED["questions"].values() for r in q["lines"]]
    rows += list(STORED["violations"].values())
    rows += [v["fix"] for v in STORED["violations"].values()]
    for row in rows:
        assert (de.cpbook_rule(row["line"]) is None) == row["accepted"], row["line"]


@pytest.mark.parametrize("key", sorted(de.QUESTIONS))
def test_stored_kv_capacity_agrees_with_the_book_within_one_block_per_rank(key):
    cap = STORED["questions"][key]["kv_capacity"]
    assert cap["free_kv_bytes_per_gpu"] == de.FREE_KV_BYTES_PER_GPU
    winner = de.answer(key).winner
    assert cap["kv_dtype"] == winner.kv_dtype
    assert (cap["dcp"]["dcp"], cap["no_dcp"]["dcp"]) == (winner.deployment.dcp, 1)
    model = de.QUESTIONS[key].spec()
    for d, row in ((winner.deployment, cap["dcp"]), (de.without_dcp(winner.deployment), None)):
        row = row or cap["no_dcp"]
        book = de.book_kv_capacity_tokens(model, d, winner.kv_dtype, de.FREE_KV_BYTES_PER_GPU)
        assert row["book_tokens"] == book
        assert 0 <= book - row["vllm_tokens"] < row["block_size"] * d.dcp
        assert row["vllm_log"].startswith(f"GPU KV cache size: {row['vllm_tokens']:,} tokens")
        assert row["vllm_log_at"].startswith("vllm/v1/core/kv_cache_utils.py:")
    on, off, dcp = cap["dcp"], cap["no_dcp"], cap["dcp"]["dcp"]
    assert abs(on["vllm_tokens"] - dcp * off["vllm_tokens"]) < on["block_size"] * dcp
    assert abs(on["book_tokens"] - dcp * off["book_tokens"]) < dcp


def test_without_dcp_keeps_the_rest_of_the_deployment():
    d = Deployment(tp=8, dcp=8, dp=2, tpa=True)
    assert de.without_dcp(d) == Deployment(tp=8, dp=2)


def test_pcp_dcp_needs_ag_rs():
    sparse = de.model_spec("DeepSeek-V3.2")
    cfg = ParallelConfig.for_model(
        sparse,
        tensor_parallel_size=4,
        prefill_context_parallel_size=2,
        decode_context_parallel_size=2,
        dcp_comm_backend="a2a",
    )
    with pytest.raises(ConfigError, match=r"\[pcp-dcp-needs-ag-rs\]"):
        check_pcp_dcp_comm_backend(cfg)
    for ok in (
        ParallelConfig.for_model(sparse, tensor_parallel_size=4, prefill_context_parallel_size=2),
        ParallelConfig.for_model(sparse, tensor_parallel_size=8, decode_context_parallel_size=8),
    ):
        check_pcp_dcp_comm_backend(ok)
    line = de.VIOLATIONS["pcp-dcp-a2a"].line
    assert de.cpbook_rule(line.replace("a2a", "ag_rs")) is None


def test_hf_configs_ship_every_model_the_examples_use():
    used = {q.model for q in de.QUESTIONS.values()} | {v.model for v in de.VIOLATIONS.values()}
    assert used <= set(HF_CONFIGS)
    for name in HF_CONFIGS:
        cfg = hf_config_json(name)
        assert cfg["architectures"] and cfg["model_type"] and cfg["num_hidden_layers"] > 0
    with pytest.raises(ValueError, match=r"\[hf-config-name\]"):
        hf_config_json("no-such-model")
