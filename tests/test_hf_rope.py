"""cpbook.engine.hf's RoPE parameters against transformers' own (``modeling_rope_utils``).

The model tests use the YaRN settings of real DeepSeek checkpoints (``mscale ==
mscale_all_dim``, so the cos/sin factor is 1): here the inverse frequencies and the factor
are compared with transformers' ``ROPE_INIT_FUNCTIONS`` on settings where each term shows."""

from __future__ import annotations

import pytest
import torch

from cpbook.engine.hf import rope_inv_freq
from tests.hf_models import float64_transformers

YARN = dict(rope_type="yarn", rope_theta=10000.0, original_max_position_embeddings=16)
CASES = [
    dict(YARN, factor=4.0, mscale=1.0, mscale_all_dim=0.5),  # attention factor != 1
    dict(YARN, factor=8.0, mscale=0.707, mscale_all_dim=1.2, beta_fast=32, beta_slow=1),
    dict(YARN, factor=4.0, beta_fast=64, beta_slow=0.25, truncate=False),  # ramp hits dim - 1
    dict(YARN, factor=40.0, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1),
    dict(YARN, rope_theta=100.0, factor=4.0, original_max_position_embeddings=4096),  # ramp > D/2
    dict(YARN, factor=4.0, attention_factor=0.8),
    dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
         high_freq_factor=4.0, original_max_position_embeddings=64),
    dict(rope_type="default", rope_theta=10000.0),
]  # fmt: skip


@pytest.mark.parametrize("dim", [8, 16, 64])
@pytest.mark.parametrize("params", CASES, ids=lambda p: f"{p['rope_type']}-{len(p)}")
def test_inv_freq_and_attention_factor_equal_transformers(params, dim):
    import transformers as tf
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = tf.LlamaConfig(
        hidden_size=4 * dim, num_attention_heads=4, head_dim=dim, max_position_embeddings=4 * 4096,
        rope_parameters=dict(params),
    )  # fmt: skip
    with float64_transformers():
        init = (
            ROPE_INIT_FUNCTIONS[params["rope_type"]] if params["rope_type"] != "default" else None
        )
        if init is None:
            want = 1.0 / params["rope_theta"] ** (
                torch.arange(0, dim, 2, dtype=torch.float64) / dim
            )
            want_factor = 1.0
        else:
            want, want_factor = init(config, None)
    inv, factor = rope_inv_freq(dict(params), dim)
    assert (inv - want.double()).abs().max() <= 1e-12 * want.abs().max()
    assert factor == pytest.approx(want_factor, rel=1e-12)
