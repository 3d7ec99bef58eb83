"""Tests for the deployment planner: cpbook.planner.plan, plan_space, plan_advice, vllm_rules,
serve_flags and ``python -m cpbook plan``.

The properties of issue 19 (every ranked deployment passes the rules and holds the concurrency;
more GPUs never worsen the best objective; a tighter target never improves it; the printed
flags parse back; ``plan`` equals a brute-force search), the four wrong answers of the old
decision path as tests of the right ones, every vLLM v0.34 rule by name, and the CLI."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shlex
import subprocess
import sys
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpbook import costmodel as cm
from cpbook import planner as pl
from cpbook.cli import main
from cpbook.cli.plan import parse_seconds, parse_tokens
from cpbook.core.config import ConfigError
from cpbook.costmodel import Deployment
from cpbook.planner import ServingWorkload, plan
from cpbook.planner.hf_config import model_from_hf_config
from cpbook.planner.plan_advice import fmt_rate, plural
from cpbook.planner.serve_flags import vllm_kv_cache_dtype

from .test_hf_config import DSV32, GLM5

K, M = 1024, 1024**2
DSV3, L8B, L70B = (cm.MODELS[k] for k in ("DeepSeek-V3", "Llama-3.1-8B", "Llama-3.1-70B"))
V32 = model_from_hf_config(DSV32, name="DeepSeek-V3.2-Exp")
H200 = cm.GPUS["H200"]
OBJ = pl.OBJECTIVES
FP8_KV = ("bf16", "fp8")
QWEN_MOE = cm.MODELS["Qwen3-235B-A22B"]


def best_value(p, objective):
    """The winner's objective as ranked (lower is better); +inf when nothing serves."""
    return pl.objective_value(p.winner, objective) if p.winner else math.inf


models = st.sampled_from(
    [DSV3, L8B, L70B, V32, cm.MODELS["Qwen3-235B-A22B"], cm.MODELS["Qwen2.5-7B-1M"]]
)
workloads = st.builds(
    ServingWorkload,
    prompt_tokens=st.sampled_from([1 * K, 4 * K, 32 * K, 128 * K, 512 * K, M]),
    output_tokens=st.sampled_from([1, 256, 1 * K]),
    concurrency=st.sampled_from([1, 3, 16, 64, 512]),
    ttft_target_s=st.sampled_from([None, 0.5, 5.0, 60.0]),
    tpot_target_s=st.sampled_from([None, 0.01, 0.05]),
    kv_dtypes=st.sampled_from([("bf16",), ("fp8",), ("bf16", "fp8")]),
)
gpus = st.sampled_from(["H200", "H100", "B200"])
objectives = st.sampled_from(OBJ)


# ------------------------------------------------------------------------------ properties


@settings(max_examples=40, deadline=None)
@given(model=models, gpu=gpus, n=st.integers(1, 8), w=workloads, objective=objectives)
def test_ranked_layouts_pass_the_rules_and_hold_the_workload(model, gpu, n, w, objective):
    p = plan(model, gpu, n, w, objective=objective, advise=False)
    g = cm.get_gpu(gpu)
    for e in p.ranked:
        e.deployment.config(model)  # ParallelConfig
        pl.check_deployment(model, e.deployment, e.kv_dtype)
        assert e.num_gpus <= n and e.drop is None
        mem = w.memory_utilization
        cap = cm.max_concurrency(
            model, g, e.deployment, w.request_tokens, e.kv_dtype, gpu_memory_utilization=mem
        )
        assert e.capacity == cap >= w.concurrency and e.batch == w.concurrency
        assert w.ttft_target_s is None or e.ttft_s <= w.ttft_target_s
        assert w.tpot_target_s is None or e.tpot_s <= w.tpot_target_s
    values = [pl.objective_value(e, objective) for e in p.ranked]
    assert values == sorted(values)


@settings(max_examples=25, deadline=None)
@given(model=models, n=st.integers(1, 16), w=workloads, objective=st.sampled_from((pl.AUTO, *OBJ)))
def test_plan_equals_brute_force(model, n, w, objective):
    """The pruned enumeration, with its caches, ranks exactly what the unpruned product of
    every size in 1..n (each checked by the rules, priced without a cache) ranks."""
    p = plan(model, H200, n, w, objective=objective, advise=False)
    assert list(p.ranked) == pl.brute_force(model, H200, n, w, objective)


@settings(max_examples=10, deadline=None)
@given(
    model=st.sampled_from([DSV3, QWEN_MOE]),
    n=st.integers(8, 16),
    prompt=st.sampled_from([4 * K, 32 * K, 128 * K]),
    concurrency=st.sampled_from([1, 16, 128]),
    objective=st.sampled_from((pl.AUTO, *OBJ)),
)
def test_plan_equals_brute_force_for_moe_with_ep(model, n, prompt, concurrency, objective):
    """MoE models on 8-16 GPUs, where EP's all-to-all spans the DP replicas (so a replica's
    prefill depends on DP): the cache keys must say so."""
    w = ServingWorkload(prompt, 1 * K, concurrency)
    p = plan(model, H200, n, w, objective=objective, advise=False)
    assert list(p.ranked) == pl.brute_force(model, H200, n, w, objective)
    assert any(e.deployment.ep for e in p.ranked + p.dropped)


@settings(max_examples=25, deadline=None)
@given(model=models, gpu=gpus, n=st.integers(1, 8), extra=st.integers(1, 8), w=workloads,
       objective=objectives)  # fmt: skip
def test_more_gpus_never_worsen_the_best(model, gpu, n, extra, w, objective):
    few = plan(model, gpu, n, w, objective=objective, advise=False)
    more = plan(model, gpu, n + extra, w, objective=objective, advise=False)
    assert best_value(more, objective) <= best_value(few, objective)


@settings(max_examples=25, deadline=None)
@given(model=models, n=st.integers(1, 8), w=workloads, objective=objectives,
       tighter=st.floats(0.05, 1.0))  # fmt: skip
