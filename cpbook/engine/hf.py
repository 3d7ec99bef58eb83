"""Load a Hugging Face model folder (``config.json`` + ``*.safetensors``) into the mini engine.

:func:`from_pretrained` reads Llama / Mistral / Qwen2 / Qwen3 (GQA) and DeepSeek-V2 / V3 (MLA)
checkpoints into an :class:`~cpbook.engine.hf_model.HFModel`; the engine's runner then shards it
for TP as vLLM does (column-parallel QKV and gate/up, row-parallel o and down, KV heads
replicated when TP > KV heads, MoE experts' columns split over TP) and runs DCP and PCP as for
the tiny models.  :func:`hf_config` validates ``config.json`` alone: a field or value the
engine does not implement raises :class:`~cpbook.core.config.ConfigError` (a ``ValueError``)
naming it; nothing is silently ignored.  The file is read by
:func:`cpbook.core.hf_config.read_hf_config`, the reader the planner uses too; this module adds
the engine's strictness (its allow-list of keys and values).  ``rope_scaling``/``rope_theta``
(checkpoints) and ``rope_parameters`` (transformers 5) are both read.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from cpbook.core.config import ConfigError
from cpbook.core.hf_config import read_hf_config
from cpbook.dcp.mla import MLAWeights
from cpbook.engine.checkpoint import check_checkpoint
from cpbook.engine.hf_model import HFConfig, HFModel

__all__ = [
    "ARCHITECTURES",
    "check_folder",
    "hf_config",
    "read_config_json",
    "max_model_len",
    "rope_inv_freq",
    "from_pretrained",
]

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}
# fields with no effect on greedy inference logits (metadata, training-only, generation ids)
_INERT = {
    "architectures", "model_type", "dtype", "torch_dtype", "transformers_version", "bos_token_id",
    "eos_token_id", "pad_token_id", "initializer_range", "use_cache", "max_position_embeddings",
    "output_router_logits", "aux_loss_alpha", "seq_aux", "router_aux_loss_coef", "auto_map",
    "num_nextn_predict_layers", "ep_size", "max_window_layers", "qk_head_dim", "_name_or_path",
    "layer_types", "head_dim",
}  # fmt: skip
# field -> value the engine requires (anything else is refused)
_REQUIRED = {
    "hidden_act": "silu",
    "attention_dropout": 0.0,
    "pretraining_tp": 1,
    "mlp_bias": False,
    "use_sliding_window": False,
    "sliding_window": None,
    "moe_layer_freq": 1,
    "scoring_func": None,  # checked per family below
}
_GQA = {"hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "rms_norm_eps", "vocab_size", "tie_word_embeddings",
        "attention_bias", "rope_theta", "rope_scaling", "rope_parameters"}  # fmt: skip
_MLA = _GQA | {
    "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
    "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts",
    "first_k_dense_replace", "topk_method", "n_group", "topk_group", "norm_topk_prob",
    "routed_scaling_factor", "rope_interleave",
}  # fmt: skip


def _bad(field: str, requirement: str, value: Any) -> ConfigError:
    return ConfigError("hf-config-supported", requirement, **{field: value})


def rope_inv_freq(p: dict, dim: int) -> tuple[torch.Tensor, float]:
    """Float64 inverse frequencies ``[dim/2]`` and the cos/sin factor of RoPE parameters ``p``
    (``default``, ``llama3``, ``yarn``), as ``transformers.modeling_rope_utils`` defines them."""
    base, kind = float(p["rope_theta"]), p["rope_type"]
    known = {"rope_theta", "rope_type"}
    inv = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    factor = 1.0
    if kind == "llama3":
        known |= {
            "factor",
            "low_freq_factor",
            "high_freq_factor",
            "original_max_position_embeddings",
        }
        f, lo, hi = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
        old = p["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / lo, inv / f, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        mid = (wavelen >= old / hi) & (wavelen <= old / lo)
        inv = torch.where(mid, (1 - smooth) * scaled / f + smooth * scaled, scaled)
    elif kind == "yarn":
        known |= {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow"}
        known |= {"mscale", "mscale_all_dim", "attention_factor", "truncate"}
        f, old = float(p["factor"]), p["original_max_position_embeddings"]

        def mscale(s: float, m: float = 1.0) -> float:
            return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0

        factor = p.get("attention_factor")
        if factor is None:
            ms, ma = p.get("mscale"), p.get("mscale_all_dim")
            factor = mscale(f, ms) / mscale(f, ma) if ms and ma else mscale(f)

        def corr(rot: float) -> float:
            return dim * math.log(old / (rot * 2 * math.pi)) / (2 * math.log(base))

        low, high = corr(p.get("beta_fast") or 32), corr(p.get("beta_slow") or 1)
        if p.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        ramp = (torch.arange(dim // 2, dtype=torch.float64) - low) / (
            (high + 0.001 * (low == high)) - low
        )
        extra = 1 - ramp.clamp(0, 1)
        inv = (inv / f) * (1 - extra) + inv * extra
    elif kind != "default":
        raise _bad("rope_scaling", "rope_type in ('default', 'llama3', 'yarn')", kind)
    for key in set(p) - known:
        raise _bad(f"rope_scaling.{key}", f"a field of rope_type {kind!r}", p[key])
    return inv, float(factor)


#: rope types whose ``factor`` does not scale ``max_position_embeddings`` (it already counts
#: the extended context), as vLLM v0.34.0 reads them (``vllm/config/model.py``,
#: ``_get_and_verify_max_len``)
_SCALED_ALREADY = ("su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling")
#: vLLM's assumption when ``config.json`` names no length (same function)
DEFAULT_MAX_MODEL_LEN = 2048


def max_model_len(config: dict) -> int:
    """The longest sequence (prompt + generated tokens) the model of ``config.json`` serves,
    derived as vLLM v0.34.0 derives ``max_model_len`` (``vllm/config/model.py``,
    ``_get_and_verify_max_len``): ``max_position_embeddings`` (2048 when absent), times the
    RoPE ``factor`` only for rope types whose length does not already include it (so for the
    ``default``, ``llama3`` and ``yarn`` types the loader supports, ``max_position_embeddings``
    itself)."""
    derived = config.get("max_position_embeddings") or DEFAULT_MAX_MODEL_LEN
    p = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if (p.get("rope_type") or p.get("type") or "default") not in _SCALED_ALREADY:
        derived *= p.get("factor") or 1.0
    return int(derived)


def hf_config(config: dict, name: str = "hf") -> tuple[HFConfig, torch.Tensor]:
    """The engine's :class:`HFConfig` and RoPE ``inv_freq`` of a ``config.json`` dict.  Raises
    :class:`ConfigError` (rule ``hf-config-supported``) on an architecture, field or value the
    engine does not implement."""
    archs = config.get("architectures") or []
    if len(archs) != 1 or archs[0] not in ARCHITECTURES:
        raise _bad("architectures", f"one of {sorted(ARCHITECTURES)}", archs)
    fam = ARCHITECTURES[archs[0]]
    mla = fam.startswith("deepseek")
    for key, value in config.items():
        if key in _REQUIRED:
            want = _REQUIRED[key]
            if key == "scoring_func":
                want = "sigmoid" if fam == "deepseek_v3" else "softmax"
            if value != want and not (key == "sliding_window" and fam in ("qwen2", "qwen3")):
                raise _bad(key, f"{key} == {want!r}", value)
        elif key not in _INERT and key not in (_MLA if mla else _GQA):
            raise _bad(key, f"a field cpbook implements for {fam}", value)
    if mla and config.get("attention_bias"):
        raise _bad("attention_bias", "attention_bias == False for DeepSeek MLA", True)
    c = read_hf_config(config, model_type=fam)
    common: dict[str, Any] = dict(
        name=name,
        model_type=fam,
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        num_hidden_layers=c.num_hidden_layers,
        num_q_heads=c.num_q_heads,
        intermediate_size=c.intermediate_size,
        rms_norm_eps=c.rms_norm_eps,
        max_model_len=max_model_len(config),
    )
    p = dict(c.rope_parameters)
    if not mla:
        inv, af = rope_inv_freq(p, c.head_dim)
        cfg = HFConfig(
            **common,
            num_kv_heads=c.num_kv_heads,
            head_dim=c.head_dim,
            qk_norm=c.qk_norm,
            rope_attention_factor=af,
        )
        return cfg, inv
    R, Dn = c.qk_rope_head_dim, c.qk_nope_head_dim
    inv, af = rope_inv_freq(p, R)
    scale = (Dn + R) ** -0.5
    if p["rope_type"] != "default" and p.get("mscale_all_dim"):
        m = 0.1 * p["mscale_all_dim"] * math.log(p["factor"]) + 1.0 if p["factor"] > 1 else 1.0
        scale *= m * m  # DeepSeek's YaRN softmax scale (HF yarn_apply_mscale)
    method = config.get("topk_method", "noaux_tc" if fam == "deepseek_v3" else "greedy")
    allowed = ("noaux_tc",) if fam == "deepseek_v3" else ("greedy", "group_limited_greedy")
    if method not in allowed:
        raise _bad("topk_method", f"topk_method in {allowed} for {fam}", method)
    if fam == "deepseek_v2" and config.get("norm_topk_prob"):
        raise _bad("norm_topk_prob", "norm_topk_prob == False for deepseek_v2", True)
    cfg = HFConfig(
        **common,
        num_kv_heads=1,
        use_mla=True,
        kv_lora_rank=c.kv_lora_rank,
        q_lora_rank=c.q_lora_rank or None,
        qk_nope_head_dim=Dn,
        qk_rope_head_dim=R,
        v_head_dim=c.v_head_dim,
        softmax_scale=scale,
        rope_attention_factor=af,
        n_routed_experts=c.num_experts,
        num_experts_per_tok=c.num_experts_per_tok,
        moe_intermediate_size=c.moe_intermediate_size,
        n_shared_experts=c.num_shared_experts,
        first_k_dense_replace=c.moe_layers[0] if c.moe_layers else 0,
        topk_method=method,
        n_group=config.get("n_group") or 1,
        topk_group=config.get("topk_group") or 1,
        norm_topk_prob=bool(config.get("norm_topk_prob", False)),
        routed_scaling_factor=float(config.get("routed_scaling_factor", 1.0)),
    )
    return cfg, inv


def _tensors(path: Path, files: set[str]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(files):
        out.update(load_file(str(path / f)))
    return out


def _interleaved_to_half(R: int) -> torch.Tensor:
    """Row order taking DeepSeek's interleaved rope pairs ``(2i, 2i+1)`` to ``(i, i + R/2)``."""
    return torch.cat([torch.arange(0, R, 2), torch.arange(1, R, 2)])


