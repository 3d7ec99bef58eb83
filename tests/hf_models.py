"""Random-initialised tiny Hugging Face models for the loader's tests (no network).

:func:`float64_transformers` makes transformers compute in float64 end to end: its RMSNorm,
router and eager softmax cast to ``torch.float32``, its RoPE tables are built in
``torch.float`` and DeepSeek-V2 rotates through ``complex64`` (``.float()``).  Inside the
context those names resolve to float64 (the math is unchanged, only the rounding), so a
cpbook-vs-transformers difference is the two implementations', not float32's.
"""

from __future__ import annotations

import contextlib
import importlib
import math
from pathlib import Path

import torch

FAMILIES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "deepseek_v2",
    "deepseek_v2_qlora_yarn",
    "deepseek_v3",
)
_MODULES = ("llama", "mistral", "qwen2", "qwen3", "deepseek_v2", "deepseek_v3")


class _TorchF64:
    """``torch`` with ``float32``/``float`` meaning float64."""

    float32 = torch.float64
    float = torch.float64

    def __getattr__(self, name: str):
        return getattr(torch, name)


def _rotary_f64(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.double().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.double().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = freqs_cis.unsqueeze(1).to(xq_.device)
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3).type_as(xq)
    return xq_out, torch.view_as_real(xk_ * freqs_cis).flatten(3).type_as(xk)


@contextlib.contextmanager
def float64_transformers():
    """transformers' float32 casts become float64 (see the module docstring)."""
    mods = [importlib.import_module(f"transformers.models.{m}.modeling_{m}") for m in _MODULES]
    mods.append(importlib.import_module("transformers.modeling_rope_utils"))
    saved = [(m, m.torch) for m in mods]
    v2 = mods[_MODULES.index("deepseek_v2")]
    rot = v2.apply_rotary_emb
    try:
        for m in mods:
            m.torch = _TorchF64()
        v2.apply_rotary_emb = _rotary_f64
        yield
    finally:
        for m, t in saved:
            m.torch = t
        v2.apply_rotary_emb = rot


def _config(family: str, **over):
    import transformers as tf

    gqa = dict(vocab_size=128, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
               attn_implementation="eager", experts_implementation="eager")  # fmt: skip
    if family == "llama":
        rope = dict(rope_type="llama3", rope_theta=10000.0, factor=4.0, low_freq_factor=1.0,
                    high_freq_factor=4.0, original_max_position_embeddings=16)  # fmt: skip
        return tf.LlamaForCausalLM, tf.LlamaConfig(
            **gqa, head_dim=16, rope_parameters=rope, attention_bias=True, **over
        )
    if family == "mistral":  # Mistral-7B-v0.3 style: full attention (no sliding window)
        return tf.MistralForCausalLM, tf.MistralConfig(**gqa, sliding_window=None, **over)
    if family == "qwen2":
        return tf.Qwen2ForCausalLM, tf.Qwen2Config(**gqa, tie_word_embeddings=True, **over)
    if family == "qwen3":
        return tf.Qwen3ForCausalLM, tf.Qwen3Config(**gqa, head_dim=16, **over)
    mla = dict(gqa, num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=8,
               qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2,
               moe_intermediate_size=16, n_shared_experts=1, first_k_dense_replace=1,
               routed_scaling_factor=1.5)  # fmt: skip
    yarn = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, mscale=0.707,
                mscale_all_dim=0.707, original_max_position_embeddings=16,
                beta_fast=32, beta_slow=1)  # fmt: skip
    if family == "deepseek_v2":
        return tf.DeepseekV2ForCausalLM, tf.DeepseekV2Config(
            **mla, q_lora_rank=None, topk_method="greedy", **over
        )
    if family == "deepseek_v2_qlora_yarn":
        return tf.DeepseekV2ForCausalLM, tf.DeepseekV2Config(
            **mla, q_lora_rank=24, rope_parameters=yarn, topk_method="group_limited_greedy",
            n_group=4, topk_group=2, **over,
        )  # fmt: skip
    if family == "deepseek_v3":
        return tf.DeepseekV3ForCausalLM, tf.DeepseekV3Config(
            **mla, q_lora_rank=24, rope_parameters=yarn, n_group=4, topk_group=2,
            norm_topk_prob=True, **over,
        )  # fmt: skip
    raise KeyError(family)


def build(family: str, folder: Path, dtype: torch.dtype = torch.float64, seed: int = 0, **over):
    """A random tiny ``family`` model saved to ``folder``; returns the transformers model (call
    inside :func:`float64_transformers` for a float64 reference)."""
    cls, cfg = _config(family, **over)
    gen = torch.Generator().manual_seed(seed)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        model = cls(cfg).eval()
    finally:
        torch.set_default_dtype(old)
    with torch.no_grad():
        for name, p in model.named_parameters():
            x = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            if p.ndim == 1:
                x = 1 + 0.2 * x if "norm" in name else 0.5 * x
            else:
                x = x / math.sqrt(p.shape[-1]) * (2.0 if "lm_head" in name else 1.0)
            p.copy_(x)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=gen, dtype=torch.float64))
    model.save_pretrained(folder)
    return model