def test_a_tighter_target_never_improves_the_best(model, n, w, objective, tighter):
    loose = plan(model, H200, n, w, objective=objective, advise=False)
    if loose.winner is None:
        return
    tight_w = ServingWorkload(
        w.prompt_tokens,
        w.output_tokens,
        w.concurrency,
        loose.winner.ttft_s * tighter,
        (w.tpot_target_s or loose.winner.tpot_s) * tighter,
        w.kv_dtypes,
    )
    tight = plan(model, H200, n, tight_w, objective=objective, advise=False)
    assert best_value(tight, objective) >= best_value(loose, objective)
    assert {e.deployment for e in tight.ranked} <= {e.deployment for e in loose.ranked}


@settings(max_examples=30, deadline=None)
@given(model=models, n=st.integers(1, 16), w=workloads)
def test_printed_flags_parse_back_into_the_same_layout(model, n, w):
    p = plan(model, H200, n, w, advise=False)
    for e in p.ranked[:6]:
        assert pl.parse_serve_command(p.command(e)) == (e.deployment, e.kv_dtype)
        short = "vllm serve m " + pl.deployment_flags(model, e.deployment, e.kv_dtype)
        assert pl.parse_serve_command(short) == (e.deployment, e.kv_dtype)


def test_estimates_are_the_cost_models_numbers():
    w = ServingWorkload(128 * K, 512, 16, kv_dtypes=("bf16", "fp8"))
    p = plan(DSV3, H200, 8, w, advise=False)
    assert p.ranked
    for e in p.ranked:
        kw = {"knobs": cm.CostKnobs(kv_dtype=e.kv_dtype)}
        assert e.weight_bytes == cm.deployment_weight_bytes(DSV3, e.deployment)
        mem = w.memory_utilization  # vLLM v0.34's default, 1.0
        assert e.kv_budget_bytes == cm.deployment_kv_budget(DSV3, H200, e.deployment, mem)
        assert e.prefill == cm.ttft(DSV3, H200, e.deployment, w.prompt_tokens)
        agg = dict(kw, batching=cm.ContinuousBatching(w.prompt_tokens, w.output_tokens))
        assert e.decode == cm.tpot(DSV3, H200, e.deployment, w.request_tokens, e.batch, **agg)
        assert e.decode.prefill_s > 0  # continuous batching: steps carry prefill chunks
        rate = cm.decode_throughput(DSV3, H200, e.deployment, w.request_tokens, e.batch, **kw)
        assert e.decode_tokens_per_s_per_gpu == rate
        assert e.tokens_per_s_per_gpu < rate  # the prefill term costs something


def test_pareto_frontiers():
    w = ServingWorkload(32 * K, 1 * K, 16)
    p = plan(DSV3, H200, 16, w, objective="throughput")
    for frontier, t in ((p.frontier_ttft, "ttft_s"), (p.frontier_tpot, "tpot_s")):
        assert frontier and frontier[-1].tokens_per_s_per_gpu == p.winner.tokens_per_s_per_gpu
        for f in frontier:  # nobody beats a frontier point on both
            assert not any(
                getattr(e, t) < getattr(f, t) and e.tokens_per_s_per_gpu > f.tokens_per_s_per_gpu
                for e in p.ranked
            )
        for e in p.ranked:  # every other point is matched or beaten on both by one of them
            assert any(
                getattr(f, t) <= getattr(e, t) and f.tokens_per_s_per_gpu >= e.tokens_per_s_per_gpu
                for f in frontier
            )


def _dominates(f, e) -> bool:
    a = (f.ttft_s, f.tpot_s, -f.tokens_per_s_per_gpu)
    b = (e.ttft_s, e.tpot_s, -e.tokens_per_s_per_gpu)
    return all(x <= y for x, y in zip(a, b)) and a != b


def _pareto_by_brute_force(rows):
    """Rows nothing dominates, one per set of rows equal on all three (the first by key)."""
    keep = [e for e in rows if not any(_dominates(f, e) for f in rows)]
    first = {}
    for e in sorted(keep, key=lambda e: e.key()):
        first.setdefault((e.ttft_s, e.tpot_s, e.tokens_per_s_per_gpu), e)
    return sorted(first.values(), key=lambda e: e.key())


@settings(max_examples=15, deadline=None)
@given(model=models, n=st.integers(1, 16), w=workloads)
def test_pareto_set_equals_a_brute_force_dominance_check(model, n, w):
    p = plan(model, H200, n, w, advise=False)
    assert sorted(p.frontier, key=lambda e: e.key()) == _pareto_by_brute_force(p.ranked)


def test_pareto_drops_dominated_ties_and_duplicates():
    p = plan(L8B, H200, 8, ServingWorkload(32 * K, 1 * K, 16), advise=False)
    a = p.winner
    slower = replace(a, deployment=replace(a.deployment, dp=2), tokens_per_s_per_gpu=1.0)
    twin = replace(a, deployment=replace(a.deployment, dp=3))  # equal on all three metrics
    front = pl.pareto([slower, twin, a])
    assert front == [a]  # the tie on TTFT and TPOT with fewer tokens/s is dominated; one twin
    assert pl.pareto([slower]) == [slower]


# ------------------------------------------------------------------ objective, columns, words


