"""Tests for cpbook.planner.hf_config: model shapes from hand-written config.json dicts that
match the published configs (Hugging Face model repositories named in each key; no network)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpbook import costmodel as cm
from cpbook import planner as pl
from cpbook.planner.hf_config import model_from_hf_config

FP8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8"}
FP8["weight_block_size"] = [128, 128]

LLAMA31_8B = {  # meta-llama/Llama-3.1-8B
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rope_scaling": {"factor": 8.0, "rope_type": "llama3"},
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
LLAMA31_70B = {**LLAMA31_8B, "hidden_size": 8192, "intermediate_size": 28672}
LLAMA31_70B |= {"num_hidden_layers": 80, "num_attention_heads": 64}
QWEN25_7B_1M = {  # Qwen/Qwen2.5-7B-Instruct-1M
    "model_type": "qwen2",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
    "max_position_embeddings": 1010000,
    "sliding_window": 32768,
    "use_sliding_window": False,
    "max_window_layers": 28,
    "dual_chunk_attention_config": {"chunk_size": 262144, "local_size": 8192},
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
QWEN3_8B = {  # Qwen/Qwen3-8B
    "model_type": "qwen3",
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "sliding_window": None,
    "use_sliding_window": False,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
QWEN3_235B = {  # Qwen/Qwen3-235B-A22B
    "model_type": "qwen3_moe",
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "moe_intermediate_size": 1536,
    "num_hidden_layers": 94,
    "num_attention_heads": 64,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
    "vocab_size": 151936,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
QWEN2_57B = {  # Qwen/Qwen2-57B-A14B
    "model_type": "qwen2_moe",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "moe_intermediate_size": 2560,
    "shared_expert_intermediate_size": 20480,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "num_experts": 64,
    "num_experts_per_tok": 8,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "vocab_size": 151936,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
MIXTRAL = {  # mistralai/Mixtral-8x7B-v0.1
    "model_type": "mixtral",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "sliding_window": None,
    "vocab_size": 32000,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
GLM45 = {  # zai-org/GLM-4.5
    "model_type": "glm4_moe",
    "hidden_size": 5120,
    "intermediate_size": 12288,
    "moe_intermediate_size": 1536,
    "num_hidden_layers": 92,
    "num_attention_heads": 96,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "n_routed_experts": 160,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "partial_rotary_factor": 0.5,
    "attention_bias": True,
    "use_qk_norm": True,
    "num_nextn_predict_layers": 1,
    "vocab_size": 151552,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
DSV3 = {  # deepseek-ai/DeepSeek-V3
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "moe_layer_freq": 1,
    "n_group": 8,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "num_nextn_predict_layers": 1,
    "quantization_config": FP8,
    "rope_scaling": {"factor": 40, "type": "yarn", "original_max_position_embeddings": 4096},
    "max_position_embeddings": 163840,
    "vocab_size": 129280,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
DSV32 = {**DSV3, "model_type": "deepseek_v32", "architectures": ["DeepseekV32ForCausalLM"]}
DSV32 |= {"index_head_dim": 128, "index_n_heads": 64, "index_topk": 2048}  # V3.2-Exp
KIMI_K2 = {**DSV3, "model_type": "kimi_k2", "num_attention_heads": 64, "num_key_value_heads": 64}
KIMI_K2 |= {"n_routed_experts": 384, "first_k_dense_replace": 1, "vocab_size": 163840}
KIMI_K2 |= {"n_group": 1, "topk_group": 1, "num_nextn_predict_layers": 0}  # Kimi-K2-Instruct
KIMI_K2 |= {"max_position_embeddings": 131072}
DSV2 = {  # deepseek-ai/DeepSeek-V2
    "model_type": "deepseek_v2",
    "hidden_size": 5120,
    "intermediate_size": 12288,
    "moe_intermediate_size": 1536,
    "num_hidden_layers": 60,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "n_routed_experts": 160,
    "n_shared_experts": 2,
    "num_experts_per_tok": 6,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "vocab_size": 102400,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
DSV2_LITE = {**DSV2, "hidden_size": 2048, "intermediate_size": 10944, "num_hidden_layers": 27}
DSV2_LITE |= {"num_attention_heads": 16, "num_key_value_heads": 16, "q_lora_rank": None}
DSV2_LITE |= {"n_routed_experts": 64, "moe_intermediate_size": 1408}  # DeepSeek-V2-Lite
GLM5 = {  # zai-org/GLM-5
    "model_type": "glm_moe_dsa",
    "hidden_size": 6144,
    "intermediate_size": 12288,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 78,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "head_dim": 64,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "moe_layer_freq": 1,
    "kv_lora_rank": 512,
    "q_lora_rank": 2048,
    "qk_nope_head_dim": 192,
    "qk_rope_head_dim": 64,
    "v_head_dim": 256,
    "index_head_dim": 128,
    "index_n_heads": 32,
    "index_topk": 2048,
    "sliding_window": 4096,
    "use_sliding_window": False,
    "vocab_size": 154880,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}

# key: (config, use_mla, q heads, kv heads, head_dim, published total B, active B, bytes/weight)
PUBLISHED = {
    "Llama-3.1-8B": (LLAMA31_8B, False, 32, 8, 128, 8.03, 8.03, 2),
    "Llama-3.1-70B": (LLAMA31_70B, False, 64, 8, 128, 70.6, 70.6, 2),
    "Qwen2.5-7B-Instruct-1M": (QWEN25_7B_1M, False, 28, 4, 128, 7.61, 7.61, 2),
    "Qwen3-8B": (QWEN3_8B, False, 32, 8, 128, 8.2, 8.2, 2),
    "Qwen3-235B-A22B": (QWEN3_235B, False, 64, 4, 128, 235, 22, 2),
    "Qwen2-57B-A14B": (QWEN2_57B, False, 28, 4, 128, 57.4, 14.2, 2),
    "Mixtral-8x7B": (MIXTRAL, False, 32, 8, 128, 46.7, 12.9, 2),
    "GLM-4.5": (GLM45, False, 96, 8, 128, 355, 32, 2),  # 355B counts the MTP layer
    "DeepSeek-V2": (DSV2, True, 128, 1, 192, 236, 21, 2),
    "DeepSeek-V2-Lite": (DSV2_LITE, True, 16, 1, 192, 15.7, 2.4, 2),
    "DeepSeek-V3": (DSV3, True, 128, 1, 192, 671, 37, 1),
    "DeepSeek-V3.2-Exp": (DSV32, True, 128, 1, 192, 671, 37, 1),
    "Kimi-K2": (KIMI_K2, True, 64, 1, 192, 1040, 32, 1),
    "GLM-5": (GLM5, True, 64, 1, 256, 744, 40, 2),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_shapes_and_sizes(name):
    cfg, mla, q, kv, hd, total, active, wbytes = PUBLISHED[name]
    m = model_from_hf_config(cfg, name=name)
    assert (m.use_mla, m.num_q_heads, m.num_kv_heads, m.head_dim) == (mla, q, kv, hd)
    assert m.num_layers == cfg["num_hidden_layers"] and m.hidden_size == cfg["hidden_size"]
    assert m.weight_bytes_per_param == wbytes
    # counted from the shapes, within 1.5 % of the published total and 12 % of the active
    # count (papers differ on whether the embeddings count: 0.4B of DeepSeek-V2-Lite's 2.7B)
    assert abs(m.num_params / (total * 1e9) - 1) < 0.015, m.num_params / 1e9
    assert abs(m.params_per_token / (active * 1e9) - 1) < 0.12, m.params_per_token / 1e9
    assert m.sparse_mla == ("index_topk" in cfg)
    if mla:
        assert (m.kv_lora_rank, m.qk_rope_head_dim) == (512, 64)
        assert m.q_lora_rank == (cfg["q_lora_rank"] or 0)
    pl.check_deployment(m, cm.Deployment(tp=1))  # vLLM's rules accept it at TP 1


def test_deepseek_v3_matches_the_built_in_table():
    """The config gives the built-in row's shape exactly, its routed experts exactly, and its
    total to 0.01 % (671.03B counted, 671B published); hence the same KV bytes per token."""
    got, ref = model_from_hf_config(DSV3), cm.MODELS["DeepSeek-V3"]
    for field in ("num_layers", "num_q_heads", "num_kv_heads", "head_dim", "use_mla"):
        assert getattr(got, field) == getattr(ref, field), field
    for field in ("kv_lora_rank", "qk_rope_head_dim", "hidden_size", "q_lora_rank"):
        assert getattr(got, field) == getattr(ref, field), field
    assert got.expert_params == ref.expert_params
    assert abs(got.num_params / ref.num_params - 1) < 1e-4
    for kv in ("bf16", "fp8"):
        assert cm.kv_bytes_per_token(got, kv) == cm.kv_bytes_per_token(ref, kv)


@pytest.mark.parametrize("cfg, key", [(LLAMA31_8B, "Llama-3.1-8B"), (LLAMA31_70B, "Llama-3.1-70B")])
def test_llama_matches_the_built_in_table(cfg, key):
    got, ref = model_from_hf_config(cfg), cm.MODELS[key]
    assert got.attention_shape == ref.attention_shape
    assert abs(got.num_params / ref.num_params - 1) < 0.002
    assert cm.kv_bytes_per_token(got) == cm.kv_bytes_per_token(ref)


def test_name_and_path(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**QWEN3_8B, "_name_or_path": "Qwen/Q"}))
    assert model_from_hf_config(tmp_path).name == "Qwen/Q"
    assert model_from_hf_config(tmp_path / "config.json", name="mine").name == "mine"
    assert model_from_hf_config(MIXTRAL).name == "mixtral"


@pytest.mark.parametrize(
    "cfg, pattern",
    [
        ({**LLAMA31_8B, "model_type": "gemma2"}, r"\[hf-model-type\].*model_type='gemma2'"),
        ({**LLAMA31_8B, "sliding_window": 4096}, r"\[hf-full-attention\].*sliding_window=4096"),
        ({**QWEN3_8B, "use_sliding_window": True, "sliding_window": 4096}, r"full-attention"),
        (
            {**QWEN3_8B, "layer_types": ["full_attention", "sliding_attention"]},
            r"\[hf-full-attention\].*sliding_attention",
        ),
        (
            {**LLAMA31_8B, "quantization_config": {"quant_method": "awq", "bits": 4}},
            r"\[hf-quantization\].*quant_method='awq'",
        ),
        ({**LLAMA31_8B, "torch_dtype": "int8"}, r"\[hf-dtype\].*torch_dtype='int8'"),
        (
            {k: v for k, v in LLAMA31_8B.items() if k != "num_hidden_layers"},
            r"\[hf-field\].*'num_hidden_layers'.*num_hidden_layers=None",
        ),
        ({**LLAMA31_8B, "hidden_size": -1}, r"\[hf-field\].*hidden_size=-1"),
        ({**LLAMA31_8B, "num_hidden_layers": 32.0}, r"\[hf-field\].*num_hidden_layers=32.0"),
        ({**DSV3, "kv_lora_rank": None}, r"\[hf-mla\].*kv_lora_rank=None"),
        ({**LLAMA31_8B, "num_key_value_heads": 5}, r"\[gqa-group-divisible-by-kv-heads\]"),
        ({**MIXTRAL, "num_experts_per_tok": 9}, r"\[hf-field\].*num_experts_per_tok=9"),
        (
            {k: v for k, v in MIXTRAL.items() if k != "num_local_experts"},
            r"\[hf-field\].*'num_local_experts'",
        ),
        ({**LLAMA31_8B, "tie_word_embeddings": "yes"}, r"\[hf-field\].*tie_word_embeddings"),
    ],
)
def test_unsupported_fields_name_the_field(cfg, pattern):
    with pytest.raises(ValueError, match=pattern):
        model_from_hf_config(cfg)


@settings(max_examples=60, deadline=None)
@given(
    kv=st.sampled_from([1, 2, 4, 8]),
    group=st.sampled_from([1, 2, 4, 8]),
    layers=st.integers(1, 96),
    hidden=st.sampled_from([1024, 2048, 4096]),
    vocab=st.integers(1000, 200_000),
    tied=st.booleans(),
    experts=st.sampled_from([0, 8, 64]),
)
def test_param_counts_are_consistent(kv, group, layers, hidden, vocab, tied, experts):
    """Routed experts are part of the total, a token uses at most all of them, tying the
    embeddings saves exactly one vocab x hidden matrix, and the KV bytes per token are GQA's
    ``2 x kv_heads x head_dim x layers x bytes``."""
    cfg = {**LLAMA31_8B, "num_hidden_layers": layers, "hidden_size": hidden, "vocab_size": vocab}
    cfg |= {
        "num_key_value_heads": kv,
        "num_attention_heads": kv * group,
        "tie_word_embeddings": tied,
    }
    if experts:
        cfg |= {"model_type": "mixtral", "num_local_experts": experts, "num_experts_per_tok": 2}
    m = model_from_hf_config(cfg)
    assert 0 <= m.expert_params < m.num_params and 0 < m.params_per_token <= m.num_params
    assert (m.expert_params > 0) == bool(experts)
    untied = model_from_hf_config({**cfg, "tie_word_embeddings": not tied})
    assert abs(untied.num_params - m.num_params) == vocab * hidden
    assert cm.kv_bytes_per_token(m) == 2 * kv * 128 * layers * 2


# ------------------------------------------------------------ the one config.json reader


def test_the_shared_reader_types_every_family():
    """``cpbook.core.hf_config.read_hf_config``: one name per quantity whatever the family."""
    from cpbook.core.hf_config import read_hf_config

    v3 = read_hf_config(DSV3)
    assert (v3.num_q_heads, v3.num_kv_heads, v3.head_dim, v3.use_mla) == (128, 1, 192, True)
    assert (v3.kv_lora_rank, v3.q_lora_rank, v3.qk_rope_head_dim, v3.v_head_dim) == (
        512,
        1536,
        64,
        128,
    )
    assert (v3.num_experts, v3.num_experts_per_tok, v3.num_shared_experts) == (256, 8, 1)
    assert len(v3.moe_layers) == 58 and v3.moe_layers[0] == 3 and v3.quant_method == "fp8"
    assert v3.rope_parameters["rope_type"] == "yarn" and v3.index_topk == 0
    assert read_hf_config(DSV32).index_topk == 2048
    mix = read_hf_config(MIXTRAL)  # num_local_experts, and every layer MoE
    assert (mix.num_experts, mix.moe_intermediate_size, len(mix.moe_layers)) == (8, 14336, 32)
    llama = read_hf_config(LLAMA31_8B)
    assert (llama.num_q_heads, llama.num_kv_heads, llama.head_dim, llama.is_moe) == (
        32,
        8,
        128,
        False,
    )
    assert read_hf_config({**LLAMA31_8B, "model_type": "mistral"}).model_type == "mistral"
    with pytest.raises(ValueError, match=r"\[hf-model-type\]"):
        read_hf_config({**LLAMA31_8B, "model_type": "gpt2"})


def test_the_shared_reader_needs_no_torch():
    import subprocess
    import sys

    code = "import sys, cpbook.core.hf_config; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_engine_and_planner_read_the_same_shape():
    """The engine's loader and the planner's reader agree on one checkpoint's shape, and each
    keeps its strictness: the planner refuses Mistral (not a cost-model family), the engine a
    field it does not run."""
    pytest.importorskip("torch")
    from cpbook.engine.hf import hf_config

    raw = {**DSV2_LITE, "architectures": ["DeepseekV2ForCausalLM"]}
    engine, _ = hf_config(raw)
    spec = model_from_hf_config(raw)
    assert (engine.num_q_heads, engine.num_hidden_layers, engine.hidden_size) == (
        spec.num_q_heads,
        spec.num_layers,
        spec.hidden_size,
    )
    assert engine.kv_lora_rank == spec.kv_lora_rank and engine.num_kv_heads == 1
    assert engine.n_routed_experts == spec.num_experts == 64
    assert engine.first_k_dense_replace == spec.num_layers - spec.moe_layers == 1
    with pytest.raises(ValueError, match=r"\[hf-model-type\]"):
        model_from_hf_config({**LLAMA31_8B, "model_type": "mistral"})
    with pytest.raises(ValueError, match=r"\[hf-config-supported\].*index_topk"):
        hf_config({**raw, "index_topk": 2048})
