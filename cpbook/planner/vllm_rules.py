"""What vLLM v0.34.0 accepts for a model: the deployment rules beyond ``ParallelConfig``'s.

:func:`check_deployment` first builds the deployment's
:class:`~cpbook.core.config.ParallelConfig` (every TP / DCP / PCP rule there: the DCP size rules
with and without PCP, ``tp % dcp``, the GQA rules on KV heads, ``pcp-dcp-combination``), then
applies the rules vLLM v0.34.0 adds at run time for a *model*, each a
:class:`~cpbook.core.config.ConfigError` naming it:

``kv-cache-dtype``
    The KV cache is 16-bit (the model's dtype) or FP8: the two choices the planner weighs.
``pcp-needs-model-runner-v2``
    PCP runs only on Model Runner V2.  In v0.34.0 V2 is the only GPU model runner (V1 is
    removed, ``vllm/platforms/interface.py``), so the rule binds only a reader on v0.33.0,
    where ``VLLM_USE_V2_MODEL_RUNNER=0`` fell back to V1, whose
    ``VllmConfig._get_v1_model_runner_unsupported_features`` lists "prefill context parallel"
    (``vllm/config/vllm.py``).
``pcp-mla-only``
    PCP > 1 needs an MLA model: ``PCPManager.validate_config`` raises "MRV2 PCP currently
    supports MLA models only" (``vllm/v1/worker/gpu/pcp_manager.py``).
``pcp-dcp-sparse-mla-only``
    PCP > 1 with DCP > 1 needs sparse MLA (DeepSeek-V3.2, GLM-5): the same function raises
    "MRV2 PCP + DCP supports sparse MLA models only" unless ``index_topk`` is in the config
    (#53573), and ``MLAAttention.__init__`` rejects PCP + DCP for attention classes whose
    ``supports_pcp_dcp`` is false (only ``DeepseekV32Attention`` sets it,
    ``vllm/models/deepseek_v32/attention.py``).
``sparse-mla-pcp-dcp-fp8-ds-mla``, ``sparse-mla-dcp-fp8-heads``, ``sparse-mla-dcp-fp8-head-padding``
    Sparse MLA with DCP runs on FlashMLA-sparse (on SM90 the other sparse backend,
    FlashAttention-MLA-sparse, "does not support DCP", and on SM100 FlashInfer's "does not
    support combined PCP+DCP" nor ``fp8_ds_mla``), whose ``FlashMLASparseMetadataBuilder``
    raises ``NotImplementedError`` at start-up
    (``vllm/v1/attention/backends/mla/flashmla_sparse.py``): PCP x DCP "gathers the KV through
    the fp8_ds_mla upconvert", so it needs ``--kv-cache-dtype fp8_ds_mla``; and with an FP8
    cache, DCP without PCP needs the mixed-batch kernel, ``heads = num_q_heads // tp < 32``
    (``MIN_HEADS_FOR_BF16_PREFILL``), and the local and DCP-gathered head counts must pad to
    the same FP8 decode kernel (``64 if h <= 64 else 128``; gathered: ``h * dcp``, or with
    PCP ``h * tp`` when ``dcp > pcp``).  In v0.33.0 the two head rules held for a bf16 cache
    too.  The planner does not switch a bf16 cache to FP8 on its own: with ``fp8`` allowed, the
    same deployment is searched with ``fp8_ds_mla`` (656 B per token and layer).
``dcp-q-replicate-needs-pcp-1``
    Query replication (``--dcp-q-replicate``, MLA) takes effect only without PCP:
    ``DeepseekV2MLAAttention.__init__`` enables it only when
    ``prefill_context_parallel_size <= 1`` (``vllm/model_executor/models/deepseek_v2.py``) and
    silently ignores it otherwise, so the planner keeps only the deployment that runs.
``tpa-gqa-unreleased``
    TPA for GQA (``tensor_parallel_size_attention``, PR #36287) is not in v0.34.0: no such
    field in ``vllm/config/parallel.py``.  MLA's form, ``dcp_q_replicate``, is.
``ep-needs-moe``
    ``--enable-expert-parallel`` needs routed experts:
    ``ModelConfig._verify_with_expert_parallelism`` raises for a dense model
    (``vllm/config/model.py``).
``ep-needs-several-gpus``
    EP spans ``dp x tp x pcp`` GPUs (``ParallelConfig.data_parallel_size``'s docstring); on one
    GPU vLLM accepts the flag and changes nothing, so the planner keeps the deployment without it.

A MoE model's DP replicas are one pool (:func:`pool_gpus`): vLLM runs them in lockstep
(``DPEngineCoreProc`` only ``if data_parallel and vllm_config.model_config.is_moe``, else
"Non-MoE DP ranks are completely independent", ``vllm/v1/engine/core.py``), and every MoE
layer runs over all ``dp x pcp x tp`` GPUs, its experts split by TP over them unless
``--enable-expert-parallel`` (``FusedMoEParallelConfig.make``,
``vllm/model_executor/layers/fused_moe/config.py``).

PCP x DCP also requires ``--dcp-comm-backend ag_rs``, rule ``pcp-dcp-needs-ag-rs``
(:func:`check_pcp_dcp_comm_backend`; ``PCPManager.validate_config``): the cost model prices
``ag_rs`` and :mod:`cpbook.planner.serve_flags` prints it, so only a hand-written line breaks it
(cpbook's own engine runs PCP x DCP over ``a2a`` too; vLLM v0.34.0 does not).  Two more rules
are about the launch, not the deployment: :func:`check_nodes` (``nnodes-divides-world``) and
:func:`check_max_model_len` (``max-model-len-within-positions``).
"""

