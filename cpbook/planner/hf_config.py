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

vLLM tells MLA by ``model_type`` and a ``kv_lora_rank``
(``ModelArchConfigConvertorBase.is_deepseek_mla`` in
``vllm/transformers_utils/model_arch_config_convertor.py``) and sparse MLA by ``index_topk``
(``PCPManager.validate_config`` in ``vllm/v1/worker/gpu/pcp_manager.py``); this module reads the
same fields.  Anything that changes what a token caches or how weights are stored and that the
cost model cannot represent raises ``ValueError`` naming the field and its value: another
``model_type``, sliding-window or non-full attention layers, a quantisation other than FP8, an
unknown dtype, a missing or non-positive size.  Fields that change neither (RoPE scaling,
routing details, token ids) are read by nobody.  The multi-token-prediction module
(``num_nextn_predict_layers``) is not counted: vLLM loads it only for speculative decoding.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from os import PathLike
from pathlib import Path
from typing import Any

from cpbook.core.config import ParallelConfig
from cpbook.costmodel.specs import ModelSpec

GQA_DENSE = ("llama", "qwen2", "qwen3")
GQA_MOE = ("mixtral", "qwen2_moe", "qwen3_moe", "glm4_moe")
MLA_TYPES = ("deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2", "glm_moe_dsa")
SUPPORTED_MODEL_TYPES = GQA_DENSE + GQA_MOE + MLA_TYPES
#: checkpoint dtypes and the bytes vLLM serves them in (float32 checkpoints run in 16 bits)
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 2}
QUANT_BYTES = {"fp8": 1}


def _error(rule: str, condition: str, **got: object) -> ValueError:
    shown = ", ".join(f"{k}={v!r}" for k, v in got.items())
    return ValueError(f"[{rule}] requires {condition}; got {shown}")


class _Fields:
    """Typed access to one ``config.json``, every failure naming the field."""

    def __init__(self, cfg: Mapping[str, Any]) -> None:
        self.cfg, self.model_type = cfg, cfg.get("model_type")

    def size(self, key: str, default: int | None = None, minimum: int = 1) -> int:
        """A required (or defaulted) integer field of at least ``minimum``."""
        v = self.cfg.get(key, default)
        if v is None:
            raise _error(
                "hf-field", f"{key!r} in config.json for model_type {self.model_type!r}", **{key: v}
            )
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            raise _error("hf-field", f"{key} to be an integer >= {minimum}", **{key: v})
        return v

    def flag(self, key: str, default: bool) -> bool:
        v = self.cfg.get(key, default)
        if not isinstance(v, bool):
            raise _error("hf-field", f"{key} to be true or false", **{key: v})
        return v


def _check_full_attention(f: _Fields) -> None:
    """Rule ``hf-full-attention``: every layer caches every token (no sliding window, no
    linear-attention layers): the cost model's KV is ``tokens x bytes per token``."""
    cfg = f.cfg
    window = cfg.get("sliding_window")
    active = cfg["use_sliding_window"] if "use_sliding_window" in cfg else window is not None
    if active and window is not None:
        raise _error(
            "hf-full-attention",
            "full attention in every layer (no sliding window)",
            use_sliding_window=cfg.get("use_sliding_window"),
            sliding_window=window,
        )
    kinds = set(cfg.get("layer_types") or ["full_attention"])
    if kinds != {"full_attention"}:
        raise _error(
            "hf-full-attention", "layer_types to be all 'full_attention'", layer_types=sorted(kinds)
        )


def _weight_bytes(f: _Fields) -> float:
    """Bytes per weight: FP8 block quantisation (1) or the checkpoint dtype (2)."""
    q = f.cfg.get("quantization_config")
    if q is not None:
        method = q.get("quant_method") if isinstance(q, Mapping) else q
        if method not in QUANT_BYTES:
            raise _error(
                "hf-quantization",
                f"quantization_config.quant_method in {tuple(QUANT_BYTES)} or no quantization",
                quant_method=method,
            )
        return float(QUANT_BYTES[method])
    dtype = f.cfg.get("torch_dtype", f.cfg.get("dtype", "bfloat16"))
    if dtype not in DTYPE_BYTES:
        raise _error("hf-dtype", f"torch_dtype in {tuple(DTYPE_BYTES)}", torch_dtype=dtype)
    return float(DTYPE_BYTES[dtype])


