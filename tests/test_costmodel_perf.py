"""Tests for chapter 8's cost model: layouts, TTFT/TPOT, reproductions, calibration."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from cpbook import costmodel as cm
from cpbook.costmodel import Deployment as L
from cpbook.costmodel import calibration

DSV3, KIMI, QWEN3 = (cm.MODELS[k] for k in ("DeepSeek-V3", "Kimi-K2", "Qwen3-235B-A22B"))
L8B, L70B, L405B = (cm.MODELS[k] for k in ("Llama-3.1-8B", "Llama-3.1-70B", "Llama-3.1-405B"))
H100, H200, B200, A910 = (cm.GPUS[k] for k in ("H100", "H200", "B200", "Ascend910C"))
M1 = 2**20

# --------------------------------------------------------------------------------- memory


def test_layout_kv_per_token_by_hand():
    assert cm.deployment_kv_bytes_per_token(DSV3, L(tp=8)) == 70_272  # 8 copies of the latent
    assert cm.deployment_kv_bytes_per_token(DSV3, L(tp=8, dcp=8)) == 70_272 / 8
    assert cm.deployment_kv_bytes_per_token(L8B, L(tp=8)) == 131_072 / 8  # one KV head each
    assert cm.deployment_kv_bytes_per_token(L8B, L(pcp=8)) == 131_072  # PCP keeps the whole cache
    assert cm.deployment_kv_bytes_per_token(QWEN3, L(tp=8, dcp=2)) == 192_512 / 4 / 2
    assert cm.deployment_kv_bytes_per_token(QWEN3, L(tp=8, dcp=2, tpa=True)) == 192_512 / 4 / 2
    assert cm.deployment_kv_bytes_per_token(DSV3, L(tp=8, dcp=8), "fp8") == 576 * 61 / 8


def test_layout_agrees_with_pre_split_functions():
    for model, tp, dcp in ((DSV3, 8, 8), (DSV3, 8, 1), (QWEN3, 8, 2), (L70B, 8, 1)):
        lay = L(tp=tp, dcp=dcp)
        assert cm.deployment_kv_bytes_per_token(model, lay) == cm.kv_bytes_per_token_per_gpu(
            model, tp, dcp
        )
        assert cm.deployment_max_context(model, H200, lay) == cm.max_context_tokens(
            model, H200, tp, dcp
        )


def test_weights_with_expert_parallelism_by_hand():
    routed = 58 * 256 * 3 * 7168 * 2048  # DeepSeek-V3 config.json
    assert DSV3.expert_params == routed
    dense = 671e9 - routed
    assert math.isclose(cm.deployment_weight_bytes(DSV3, L(dp=8, ep=True)), dense + routed / 8)
    assert (
        cm.deployment_weight_bytes(DSV3, L(tp=8)) == cm.weight_bytes_per_gpu(DSV3, 8) == 671e9 / 8
    )
    assert cm.deployment_weight_bytes(L8B, L(tp=2, pcp=4)) == 8.03e9 * 2 / 2  # PCP replicates


def test_max_concurrency_counts_replicas():
    one = cm.max_concurrency(L8B, H200, L(), 4096)
    assert cm.max_concurrency(L8B, H200, L(dp=8), 4096) == 8 * one
    assert one == math.floor(cm.deployment_kv_budget(L8B, H200, L()) / (131_072 * 4096))


# ---------------------------------------------------------------------------- time


def test_ttft_splits_flops_and_dcp_adds_nothing():
    base = cm.ttft(L8B, H200, L(), 131072)
    assert base.tp_comm_s == base.cp_comm_s == 0
    dense, experts = cm.prefill_gemm_flops(L8B, 131072)
    _, attn = cm.prefill_flops(L8B, 131072)
    peak, gt = H200.bf16_flops, cm.gpu_terms
    assert experts == 0
    assert math.isclose(
        base.compute_s, dense / (peak * 0.74) + attn / (peak * gt.attention_mfu(131072))
    )
    one = cm.ttft(
        L8B, H200, L(), 131072, knobs=cm.CostKnobs(mfu=cm.DEFAULT_MFU)
    )  # the former model
    mm, _ = cm.prefill_flops(L8B, 131072)
    assert math.isclose(one.compute_s, (mm + attn) / (peak * cm.DEFAULT_MFU))
    assert one.elementwise_s == 0 < base.elementwise_s
    assert cm.ttft(DSV3, H200, L(tp=8), 8192) == cm.ttft(DSV3, H200, L(tp=8, dcp=8), 8192)
    for n in (2, 4, 8):  # claim pcp-ttft-x-ranks
        ratio = base.total_s / cm.ttft(L8B, H200, L(pcp=n), 131072).total_s
        assert 0.9 * n <= ratio <= n


def test_tpot_matches_chapter6_break_even():
    def slower(c):
        return (
            cm.tpot(DSV3, H200, L(tp=8, dcp=8), c).total_s > cm.tpot(DSV3, H200, L(tp=8), c).total_s
        )

    # one request reads its one latent head at the occupancy-bound KV efficiency
    eff = cm.gpu_terms.DECODE_ATTENTION_UNIT_EFFICIENCY
    be = cm.decode_break_even(
        DSV3, H200, "dcp", tp=8, dcp=8, knobs=cm.CostKnobs(hbm_efficiency=eff)
    )
    assert slower(int(be * 0.99)) and not slower(int(be * 1.01))


def test_meta_405b_prefill_is_a_shape_check_at_the_papers_utilisation():
    """Yang et al., arXiv 2411.01783: 1M tokens in 77 s, 128K in 3.8 s, 128 H100 (TP8 x CP16),
    FP8 weights, 63 % FLOPS utilisation.  At 63 % of the dense BF16 peak the model is within
    30 % at 1M but more than 30 % fast at 128K: a shape check, as chapter 8 says."""
    fp8 = replace(L405B, weight_bytes_per_param=1)
    with pytest.raises(ValueError, match="model-fits"):  # bf16 weights: 101.5 GB per GPU
        cm.deployment_kv_budget(L405B, H100, L(tp=8, pcp=16))
    assert cm.deployment_kv_budget(fp8, H100, L(tp=8, pcp=16)) > 0
    kw = dict(cp_link=cm.LINKS["RDMA400"], cp_comm="ring", knobs=cm.CostKnobs(mfu=0.63))
    err = {
        n: cm.ttft(fp8, H100, L(tp=8, pcp=16), n, **kw).total_s / p - 1
        for n, p in ((10**6, 77.0), (M1, 77.0), (128_000, 3.8), (2**17, 3.8))
    }
    assert all(abs(err[n]) <= 0.30 for n in (10**6, M1))
    assert all(err[n] < -0.30 for n in (128_000, 2**17))
    # the published 77 s is 51-55 % of the datasheet peak by the model's FLOP count
    for n in (10**6, M1):
        flops = sum(cm.prefill_flops(L405B, n))
        assert 0.50 < flops / (77.0 * 128 * H100.bf16_flops) < 0.56


def test_one_million_tokens_on_one_node():
    def fits(gpu, dcp, kv, util=0.9):
        return (
            cm.deployment_max_context(DSV3, gpu, L(tp=8, dcp=dcp), kv, gpu_memory_utilization=util)
            >= M1
        )

    for gpu in (H200, A910):
        assert fits(gpu, 8, "bf16") and fits(gpu, 8, "fp8") and not fits(gpu, 1, "bf16")
    # fp8 KV (576 B per token and layer) without DCP: from a utilisation of 0.89 on
    assert fits(H200, 1, "fp8") and fits(H200, 1, "fp8", 0.89) and not fits(H200, 1, "fp8", 0.885)
    assert not fits(H200, 1, "fp8_ds_mla")  # V3.2's 656 B layout would miss at 0.9
    with pytest.raises(ValueError, match="model-fits"):
        cm.deployment_max_context(KIMI, H200, L(tp=8, dcp=8), gpu_memory_utilization=0.95)


def test_dcp_throughput_story_qualitatively():
    """vLLM blog (Jul 2026): 1,863 -> 6,091 tok/s/GPU; concurrency x DCP, throughput less."""
    kimi = replace(KIMI, weight_bytes_per_param=4.5 / 8)
    c = {d: cm.max_concurrency(kimi, B200, L(tp=8, dcp=d), 67_000) for d in (1, 8)}
    x = {d: cm.decode_throughput(kimi, B200, L(tp=8, dcp=d), 67_000, c[d]) for d in (1, 8)}
    assert 7 <= c[8] / c[1] <= 9 and 2 < x[8] / x[1] < c[8] / c[1]


def test_pcp_between_dp_and_tp():
    for ctx in (32768, 131072):
        t = {lay: cm.ttft(L8B, H200, lay, ctx).total_s for lay in (L(tp=8), L(pcp=8), L(dp=8))}
        x = {
            lay: cm.prefill_throughput(L8B, H200, lay, ctx) for lay in (L(tp=8), L(pcp=8), L(dp=8))
        }
        assert t[L(pcp=8)] < t[L(dp=8)] and t[L(pcp=8)] <= t[L(tp=8)]
        assert x[L(tp=8)] < x[L(pcp=8)] < x[L(dp=8)]


# ---------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "call, rule",
    [
        (lambda: cm.ttft(L8B, H200, L(), 0), "positive-tokens"),
        (lambda: cm.tpot(L8B, H200, L(), 1024, batch=-1), "positive-tokens"),
        (lambda: cm.max_concurrency(L8B, H200, L(), -1), "positive-tokens"),
        (lambda: cm.deployment_weight_bytes(DSV3, L(tp=3)), "heads-divisible-by-tp"),
        (lambda: cm.deployment_kv_bytes_per_token(L70B, L(tp=8, dcp=2)), "gqa-dcp-needs"),
        (lambda: cm.ttft(L8B, H200, L(), 1024, cp_comm="ulysses"), "cp-comm"),
    ],
)
def test_bad_input_raises_value_error(call, rule):
    with pytest.raises(ValueError, match=rule):
        call()


# ---------------------------------------------------------------------- calibration


def test_calibration_holds_out_and_predicts():
    points = calibration.load_points()
    held = [p for p in points if calibration.is_validation(p)]
    fit, rows = calibration.calibrate(points)
    assert len(held) == len(rows) >= 8 and len(points) - len(held) >= 30
    assert {p.bench for p in held} == {"decode_step", "pcp_prefill", "chunked_prefill"}
    assert fit.alpha_s > 0 and fit.beta_s_per_byte > 0 and fit.prefill_flops_per_s > 0
    refit = calibration.fit([p for p in points if not calibration.is_validation(p)])
    assert refit == fit  # the held-out runs never enter the fit
    assert sum(abs(r["error"]) <= 0.20 for r in rows) >= 20


def test_bench_calibrate_prints_json_lines(capsys):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "calibrate.py"
    spec = importlib.util.spec_from_file_location("calibrate", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.main(["--json"])
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert lines[0]["name"] == "costmodel_fit"
    val = [x for x in lines if x["name"] == "costmodel_validation"]
    assert val and all(set(x) >= {"config", "predicted_ms", "measured_ms", "error"} for x in val)
    for x in val:
        assert math.isclose(x["error"], x["predicted_ms"] / x["measured_ms"] - 1, abs_tol=2e-3)


def test_appendix_moe_and_link_tables_match_costmodel():
    from tests.test_costmodel import appendix_table, cited, key, num

    moe = appendix_table("tab-moe")
    assert [key(r["Key"]) for r in moe] == [k for k, m in cm.MODELS.items() if m.expert_params]
    for row in moe:
        model = cm.MODELS[key(row["Key"])]
        assert num(row["Active per token (billions)"]) * 1e9 == model.active_params
        assert row["Routed experts (billions)"] == f"{model.expert_params / 1e9:,.1f}"
        assert cited(row["Source"]) == model.source
    links = appendix_table("tab-links")
    assert [key(r["Key"]) for r in links] == list(cm.LINKS)
    for row in links:
        link = cm.LINKS[key(row["Key"])]
        assert math.isclose(num(row["α (µs)"]) * 1e-6, link.alpha_s)
        assert math.isclose(num(row["Bandwidth per direction (GB/s)"]) * 1e9, link.bw_bytes_per_s)
        assert cited(row["Source"]) == link.source


def test_tpot_break_even_brackets_the_crossing():
    dsv3, h200 = cm.MODELS["DeepSeek-V3"], cm.GPUS["H200"]
    dcp, tp = cm.Deployment(tp=8, dcp=8), cm.Deployment(tp=8)
    c = cm.tpot_break_even(dsv3, h200, dcp, tp)
    assert cm.tpot(dsv3, h200, dcp, c).total_s <= cm.tpot(dsv3, h200, tp, c).total_s
    assert cm.tpot(dsv3, h200, dcp, c - 256).total_s > cm.tpot(dsv3, h200, tp, c - 256).total_s


def test_break_even_table_is_the_two_decode_models():
    """The book's one break-even table: every entry is the existing function it names
    (``tpot_break_even`` for the whole-model rows, chapter 6's ``decode_break_even`` for the
    per-layer ones), at the latencies the cost model uses; the headline is the whole model."""
    from cpbook.costmodel import Deployment as Dep

    dsv3, h200 = cm.MODELS["DeepSeek-V3"], cm.GPUS["H200"]
    table = cm.break_even_table("DeepSeek-V3", "H200")
    assert len(table) == 2 * 2 * 2
    assert [r.decode_model for r in table[:4]] == [cm.HEADLINE_DECODE_MODEL] * 4
    assert set(cm.DECODE_MODELS) == {r.decode_model for r in table}
    for r in table:
        assert r.allreduce_alpha_s == cm.gpu_terms.DECODE_ALLREDUCE_ALPHA_S
        assert r.dcp_alpha_s == cm.LINKS["NVLink4"].alpha_s
        if r.decode_model == "whole-model":
            lay = Dep(tp=8, dcp=8, tpa=r.tpa)
            assert r.tokens == cm.tpot_break_even(dsv3, h200, lay, Dep(tp=8), r.num_reqs)
        else:
            mode = "dcp_tpa" if r.tpa else "dcp"
            want = cm.decode_break_even(dsv3, h200, mode, tp=8, dcp=8, num_reqs=r.num_reqs)
            assert r.tokens == want and r.kv_read_efficiency == cm.DEFAULT_HBM_EFFICIENCY
    k = {(r.decode_model, r.num_reqs, r.label): r.k_tokens for r in table}
    assert k == {
        ("whole-model", 1, "DCP"): 74,
        ("whole-model", 1, "DCP + TPA"): 70,
        ("whole-model", 16, "DCP"): 13,
        ("whole-model", 16, "DCP + TPA"): 11,
        ("per-layer", 1, "DCP"): 169,
        ("per-layer", 1, "DCP + TPA"): 159,
        ("per-layer", 16, "DCP"): 13,
        ("per-layer", 16, "DCP + TPA"): 11,
    }
    one = cm.headline_break_even(table)
    assert (one.decode_model, one.num_reqs, one.tpa, one.k_tokens) == ("whole-model", 1, False, 74)
    # the one term between the two models: one request's KV read, occupancy-bound
    assert one.kv_read_efficiency == cm.gpu_terms.DECODE_ATTENTION_UNIT_EFFICIENCY
    at_eff = cm.decode_break_even(
        dsv3, h200, "dcp", tp=8, dcp=8, knobs=cm.CostKnobs(hbm_efficiency=one.kv_read_efficiency)
    )
    assert abs(one.tokens / at_eff - 1) < 0.01
