"""The one ``config.json`` reader: a Hugging Face model config as a typed, frozen record.

:func:`read_hf_config` turns a ``config.json`` (a parsed dict, or the path of the file or of a
model folder) into an :class:`HFModelConfig`: the shape fields the engine's loader
(:func:`cpbook.engine.hf.hf_config`) and the planner's model reader
(:func:`cpbook.planner.hf_config.model_from_hf_config`) both need, under one name each
(``num_q_heads`` for the JSON key ``num_attention_heads``, ``num_experts`` for whichever of
``num_local_experts`` / ``num_experts`` / ``n_routed_experts`` the family uses, …).  Families
(``model_type``), the union of what the two callers serve:

* GQA, dense: ``llama``, ``mistral``, ``qwen2`` (QKV bias), ``qwen3`` (q/k RMSNorm);
* GQA, MoE: ``mixtral``, ``qwen2_moe`` (with a shared expert), ``qwen3_moe``, ``glm4_moe``
  (GLM-4.5: QKV bias, ``first_k_dense_replace``);
* MLA, MoE: ``deepseek_v2``, ``deepseek_v3``, ``kimi_k2``; sparse MLA (a lightning indexer,
  ``index_topk``): ``deepseek_v32``, ``glm_moe_dsa`` (GLM-5).

This module only reads: a missing required field, a field of the wrong type, an unknown
``model_type`` or a shape that contradicts itself raises
:class:`~cpbook.core.config.ConfigError` naming the field and its value (rules ``hf-field``,
``hf-model-type``, ``hf-mla``).  What each caller *serves* is its own strictness: the planner
refuses what the cost model cannot represent (sliding windows, quantisations other than FP8),
the engine what its models cannot run (its allow-list of keys).  No torch here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from os import PathLike
from pathlib import Path
from typing import Any

from cpbook.core.config import ConfigError

__all__ = [
    "GQA_DENSE",
    "GQA_MOE",
    "MLA_TYPES",
    "MODEL_TYPES",
    "HFModelConfig",
    "load_config_json",
    "read_hf_config",
]

GQA_DENSE = ("llama", "mistral", "qwen2", "qwen3")
GQA_MOE = ("mixtral", "qwen2_moe", "qwen3_moe", "glm4_moe")
MLA_TYPES = ("deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2", "glm_moe_dsa")
MODEL_TYPES = GQA_DENSE + GQA_MOE + MLA_TYPES


@dataclass(frozen=True)
class HFModelConfig:
    """One ``config.json``, typed.  Sizes are ``int`` (0 where the family has none: no MoE, no
    q-LoRA, no indexer); ``head_dim`` is the query/key width per head (MLA: ``qk_nope_head_dim +
    qk_rope_head_dim``); ``num_kv_heads`` is what a token caches per layer (MLA: 1 latent);
    ``moe_layers`` the indices of the MoE layers by the family's rule; ``moe_intermediate_size``
    one routed expert's width (Mixtral: ``intermediate_size``); ``num_shared_experts`` of width
    ``shared_expert_intermediate_size`` each; ``rope_parameters`` carries ``rope_theta`` and
    ``rope_type`` (from ``rope_parameters`` or ``rope_scaling``); ``raw`` the dict itself, for
    a caller's own checks.

    More than eight parameters: a record of every ``config.json`` quantity the engine or the
    cost model reads, built by :func:`read_hf_config` only.
    """

    model_type: str
    name: str | None
    hidden_size: int
    num_hidden_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    intermediate_size: int
    tie_word_embeddings: bool
    rms_norm_eps: float
    attention_bias: bool
    qk_norm: bool
    use_mla: bool = False
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    index_topk: int = 0
    index_n_heads: int = 0
    index_head_dim: int = 0
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    num_shared_experts: int = 0
    shared_expert_intermediate_size: int = 0
    moe_layers: tuple[int, ...] = ()
    rope_parameters: Mapping[str, Any] = field(default_factory=dict)
    max_position_embeddings: int | None = None
    dtype: str = "bfloat16"
    quant_method: str | None = None
    sliding_window: int | None = None
    use_sliding_window: bool = False
    layer_types: tuple[str, ...] = ()
    raw: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def is_moe(self) -> bool:
        return bool(self.moe_layers)


class _Fields:
    """Typed access to one ``config.json``, every failure naming the field."""

    def __init__(self, cfg: Mapping[str, Any], model_type: str) -> None:
        self.cfg, self.model_type = cfg, model_type

    def size(self, key: str, default: int | None = None, minimum: int = 1) -> int:
        """A required (or defaulted) integer field of at least ``minimum``."""
        v = self.cfg.get(key, default)
        if v is None:
            where = f"{key!r} in config.json for model_type {self.model_type!r}"
            raise ConfigError("hf-field", where, **{key: v})
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            raise ConfigError("hf-field", f"{key} to be an integer >= {minimum}", **{key: v})
        return v

    def optional(self, key: str) -> int:
        """An integer field that may be absent or null (0 then)."""
        return 0 if self.cfg.get(key) is None else self.size(key)

    def flag(self, key: str, default: bool = False) -> bool:
        v = self.cfg.get(key, default)
        if not isinstance(v, bool):
            raise ConfigError("hf-field", f"{key} to be true or false", **{key: v})
        return v


def load_config_json(config: Mapping[str, Any] | str | PathLike) -> Mapping[str, Any]:
    """``config`` itself if it is a mapping, else the parsed ``config.json`` at that path (a file,
    or a model folder holding one)."""
    if isinstance(config, Mapping):
        return config
    path = Path(config)
    path = path / "config.json" if path.is_dir() else path
    return json.loads(path.read_text())


def _gqa(f: _Fields, hidden: int) -> dict[str, Any]:
    q = f.size("num_attention_heads")
    if f.cfg.get("head_dim") is not None:
        hd = f.size("head_dim")
    elif hidden % q:
        raise ConfigError(
            "hf-field",
            "hidden_size % num_attention_heads == 0 without head_dim",
            hidden_size=hidden,
            num_attention_heads=q,
        )
    else:
        hd = hidden // q
    return dict(num_q_heads=q, num_kv_heads=f.size("num_key_value_heads", q), head_dim=hd)


def _mla(f: _Fields) -> dict[str, Any]:
    if f.cfg.get("kv_lora_rank") is None:
        where = f"kv_lora_rank for MLA (model_type {f.model_type!r})"
        raise ConfigError("hf-mla", where, kv_lora_rank=None)
    nope, rope = f.size("qk_nope_head_dim"), f.size("qk_rope_head_dim")
    out = dict(num_q_heads=f.size("num_attention_heads"), num_kv_heads=1, head_dim=nope + rope)
    out |= dict(use_mla=True, kv_lora_rank=f.size("kv_lora_rank"))
    out |= dict(q_lora_rank=f.optional("q_lora_rank"), v_head_dim=f.size("v_head_dim"))
    out |= dict(qk_nope_head_dim=nope, qk_rope_head_dim=rope)
    if "index_topk" in f.cfg:
        out |= dict(index_topk=f.size("index_topk"), index_n_heads=f.size("index_n_heads"))
        out["index_head_dim"] = f.size("index_head_dim")
    return out


def _moe_layers(f: _Fields, layers: int) -> tuple[int, ...]:
    """Indices of the MoE layers, by each family's rule (none for a dense family)."""
    t, cfg = f.model_type, f.cfg
    if t in GQA_DENSE:
        return ()
    if t == "mixtral":
        return tuple(range(layers))
    if t in ("qwen2_moe", "qwen3_moe"):
        step = f.size("decoder_sparse_step", 1)
        dense = set(cfg.get("mlp_only_layers") or [])
        return tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)
    first, freq = f.size("first_k_dense_replace", 0, minimum=0), f.size("moe_layer_freq", 1)
    return tuple(i for i in range(layers) if i >= first and i % freq == 0)