def _gqa_attention(f: _Fields, hidden: int) -> tuple[int, int, int, int]:
    """``(q_heads, kv_heads, head_dim, params per layer)`` of a GQA attention block."""
    q = f.size("num_attention_heads")
    kv = f.size("num_key_value_heads", q)
    if f.cfg.get("head_dim") is not None:
        hd = f.size("head_dim")
    elif hidden % q:
        raise _error(
            "hf-field",
            "hidden_size % num_attention_heads == 0 without head_dim",
            hidden_size=hidden,
            num_attention_heads=q,
        )
    else:
        hd = hidden // q
    params = hidden * (q + 2 * kv) * hd + q * hd * hidden
    bias = f.model_type == "qwen2" or f.flag("attention_bias", False)
    params += (q + 2 * kv) * hd if bias else 0
    qk_norm = f.model_type in ("qwen3", "qwen3_moe") or f.flag("use_qk_norm", False)
    params += 2 * hd if qk_norm else 0
    return q, kv, hd, params


def _mla_attention(f: _Fields, hidden: int) -> tuple[dict[str, int], int]:
    """MLA's widths and its params per layer: q (LoRA or direct), the latent ``kv_a``, its
    up-projection ``kv_b``, ``o_proj``; plus the lightning indexer of sparse MLA."""
    if f.cfg.get("kv_lora_rank") is None:
        raise _error(
            "hf-mla",
            f"kv_lora_rank for MLA (model_type {f.model_type!r})",
            kv_lora_rank=None,
        )
    heads = f.size("num_attention_heads")
    nope, rope = f.size("qk_nope_head_dim"), f.size("qk_rope_head_dim")
    v, latent = f.size("v_head_dim"), f.size("kv_lora_rank")
    q_lora = 0 if f.cfg.get("q_lora_rank") is None else f.size("q_lora_rank")
    qk = nope + rope
    q = hidden * q_lora + q_lora + q_lora * heads * qk if q_lora else hidden * heads * qk
    params = (
        q + hidden * (latent + rope) + latent + latent * heads * (nope + v) + heads * v * hidden
    )
    topk = 0
    if "index_topk" in f.cfg:
        topk = f.size("index_topk")
        ih, idim = f.size("index_n_heads"), f.size("index_head_dim")
        params += (q_lora or hidden) * ih * idim + hidden * idim + 2 * idim + hidden * ih
    shape = dict(heads=heads, head_dim=qk, latent=latent, rope=rope, q_lora=q_lora, topk=topk)
    return shape, params


def _moe_layers(f: _Fields, layers: int) -> list[int]:
    """Indices of the MoE layers, by each family's rule."""
    t, cfg = f.model_type, f.cfg
    if t == "mixtral":
        return list(range(layers))
    if t in ("qwen2_moe", "qwen3_moe"):
        step = f.size("decoder_sparse_step", 1)
        dense = set(cfg.get("mlp_only_layers") or [])
        return [i for i in range(layers) if i not in dense and (i + 1) % step == 0]
    first, freq = f.size("first_k_dense_replace", 0, minimum=0), f.size("moe_layer_freq", 1)
    return [i for i in range(layers) if i >= first and i % freq == 0]


def _experts(f: _Fields, hidden: int) -> tuple[int, int, int, int]:
    """``(routed experts, experts per token, expert width, shared-expert params per layer)``."""
    t = f.model_type
    if t == "mixtral":
        return (
            f.size("num_local_experts"),
            f.size("num_experts_per_tok"),
            f.size("intermediate_size"),
            0,
        )
    width = f.size("moe_intermediate_size")
    if t in ("qwen2_moe", "qwen3_moe"):
        shared_width = f.size("shared_expert_intermediate_size", 0, minimum=0)
        shared = 3 * hidden * shared_width + (hidden if shared_width else 0)  # + its gate
        return f.size("num_experts"), f.size("num_experts_per_tok"), width, shared
    n_shared = f.size("n_shared_experts", 0, minimum=0)
    return (
        f.size("n_routed_experts"),
        f.size("num_experts_per_tok"),
        width,
        3 * hidden * width * n_shared,
    )


