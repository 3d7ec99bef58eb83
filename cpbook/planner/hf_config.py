"""Model shapes from a Hugging Face ``config.json``: what the cost model and the planner need.

:func:`model_from_hf_config` turns the ``config.json`` of a supported family into a
:class:`~cpbook.costmodel.specs.ModelSpec`: attention shape (GQA heads, or MLA's latent widths),
parameter counts (total, active per token, routed experts) counted from the shapes, bytes per
weight (FP8 block quantisation or the checkpoint dtype) and, for DeepSeek-V3.2-style sparse MLA,
``index_topk``.  Families (``model_type``):

* GQA, dense: ``llama``, ``qwen2`` (QKV bias), ``qwen3`` (q/k RMSNorm);
* GQA, MoE: ``mixtral``, ``qwen2_moe`` (with a shared expert), ``qwen3_moe``, ``glm4_moe``
  (GLM-4.5: QKV bias, ``first_k_dense_replace``);
* MLA, MoE: ``deepseek_v2``, ``deepseek_v3``, ``kimi_k2`` (DeepSeek-V3's architecture); sparse
  MLA: ``deepseek_v32`` and ``glm_moe_dsa`` (GLM-5), whose lightning indexer adds weights.

The file is read by :func:`cpbook.core.hf_config.read_hf_config` (the engine's loader reads it
through the same function); this module adds the cost model's strictness and counts the
parameters.  vLLM tells MLA by ``model_type`` and a ``kv_lora_rank``
(``ModelArchConfigConvertorBase.is_deepseek_mla`` in
``vllm/transformers_utils/model_arch_config_convertor.py``) and sparse MLA by ``index_topk``
(``PCPManager.validate_config`` in ``vllm/v1/worker/gpu/pcp_manager.py``); this module reads the
same fields.  Anything that changes what a token caches or how weights are stored and that the
cost model cannot represent raises :class:`~cpbook.core.config.ConfigError` (a ``ValueError``)
naming the field and its value: another
``model_type``, sliding-window or non-full attention layers, a quantisation other than FP8, an
unknown dtype, a missing or non-positive size.  Fields that change neither (RoPE scaling,
routing details, token ids) are read by nobody.  The multi-token-prediction module
(``num_nextn_predict_layers``) is not counted: vLLM loads it only for speculative decoding.
"""

from __future__ import annotations

from collections.abc import Mapping
from os import PathLike
from typing import Any

from cpbook.core.config import ConfigError, ParallelConfig
from cpbook.core.hf_config import GQA_MOE, MLA_TYPES, HFModelConfig, read_hf_config
from cpbook.costmodel.specs import ModelSpec

__all__ = ["SUPPORTED_MODEL_TYPES", "model_from_hf_config"]

#: the families the cost model represents (the reader's, less the engine-only ``mistral``)
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3") + GQA_MOE + MLA_TYPES
#: checkpoint dtypes and the bytes vLLM serves them in (float32 checkpoints run in 16 bits)
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 2}
QUANT_BYTES = {"fp8": 1}


def _check_full_attention(c: HFModelConfig) -> None:
    """Rule ``hf-full-attention``: every layer caches every token (no sliding window, no
    linear-attention layers): the cost model's KV is ``tokens x bytes per token``."""
    if c.use_sliding_window and c.sliding_window is not None:
        raise ConfigError(
            "hf-full-attention",
            "full attention in every layer (no sliding window)",
            use_sliding_window=c.raw.get("use_sliding_window"),
            sliding_window=c.sliding_window,
        )
    kinds = set(c.layer_types or ["full_attention"])
    if kinds != {"full_attention"}:
        raise ConfigError(
            "hf-full-attention", "layer_types to be all 'full_attention'", layer_types=sorted(kinds)
        )


def _weight_bytes(c: HFModelConfig) -> float:
    """Bytes per weight: FP8 block quantisation (1) or the checkpoint dtype (2)."""
    if c.raw.get("quantization_config") is not None:
        if c.quant_method not in QUANT_BYTES:
            raise ConfigError(
                "hf-quantization",
                f"quantization_config.quant_method in {tuple(QUANT_BYTES)} or no quantization",
                quant_method=c.quant_method,
            )
        return float(QUANT_BYTES[c.quant_method])
    if c.dtype not in DTYPE_BYTES:
        raise ConfigError("hf-dtype", f"torch_dtype in {tuple(DTYPE_BYTES)}", torch_dtype=c.dtype)
    return float(DTYPE_BYTES[c.dtype])


