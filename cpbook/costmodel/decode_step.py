"""One decode step of a whole deployment, term by term (chapter 8's TPOT)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from cpbook.costmodel import gpu_terms as gt
from cpbook.costmodel.decode import (
    collective_time,
    decode_attention_calls,
    kv_read_efficiency,
    tpa_weight_costs,
)
from cpbook.costmodel.knobs import CostKnobs
from cpbook.costmodel.memory import (
    Deployment,
    deployment_kv_bytes_per_token,
    deployment_weight_bytes,
)
from cpbook.costmodel.moe_gather import ep_dispatch_rows, moe_gather_s
from cpbook.costmodel.nodes import group_link, spans_nodes
from cpbook.costmodel.specs import GPUSpec, ModelSpec, check_moe_shape, check_tokens


@dataclass(frozen=True)
class DecodeTime:
    """Modelled seconds of one decode step on one GPU of a deployment.

    Memory (weights, KV, TPA's extra ``q_proj`` and MLA ``W_UK_T`` shards, experts) and compute
    (at the GEMM MFU) overlap, so the step costs the larger of the two; the per-kernel fixed
    costs (``fixed_s``) and the collectives (``comm_s``, α–β per layer) add to it, and under
    continuous batching so does the share of prefill chunks the step carries (``prefill_s``).
    ``batch_per_gpu``: requests this GPU's replica (or, PCP without DCP, this PCP rank)
    decodes in the step.
    """

    memory_s: float
    compute_s: float
    comm_s: float
    batch_per_gpu: int
    fixed_s: float = 0.0
    prefill_s: float = 0.0

    @property
    def step_s(self) -> float:
        """The decode step alone, without prefill chunks."""
        return max(self.memory_s, self.compute_s) + self.fixed_s + self.comm_s

    @property
    def total_s(self) -> float:
        return self.step_s + self.prefill_s


def _expert_bytes(model: ModelSpec, deployment: Deployment, tokens: int) -> tuple[float, float]:
    """``(resident, read)``: routed-expert bytes one GPU holds, and those one MoE layer of the
    step reads on the busiest GPU when the pool's ``tokens`` tokens route (TP over the pool:
    the touched experts' shards; EP: the touched experts on the busiest rank,
    :func:`~cpbook.costmodel.gpu_terms.busiest_rank_experts`)."""
    size = model.expert_size_params * model.weight_bytes_per_param
    gpus, k = deployment.num_gpus, model.num_experts_per_tok
    resident = model.expert_params * model.weight_bytes_per_param / gpus
    if deployment.ep:
        return resident, gt.busiest_rank_experts(model.num_experts, gpus, k, tokens) * size
    touched = gt.touched_experts(model.num_experts, k, tokens)
    return resident, touched * size / deployment.moe_tp


def _kernel_counts(model: ModelSpec) -> tuple[int, int]:
    """``(small GEMMs, elementwise kernels)`` of one decode step outside attention and the
    routed experts: GQA's qkv and o projections per layer (MLA's are in its fixed block), the
    dense MLP's gate-up and down, a MoE layer's router (GQA MoE; DeepSeek's is fused into its
    MoE), two add + RMSNorm per layer and an activation per dense MLP."""
    layers = model.num_layers
    moe = model.moe_layers if model.expert_params else 0
    dense = layers - moe
    gemms = (0 if model.use_mla else 2 * layers) + 2 * dense + (0 if model.use_mla else moe)
    elementwise = 2 * layers + (dense if model.intermediate_size or not moe else 0)
    return gemms, elementwise


def _gemm_bytes(model: ModelSpec, tp: int) -> list[tuple[float, int]]:
    """``(weight bytes per GPU, calls per step)`` of a GQA model's qkv, o, and dense MLP
    gate-up and down GEMMs at TP ``tp``."""
    h, d, wb = model.hidden_size, model.head_dim, model.weight_bytes_per_param
    q, kv = max(model.num_q_heads // tp, 1) * d, max(model.num_kv_heads // tp, 1) * d
    out = [((q + 2 * kv) * h * wb, model.num_layers), (q * h * wb, model.num_layers)]
    if model.intermediate_size:
        mlp, dense = model.intermediate_size // tp, model.num_layers - model.moe_layers
        out += [(2 * mlp * h * wb, dense), (mlp * h * wb, dense)]
    return out


def decode_step(
    model: ModelSpec,
    gpu: GPUSpec,
    deployment: Deployment,
    context_tokens: int,
    batch: int = 1,
    *,
    knobs: CostKnobs = CostKnobs(),
) -> DecodeTime:
    """One static decode step (no prefill chunks): what :func:`~cpbook.costmodel.latency.tpot`
    returns without continuous batching.  ``knobs``: :class:`~cpbook.costmodel.knobs.CostKnobs`
    (KV dtype, HBM efficiency, GEMM MFU, link — default the GPU's scale-up link —, DCP's combine
    backend, activation bytes).

    Memory at ``hbm_efficiency`` of HBM: the GPU's weight shard without the embedding table (a
    lookup), its share of the KV (:func:`~cpbook.costmodel.memory.deployment_kv_bytes_per_token`,
    at :data:`~cpbook.costmodel.gpu_terms.DECODE_ATTENTION_UNIT_EFFICIENCY`, or
    ``knobs.kv_unit_efficiency`` where set, per request and KV head up to ``hbm_efficiency``),
    TPA's extra shards, and per MoE layer the experts the batch touches on the busiest GPU.
    Compute at ``mfu`` (default ``GEMM_MFU``) of the weights' peak.
    Fixed costs: small GEMMs, elementwise kernels, GQA decode attention or the MLA block
    (:mod:`~cpbook.costmodel.gpu_terms`), and the MoE kernels' floor.  Collectives per layer:
    :func:`cpbook.dcp.tpa.tpa_comm_bytes`'s (DCP's query all-gather unless TPA, the combine,
    the ``o_proj`` all-reduce) plus the MLP's all-reduce, all-reduces at the CUDA-graph
    latency :data:`~cpbook.costmodel.gpu_terms.DECODE_ALLREDUCE_ALPHA_S`, the others at the
    link's α; EP adds a dispatch and a combine all-to-all per MoE layer
    (:func:`~cpbook.costmodel.moe_gather.ep_dispatch_rows`), experts split by TP over DP or PCP
    replicas their token all-gathers and reduce-scatters
    (:func:`~cpbook.costmodel.moe_gather.moe_gather_s`).  With ``knobs.nodes``
    a TP, DCP or EP group that spans nodes runs on the inter-node link (its own α, no CUDA-graph
    latency) instead (:func:`~cpbook.costmodel.nodes.group_link`).
    """
    check_tokens("context_tokens", context_tokens, minimum=1)
    check_tokens("batch", batch, minimum=1)
    check_moe_shape(model)
    cfg = deployment.config(model, knobs.dcp_comm_backend)
    hbm_efficiency, mfu, act_bytes = knobs.hbm_efficiency, knobs.mfu, knobs.act_bytes
    link = group_link(gpu, deployment, "dcp", knobs.nodes, knobs.link)
    tp_link = group_link(gpu, deployment, "tp", knobs.nodes, knobs.link)
    ep_link_bw = group_link(gpu, deployment, "ep", knobs.nodes, knobs.link).bw_bytes_per_s
    # CUDA-graph all-reduces inside a node; a TP group across nodes keeps the RDMA link's alpha
    nodes = knobs.nodes
    tp_across = nodes is not None and spans_nodes(deployment, "tp", nodes.gpus_per_node)
    graph_link = tp_link if tp_across else replace(tp_link, alpha_s=gt.DECODE_ALLREDUCE_ALPHA_S)
    shards = deployment.dp * (cfg.pcp if cfg.dcp == 1 else 1)
    b = -(-batch // shards)
    bw = gpu.hbm_bw_bytes_per_s * hbm_efficiency
    wbytes = model.weight_bytes_per_param
    weights = deployment_weight_bytes(
        model, deployment
    ) - model.lm_head_params * wbytes / cfg.tp * (0 if model.tie_word_embeddings else 1)
    fixed = 0.0
    expert_read = 0.0
    if model.expert_params:
        resident, per_layer = _expert_bytes(model, deployment, b * shards)
        weights -= resident
        _, extra = gt.moe_decode_s(per_layer, wbytes, bw, gqa=not model.use_mla)
        expert_read = per_layer * model.moe_layers
        fixed += extra * model.moe_layers
    kv = deployment_kv_bytes_per_token(model, deployment, knobs.kv_dtype) * context_tokens * b
    kv_heads = 1 if model.use_mla else max(model.num_kv_heads // cfg.tp, 1)
    kv_eff = kv_read_efficiency(hbm_efficiency, b, kv_heads, knobs.kv_unit_efficiency)
    extra = tpa_weight_costs(model, cfg, b, act_bytes)
    tpa_bytes = extra["extra_weight_bytes"] + extra["extra_w_uk_t_bytes"]
    memory = (weights + expert_read + tpa_bytes * model.num_layers) / bw + kv / (
        gpu.hbm_bw_bytes_per_s * kv_eff
    )
    q_dim = model.kv_lora_rank + model.qk_rope_head_dim if model.use_mla else model.head_dim
    attn_flops = 4 * cfg.q_heads_per_rank * q_dim * context_tokens * b / cfg.dcp
    gemm_mfu = mfu if mfu is not None else gt.GEMM_MFU[1 if wbytes <= 1 else 2][-1][1]
    compute = 2 * model.params_per_token * b / cfg.tp / (gpu.peak_flops(wbytes) * gemm_mfu)
    compute += attn_flops * model.num_layers / (gpu.bf16_flops * gemm_mfu)
    gemms, elementwise = _kernel_counts(model)
    # FP8 block-scaled GQA projections and dense MLPs overlap their fixed cost with their
    # weights; a MoE router stays bf16
    routers = model.moe_layers if model.expert_params and not model.use_mla else 0
    if wbytes <= 1 and not model.use_mla:
        fixed += sum(n * gt.fp8_decode_gemm_s(w, bw, b) for w, n in _gemm_bytes(model, cfg.tp))
        fixed += routers * gt.DECODE_GEMM_FIXED_S
    else:
        fixed += gemms * gt.DECODE_GEMM_FIXED_S
    fixed += elementwise * gt.elementwise_s(
        b * model.hidden_size, gt.NORM_BYTES_PER_ELEMENT, gpu.hbm_bw_bytes_per_s
    )
    if model.use_mla:
        per_layer_fixed = gt.MLA_DECODE_FIXED_S + gt.MLA_DECODE_PER_REQUEST_S * b
    else:
        per_layer_fixed = gt.DECODE_ATTENTION_FIXED_S
    fixed += per_layer_fixed * model.num_layers
    calls = decode_attention_calls(model, cfg, deployment.tpa, b, act_bytes)
    mlp = 2 * b * model.hidden_size * act_bytes * (cfg.tp - 1) // cfg.tp
    per_layer = sum(
        collective_time(op, nb, n, graph_link if op == "all_reduce" else link)
        for op, n, nb in calls
    ) + collective_time("all_reduce", mlp, cfg.tp, graph_link)
    comm = per_layer * model.num_layers
    if model.expert_params:
        ep, row_bytes = deployment.num_gpus, model.hidden_size * act_bytes
        sent = ep_dispatch_rows(deployment, b) * model.num_experts_per_tok * row_bytes
        comm += 2 * model.moe_layers * gt.all_to_all_s(sent * (ep - 1) / ep, ep, ep_link_bw)
        gather_link = {k: group_link(gpu, deployment, k, nodes, knobs.link) for k in ("dp", "pcp")}
        comm += model.moe_layers * moe_gather_s(deployment, b, row_bytes, gather_link.get)
    return DecodeTime(memory, compute, comm, b, fixed)
