"""Tests for cpbook.planner.decision_path: the article's three questions, and the check that
sets them beside the planner (chapter 8).

The path's answers on the article's three cases and on the four questions chapter 8's old
explorer answered wrongly; why it and ``plan`` differ, from the planner's own verdicts; and the
property that the planner never does worse than the path on a deployment vLLM runs."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpbook import costmodel as cm
from cpbook import planner as pl
from cpbook.core.config import ConfigError
from cpbook.costmodel import Deployment
from cpbook.planner import ServingWorkload, decision_path, path_vs_plan

K, M = 1024, 1024**2
H200 = cm.GPUS["H200"]


def test_the_articles_three_cases():
    """DCP when one request does not fit, PCP for a TTFT target, pure DP for short crowded
    traffic: what the article's path says, asked literally."""
    one = decision_path("DeepSeek-V3", H200, 8, ServingWorkload(M, 1 * K, 1))
    assert one.deployment == Deployment(tp=8, dcp=2)  # the smallest DCP that holds 1M + 1K tokens
    assert cm.deployment_max_context(cm.MODELS["DeepSeek-V3"], H200, one.deployment) >= M + K
    ttft = decision_path("Llama-3.1-70B", H200, 8, ServingWorkload(128 * K, 1 * K, 4, 15.0))
    assert ttft.deployment == Deployment(tp=2, pcp=4) and ttft.steps[2].startswith("2. TTFT 31.2 s")
    dp = decision_path("Llama-3.1-8B", H200, 8, ServingWorkload(4 * K, 1 * K, 512))
    assert dp.deployment == Deployment(dp=8) and dp.steps[-1].endswith(
        "pure DP (DP8), no context parallelism."
    )


def test_path_vs_plan_on_the_articles_cases():
    one = path_vs_plan("DeepSeek-V3", H200, 8, ServingWorkload(M, 1 * K, 1))
    assert one.plan.winner.deployment == Deployment(tp=8, dcp=8, tpa=True)
    assert one.same_cp and not one.agree and "decode costs 315 vs 182 GPU-ms" in one.reason
    ttft = path_vs_plan("Llama-3.1-70B", H200, 8, ServingWorkload(128 * K, 1 * K, 4, 15.0))
    assert ttft.same_cp is False and ttft.reason.endswith("[pcp-mla-only].")
    assert ttft.plan.winner.ttft_s <= 15
    dp = path_vs_plan("Llama-3.1-8B", H200, 8, ServingWorkload(4 * K, 1 * K, 512))
    assert dp.same_cp and dp.reason.startswith("DP8+TP1: ") and " less): decode costs" in dp.reason
    rank = 1 + [e.deployment for e in dp.plan.ranked].index(dp.path.deployment)
    assert rank > 1 and dp.reason.endswith(f"Ranked {rank} of {len(dp.plan.ranked)}.")


@pytest.mark.parametrize(
    "context, concurrency, deployment, reason",
    [
        (128 * K, 16, Deployment(tp=8), "TP8 holds 5 of 16 requests."),
        (M, 1, Deployment(tp=8, dcp=2), "TP8+DCP2's TTFT 566 s misses the 10 s target."),
        (M, 16, Deployment(tp=8, dcp=2), "TP8+DCP2 holds 1 of 16 requests."),
        (M, 512, Deployment(tp=8, dcp=2), "TP8+DCP2 holds 1 of 512 requests."),
        (4 * K, 512, Deployment(tp=8), "TP8 holds 146 of 512 requests."),
    ],
)
def test_the_old_explorers_questions(context, concurrency, deployment, reason):
    """DeepSeek-V3 on 8 x H200 with a 10 s TTFT target, as chapter 8's old explorer asked: the
    path ends on the layouts it showed, and says so when PCP has no room or DP needs TP8."""
    w = ServingWorkload(context, 1 * K, concurrency, ttft_target_s=10)
    c = path_vs_plan("DeepSeek-V3", H200, 8, w)
    assert c.path.deployment == deployment and c.reason == reason and not c.agree
    if concurrency < 128:  # moderate concurrency: question 2 asks for PCP, with no GPU for it
        assert c.path.steps[-1].endswith("but TP8 already uses the 8 GPUs.")
    if context == 4 * K:
        assert "pure DP, but the weights need TP8, so DP1 x TP8" in c.path.steps[-1]


def test_agreement_has_no_reason():
    c = path_vs_plan("Llama-3.1-8B", H200, 1, ServingWorkload(4 * K, 1 * K, 16))
    assert c.agree and c.same_cp and c.reason == ""
    assert c.plan.winner.deployment == c.path.deployment == Deployment()


@settings(max_examples=30, deadline=None)
@given(
    model=st.sampled_from(["DeepSeek-V3", "Llama-3.1-8B", "Llama-3.1-70B", "Qwen3-235B-A22B"]),
    n=st.sampled_from([2, 4, 8]),
    prompt=st.sampled_from([4 * K, 32 * K, 128 * K, M]),
    concurrency=st.sampled_from([1, 16, 512]),
    target=st.sampled_from([None, 5.0, 60.0]),
)
def test_plan_never_loses_to_the_path(model, n, prompt, concurrency, target):
    """Where the path's deployment is one vLLM runs and it serves the workload, the planner's
    winner is at least as good on the objective; the reason is empty exactly when they agree."""
    w = ServingWorkload(prompt, 1 * K, concurrency, ttft_target_s=target)
    c = path_vs_plan(model, H200, n, w)
    assert (c.reason == "") == c.agree
    if c.path is None:
        return
    try:
        pl.check_deployment(c.plan.model, c.path.deployment)
    except ConfigError:
        assert "vLLM v0.34 does not run" in c.reason
        return
    e = pl.estimate(c.plan.model, H200, c.path.deployment, "bf16", w)
    if e.drop is None:
        best = pl.objective_value(c.plan.winner, "throughput")
        assert best <= pl.objective_value(e, "throughput")
    else:  # the path's deployment is dropped: the planner never picks a dropped deployment
        assert not c.agree and c.reason


@pytest.mark.parametrize(
    "call, rule",
    [
        (lambda: decision_path("GPT-9", H200, 8, ServingWorkload(1024)), "known-model"),
        (lambda: decision_path("Llama-3.1-8B", "TPU", 8, ServingWorkload(1024)), "known-gpu"),
        (lambda: decision_path("Llama-3.1-8B", H200, 0, ServingWorkload(1024)), "positive-gpus"),
        (lambda: decision_path("Kimi-K2", "H100", 8, ServingWorkload(1024)), "model-fits"),
        (lambda: decision_path("Llama-3.1-405B", H200, 8, ServingWorkload(8 * M)), "request-fits"),
    ],
)
def test_bad_input_names_the_rule(call, rule):
    with pytest.raises(ValueError, match=rf"\[{rule}\]"):
        call()


def test_no_path_layout_is_the_reason():
    """Kimi-K2 on 10 x H200: no TP in 1, 2, 5, 10 holds its weights (TP 5 and 10 do not divide
    64 heads), but TP8 on 8 of the 10 does (vLLM v0.34's memory default, 1.0, leaves it KV
    room); on 8 x H100 neither finds a deployment."""
    c = path_vs_plan("Kimi-K2", H200, 10, ServingWorkload(1024))
    assert c.path is None and c.plan.winner.num_gpus < 10
    assert c.reason.startswith("[model-fits] requires the weights to fit at some TP")
    none = path_vs_plan("Kimi-K2", "H100", 8, ServingWorkload(1024))
    assert none.path is None and none.plan.winner is None and none.agree