def check_folder(
    path: str | Path, name: str | None = None
) -> tuple[dict, HFConfig, torch.Tensor, dict[str, str]]:
    """Model folder ``path`` checked without reading a weight: ``config.json`` (JSON, and
    :func:`hf_config`'s rules) and every safetensors header against it
    (:func:`cpbook.engine.checkpoint.check_checkpoint`).  Returns the raw config, the
    :class:`HFConfig`, RoPE ``inv_freq`` and ``{tensor: file}``; raises
    :class:`ConfigError` naming the rule and the file."""
    path = Path(path)
    raw = read_config_json(path)
    cfg, inv = hf_config(raw, name or path.name)
    return raw, cfg, inv, check_checkpoint(path, cfg, raw)


def read_config_json(path: str | Path) -> dict:
    """Folder ``path``'s ``config.json`` as a dict; rule ``hf-folder`` (no such file) or
    ``hf-config-json`` (not a JSON object) naming the file."""
    file = Path(path) / "config.json"
    if not file.is_file():
        raise ConfigError("hf-folder", "a folder with config.json", path=str(path))
    try:
        raw = json.loads(file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(
            "hf-config-json", "config.json to be a JSON object", file=str(file), error=str(e)
        ) from None
    if not isinstance(raw, dict):
        raise ConfigError("hf-config-json", "config.json to be a JSON object", file=str(file))
    return raw


def from_pretrained(
    path: str | Path, dtype: torch.dtype = torch.float32, name: str | None = None
) -> HFModel:
    """The checkpoint in folder ``path`` as an :class:`HFModel` in ``dtype`` (float64 for the
    exactness checks).  The folder is checked against ``config.json`` before any weight is read
    (:func:`cpbook.engine.checkpoint.check_checkpoint`: every tensor's name, dtype and shape,
    the index, whole safetensors files); every tensor of the folder is used or the load fails
    (rule ``hf-weights-used``)."""
    path = Path(path)
    raw, cfg, inv, where = check_folder(path, name)
    sd = _tensors(path, set(where.values()))
    used: set[str] = set()

    def t(key: str) -> torch.Tensor:
        used.add(key)
        return sd[key].to(torch.float64)

    H, n, L = cfg.hidden_size, cfg.num_q_heads, cfg.num_hidden_layers
    layers, mlas = [], []
    perm = torch.arange(cfg.qk_rope_head_dim)
    if raw.get("rope_interleave", True):  # DeepSeek-V2 always, V3 unless the config says not
        perm = _interleaved_to_half(cfg.qk_rope_head_dim)
    for i in range(L):
        pre = f"model.layers.{i}."
        a, m = pre + "self_attn.", pre + "mlp."
        lw = {"attn_norm": t(pre + "input_layernorm.weight")}
        lw["mlp_norm"] = t(pre + "post_attention_layernorm.weight")
        if cfg.use_mla:
            Dn, R, C = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
            if cfg.q_lora_rank:
                lw["wq_a"] = t(a + "q_a_proj.weight").T
                lw["q_a_norm"] = t(a + "q_a_layernorm.weight")
                wq = t(a + "q_b_proj.weight")
            else:
                wq = t(a + "q_proj.weight")
            wq = wq.T.reshape(wq.shape[1], n, Dn + R)
            lw["wq"] = torch.cat([wq[..., :Dn], wq[..., Dn:][..., perm]], dim=-1)
            kva = t(a + "kv_a_proj_with_mqa.weight").T
            lw["w_dkv"], lw["w_kr"] = kva[:, :C], kva[:, C:][:, perm]
            lw["kv_norm"] = t(a + "kv_a_layernorm.weight")
            kvb = t(a + "kv_b_proj.weight").reshape(n, Dn + cfg.v_head_dim, C)
            mlas.append(MLAWeights(kvb[:, :Dn].permute(2, 0, 1), kvb[:, Dn:].permute(2, 0, 1), R))
        else:
            D, k = cfg.head_dim, cfg.num_kv_heads
            for w, heads in (("q", n), ("k", k), ("v", k)):
                lw[f"w{w}"] = t(f"{a}{w}_proj.weight").T.reshape(H, heads, D)
                if f"{a}{w}_proj.bias" in sd:
                    lw[f"b{w}"] = t(f"{a}{w}_proj.bias").reshape(heads, D)
            if a + "o_proj.bias" in sd:
                lw["bo"] = t(a + "o_proj.bias")
            if cfg.qk_norm:
                lw["q_norm"], lw["k_norm"] = t(a + "q_norm.weight"), t(a + "k_norm.weight")
        lw["wo"] = t(a + "o_proj.weight").T.reshape(n, cfg.out_head_dim, H)
        if cfg.is_moe(i):
            E = cfg.n_routed_experts
            lw["router"] = t(m + "gate.weight").T
            if cfg.topk_method == "noaux_tc":
                lw["e_bias"] = t(m + "gate.e_score_correction_bias")
            for proj, key in (("gate", "e_gate"), ("up", "e_up"), ("down", "e_down")):
                ws = [t(f"{m}experts.{e}.{proj}_proj.weight").T for e in range(E)]
                lw[key] = torch.stack(ws)
            if cfg.n_shared_experts:
                for proj in ("gate", "up", "down"):
                    lw[f"s_{proj}"] = t(f"{m}shared_experts.{proj}_proj.weight").T
        else:
            for proj in ("gate", "up", "down"):
                lw[f"w_{proj}"] = t(f"{m}{proj}_proj.weight").T
        layers.append({k: v.to(dtype).contiguous() for k, v in lw.items()})
    embed = t("model.embed_tokens.weight")
    tied = raw.get("tie_word_embeddings", False)
    lm_head = embed.T if tied and "lm_head.weight" not in sd else t("lm_head.weight").T
    final = t("model.norm.weight")
    mtp = tuple(f"model.layers.{L + j}." for j in range(raw.get("num_nextn_predict_layers", 0)))
    unused = sorted(k for k in set(sd) - used if not k.startswith(mtp))  # MTP: speculative only
    if unused:
        raise ConfigError(
            "hf-weights-used", "every tensor of the folder is loaded", tensor=unused[0]
        )
    return HFModel(
        cfg,
        embed.to(dtype),
        lm_head.to(dtype).contiguous(),
        final.to(dtype),
        layers,
        [x.to(dtype=dtype) for x in mlas],
        inv,
    )
