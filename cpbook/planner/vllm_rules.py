"""What vLLM v0.33.0 accepts for a model: the deployment rules beyond ``ParallelConfig``'s.

:func:`check_deployment` first builds the deployment's
:class:`~cpbook.core.config.ParallelConfig` (every TP / DCP / PCP rule there: the DCP size rules
with and without PCP, ``tp % dcp``, the GQA rules on KV heads, ``pcp-dcp-combination``), then
applies the rules vLLM v0.33.0 adds at run time for a *model*, each a
:class:`~cpbook.core.config.ConfigError` naming it:

``kv-cache-dtype``
    The KV cache is 16-bit (the model's dtype) or FP8: the two choices the planner weighs.
``pcp-needs-model-runner-v2``
    PCP runs only on Model Runner V2: ``VllmConfig._get_v1_model_runner_unsupported_features``
    lists "prefill context parallel" (``vllm/config/vllm.py``).  V2 is the default in v0.33;
    ``VLLM_USE_V2_MODEL_RUNNER=0`` turns it off.
``pcp-mla-only``
    PCP > 1 needs an MLA model: ``PCPManager.validate_config`` raises "MRV2 PCP currently
    supports MLA models only" (``vllm/v1/worker/gpu/pcp_manager.py``).
``pcp-dcp-sparse-mla-only``
    PCP > 1 with DCP > 1 needs sparse MLA (DeepSeek-V3.2, GLM-5): the same function raises
    "MRV2 PCP + DCP supports sparse MLA models only" unless ``index_topk`` is in the config
    (#53573), and ``MLAAttention.__init__`` rejects PCP + DCP for attention classes whose
    ``supports_pcp_dcp`` is false (only ``DeepseekV32Attention`` sets it,
    ``vllm/models/deepseek_v32/attention.py``).
``dcp-q-replicate-needs-pcp-1``
    Query replication (``--dcp-q-replicate``, MLA) takes effect only without PCP:
    ``DeepseekV2MLAAttention.__init__`` enables it only when
    ``prefill_context_parallel_size <= 1`` (``vllm/model_executor/models/deepseek_v2.py``) and
    silently ignores it otherwise, so the planner keeps only the deployment that runs.
``tpa-gqa-unreleased``
    TPA for GQA (``tensor_parallel_size_attention``, PR #36287) is not in v0.33.0: no such
    field in ``vllm/config/parallel.py``.  MLA's form, ``dcp_q_replicate``, is.
``ep-needs-moe``
    ``--enable-expert-parallel`` needs routed experts:
    ``ModelConfig._verify_with_expert_parallelism`` raises for a dense model
    (``vllm/config/model.py``).
``ep-needs-several-gpus``
    EP spans ``dp x tp x pcp`` GPUs (``ParallelConfig.data_parallel_size``'s docstring); on one
    GPU vLLM accepts the flag and changes nothing, so the planner keeps the deployment without it.

PCP x DCP also requires ``--dcp-comm-backend ag_rs`` (``PCPManager.validate_config``): the
cost model prices ``ag_rs`` and :mod:`cpbook.planner.serve_flags` prints it.
"""

from __future__ import annotations

from cpbook.core.config import ConfigError, ParallelConfig
from cpbook.costmodel.memory import Deployment
from cpbook.costmodel.specs import ModelSpec

#: the KV cache dtypes the planner weighs (cpbook's names; serve_flags maps them to vLLM's)
PLAN_KV_DTYPES = ("bf16", "fp8")


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
    """The replica's :class:`ParallelConfig` if vLLM v0.33.0 serves ``model`` as ``deployment``
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
    if deployment.tpa and model.use_mla and cfg.pcp > 1:
        raise ConfigError(
            "dcp-q-replicate-needs-pcp-1",
            "prefill_context_parallel_size == 1 for dcp_q_replicate (ignored under PCP)",
            prefill_context_parallel_size=cfg.pcp,
        )
    if deployment.tpa and not model.use_mla:
        raise ConfigError(
            "tpa-gqa-unreleased",
            "MLA for TPA in vLLM v0.33.0 (GQA's tensor_parallel_size_attention is PR #36287)",
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
    (vLLM v0.33 serves it) or the rule that rejects it.  The decision page's figure and table
    draw the model families' differences from this."""
    out: dict[str, str | None] = {}
    for name, deployment in _probes(model).items():
        try:
            check_deployment(model, deployment)
            out[name] = None
        except ConfigError as e:
            out[name] = e.rule
    return out