def test_objective_follows_the_workload():
    """Up to the concurrency where decode's KV reads reach its weight reads, latency; above
    it, tokens/s per GPU.  DeepSeek-V3 with one 4K request on 8 GPUs: TP8 (lowest latency),
    not the 6-GPU TP2+PCP3+EP that the throughput objective picks."""
    w = ServingWorkload(4 * K, 1 * K, 1)
    sat = pl.saturation_concurrency(DSV3, w)
    kv = cm.kv_bytes_per_token(DSV3) * w.request_tokens
    experts = cm.gpu_terms.touched_experts(256, 8, sat) * DSV3.expert_size_params * 58
    weights = (DSV3.num_params - DSV3.expert_params) * DSV3.weight_bytes_per_param
    assert sat * kv >= weights + experts * DSV3.weight_bytes_per_param
    assert pl.resolve_objective(DSV3, w, pl.AUTO)[0] == "latency"
    p = plan(DSV3, H200, 8, w)
    assert p.objective == "latency" and p.winner.deployment == Deployment(tp=8)
    assert p.objective_reason.startswith("objective latency: 1 in flight")
    thr = plan(DSV3, H200, 8, w, objective="throughput")
    assert thr.winner.deployment.pcp > 1 and thr.winner.latency_s > p.winner.latency_s
    crowd = ServingWorkload(4 * K, 1 * K, sat + 1)
    assert plan(DSV3, H200, 8, crowd, advise=False).objective == "throughput"
    assert plan(L8B, H200, 8, ServingWorkload(4 * K, 1 * K, 512), advise=False).objective == (
        "throughput"
    )


@settings(max_examples=30, deadline=None)
@given(model=models, prompt=st.integers(1, 2 * M), longer=st.integers(0, M))
def test_saturation_is_the_first_kv_bound_batch(model, prompt, longer):
    w = ServingWorkload(prompt, 1 * K)
    sat = pl.saturation_concurrency(model, w)
    assert sat >= 1
    assert pl.saturation_concurrency(model, ServingWorkload(prompt + longer, 1 * K)) <= sat


def test_two_tpot_columns_are_labelled(capsys):
    argv = ["plan", "--model", "Llama-3.1-70B", "--gpus", "8", "--context", "128K"]
    assert main([*argv, "--concurrency", "4", "--objective", "tpot"]) == 0
    out = capsys.readouterr().out.splitlines()
    header = next(line for line in out if "deployment" in line and "GPUs" in line)
    assert header.split()[-4:] == ["TTFT", "step", "TPOT+pf", "tok/s/GPU"]
    assert any(line.startswith("step: one decode step alone") for line in out)
    p = plan(L70B, H200, 8, ServingWorkload(128 * K, 1 * K, 4), objective="tpot")
    for e in p.ranked:
        assert e.step_s == e.decode.step_s <= e.tpot_s == e.decode.total_s
        row = pl.estimate_record(e)
        assert row["decode_step_s"] <= row["tpot_s"]
    assert any(e.tpot_s > e.step_s for e in p.ranked)  # other requests' prefill chunks


def test_reasons_name_the_driver_and_never_a_dash():
    """The throughput winner for one 4K DeepSeek-V3 request uses PCP because without it the
    weights of TP2+EP do not fit (not because of TTFT); no number prints as "-"."""
    p = plan(DSV3, H200, 8, ServingWorkload(4 * K, 1 * K, 1), objective="throughput")
    assert p.winner.deployment.pcp > 1
    line = next(r for r in p.reasons if r.startswith(f"PCP{p.winner.deployment.pcp}:"))
    assert "weights fit" in line and "does not fit: its weights" in line
    assert pl.plan_advice.fmt_s(math.inf) == "not timed"
    for q in (p, plan(DSV3, H200, 8, ServingWorkload(4 * K, 1 * K, 1))):
        for r in q.reasons:
            assert not re.search(r"(^|\s)-(\s|$|,|\.)", r), r


def test_kv_headroom_warning():
    tight = plan(L8B, H200, 8, ServingWorkload(128 * K, 1 * K, 62))
    assert tight.winner.kv_headroom < 0.1
    assert any(r.startswith("KV headroom ") for r in tight.reasons)
    roomy = plan(L8B, H200, 8, ServingWorkload(4 * K, 1 * K, 16))
    assert roomy.winner.kv_headroom >= 0.1
    assert not any(r.startswith("KV headroom ") for r in roomy.reasons)