def _experts(f: _Fields, hidden: int) -> dict[str, int]:
    """Routed experts, experts per token, expert width, and the shared experts."""
    t = f.model_type
    if t == "mixtral":
        out = dict(num_experts=f.size("num_local_experts"))
        out["moe_intermediate_size"] = f.size("intermediate_size")
    elif t in ("qwen2_moe", "qwen3_moe"):
        width = f.size("shared_expert_intermediate_size", 0, minimum=0)
        out = dict(num_experts=f.size("num_experts"), num_shared_experts=int(width > 0))
        out |= dict(moe_intermediate_size=f.size("moe_intermediate_size"))
        out["shared_expert_intermediate_size"] = width
    else:
        out = dict(num_experts=f.size("n_routed_experts"))
        out["moe_intermediate_size"] = width = f.size("moe_intermediate_size")
        out["num_shared_experts"] = f.size("n_shared_experts", 0, minimum=0)
        out["shared_expert_intermediate_size"] = width
    out["num_experts_per_tok"] = per_tok = f.size("num_experts_per_tok")
    if per_tok > out["num_experts"]:
        raise ConfigError(
            "hf-field",
            "num_experts_per_tok <= the number of routed experts",
            num_experts_per_tok=per_tok,
            experts=out["num_experts"],
        )
    return out