def model_from_hf_config(
    config: Mapping[str, Any] | str | PathLike, name: str | None = None
) -> ModelSpec:
    """The :class:`ModelSpec` of a ``config.json`` (a parsed dict, or a path to the file or to
    a model folder holding it).  ``name`` defaults to ``_name_or_path``, else ``model_type``.

    Parameters are counted from the shapes: embeddings (and an untied LM head), attention,
    dense MLPs (gate, up, down), routed and shared experts and their router, norms.  On the
    published configs this gives DeepSeek-V3 670.9B total / 37.4B active, Llama-3.1-8B 8.03B,
    Qwen3-235B-A22B 235.1B; the tests check these.  Raises ``ValueError`` (see the module
    docstring) for a family or field the cost model cannot represent; the result's attention
    shape passes :class:`~cpbook.core.config.ParallelConfig` at TP 1.
    """
    if not isinstance(config, Mapping):
        path = Path(config)
        path = path / "config.json" if path.is_dir() else path
        config = json.loads(path.read_text())
    f = _Fields(config)
    if f.model_type not in SUPPORTED_MODEL_TYPES:
        raise _error(
            "hf-model-type", f"model_type in {SUPPORTED_MODEL_TYPES}", model_type=f.model_type
        )
    _check_full_attention(f)
    hidden, layers, vocab = f.size("hidden_size"), f.size("num_hidden_layers"), f.size("vocab_size")
    mla = f.model_type in MLA_TYPES
    if mla:
        shape, attn = _mla_attention(f, hidden)
        q_heads, kv_heads, head_dim = shape["heads"], 1, shape["head_dim"]
    else:
        q_heads, kv_heads, head_dim, attn = _gqa_attention(f, hidden)
        shape = dict(latent=0, rope=0, q_lora=0, topk=0)
    moe = _moe_layers(f, layers) if f.model_type in GQA_MOE + MLA_TYPES else []
    inter = f.size("intermediate_size") if len(moe) < layers else 0
    dense_mlp = 3 * hidden * inter
    experts = per_tok = width = shared = 0
    if moe:
        experts, per_tok, width, shared = _experts(f, hidden)
        if per_tok > experts:
            raise _error(
                "hf-field",
                "num_experts_per_tok <= the number of routed experts",
                num_experts_per_tok=per_tok,
                experts=experts,
            )
    expert = 3 * hidden * width
    routed = len(moe) * experts * expert
    tied = f.flag("tie_word_embeddings", False)
    total = (
        vocab * hidden * (1 if tied else 2)
        + hidden  # final norm
        + layers * (attn + 2 * hidden)
        + (layers - len(moe)) * dense_mlp
        + len(moe) * (shared + experts * hidden)
        + routed
    )
    active = total - len(moe) * (experts - per_tok) * expert
    spec = ModelSpec(
        name=name or config.get("_name_or_path") or f.model_type,
        num_layers=layers,
        num_q_heads=q_heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        use_mla=mla,
        kv_lora_rank=shape["latent"],
        qk_rope_head_dim=shape["rope"],
        num_params=float(total),
        weight_bytes_per_param=_weight_bytes(f),
        source=f"config.json ({f.model_type})",
        hidden_size=hidden,
        q_lora_rank=shape["q_lora"],
        active_params=float(active) if moe else 0.0,
        expert_params=float(routed),
        index_topk=shape["topk"],
        vocab_size=vocab,
        tie_word_embeddings=tied,
        intermediate_size=inter,
        num_experts=experts,
        num_experts_per_tok=per_tok,
        moe_layers=len(moe),
    )
    ParallelConfig.for_model(spec)  # the GQA group rule, named as everywhere else
    return spec