from __future__ import annotations

from cpbook.core.config import ConfigError, ParallelConfig
from cpbook.costmodel.memory import Deployment
from cpbook.costmodel.nodes import node_count
from cpbook.costmodel.specs import ModelSpec

#: FlashMLA-sparse's ``MIN_HEADS_FOR_BF16_PREFILL``: below it, the mixed-batch FP8 kernel
SPARSE_MLA_MIN_HEADS_FOR_BF16_PREFILL = 32

#: the KV cache dtypes the planner weighs (cpbook's names; serve_flags maps them to vLLM's)
PLAN_KV_DTYPES = ("bf16", "fp8")


def pool_gpus(model: ModelSpec, deployment: Deployment) -> int:
    """The GPUs that step together as one vLLM engine pool: a MoE model's whole ``dp x pcp x tp``
    (its MoE layers span them, with or without EP), a dense model's one replica (``pcp x tp``;
    its DP replicas are independent engines)."""
    if model.expert_params:
        return deployment.num_gpus
    return deployment.tp * deployment.pcp


def check_kv_dtype(kv_dtype: str) -> None:
    """Rule ``kv-cache-dtype``: ``kv_dtype`` is one of :data:`PLAN_KV_DTYPES`."""
    if kv_dtype not in PLAN_KV_DTYPES:
        raise ConfigError("kv-cache-dtype", f"kv_dtype in {PLAN_KV_DTYPES}", kv_dtype=kv_dtype)


def check_deployment(
    model: ModelSpec,
    deployment: Deployment,
    kv_dtype: str = "bf16",
    *,
    model_runner_v2: bool = True,
) -> ParallelConfig:
    """The replica's :class:`ParallelConfig` if vLLM v0.34.0 serves ``model`` as ``deployment``
    with a ``kv_dtype`` cache; else :class:`ConfigError` naming the first violated rule
    (``ParallelConfig``'s, then this module's in the order of its docstring)."""
    cfg = deployment.config(model)
    check_kv_dtype(kv_dtype)
    if cfg.pcp > 1 and not model_runner_v2:
        raise ConfigError(
            "pcp-needs-model-runner-v2",
            "Model Runner V2 for prefill_context_parallel_size > 1",
            prefill_context_parallel_size=cfg.pcp,
            model_runner_v2=model_runner_v2,
        )
    if cfg.pcp > 1 and not model.use_mla:
        raise ConfigError(
            "pcp-mla-only",
            "an MLA model for prefill_context_parallel_size > 1 (PCPManager.validate_config)",
            model=model.name,
            prefill_context_parallel_size=cfg.pcp,
        )
    if cfg.pcp > 1 and cfg.dcp > 1 and not model.sparse_mla:
        raise ConfigError(
            "pcp-dcp-sparse-mla-only",
            "sparse MLA (index_topk) for PCP > 1 with DCP > 1 (PCPManager.validate_config)",
            model=model.name,
            prefill_context_parallel_size=cfg.pcp,
            decode_context_parallel_size=cfg.dcp,
        )
    if model.sparse_mla and cfg.dcp > 1:
        check_sparse_mla_dcp(model, cfg, kv_dtype)
    if deployment.tpa and model.use_mla and cfg.pcp > 1:
        raise ConfigError(
            "dcp-q-replicate-needs-pcp-1",
            "prefill_context_parallel_size == 1 for dcp_q_replicate (ignored under PCP)",
            prefill_context_parallel_size=cfg.pcp,
        )
    if deployment.tpa and not model.use_mla:
        raise ConfigError(
            "tpa-gqa-unreleased",
            "MLA for TPA in vLLM v0.34.0 (GQA's tensor_parallel_size_attention is PR #36287)",
            model=model.name,
        )
    if deployment.ep and not model.expert_params:
        raise ConfigError(
            "ep-needs-moe", "routed experts for enable_expert_parallel", model=model.name
        )
    if deployment.ep and deployment.num_gpus == 1:
        raise ConfigError(
            "ep-needs-several-gpus",
            "dp * tp * pcp > 1 for enable_expert_parallel (one GPU: nothing to spread)",
            num_gpus=deployment.num_gpus,
        )
    return cfg