def _rope_parameters(c: Mapping[str, Any]) -> dict[str, Any]:
    """``rope_parameters`` (transformers 5) or ``rope_scaling`` with ``rope_theta`` and a
    ``rope_type`` (``"default"`` when none), ``type`` renamed ``rope_type``."""
    p = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
    p.setdefault("rope_theta", c.get("rope_theta", 10000.0))
    p["rope_type"] = p.pop("type", None) or p.get("rope_type") or "default"
    return p


def _attention_kinds(c: Mapping[str, Any]) -> dict[str, Any]:
    window = c.get("sliding_window")
    active = c["use_sliding_window"] if "use_sliding_window" in c else window is not None
    kinds = tuple(c.get("layer_types") or ())
    return dict(sliding_window=window, use_sliding_window=bool(active), layer_types=kinds)


def _weights(c: Mapping[str, Any]) -> dict[str, Any]:
    q = c.get("quantization_config")
    method = (q.get("quant_method") if isinstance(q, Mapping) else q) if q is not None else None
    return dict(dtype=c.get("torch_dtype", c.get("dtype", "bfloat16")), quant_method=method)


def read_hf_config(
    config: Mapping[str, Any] | str | PathLike, model_type: str | None = None
) -> HFModelConfig:
    """The :class:`HFModelConfig` of a ``config.json`` (dict or path).  ``model_type`` overrides
    the file's (the engine names the family by ``architectures``).  Guarantees: every size is a
    positive ``int`` (offsets ``>= 0``), the family is one of :data:`MODEL_TYPES`, an MLA family
    has ``kv_lora_rank``, a MoE family its expert counts with ``num_experts_per_tok <=
    num_experts``; otherwise :class:`~cpbook.core.config.ConfigError` naming the field."""
    c = load_config_json(config)
    t = model_type or c.get("model_type")
    if t not in MODEL_TYPES:
        raise ConfigError("hf-model-type", f"model_type in {MODEL_TYPES}", model_type=t)
    f = _Fields(c, t)
    hidden, layers = f.size("hidden_size"), f.size("num_hidden_layers")
    shape = _mla(f) if t in MLA_TYPES else _gqa(f, hidden)
    moe = _moe_layers(f, layers)
    experts = _experts(f, hidden) if moe else {}
    eps = c.get("rms_norm_eps", 1e-6)
    return HFModelConfig(
        model_type=t,
        name=c.get("_name_or_path"),
        hidden_size=hidden,
        num_hidden_layers=layers,
        vocab_size=f.size("vocab_size"),
        intermediate_size=f.size("intermediate_size") if len(moe) < layers else 0,
        tie_word_embeddings=f.flag("tie_word_embeddings"),
        rms_norm_eps=float(eps),
        attention_bias=t == "qwen2" or f.flag("attention_bias"),
        qk_norm=t in ("qwen3", "qwen3_moe") or f.flag("use_qk_norm"),
        moe_layers=moe,
        rope_parameters=_rope_parameters(c),
        max_position_embeddings=c.get("max_position_embeddings"),
        raw=c,
        **shape,
        **experts,
        **_weights(c),
        **_attention_kinds(c),
    )
