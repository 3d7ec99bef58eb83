"""Memory: weights and KV cache per GPU, the longest request and the largest batch that fit.

Every function raises ``ValueError`` for a configuration vLLM rejects (through
:class:`cpbook.core.config.ParallelConfig`) or for a model that does not fit.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from fractions import Fraction

from cpbook.core.config import ParallelConfig
from cpbook.core.errors import RuleError
from cpbook.core.heads import attention_kv_heads, tpa_config
from cpbook.costmodel.specs import (
    DEFAULT_ACTIVATION_RESERVE_BYTES,
    DEFAULT_GPU_MEMORY_UTILIZATION,
    FP8_DS_MLA_BYTES_PER_TOKEN_PER_LAYER,
    GB,
    KV_DTYPE_BYTES,
    KV_DTYPES,
    GPUSpec,
    ModelSpec,
    check_tokens,
)


def kv_bytes_per_token(model: ModelSpec, kv_dtype: str = "bf16") -> int:
    """Bytes of KV cache one token occupies, summed over all layers (one copy).

    GQA: ``2 * num_kv_heads * head_dim * num_layers * bytes``.
    MLA: ``(kv_lora_rank + qk_rope_head_dim) * num_layers * bytes``: with ``kv_dtype="fp8"``
    (vLLM's ``fp8`` / ``fp8_e4m3`` on FlashMLA) 576 B per token and layer for DeepSeek-V3;
    ``kv_dtype="fp8_ds_mla"`` is sparse MLA's KV layout (DeepSeek-V3.2), 656 B per token and layer;
    ``"fp8"`` of a sparse-MLA model is the same layout (FlashMLA-sparse lists vLLM's ``fp8`` as
    an alias of ``fp8_ds_mla``, ``vllm/v1/attention/backends/mla/flashmla_sparse.py``).
    """
    if kv_dtype not in KV_DTYPES:
        raise RuleError("kv-dtype", f"kv_dtype in {sorted(KV_DTYPES)}", kv_dtype=kv_dtype)
    if kv_dtype == "fp8" and model.sparse_mla:
        kv_dtype = "fp8_ds_mla"
    if kv_dtype == "fp8_ds_mla":
        if not model.use_mla:
            raise RuleError(
                "kv-dtype-ds-mla",
                "an MLA model for kv_dtype='fp8_ds_mla'",
                model=model.name,
                use_mla=model.use_mla,
            )
        return FP8_DS_MLA_BYTES_PER_TOKEN_PER_LAYER * model.num_layers
    if model.use_mla:
        width = model.kv_lora_rank + model.qk_rope_head_dim
        return width * model.num_layers * KV_DTYPE_BYTES[kv_dtype]
    return 2 * model.num_kv_heads * model.head_dim * model.num_layers * KV_DTYPE_BYTES[kv_dtype]


def kv_bytes_for_context(model: ModelSpec, tokens: int, kv_dtype: str = "bf16") -> int:
    """Bytes of KV cache for ``tokens`` tokens of one request (one copy, all layers)."""
    check_tokens("tokens", tokens)
    return tokens * kv_bytes_per_token(model, kv_dtype)


def kv_replication(model: ModelSpec, tp: int) -> int:
    """How many GPUs of one TP group hold a copy of each KV head.

    GQA: ``tp // num_kv_heads`` when ``tp > num_kv_heads``, else 1 (heads are
    split, nothing is copied). MLA: ``tp`` (every rank keeps the full latent).
    """
    ParallelConfig.for_model(model, tensor_parallel_size=tp)
    if model.use_mla:
        return tp
    return tp // model.num_kv_heads if tp > model.num_kv_heads else 1


def kv_bytes_per_token_per_gpu(
    model: ModelSpec, tp: int = 1, dcp: int = 1, kv_dtype: str = "bf16"
) -> float:
    """KV bytes one GPU stores per token of a request, under TP and DCP.

    A GPU holds ``num_kv_heads / tp`` KV heads but never less than one (MLA:
    the whole latent); DCP then shards the *tokens* over ``dcp`` ranks without
    changing the heads, so the result is exactly the ``dcp=1`` value / ``dcp``.
    Raises ValueError for configurations vLLM rejects.
    """
    ParallelConfig.for_model(model, tensor_parallel_size=tp, decode_context_parallel_size=dcp)
    total = kv_bytes_per_token(model, kv_dtype)
    if model.use_mla:
        heads_share = Fraction(1)
    else:
        heads_share = Fraction(max(model.num_kv_heads // tp, 1), model.num_kv_heads)
    return float(total * heads_share / dcp)


def weight_bytes_per_gpu(model: ModelSpec, tp: int, ep_size: int | None = None) -> float:
    """Weight bytes per GPU: ``num_params * weight_bytes_per_param / tp``.

    With ``ep_size``, a MoE model's routed experts are spread over ``ep_size`` GPUs instead of
    ``tp`` (expert parallelism, or vLLM's experts split by TP over a DP x PCP x TP pool).
    Ignores tensors replicated across TP ranks (norms, and embeddings in some setups): a lower
    bound good to a few percent.
    """
    ParallelConfig.for_model(model, tensor_parallel_size=tp)
    experts = model.expert_params if ep_size else 0.0
    dense = (model.num_params - experts) / tp + (experts / ep_size if ep_size else 0.0)
    return dense * model.weight_bytes_per_param


def kv_budget_bytes_per_gpu(
    model: ModelSpec,
    gpu: GPUSpec,
    tp: int,
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
    activation_reserve_bytes: float = DEFAULT_ACTIVATION_RESERVE_BYTES,
) -> float:
    """Bytes left for the KV cache on one GPU, vLLM style.

    ``hbm * gpu_memory_utilization - weights / tp - activation_reserve_bytes``.
    Raises ValueError when the result is not positive (the model does not fit).
    """
    return _kv_budget(
        model,
        gpu,
        weight_bytes_per_gpu(model, tp),
        f"at tp={tp}",
        gpu_memory_utilization,
        activation_reserve_bytes,
    )


def _kv_budget(
    model: ModelSpec,
    gpu: GPUSpec,
    weights: float,
    where: str,
    gpu_memory_utilization: float,
    activation_reserve_bytes: float,
) -> float:
    """``hbm * gpu_memory_utilization - weights - activation_reserve_bytes`` for one GPU holding
    ``weights`` (``where`` names the deployment in the error); ValueError unless positive."""
    if not 0 < gpu_memory_utilization <= 1:
        raise RuleError(
            "gpu-memory-utilization",
            "0 < gpu_memory_utilization <= 1",
            gpu_memory_utilization=gpu_memory_utilization,
        )
    if activation_reserve_bytes < 0:
        raise RuleError(
            "activation-reserve",
            "activation_reserve_bytes >= 0",
            activation_reserve_bytes=activation_reserve_bytes,
        )
    budget = gpu.hbm_bytes * gpu_memory_utilization - weights - activation_reserve_bytes
    if budget <= 0:
        raise RuleError(
            "model-fits",
            f"weights + reserve < usable HBM ({model.name} on {gpu.name} {where}: "
            f"{gpu.hbm_bytes / GB:.0f} GB x {gpu_memory_utilization} - weights "
            f"{weights / GB:.1f} GB - reserve {activation_reserve_bytes / GB:.1f} GB)",
            budget_gb=round(budget / GB, 1),
        )
    return budget


def max_context_tokens(
    model: ModelSpec,
    gpu: GPUSpec,
    tp: int = 1,
    dcp: int = 1,
    kv_dtype: str = "bf16",
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
    activation_reserve_bytes: float = DEFAULT_ACTIVATION_RESERVE_BYTES,
) -> int:
    """Longest single request whose KV cache fits: floor(budget / per-GPU bytes).

    Data parallelism does not change this number: each DP replica serves whole
    requests, so a request's KV must fit in one replica. Block granularity and
    the model's own position limit are ignored.
    """
    budget = kv_budget_bytes_per_gpu(
        model, gpu, tp, gpu_memory_utilization, activation_reserve_bytes
    )
    per_token = kv_bytes_per_token_per_gpu(model, tp, dcp, kv_dtype)
    return math.floor(budget / per_token)


# ---------------------------------------------------------------- whole deployments


@dataclass(frozen=True)
class Deployment:
    """How ``dp * tp * pcp`` GPUs serve one model, in vLLM's terms.

    ``tp``, ``dcp``, ``pcp``: ``tensor_parallel_size``, ``decode_context_parallel_size`` and
    ``prefill_context_parallel_size`` of one replica; ``dp`` replicas serve whole requests;
    ``tpa``: TPA for GQA, ``dcp_q_replicate`` for MLA.  A MoE model's routed experts span all
    ``dp * pcp * tp`` GPUs either way (vLLM v0.34.0's ``FusedMoEParallelConfig.make``,
    ``vllm/model_executor/layers/fused_moe/config.py``): split by TP over them
    (:attr:`moe_tp`), or with ``ep`` (``--enable-expert-parallel``) spread whole over them.
    """

    tp: int = 1
    dcp: int = 1
    pcp: int = 1
    dp: int = 1
    ep: bool = False
    tpa: bool = False

    @property
    def num_gpus(self) -> int:
        return self.dp * self.tp * self.pcp

    @property
    def moe_tp(self) -> int:
        """The TP degree of a MoE model's expert weights: the whole pool, ``dp * pcp * tp``,
        without EP (vLLM's ``flatten_tp_across_dp_and_pcp``); 1 with EP."""
        return 1 if self.ep else self.num_gpus

    @property
    def moe_label(self) -> str:
        """How a MoE model's experts are laid out: ``"experts TP8"`` or ``"experts EP8"``."""
        return f"experts {'EP' if self.ep else 'TP'}{self.num_gpus}"

    @property
    def label(self) -> str:
        """``"TP8+DCP8"`` style name (DP and PCP shown when > 1, ``+EP``, ``+TPA``)."""
        parts = [f"DP{self.dp}"] if self.dp > 1 else []
        parts.append(f"TP{self.tp}")
        parts += [f"{k}{v}" for k, v in (("PCP", self.pcp), ("DCP", self.dcp)) if v > 1]
        parts += [k for k, on in (("EP", self.ep), ("TPA", self.tpa)) if on]
        return "+".join(parts)

    @functools.lru_cache(maxsize=4096)  # deployments and models are frozen dataclasses
    def config(self, model: ModelSpec, dcp_comm_backend: str = "ag_rs") -> ParallelConfig:
        """One replica's attention config, with DCP's combine ``dcp_comm_backend``, validated
        by vLLM's rules (ValueError if invalid; a valid one is built once per deployment, model
        and backend, all immutable)."""

        if self.dp < 1:
            raise RuleError("positive-sizes", "dp >= 1", dp=self.dp)
        return tpa_config(
            self.tpa,
            tensor_parallel_size=self.tp,
            decode_context_parallel_size=self.dcp,
            prefill_context_parallel_size=self.pcp,
            dcp_comm_backend=dcp_comm_backend,
            **model.attention_shape,
        )


def deployment_weight_bytes(model: ModelSpec, deployment: Deployment) -> float:
    """Weight bytes on one GPU of ``deployment``: TP shards the attention and dense layers, PCP
    and DP replicate them; the routed experts are split over every GPU of the pool (by TP over
    ``dp * pcp * tp`` without EP, whole experts with EP: the same bytes)."""
    deployment.config(model)
    return weight_bytes_per_gpu(model, deployment.tp, deployment.num_gpus)


def deployment_kv_bytes_per_token(
    model: ModelSpec, deployment: Deployment, kv_dtype: str = "bf16"
) -> float:
    """KV bytes one GPU stores per token of a request under ``deployment``.

    The GPU's KV heads are :func:`cpbook.core.heads.attention_kv_heads` of its replica's
    configuration (TP heads, or TPA's attention shard); DCP divides the tokens by ``dcp``.  PCP
    alone does not shard the cache: vLLM all-gathers K/V over the PCP group before writing it, so
    every PCP rank keeps the request's full cache unless ``dcp`` spans the PCP ranks.
    """

    cfg = deployment.config(model)
    heads = attention_kv_heads(cfg, 0)
    per_head = Fraction(kv_bytes_per_token(model, kv_dtype), model.num_kv_heads)
    return float(per_head * (heads.stop - heads.start) / cfg.dcp)


def deployment_kv_budget(
    model: ModelSpec,
    gpu: GPUSpec,
    deployment: Deployment,
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
    activation_reserve_bytes: float = DEFAULT_ACTIVATION_RESERVE_BYTES,
) -> float:
    """Bytes left for KV on one GPU of ``deployment``; ValueError when the weights do not fit."""
    return _kv_budget(
        model,
        gpu,
        deployment_weight_bytes(model, deployment),
        f"as {deployment.label}",
        gpu_memory_utilization,
        activation_reserve_bytes,
    )


def deployment_max_context(
    model: ModelSpec, gpu: GPUSpec, deployment: Deployment, kv_dtype: str = "bf16", **memory
) -> int:
    """Longest single request whose KV fits one replica of ``deployment`` (``memory``: the keyword
    arguments of :func:`deployment_kv_budget`)."""
    budget = deployment_kv_budget(model, gpu, deployment, **memory)
    return math.floor(budget / deployment_kv_bytes_per_token(model, deployment, kv_dtype))


def max_concurrency(
    model: ModelSpec,
    gpu: GPUSpec,
    deployment: Deployment,
    context_tokens: int,
    kv_dtype: str = "bf16",
    **memory,
) -> int:
    """Requests of ``context_tokens`` tokens whose KV fits at once on all ``dp`` replicas."""
    check_tokens("context_tokens", context_tokens, minimum=1)
    per_request = deployment_kv_bytes_per_token(model, deployment, kv_dtype) * context_tokens
    return deployment.dp * math.floor(
        deployment_kv_budget(model, gpu, deployment, **memory) / per_request
    )
