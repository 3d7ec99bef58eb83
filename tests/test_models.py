"""cpbook.engine.models: the tiny decoders, their TP slices and the single-device reference."""

from __future__ import annotations

import pytest
import torch

from cpbook.core.attention import dense_attention
from cpbook.core.config import ConfigError
from cpbook.engine.models import ENGINE_MODELS, TinyModel, reference_generate

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module", params=sorted(ENGINE_MODELS))
def model(request) -> TinyModel:
    return TinyModel.from_name(request.param, seed=0)


def test_shapes_from_the_issue():
    gqa, mla = ENGINE_MODELS["tiny-gqa"], ENGINE_MODELS["tiny-mla"]
    assert (gqa.num_q_heads, gqa.num_kv_heads, gqa.use_mla) == (8, 2, False)
    assert (mla.num_q_heads, mla.num_kv_heads, mla.use_mla) == (8, 1, True)
    assert mla.kv_cache_dim == mla.kv_lora_rank + mla.qk_rope_head_dim


def test_weights_are_deterministic(model):
    again = TinyModel.from_name(model.config.name, seed=0)
    other = TinyModel.from_name(model.config.name, seed=1)
    assert torch.equal(again.embed, model.embed) and torch.equal(again.lm_head, model.lm_head)
    assert not torch.equal(other.embed, model.embed)


def test_unknown_model_is_a_config_error():
    with pytest.raises(ConfigError, match=r"^\[known-model\]"):
        TinyModel.from_name("tiny-moe")


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_slices_sum_to_the_full_layer(model, tp):
    """Per-rank partial projections (heads, MLP columns) sum to the single-device result."""
    cfg, gen = model.config, torch.Generator().manual_seed(3)
    x = torch.randn(5, cfg.hidden_size, generator=gen, dtype=torch.float64)
    attn = torch.randn(
        5,
        cfg.num_q_heads,
        cfg.kv_lora_rank if cfg.use_mla else cfg.head_dim,
        generator=gen,
        dtype=torch.float64,
    )
    h, i = cfg.num_q_heads // tp, cfg.intermediate_size // tp
    o = sum(
        model.o_proj(0, attn[:, r * h : (r + 1) * h], slice(r * h, (r + 1) * h)) for r in range(tp)
    )
    m = sum(model.mlp(0, x, slice(r * i, (r + 1) * i)) for r in range(tp))
    assert torch.allclose(o, model.o_proj(0, attn, slice(None)), atol=1e-12, rtol=0)
    assert torch.allclose(m, model.mlp(0, x, slice(None)), atol=1e-12, rtol=0)


def test_mla_absorbed_attention_equals_its_mha_form():
    """The engine's latent (absorbed) attention and the reference's MHA form agree."""
    model = TinyModel.from_name("tiny-mla")
    cfg, gen = model.config, torch.Generator().manual_seed(4)
    x = torch.randn(6, cfg.hidden_size, generator=gen, dtype=torch.float64)
    pos = torch.arange(6)
    q, lat, v = model.qkv(0, model.attn_input(0, x), pos, slice(None), slice(0, 1))
    assert v is None and lat.shape == (6, 1, cfg.kv_cache_dim)
    m = model.mla[0]
    o_lat, _ = dense_attention(q, lat, lat[..., : cfg.kv_lora_rank], causal=True, scale=m.scale)
    absorbed = m.v_up_proj(o_lat, slice(None))
    qm, latm = model.mla_q_and_latent(0, model.attn_input(0, x), pos)
    assert torch.allclose(latm, lat[:, 0], atol=1e-13, rtol=0)
    kk, vv = m.expand_kv(latm, slice(None))
    mha, _ = dense_attention(qm, kk, vv, causal=True, scale=m.scale)
    assert torch.allclose(absorbed, mha, atol=1e-12, rtol=0)


def test_greedy_decoding_is_not_degenerate(model):
    gen = torch.Generator().manual_seed(1)
    seen = set()
    for n in (5, 17, 30):
        prompt = torch.randint(cfg_vocab(model), (n,), generator=gen).tolist()
        out, logits = reference_generate(model, prompt, 8, return_logits=True)
        assert len(out) == 8 and logits.shape == (8, cfg_vocab(model))
        assert out == logits.argmax(-1).tolist()
        seen |= set(out)
    assert len(seen) >= 8  # not one repeated token


def cfg_vocab(model: TinyModel) -> int:
    return model.config.vocab_size
