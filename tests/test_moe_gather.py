"""A MoE layer over the whole DP x PCP x TP pool (costmodel.moe_gather): experts split by TP
over it without EP, the token all-gathers and reduce-scatters that costs, EP's dispatch under
sequence-parallel MoE, the DP group across nodes, and the planner's pool of GPUs."""

from __future__ import annotations

import pytest

from cpbook import costmodel as cm
from cpbook.costmodel.knobs import CostKnobs
from cpbook.costmodel.moe_gather import ep_dispatch_rows, moe_gather_calls
from cpbook.costmodel.nodes import Nodes, group_ranks, spans_nodes
from cpbook.planner.vllm_rules import pool_gpus

DSV3 = cm.get_model("DeepSeek-V3")
L70B = cm.get_model("Llama-3.1-70B")
H200 = cm.get_gpu("H200")
D = cm.Deployment


def test_experts_split_over_the_whole_pool():
    """vLLM's flatten_tp_across_dp_and_pcp: without EP the experts' TP degree is dp*pcp*tp, so
    a GPU holds the same expert bytes as with EP; attention and dense layers stay TP-sharded."""
    dense = DSV3.num_params - DSV3.expert_params
    per_gpu = (dense / 2 + DSV3.expert_params / 8) * DSV3.weight_bytes_per_param
    for d in (D(tp=2, dp=4), D(tp=2, dp=4, ep=True), D(tp=2, pcp=4)):
        assert cm.deployment_weight_bytes(DSV3, d) == pytest.approx(per_gpu)
    assert D(tp=2, dp=4).moe_tp == 8 and D(tp=2, dp=4, ep=True).moe_tp == 1
    assert D(tp=2, dp=4).moe_label == "experts TP8"
    assert D(tp=1, pcp=8, ep=True).moe_label == "experts EP8"
    # a dense model's DP replicas each hold the whole model over TP
    assert cm.deployment_weight_bytes(L70B, D(tp=2, dp=4)) == cm.weight_bytes_per_gpu(L70B, 2)


def test_gather_calls_over_dp_then_pcp():
    row = 7168 * 2
    assert moe_gather_calls(D(tp=8), 100, row) == []
    assert moe_gather_calls(D(tp=2, dp=4, ep=True), 100, row) == []
    calls = moe_gather_calls(D(tp=2, dp=4, pcp=2), 100, row)
    assert calls == [
        ("all_gather", "dp", 4, 3 * 100 * row),
        ("reduce_scatter", "dp", 4, 3 * 100 * row),
        ("all_gather", "pcp", 2, 1 * 4 * 100 * row),
        ("reduce_scatter", "pcp", 2, 1 * 4 * 100 * row),
    ]


def test_ep_dispatch_rows_follow_vllm():
    """No all-to-all for EP over TP alone; a TP rank's share under sequence-parallel MoE (EP,
    tp > 1, dp > 1), padded to whole rows."""
    assert ep_dispatch_rows(D(tp=8), 64) == 0
    assert ep_dispatch_rows(D(tp=8, ep=True), 64) == 0
    assert ep_dispatch_rows(D(tp=2, dp=4, ep=True), 64) == 32
    assert ep_dispatch_rows(D(tp=8, dp=2, ep=True), 3) == 1
    assert ep_dispatch_rows(D(tp=1, dp=8, ep=True), 64) == 64
    assert ep_dispatch_rows(D(tp=2, pcp=4, ep=True), 64) == 64


def test_prefill_prices_the_gather_only_where_vllm_runs_it():
    t = {d.label: cm.ttft(DSV3, H200, d, 4096) for d in (D(tp=8), D(tp=2, dp=4))}
    assert t["TP8"].moe_comm_s == 0 and t["TP8"].ep_comm_s == 0
    assert t["DP4+TP2"].moe_comm_s > 0 and t["DP4+TP2"].ep_comm_s == 0
    ep = cm.ttft(DSV3, H200, D(tp=2, dp=4, ep=True), 4096)
    assert ep.moe_comm_s == 0 and ep.ep_comm_s > 0
    # sequence-parallel MoE: TP 2 halves what each GPU dispatches
    no_sp = cm.ttft(DSV3, H200, D(tp=1, dp=8, ep=True), 4096)
    assert ep.ep_comm_s < no_sp.ep_comm_s
    assert cm.ttft(L70B, H200, D(tp=2, dp=4), 4096).moe_comm_s == 0


def test_dp_group_spans_nodes_and_is_priced_there():
    """The DP group: one (PCP, TP) position across replicas; DP2 x TP8 on two 8-GPU nodes
    gathers its MoE tokens over the inter-node link."""
    assert group_ranks(D(tp=2, dp=3), "dp") == [[0, 2, 4], [1, 3, 5]]
    d = D(tp=8, dp=2)
    assert spans_nodes(d, "dp", 8) and not spans_nodes(d, "tp", 8)
    one = cm.ttft(DSV3, H200, d, 4096)
    two = cm.ttft(DSV3, H200, d, 4096, knobs=CostKnobs(nodes=Nodes(8)))
    assert two.moe_comm_s > one.moe_comm_s and two.tp_comm_s == one.tp_comm_s
    step = cm.tpot(DSV3, H200, d, 5120, 64, knobs=CostKnobs(nodes=Nodes(8)))
    assert step.comm_s > cm.tpot(DSV3, H200, d, 5120, 64).comm_s


def test_pool_gpus():
    assert pool_gpus(DSV3, D(tp=2, dp=4)) == 8
    assert pool_gpus(L70B, D(tp=2, dp=4)) == 2
    assert pool_gpus(DSV3, D(tp=2, pcp=2)) == 4