def _attention_params(c: HFModelConfig) -> int:
    """Parameters of one attention block: GQA's q, k, v, o (biases, q/k norms), or MLA's q
    (LoRA or direct), latent ``kv_a``, its up-projection ``kv_b``, ``o_proj`` and, for sparse
    MLA, the lightning indexer."""
    hidden, q = c.hidden_size, c.num_q_heads
    if not c.use_mla:
        kv, hd = c.num_kv_heads, c.head_dim
        params = hidden * (q + 2 * kv) * hd + q * hd * hidden
        params += (q + 2 * kv) * hd if c.attention_bias else 0
        return params + (2 * hd if c.qk_norm else 0)
    q_lora, latent, rope = c.q_lora_rank, c.kv_lora_rank, c.qk_rope_head_dim
    q_proj = (
        hidden * q_lora + q_lora + q_lora * q * c.head_dim if q_lora else hidden * q * c.head_dim
    )
    kv_b = latent * q * (c.qk_nope_head_dim + c.v_head_dim)
    params = q_proj + hidden * (latent + rope) + latent + kv_b + q * c.v_head_dim * hidden
    if c.index_topk:
        ih, idim = c.index_n_heads, c.index_head_dim
        params += (q_lora or hidden) * ih * idim + hidden * idim + 2 * idim + hidden * ih
    return params


def _shared_expert_params(c: HFModelConfig) -> int:
    """Shared-expert parameters of one MoE layer (Qwen's shared expert adds its gate)."""
    width, n = c.shared_expert_intermediate_size, c.num_shared_experts
    gate = c.hidden_size if n and c.model_type in ("qwen2_moe", "qwen3_moe") else 0
    return 3 * c.hidden_size * width * n + gate


def model_from_hf_config(
    config: Mapping[str, Any] | str | PathLike, name: str | None = None
) -> ModelSpec:
    """The :class:`ModelSpec` of a ``config.json`` (a parsed dict, or a path to the file or to
    a model folder holding it).  ``name`` defaults to ``_name_or_path``, else ``model_type``.

    Parameters are counted from the shapes: embeddings (and an untied LM head), attention,
    dense MLPs (gate, up, down), routed and shared experts and their router, norms.  On the
    published configs this gives DeepSeek-V3 670.9B total / 37.4B active, Llama-3.1-8B 8.03B,
    Qwen3-235B-A22B 235.1B; the tests check these.  Raises ``ConfigError`` (see the module
    docstring) for a family or field the cost model cannot represent; the result's attention
    shape passes :class:`~cpbook.core.config.ParallelConfig` at TP 1.
    """
    c = read_hf_config(config)
    if c.model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            "hf-model-type", f"model_type in {SUPPORTED_MODEL_TYPES}", model_type=c.model_type
        )
    _check_full_attention(c)
    hidden, layers, moe = c.hidden_size, c.num_hidden_layers, len(c.moe_layers)
    experts, per_tok = c.num_experts, c.num_experts_per_tok
    expert = 3 * hidden * c.moe_intermediate_size
    routed = moe * experts * expert
    total = (
        c.vocab_size * hidden * (1 if c.tie_word_embeddings else 2)
        + hidden  # final norm
        + layers * (_attention_params(c) + 2 * hidden)
        + (layers - moe) * 3 * hidden * c.intermediate_size
        + moe * (_shared_expert_params(c) + experts * hidden)
        + routed
    )
    active = total - moe * (experts - per_tok) * expert
    spec = ModelSpec(
        name=name or c.name or c.model_type,
        num_layers=layers,
        num_q_heads=c.num_q_heads,
        num_kv_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        use_mla=c.use_mla,
        kv_lora_rank=c.kv_lora_rank,
        qk_rope_head_dim=c.qk_rope_head_dim if c.use_mla else 0,
        num_params=float(total),
        weight_bytes_per_param=_weight_bytes(c),
        source=f"config.json ({c.model_type})",
        hidden_size=hidden,
        q_lora_rank=c.q_lora_rank,
        active_params=float(active) if moe else 0.0,
        expert_params=float(routed),
        index_topk=c.index_topk,
        vocab_size=c.vocab_size,
        max_position_embeddings=c.max_position_embeddings or 0,
        tie_word_embeddings=c.tie_word_embeddings,
        intermediate_size=c.intermediate_size,
        num_experts=experts,
        num_experts_per_tok=per_tok,
        moe_layers=moe,
    )
    ParallelConfig.for_model(spec)  # the GQA group rule, named as everywhere else
    return spec