def test_no_cp_is_said_in_one_line(capsys):
    p = plan(L70B, H200, 8, ServingWorkload(M, 1 * K, 1))
    assert p.cp_note.startswith("No context parallelism applies to Llama-3.1-70B on 8 GPUs: ")
    assert "[gqa-dcp-needs-replicated-kv]" in p.cp_note and "[pcp-mla-only]" in p.cp_note
    assert plan(DSV3, H200, 8, ServingWorkload(M, 1 * K, 1)).cp_note is None
    assert main(["plan", "--model", "Llama-3.1-70B", "--gpus", "8", "--context", "1M"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert sum(line.startswith("No context parallelism") for line in out) == 1


def test_max_num_seqs_is_the_replicas_share_rounded_up():
    """--max-num-seqs: each replica's share of the concurrency, rounded up (never floored),
    and no more than that replica admits."""
    w = ServingWorkload(32 * K, 1 * K, 3)
    p = plan(L8B, H200, 8, w, objective="throughput", advise=False)
    seen = 0
    for e in p.ranked:
        args = shlex.split(p.command(e))
        seqs = int(args[args.index("--max-num-seqs") + 1])
        dp = e.deployment.dp
        assert seqs == math.ceil(w.concurrency / dp) and seqs * dp >= w.concurrency
        assert seqs <= e.capacity // dp  # what the replica admits
        seen += dp > 1 and w.concurrency % dp != 0
    assert seen  # a DP size that does not divide the concurrency was checked


def test_planner_imports_no_torch():
    """The cost model, the planner and ``python -m cpbook plan`` run without importing torch."""
    code = (
        "import sys; from cpbook.cli import main; import cpbook.planner, cpbook.costmodel; "
        "main(['plan', '--model', 'DeepSeek-V3', '--gpus', '8', '--context', '32K']); "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


def test_gpu_counts_beyond_the_search_are_refused_by_rule(capsys):
    pl.search_space.check_num_gpus(pl.search_space.MAX_PLAN_GPUS)
    with pytest.raises(ValueError, match=r"\[plan-gpus-supported\].*num_gpus=1000000"):
        plan(L8B, H200, 1_000_000, ServingWorkload(4 * K))
    assert main(["plan", "--model", "Llama-3.1-8B", "--gpus", "1000000"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "[plan-gpus-supported]" in err[0]


def test_non_json_hf_config_names_the_file_and_rule(tmp_path, capsys):
    bad = tmp_path / "config.json"
    bad.write_text("model_type: llama\n")
    assert main(["plan", "--hf-config", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "[hf-config-json]" in err[0] and str(bad) in err[0]


# ----------------------------------------------------------- the old decision path's errors


def explorer(context, concurrency, **targets):
    """Chapter 8's old explorer question: DeepSeek-V3 on 8 x H200, 1K output tokens."""
    return plan(DSV3, H200, 8, ServingWorkload(context, 1 * K, concurrency, **targets))


def test_128k_16_users_needs_capacity_not_one_request():
    """Old answer: "TP8, 4 such requests at once ... no DCP needed ... add PCP", then no PCP.
    Right: TP8 holds 5 of the 16 requests and is dropped; the winner holds all 16."""
    p = explorer(128 * K, 16)
    tp8 = next(e for e in p.dropped if e.deployment == Deployment(tp=8))
    assert (tp8.drop, tp8.capacity) == ("holds-concurrency", 5)
    assert p.winner.capacity >= 16 and p.winner.deployment != Deployment(tp=8)
    best_tp8 = next(e for e in p.ranked if e.deployment.tp == 8)  # the TTFT end of the frontier
    assert best_tp8.deployment.dcp == 8 and best_tp8.capacity == 45
    # with the explorer's 10 s TTFT target nothing on 8 GPUs meets it, and PCP cannot help:
    # TP8 (the smallest TP whose weights fit without EP) already uses all 8 GPUs
    t = explorer(128 * K, 16, ttft_target_s=10)
    assert t.winner is None and t.would_fit.rule == "ttft-target"
    assert t.would_fit.ttft_target_s == pytest.approx(best_tp8.ttft_s)
    # in one 16-GPU NVLink domain 16 GPUs would; on 8-GPU nodes the 16-wide groups cross RDMA
    # and the advice prices them so: 16 GPUs miss 10 s, the advice's count serves it
    one = replace(t.workload, gpus_per_node=16)
    wide = plan(DSV3, H200, 8, one).would_fit
    assert wide.num_gpus == 16 and wide.gpus_deployment.ttft_s <= 10
    assert plan(DSV3, H200, 16, one, advise=False).winner is not None
    assert plan(DSV3, H200, 16, t.workload, advise=False).winner is None
    f = t.would_fit
    assert f.num_gpus > 16 and f.gpus_deployment.ttft_s <= 10
    assert plan(DSV3, H200, f.num_gpus, t.workload, advise=False).winner is not None


def test_1m_one_user_pcp_is_impossible_on_8_gpus():
    """Old answer: "add PCP" with the deployment unchanged and TTFT 860 s (567 s now).  Right: DCP
    is needed
    (TP8 alone holds no 1M request), no deployment with PCP holds one on 8 GPUs, so the winner is
    TP8 + DCP8 at TP8's TTFT; a TTFT target needs more GPUs."""
    p = explorer(M, 1)
    win = p.winner.deployment
    assert (win.tp, win.dcp, win.pcp) == (8, 8, 1)
    assert p.winner.ttft_s == cm.ttft(DSV3, H200, Deployment(tp=8), M).total_s
    assert not any(e.deployment.pcp > 1 for e in p.ranked)
    pcp_rows = [e for e in p.dropped if e.deployment.pcp > 1]
    assert pcp_rows and all(e.capacity == 0 for e in pcp_rows)
    assert any("without it TP8 holds 0" in r for r in p.reasons)
    t = explorer(M, 1, ttft_target_s=500)
    assert t.winner is None and t.would_fit.num_gpus > 8


def test_1m_16_users_says_what_would_fit():
    """Old answer: "add PCP", deployment unchanged.  Right: nothing on 8 GPUs holds 16 requests of
    1M tokens; the planner says how many GPUs would, and what fits on these 8."""
    p = explorer(M, 16)
    f = p.winner, p.would_fit
    assert f[0] is None and f[1].rule == "holds-concurrency"
    most = max(e.capacity for e in p.dropped)
    assert f[1].concurrency == most == 5
    assert plan(DSV3, H200, f[1].num_gpus, p.workload, advise=False).winner is not None
    assert plan(DSV3, H200, f[1].num_gpus - 1, p.workload, advise=False).winner is None
    short = ServingWorkload(f[1].prompt_tokens, 1 * K, 16)
    assert plan(DSV3, H200, 8, short, advise=False).winner is not None
    longer = ServingWorkload(f[1].prompt_tokens + 1, 1 * K, 16)
    assert plan(DSV3, H200, 8, longer, advise=False).winner is None


def test_1m_512_users_is_not_keep_the_layout():
    """Old answer: "keep the deployment", which holds one request.  Right: no deployment of 8 GPUs
    holds 512; the fewest GPUs that would, and the 5 requests these 8 hold."""
    p = explorer(M, 512)
    assert p.winner is None and p.would_fit.concurrency == 5
    e = p.would_fit.gpus_deployment
    assert e.drop is None and e.capacity >= 512 and e.num_gpus == p.would_fit.num_gpus > 8
    pl.check_deployment(DSV3, e.deployment, e.kv_dtype)
    assert any(f"{p.would_fit.num_gpus} GPUs would" in line for line in p.would_fit.lines)


def test_4k_512_users_says_what_it_shows():
    """Old answer: "pure DP" beside a TP8 deployment.  Right: DP 8 without EP is not eight
    whole copies: vLLM splits each expert by TP over the 8 GPUs, so it holds DeepSeek-V3's
    weights in the bytes per GPU EP would; the winner holds the 512 requests and its reasons
    and flags name the same deployment."""
    p = explorer(4 * K, 512)
    rows = p.ranked + p.dropped
    pure = next(e for e in rows if e.deployment == Deployment(dp=8))
    ep = next(e for e in rows if e.deployment == Deployment(dp=8, ep=True))
    assert pure.drop != "model-fits" and pure.weight_bytes == ep.weight_bytes
    assert p.winner.capacity >= 512
    assert pl.parse_serve_command(p.command()) == (p.winner.deployment, p.winner.kv_dtype)
    assert p.reasons[0].startswith(p.winner.label + " ")


def test_llama_8b_128k_ttft_2s_ranks_tp8_first():
    """The peer's answer: TP8 first (the article's decision path picks TP1 + PCP8, which vLLM
    v0.34 does not run for GQA: PCP is MLA-only; tests/test_decision_path.py)."""
    p = plan(L8B, H200, 8, ServingWorkload(128 * K, 1 * K, 1, ttft_target_s=2))
    assert p.winner.deployment == Deployment(tp=8) and p.winner.ttft_s <= 2
    with pytest.raises(ConfigError, match=r"\[pcp-mla-only\]"):
        pl.check_deployment(L8B, Deployment(tp=1, pcp=8))


# ------------------------------------------------------------------------ vLLM v0.34 rules


@pytest.mark.parametrize(
    "model, deployment, kv, rule",
    [
        (L8B, Deployment(tp=1, pcp=2), "bf16", "pcp-mla-only"),
        (DSV3, Deployment(tp=4, pcp=2, dcp=2), "bf16", "pcp-dcp-sparse-mla-only"),
        (V32, Deployment(tp=4, pcp=2, dcp=2, tpa=True), "fp8", "dcp-q-replicate-needs-pcp-1"),
        (V32, Deployment(tp=4, pcp=2, dcp=2), "bf16", "sparse-mla-pcp-dcp-fp8-ds-mla"),
        (V32, Deployment(tp=2, dcp=2), "fp8", "sparse-mla-dcp-fp8-heads"),
        (V32, Deployment(tp=8, dcp=8), "fp8", "sparse-mla-dcp-fp8-head-padding"),
        (V32, Deployment(tp=4, pcp=2, dcp=8), "fp8", "sparse-mla-dcp-fp8-head-padding"),
        (L70B, Deployment(tp=16, dcp=2, tpa=True), "bf16", "tpa-gqa-unreleased"),
        (L8B, Deployment(tp=2, ep=True), "bf16", "ep-needs-moe"),
        (DSV3, Deployment(tp=1, ep=True), "bf16", "ep-needs-several-gpus"),
        (DSV3, Deployment(tp=8), "fp16", "kv-cache-dtype"),
        (DSV3, Deployment(tp=8, dcp=3), "bf16", "tp-divisible-by-dcp"),
        (DSV3, Deployment(tp=6), "bf16", "heads-divisible-by-tp"),
        (L8B, Deployment(tp=8, dcp=2), "bf16", "gqa-dcp-needs-replicated-kv"),
        (L70B, Deployment(tp=16, dcp=4), "bf16", "gqa-dcp-within-replicas"),
        (V32, Deployment(tp=4, pcp=2, dcp=4), "bf16", "pcp-dcp-combination"),
    ],
)
def test_every_rule_is_a_named_config_error(model, deployment, kv, rule):
    with pytest.raises(ConfigError) as err:
        pl.check_deployment(model, deployment, kv)
    assert err.value.rule == rule and f"[{rule}] requires" in str(err.value)


def test_rules_admit_what_vllm_runs():
    for model, deployment, kv in [
        (V32, Deployment(tp=4, pcp=2, dcp=2), "fp8"),  # sparse MLA: PCP x DCP spanning PCP
        (V32, Deployment(tp=1, pcp=8, dcp=8), "fp8"),  # ... or the whole TP x PCP block
        (V32, Deployment(tp=2, dcp=2), "bf16"),  # v0.34: bf16 DCP at 64 heads per rank
        (V32, Deployment(tp=8, dcp=4), "fp8"),  # 16 heads, gathered 64: one FP8 kernel
        (DSV3, Deployment(tp=4, pcp=2), "bf16"),  # dense MLA: PCP without DCP
        (DSV3, Deployment(tp=8, dcp=8, tpa=True), "bf16"),  # query replication
        (L70B, Deployment(tp=16, dcp=2), "bf16"),  # GQA: DCP within the KV-head copies
        (DSV3, Deployment(tp=1, dp=8, ep=True), "bf16"),
    ]:
        pl.check_deployment(model, deployment, kv)
    with pytest.raises(ConfigError, match=r"\[pcp-needs-model-runner-v2\]"):
        pl.check_deployment(DSV3, Deployment(tp=4, pcp=2), model_runner_v2=False)


def test_planner_counts_rejections_by_rule():
    p = plan(V32, H200, 16, ServingWorkload(128 * K, 1 * K, 16, kv_dtypes=FP8_KV), advise=False)
    assert set(p.rejected) <= {
        "heads-divisible-by-tp",
        "ep-needs-several-gpus",
        "dcp-q-replicate-needs-pcp-1",
        "sparse-mla-pcp-dcp-fp8-ds-mla",
        "sparse-mla-dcp-fp8-heads",
        "sparse-mla-dcp-fp8-head-padding",
        "nnodes-divides-world",
    }
    assert p.rejected["sparse-mla-pcp-dcp-fp8-ds-mla"] > 0  # the bf16 PCP x DCP candidates
    assert p.rejected["nnodes-divides-world"] > 0  # e.g. 9 GPUs on two 8-GPU nodes
    d = plan(DSV3, H200, 16, ServingWorkload(128 * K, 1 * K, 16), advise=False)
    assert d.rejected["pcp-dcp-sparse-mla-only"] > 0
    g = plan(L70B, H200, 16, ServingWorkload(128 * K, 1 * K, 16), advise=False)
    assert g.rejected["pcp-mla-only"] > 0 and g.rejected["gqa-dcp-needs-replicated-kv"] > 0
    assert any(e.deployment.pcp > 1 and e.deployment.dcp > 1 for e in p.ranked + p.dropped)


# ------------------------------------------------------------------------------ serve flags


def test_serve_command_flags():
    w = ServingWorkload(M, 1 * K, 1)
    p = plan(DSV3, H200, 8, w)
    cmd = p.command()
    # 1,049,600 tokens > DeepSeek-V3's 163,840 positions: the line carries vLLM's override
    head = "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 vllm serve deepseek-ai/DeepSeek-V3 "
    assert cmd.startswith(head + "--tensor-parallel-size 8 ")
    for flag in ("--decode-context-parallel-size 8", "--dcp-comm-backend ag_rs",
                 "--max-model-len 1049600"):  # fmt: skip
        assert flag in cmd
    assert "--cp-kv-cache-interleave-size" not in cmd  # vLLM's default (1) and its P/D choice
    assert "--nnodes" not in cmd  # one node
    # vLLM v0.34's own gpu_memory_utilization default (1.0, extensible KV cache) is left unset;
    # another value is the plan's assumption and is printed
    assert "--gpu-memory-utilization" not in cmd and w.memory_utilization == 1.0
    set_09 = plan(DSV3, H200, 8, ServingWorkload(M, 1 * K, 1, gpu_memory_utilization=0.9))
    assert "--gpu-memory-utilization 0.9" in set_09.command()
    assert ("--dcp-q-replicate" in cmd.split()) == p.winner.deployment.tpa
    short = "vllm serve x -tp 4 -dcp 2 -pcp 2 -dp 2 -ep --kv-cache-dtype fp8_ds_mla"
    assert pl.parse_serve_command(short) == (Deployment(tp=4, dcp=2, pcp=2, dp=2, ep=True), "fp8")
    with pytest.raises(ValueError, match=r"\[serve-command\]"):
        pl.parse_serve_command("vllm serve x --pipeline-parallel-size 2")
    with pytest.raises(ValueError, match=r"\[serve-command\]"):
        pl.parse_serve_command("vllm serve x --kv-cache-dtype int3")
    assert vllm_kv_cache_dtype(V32, "fp8") == "fp8_ds_mla"
    assert vllm_kv_cache_dtype(V32, "bf16") == "bfloat16"  # V3.2's auto means FP8
    assert (vllm_kv_cache_dtype(DSV3, "fp8"), vllm_kv_cache_dtype(DSV3, "bf16")) == ("fp8", "auto")


# -------------------------------------------------------------------------- reasons, errors


def test_reasons_name_the_runners_up():
    p = plan(DSV3, H200, 8, ServingWorkload(4 * K, 1 * K, 512), objective="throughput")
    labels = [e.label for e in p.ranked]
    ups = [r for r in p.reasons if r.split(":")[0] in labels[1:]]
    assert 1 <= len(ups) <= 4
    assert all("less" in r or "ties" in r for r in ups)
    assert p.reasons[-1].startswith("Dropped: ")


def test_headlines():
    assert pl.headline(explorer(M, 1)) == "DCP8: without it 0 of 1 fit"
    assert pl.headline(explorer(M, 16)).startswith("nothing fits [holds-concurrency]: ")
    p = plan(L8B, H200, 8, ServingWorkload(4 * K, 256, 16))
    assert pl.headline(p).startswith(f"no CP: TP{p.winner.deployment.tp} holds ")
    # sparse MLA's PCP x DCP needs the fp8_ds_mla cache (FlashMLA-sparse)
    w = ServingWorkload(M, 1 * K, 1, kv_dtypes=FP8_KV)
    sparse = plan(V32, H200, 16, w, objective="ttft")
    assert sparse.winner.deployment.pcp > 1 and "PCP" in pl.headline(sparse)
    assert sparse.winner.kv_dtype == "fp8" and "--kv-cache-dtype fp8_ds_mla" in sparse.command()
    bf16 = plan(V32, H200, 16, replace(w, kv_dtypes=("bf16",)), objective="ttft")
    assert bf16.winner.deployment.pcp == 1 or bf16.winner.deployment.dcp == 1


def test_idle_gpus_are_said():
    p = plan(L8B, H200, 8, ServingWorkload(4 * K, 256, 16), objective="throughput")
    assert p.winner.num_gpus < 8
    assert any(r.startswith(f"Uses {p.winner.num_gpus} of 8 GPUs") for r in p.reasons)


def test_counts_of_one_are_singular():
    assert (plural(1, "request"), plural(1_024, "GPU")) == ("1 request", "1,024 GPUs")
    two = plan(DSV3, H200, 8, ServingWorkload(512 * K, 1 * K, 2))
    assert any("holds 1 such request;" in r for r in two.reasons)
    alone = plan(DSV3, "H100", 4, ServingWorkload(M, 1 * K, 1))
    assert alone.would_fit.lines[0].startswith(
        "No deployment of at most 4 x H100 SXM serves 1 request "
    )
    for text in two.reasons + alone.would_fit.lines:
        assert not re.search(r"\b1 (such )?requests\b", text), text


def test_rates_print_without_an_exponent():
    assert [fmt_rate(x) for x in (0.1474, 838.2, 2637.4)] == ["0.147", "838", "2,640"]
    assert (fmt_rate(2637.4, 4), fmt_rate(2637.4, 2)) == ("2,637", "2,600")
    p = plan(L8B, H200, 8, ServingWorkload(4 * K, 1 * K, 512))
    assert p.winner.tokens_per_s_per_gpu > 1000
    assert not any(re.search(r"\de\+\d", r) for r in p.reasons), p.reasons


def test_fp8_kv_suggestion():
    """Six 1M-token requests: TP8 + DCP8 holds 5 with a 16-bit cache; FP8 KV would hold them."""
    p = plan(DSV3, H200, 8, ServingWorkload(M, 1 * K, 6))
    assert p.winner is None and p.would_fit.concurrency == 5
    fp8 = p.would_fit.fp8_kv
    assert fp8.kv_dtype == "fp8" and fp8.capacity >= 6
    assert any(line.startswith("FP8 KV (--kv-cache-dtype fp8) would") for line in p.would_fit.lines)


@pytest.mark.parametrize(
    "call, pattern",
    [
        (lambda: plan("Nope", "H200", 8, ServingWorkload(1)), r"\[known-model\]"),
        (lambda: plan(DSV3, "TPU", 8, ServingWorkload(1)), r"\[known-gpu\]"),
        (lambda: plan(DSV3, H200, 0, ServingWorkload(1)), r"\[positive-gpus\]"),
        (lambda: plan(DSV3, H200, 8, ServingWorkload(1), objective="x"), r"\[plan-objective\]"),
        (lambda: ServingWorkload(0), r"\[positive-tokens\].*prompt_tokens=0"),
        (lambda: ServingWorkload(1, concurrency=0), r"\[positive-tokens\].*concurrency=0"),
        (lambda: ServingWorkload(1, ttft_target_s=0), r"\[positive-target\]"),
        (lambda: ServingWorkload(1, kv_dtypes=()), r"\[kv-dtype-choices\]"),
        (lambda: ServingWorkload(1, kv_dtypes=("int4",)), r"\[kv-cache-dtype\]"),
        (lambda: ServingWorkload(1, gpu_memory_utilization=1.5), r"\[gpu-memory-utilization\]"),
    ],
)
def test_bad_input_names_the_rule(call, pattern):
    with pytest.raises(ValueError, match=pattern):
        call()


# ---------------------------------------------------------------------------------------- CLI


def test_cli_prints_the_command_table_and_reasons(capsys):
    argv = ["plan", "--model", "DeepSeek-V3", "--gpu", "H200", "--gpus", "8"]
    argv += ["--context", "128K", "--output", "1K", "--concurrency", "16"]
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    p = plan(DSV3, H200, 8, ServingWorkload(128 * K, 1 * K, 16))
    assert out[0] == p.command()
    assert pl.parse_serve_command(out[0]) == (p.winner.deployment, p.winner.kv_dtype)
    assert any(line.split()[:2] in (["1", p.winner.label], ["1*", p.winner.label]) for line in out)
    assert "Why:" in out and f"  - {p.reasons[0]}" in out


def test_cli_prints_one_line_per_node(capsys):
    """A deployment over two nodes: the line for node 0, then node 1's (``--node-rank 1
    --headless``), then the table; ``--json``'s summary holds both."""
    argv = ["plan", "--model", "DeepSeek-V3", "--gpu", "H200", "--gpus", "16"]
    argv += ["--context", "128K", "--output", "1K", "--concurrency", "96"]
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    p = plan(DSV3, H200, 16, ServingWorkload(128 * K, 1 * K, 96))
    assert len(p.commands()) == 2 and out[:2] == p.commands()
    assert "--node-rank 0" in out[0] and "--headless" not in out[0]
    assert "--node-rank 1" in out[1] and "--headless" in out[1]
    assert main([*argv, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert summary["commands"] == p.commands() and summary["command"] == out[0]


def test_cli_json(capsys):
    argv = ["plan", "--model", "Llama-3.1-70B", "--gpus", "8", "--context", "32K"]
    argv += ["--concurrency", "64", "--tpot", "150ms", "--json"]
    assert main(argv) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    summary = rows[-1]
    assert summary["name"] == "plan" and all(r["name"] == "deployment" for r in rows[:-1])
    ranked = [r for r in rows[:-1] if r["rank"] is not None]
    assert len(ranked) == summary["serving"] and len(rows) - 1 - len(ranked) == summary["dropped"]
    assert ranked[0]["label"] == summary["winner"] and summary["tpot_target_s"] == 0.15
    assert all(r["tpot_s"] <= 0.15 for r in ranked)
    deployment, kv = pl.parse_serve_command(summary["command"])
    assert (deployment.tp, deployment.dcp, deployment.pcp, deployment.dp) == tuple(
        ranked[0][k] for k in ("tp", "dcp", "pcp", "dp")
    )


def test_cli_hf_config(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(GLM5))
    argv = ["plan", "--hf-config", str(tmp_path), "--model", "zai-org/GLM-5", "--gpus", "16"]
    argv += ["--context", "128K", "--concurrency", "8", "--kv-cache-dtype", "fp8"]
    assert main(argv) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("vllm serve zai-org/GLM-5 ") and "fp8_ds_mla" in first


@pytest.mark.parametrize(
    "extra, rule",
    [
        (["--model", "Nope"], "known-model"),
        (["--model", "DeepSeek-V3", "--gpu", "TPU"], "known-gpu"),
        (["--model", "DeepSeek-V3", "--context", "0"], "positive-tokens"),
        (["--model", "DeepSeek-V3", "--context", "12Q"], "token-count"),
        (["--model", "DeepSeek-V3", "--ttft", "fast"], "duration"),
        (["--model", "DeepSeek-V3", "--ttft", "1ms"], "ttft-target"),
        (["--model", "DeepSeek-V3", "--gpus", "0"], "positive-gpus"),
        (["--gpus", "8"], "plan-model"),
        (["--hf-config", "/nonexistent/config.json"], "FileNotFoundError"),
    ],
)
def test_cli_bad_input_is_one_line_exit_2(capsys, extra, rule):
    assert main(["plan", *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("cpbook: error: ") and rule in err[0]


def test_size_and_time_parsing():
    assert [parse_tokens("--context", t) for t in ("1M", "128K", "4096", "1.5k")] == [
        M,
        128 * K,
        4096,
        1536,
    ]
    assert [parse_seconds("--ttft", t) for t in ("10s", "50ms", "2", None)] == [10, 0.05, 2, None]
    with pytest.raises(ValueError, match=r"\[token-count\]"):
        parse_tokens("--context", "0.3K")


def test_rule_probes_and_flowchart():
    import matplotlib.pyplot as plt

    from cpbook.viz.plan import decision_flowchart

    families = {"GQA": L70B, "MLA": DSV3, "sparse MLA": V32}
    probes = {k: pl.rule_probes(m) for k, m in families.items()}
    assert probes["GQA"]["PCP 2"] == "pcp-mla-only"
    assert probes["MLA"]["PCP 2 x DCP 2"] == "pcp-dcp-sparse-mla-only"
    assert not any(probes["sparse MLA"].values())
    fig = decision_flowchart(families)
    texts = {t.get_text() for ax in fig.axes for t in ax.texts}
    assert "✓" in texts and "MLA only" in texts  # short phrases, not rule ids
    assert not any("-\n" in t or "pcp-mla" in t for t in texts)  # no word broken
    every = [t.get_text() for ax in fig.axes for t in ax.texts]
    assert every.count("no: dropped") == len(pl.plan_space.DROP_RULES)
    assert min(t.get_fontsize() for ax in fig.axes for t in ax.texts) >= 11
    plt.close(fig)  # tests/test_explorer.py checks that its own explorers leave no figure open


def test_cli_output_piped_into_head_stops_quietly():
    """``python -m cpbook plan ... --json | head -1``: the closed pipe ends the command with exit
    0 and no error line (about 100 KB of deployment lines, more than a pipe holds)."""
    cmd = (
        f"{shlex.quote(sys.executable)} -m cpbook plan --model DeepSeek-V3 --gpus 16 "
        "--context 32K --concurrency 16 --json | head -1"
    )
    r = subprocess.run(
        ["bash", "-o", "pipefail", "-c", cmd], capture_output=True, text=True, timeout=300
    )
    assert r.stdout.startswith('{"name": "deployment", "rank": 1')
    assert r.stderr == "" and r.returncode == 0, (r.returncode, r.stderr)


# ------------------------------------------------- the frontier and the serve line, by brute force


def _dominates_on(a, b, t: str) -> bool:
    """``a`` is at least as good as ``b`` on ``t`` (lower) and tokens/s per GPU (higher), and
    better on one of them."""
    at, bt, ar, br = getattr(a, t), getattr(b, t), a.tokens_per_s_per_gpu, b.tokens_per_s_per_gpu
    return at <= bt and ar >= br and (at < bt or ar > br)


_FRONTIER_PLAN = {}


def _frontier_rows():
    if not _FRONTIER_PLAN:
        _FRONTIER_PLAN["p"] = plan(DSV3, H200, 16, ServingWorkload(32 * K, 1 * K, 16))
    return _FRONTIER_PLAN["p"].ranked


@settings(max_examples=60, deadline=None)
@given(
    t=st.sampled_from(["ttft_s", "tpot_s"]),
    picks=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3)), min_size=1, max_size=12),
)
def test_pareto_is_the_brute_force_non_dominated_set_with_ties(t, picks):
    """Real estimates given few distinct times and rates, so ties on either axis are common:
    the frontier is exactly the set of points no row dominates (a row tied on one axis and
    worse on the other is dominated and dropped), each point once, fastest first."""
    rows = _frontier_rows()
    rates = [1.0, 2.0, 2.0, 3.0]
    tied = [
        dataclasses.replace(
            rows[j % len(rows)],
            prefill=rows[i].prefill,
            decode=rows[i].decode,
            tokens_per_s_per_gpu=rates[r],
        )
        for j, (i, r) in enumerate(picks)
    ]
    front = pl.pareto(tied, t)
    point = lambda e: (getattr(e, t), e.tokens_per_s_per_gpu)  # noqa: E731
    want = {point(e) for e in tied if not any(_dominates_on(o, e, t) for o in tied)}
    assert {point(e) for e in front} == want and len(front) == len(want)
    assert [point(e) for e in front] == sorted(want)


def test_max_num_seqs_admits_each_replicas_share():
    """Every ranked deployment's ``--max-num-seqs``, given to the engine's scheduler, admits all
    the requests the busiest of its ``dp`` replicas receives (round robin) in one step, and is
    no larger than that share."""
    from cpbook.engine.scheduler import Request, Scheduler
    from cpbook.kv.manager import KVCacheManager

    w = ServingWorkload(4 * K, 256, 13)
    p = plan(L8B, H200, 8, w)
    seen = set()
    for e in p.ranked:
        dp = e.deployment.dp
        if dp in seen:
            continue
        seen.add(dp)
        argv = shlex.split(p.command(e))
        seqs = int(argv[argv.index("--max-num-seqs") + 1])
        share = [r for r in range(w.concurrency) if r % dp == 0]  # replica 0: the busiest
        sched = Scheduler(KVCacheManager(4 * len(share), 16), 64 * len(share), seqs)
        for r in share:
            sched.add_request(Request(str(r), [1, 2, 3], 1))
        assert len(sched.schedule().admitted) == len(share) == seqs
    assert len(seen) > 1 and any(w.concurrency % dp for dp in seen)


def test_serve_args_state_the_interleave_whenever_the_kv_is_sharded():
    """vLLM v0.34.0 lays the KV cache over PCP as well as DCP ranks in stripes of
    ``cp_kv_cache_interleave_size`` (``v1/worker/gpu/pcp_manager.py`` passes it as
    ``cp_interleave``): a deployment with PCP or DCP states the size it was planned with."""
    from cpbook.planner.serve_flags import serve_args

    kw = dict(max_model_len=4096, max_num_seqs=1, gpu_memory_utilization=0.9)
    for dep in (Deployment(tp=4, pcp=2), Deployment(tp=4, dcp=4), Deployment(tp=8)):
        args = serve_args(DSV3, dep, "bf16", cp_kv_cache_interleave_size=16, **kw)
        flag = "--cp-kv-cache-interleave-size"
        sharded = dep.pcp > 1 or dep.dcp > 1
        assert (flag in args) == sharded
        assert not sharded or args[args.index(flag) + 1] == "16"