def check_pcp_dcp_comm_backend(cfg: ParallelConfig) -> None:
    """Rule ``pcp-dcp-needs-ag-rs``: with PCP > 1 and DCP > 1, ``dcp_comm_backend`` is
    ``"ag_rs"``; vLLM v0.34.0's ``PCPManager.validate_config`` raises "MRV2 PCP + DCP requires
    dcp_comm_backend='ag_rs'" otherwise (``vllm/v1/worker/gpu/pcp_manager.py``)."""
    if cfg.pcp > 1 and cfg.dcp > 1 and cfg.dcp_comm_backend != "ag_rs":
        raise ConfigError(
            "pcp-dcp-needs-ag-rs",
            "dcp_comm_backend == 'ag_rs' when pcp > 1 and dcp > 1 (PCPManager.validate_config)",
            dcp_comm_backend=cfg.dcp_comm_backend,
            prefill_context_parallel_size=cfg.pcp,
            decode_context_parallel_size=cfg.dcp,
        )


def fp8_decode_padded_heads(num_heads: int) -> int:
    """FlashMLA-sparse's ``_compute_fp8_decode_padded_heads``: the FP8 decode kernel runs 64
    or 128 query heads."""
    return 64 if num_heads <= 64 else 128


def check_sparse_mla_dcp(model: ModelSpec, cfg: ParallelConfig, kv_dtype: str) -> None:
    """FlashMLA-sparse's start-up checks for DCP > 1 (``FlashMLASparseMetadataBuilder.__init__``,
    v0.34.0), with cpbook's ``fp8`` as vLLM's ``fp8_ds_mla``: rules
    ``sparse-mla-pcp-dcp-fp8-ds-mla``, ``sparse-mla-dcp-fp8-heads`` and
    ``sparse-mla-dcp-fp8-head-padding`` (see the module docstring)."""
    heads = model.num_q_heads // cfg.tp  # ModelConfig.get_num_attention_heads
    pcp_dcp = cfg.pcp > 1 and cfg.dcp > 1
    sizes = dict(
        tensor_parallel_size=cfg.tp,
        prefill_context_parallel_size=cfg.pcp,
        decode_context_parallel_size=cfg.dcp,
    )
    if pcp_dcp and kv_dtype != "fp8":
        raise ConfigError(
            "sparse-mla-pcp-dcp-fp8-ds-mla",
            "--kv-cache-dtype fp8_ds_mla for sparse MLA with PCP x DCP (FlashMLA-sparse gathers "
            "the KV through the fp8_ds_mla upconvert)",
            kv_cache_dtype=kv_dtype,
            **sizes,
        )
    if kv_dtype != "fp8":
        return
    if not pcp_dcp and heads >= SPARSE_MLA_MIN_HEADS_FOR_BF16_PREFILL:
        raise ConfigError(
            "sparse-mla-dcp-fp8-heads",
            f"num_q_heads // tp < {SPARSE_MLA_MIN_HEADS_FOR_BF16_PREFILL} for sparse MLA DCP with "
            "an fp8_ds_mla cache (FlashMLA-sparse's mixed-batch kernel)",
            num_heads_per_rank=heads,
            **sizes,
        )
    if cfg.pcp > 1:
        gathered = heads * cfg.tp if cfg.dcp > cfg.pcp else heads
    else:
        gathered = heads * cfg.dcp
    if fp8_decode_padded_heads(heads) != fp8_decode_padded_heads(gathered):
        raise ConfigError(
            "sparse-mla-dcp-fp8-head-padding",
            "local and DCP-gathered heads padded to the same FP8 decode kernel (64 or 128)",
            num_heads_per_rank=heads,
            gathered_num_heads=gathered,
            **sizes,
        )


def check_nodes(deployment: Deployment, gpus_per_node: int, num_gpus: int) -> int:
    """The nodes vLLM's multi-node launch runs ``deployment`` on
    (:func:`~cpbook.costmodel.nodes.node_count`: ``world // nnodes`` ranks on each) when the
    pool is ``num_gpus`` GPUs in nodes of ``gpus_per_node`` (the last one holding the rest);
    rule ``nnodes-divides-world``: the pool has that many nodes with that many GPUs (vLLM's
    ``--nnodes`` must evenly divide the world size, ``EngineArgs.create_engine_config``, so 9
    GPUs on two 8-GPU nodes cannot be launched, nor 6 + 6 on a pool of 8 + 4)."""
    n = node_count(deployment.num_gpus, gpus_per_node)
    per_node = deployment.num_gpus // n
    full, rest = divmod(num_gpus, gpus_per_node)
    available = full + (1 if rest >= per_node else 0)
    if n > 1 and n > available:
        raise ConfigError(
            "nnodes-divides-world",
            "world_size % nnodes == 0 with world_size // nnodes GPUs on each of nnodes nodes "
            "of the pool",
            world_size=deployment.num_gpus,
            gpus_per_node=gpus_per_node,
            nnodes=n,
            nodes_with_room=available,
        )
    return n


def check_max_model_len(model: ModelSpec, max_model_len: int) -> None:
    """Rule ``max-model-len-within-positions``: ``--max-model-len`` at most the model's
    ``max_position_embeddings`` (its YaRN or ``llama3`` RoPE scaling already folded in), else
    vLLM v0.34.0 refuses to start "To allow overriding this maximum, set the env var
    VLLM_ALLOW_LONG_MAX_MODEL_LEN=1" (``_get_and_verify_max_len``, ``vllm/config/model.py``).
    A model whose positions are unknown (0) passes."""
    limit = model.max_position_embeddings
    if limit and max_model_len > limit:
        raise ConfigError(
            "max-model-len-within-positions",
            "max_model_len <= max_position_embeddings, or VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 (and "
            "a RoPE scaling that covers the positions, for the answers to be right)",
            model=model.name,
            max_model_len=max_model_len,
            max_position_embeddings=limit,
        )


def _probes(model: ModelSpec) -> dict[str, Deployment]:
    kv = model.num_kv_heads
    return {
        "DCP = TP = 8": Deployment(tp=8, dcp=8),
        "DCP 2 on TP = 2 x KV heads": Deployment(tp=2 * kv, dcp=2),
        "PCP 2": Deployment(tp=4, pcp=2),
        "PCP 2 x DCP 2": Deployment(tp=4, pcp=2, dcp=2),
        "query replication (DCP 8)": Deployment(tp=8, dcp=8, tpa=True),
        "EP over DP 8": Deployment(tp=1, dp=8, ep=True),
    }


def rule_probes(model: ModelSpec) -> dict[str, str | None]:
    """Six probe deployments and what :func:`check_deployment` says of each for ``model``: ``None``
    (vLLM v0.34 serves it with one of :data:`PLAN_KV_DTYPES`) or the rule that rejects it (with
    a bf16 cache).  The decision page's figure and table draw the model families' differences
    from this."""
    out: dict[str, str | None] = {}
    for name, deployment in _probes(model).items():
        out[name] = None
        for kv in reversed(PLAN_KV_DTYPES):  # bf16 last: its rule is the one reported
            try:
                check_deployment(model, deployment, kv)
                out[name] = None
                break
            except ConfigError as e:
                out[name] = e.rule
    return out
