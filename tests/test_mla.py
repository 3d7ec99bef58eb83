"""mla: absorbed decode (moves Q) and chunked context prefill (moves latent KV) are exact;
the traced bytes equal the formulas; the measured crossover matches the analytic one; vLLM
v0.34.0's up-projected All2All combine is exact on both sides of its 8-token threshold."""

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cpbook.core.attention import dense_attention
from cpbook.core.comm import comm_bytes
from cpbook.core.config import ConfigError
from cpbook.core.errors import RuleError
from cpbook.core.launch import run
from cpbook.dcp.mla import (
    V_UP_PROJ_FIRST_MIN_TOKENS,
    MLAShape,
    MLAWeights,
    crossover_context_len,
    kv_move_bytes,
    mla_decode_comm_bytes,
    q_move_bytes,
)
from cpbook.demos import demo_kwargs
from cpbook.demos.ch03_decode import mla_context_rank, mla_decode_rank
from cpbook.kv.gather import context_chunk_len, context_gather_comm_bytes, reorg_kvcache
from tests.rank_fns import in_sequence


def _check(res):
    assert max(r["max_abs_err"] for r in res) <= 1e-10
    for r, trace in zip(res, res.traces):
        load = r.get("load_comm", [])
        assert load == r.get("load_expected", [])
        assert r["comm"] == r["expected"]
        assert load + r["comm"] == [(c.op, c.bytes_sent) for c in trace]
        assert all(c.bytes_recv == c.bytes_sent for c in trace)


def test_absorbed_form_equals_mha_form():
    mla = MLAWeights.random(num_q_heads=4, seed=3)
    g = torch.Generator().manual_seed(4)
    qn = torch.randn(2, 4, 16, generator=g, dtype=torch.float64)
    qp = torch.randn(2, 4, 8, generator=g, dtype=torch.float64)
    lat = torch.randn(25, mla.latent_dim, generator=g, dtype=torch.float64)
    heads = slice(0, 4)
    k, v = mla.expand_kv(lat, heads)
    mha, mha_lse = dense_attention(torch.cat([qn, qp], -1), k, v, scale=mla.scale)
    q_lat = mla.absorb_q(qn, qp, heads)  # [2, 4, C+R] against one latent "KV head"
    o, lse = dense_attention(q_lat, lat[:, None], lat[:, None, : mla.kv_lora_rank], scale=mla.scale)
    assert (mla.v_up_proj(o, heads) - mha).abs().max() <= 1e-13
    assert (lse - mha_lse).abs().max() <= 1e-13


def test_reorg_kvcache_hand_example():
    """dcp=2, interleave 1, context 5: rank 0 holds 0, 2, 4; rank 1 holds 1, 3 (+1 pad row).
    The workspace is rank-major: positions 0, 2, 4, 1, 3 — not re-interleaved."""
    rows = torch.tensor([[0.0], [2.0], [4.0], [1.0], [3.0], [-1.0]])
    ws, cu = reorg_kvcache(rows, counts=[[3], [2]], padded=[3])
    assert ws.flatten().tolist() == [0, 2, 4, 1, 3] and cu == [0, 5]
    rows = torch.tensor([[0.0], [2.0], [10.0], [1.0], [-1.0], [-1.0]])  # two requests: lens 3 and 1
    ws, cu = reorg_kvcache(rows, counts=[[2, 1], [1, 0]], padded=[2, 1])
    assert ws.flatten().tolist() == [0, 2, 1, 10] and cu == [0, 3, 4]
    with pytest.raises(ValueError, match="reorg-rows"):
        reorg_kvcache(rows[:5], counts=[[2, 1], [1, 0]], padded=[2, 1])


def _cases(n, seed=0):
    rng = random.Random(seed)
    for _ in range(n):
        tp, dcp = rng.choice([(1, 1), (2, 1), (2, 2), (3, 3), (4, 2), (4, 4)])
        block = rng.choice([4, 8])
        interleave = rng.choice([1, 2, block])
        nreq = rng.randint(1, 3)
        yield dict(
            tensor_parallel_size=tp,
            decode_context_parallel_size=dcp,
            num_q_heads=tp * rng.choice([1, 2]),
            block_size=block,
            cp_kv_cache_interleave_size=interleave,
            seed=rng.randint(0, 2**31),
            lens=[rng.choice([1, 2, rng.randint(1, 70)]) for _ in range(nreq)],
            query_lens=[rng.randint(1, 4) for _ in range(nreq)],
            workspace=rng.choice([dcp * interleave * 3, 64, 256]),
            backend=rng.choice(["ag_rs", "a2a"]),
        )


@pytest.mark.parametrize(
    "case",
    list(_cases(16)),
    ids=lambda c: (
        "tp{tensor_parallel_size}-dcp"
        "{decode_context_parallel_size}-I{cp_kv_cache_interleave_size}-{lens}".format(**c)
    ),
)
def test_decode_and_context_exact_and_bytes_match_formula(case):
    case = dict(case)
    lens, qlens, ws, backend = (
        case.pop("lens"),
        case.pop("query_lens"),
        case.pop("workspace"),
        case.pop("backend"),
    )
    world = case["tensor_parallel_size"]
    _check(
        run(
            mla_decode_rank,
            world,
            fn_kwargs=demo_kwargs(
                mla_decode_rank, dict(seq_lens=tuple(lens), dcp_comm_backend=backend, **case)
            ),
            report=False,
        )
    )
    ctx_lens = tuple(
        x - 1 if i % 2 else x for i, x in enumerate(lens)
    )  # some requests without context
    kw = dict(context_lens=ctx_lens, query_lens=tuple(qlens), workspace_size=ws, **case)
    res = run(mla_context_rank, world, fn_kwargs=demo_kwargs(mla_context_rank, kw), report=False)
    _check(res)
    assert all(rows <= ws for rows in res[0]["stats"]["rows_per_chunk"])


def test_workspace_too_small_is_rejected():
    with pytest.raises(ConfigError, match="workspace-fits-requests"):
        context_chunk_len(3, 20, 4, 2)
    assert context_chunk_len(2, 50, 4, 2) == 24


def test_measured_crossover_matches_formula():
    """Per rank, one decode token: moving Q costs a fixed amount; moving the latent context KV
    grows with L.  The first context length where KV costs more is the analytic crossover."""
    kw = dict(tensor_parallel_size=4, decode_context_parallel_size=4, num_q_heads=8)
    dec = run(
        mla_decode_rank,
        4,
        fn_kwargs=demo_kwargs(mla_decode_rank, dict(seq_lens=(64,), **kw)),
        report=False,
    )
    q_bytes = comm_bytes(dec[0]["comm"])
    assert q_bytes == q_move_bytes(1, 2, 32, 8, 4, elem_bytes=8, lse_bytes=8)
    measured = None
    for ctx_len in range(1, 40):
        flat = dict(context_lens=(ctx_len,), query_lens=(1,), workspace_size=256, **kw)
        res = run(mla_context_rank, 4, fn_kwargs=demo_kwargs(mla_context_rank, flat), report=False)
        kv = comm_bytes(res[0]["comm"])
        assert kv == comm_bytes(context_gather_comm_bytes((ctx_len,), 256, 4, 1, 40))
        if kv > q_bytes:
            measured = ctx_len
            break
    analytic = crossover_context_len(1, 2, 32, 8, 4, elem_bytes=8, lse_bytes=8)
    assert analytic == pytest.approx(15.2)
    assert kv_move_bytes(16, 32, 8, 4, 8) > q_bytes > kv_move_bytes(15, 32, 8, 4, 8)
    # every rank sends rank 0's ceil(L/4) rows (padding), so the measured switch comes one
    # stripe early: 13 tokens = 4 rows, the first row count above 15.2 / 4 = 3.8
    assert measured == 13


@settings(max_examples=25, deadline=None)
@given(
    grid=st.sampled_from([(1, 1), (2, 2), (3, 3), (4, 2), (4, 4)]),
    heads=st.sampled_from([1, 2]),
    block=st.sampled_from([4, 8]),
    interleave=st.sampled_from([1, 2, 4]),
    lens=st.lists(st.integers(1, 40), min_size=1, max_size=12),
    seed=st.integers(0, 2**31),
)
def test_v_up_proj_combine_exact_and_bytes(grid, heads, block, interleave, lens, seed):
    """vLLM v0.34.0's MLA All2All: W_UV before the exchange from 8 tokens, the latent merge
    below; exact against dense float64 on random batches (short requests leave empty shards),
    its bytes = formula = trace, and its output equals the latent ``a2a`` combine's."""
    tp, dcp = grid
    kw = dict(
        tensor_parallel_size=tp,
        decode_context_parallel_size=dcp,
        num_q_heads=tp * heads,
        block_size=block,
        cp_kv_cache_interleave_size=interleave,
        dcp_comm_backend="a2a",
        seq_lens=tuple(lens),
        seed=seed,
    )
    up = run(
        mla_decode_rank,
        tp,
        fn_kwargs=demo_kwargs(mla_decode_rank, dict(v_up_proj_combine=True, **kw)),
        report=False,
    )
    _check(up)
    latent = run(mla_decode_rank, tp, fn_kwargs=demo_kwargs(mla_decode_rank, kw), report=False)
    _check(latent)
    shape, h, n, e = MLAShape(), heads, dcp, 8
    width = shape.v_head_dim if len(lens) >= V_UP_PROJ_FIRST_MIN_TOKENS else shape.kv_lora_rank
    for a, b in zip(up, latent):
        assert a["comm"][0] == b["comm"][0]  # the same query AllGather
        if dcp > 1:
            assert a["comm"][1] == ("all_to_all", len(lens) * h * (width + 1) * e * (n - 1))
        assert a["load_comm"] == [("all_gather", 32 * h * 16 * e * (n - 1))]


def test_v_up_proj_threshold_both_sides():
    """7 tokens: the latent (C-wide) All2All, as the ``a2a`` combine; 8 tokens: the Dv-wide one."""
    kw = dict(dcp_comm_backend="a2a", v_up_proj_combine=True)
    sent = {}
    for n in (V_UP_PROJ_FIRST_MIN_TOKENS - 1, V_UP_PROJ_FIRST_MIN_TOKENS):
        res = run(
            mla_decode_rank,
            4,
            fn_kwargs=demo_kwargs(mla_decode_rank, dict(seq_lens=(1,) * (n - 1) + (33,), **kw)),
            report=False,
        )
        _check(res)
        sent[n] = res[0]["comm"][1]
        assert res[0]["shapes"]["out"] == (n, 2, 16)
        assert ("out_latent" in res[0]["shapes"]) is False
    # h = 2 heads per rank, DCP 4, float64: (C + 1) below the threshold, (Dv + 1) from it
    assert sent == {7: ("all_to_all", 7 * 2 * 33 * 8 * 3), 8: ("all_to_all", 8 * 2 * 17 * 8 * 3)}
    formula = mla_decode_comm_bytes(8, 2, MLAShape(), 4, "a2a", True)
    assert formula[1] == sent[8]
    assert mla_decode_comm_bytes(7, 2, MLAShape(), 4, "a2a", True) == mla_decode_comm_bytes(
        7, 2, MLAShape(), 4, "a2a"
    )


def test_v_up_proj_combine_needs_a2a():
    with pytest.raises(RuleError, match="v-up-proj-combine-a2a"):
        mla_decode_comm_bytes(8, 2, MLAShape(), 4, "ag_rs", True)
    with pytest.raises(RuntimeError, match="v-up-proj-combine-a2a"):  # the rank's RuleError
        run(
            mla_decode_rank,
            4,
            fn_kwargs=dict(v_up_proj_combine=True),  # MLA_CONFIG combines with ag_rs
            report=False,
        )


@pytest.mark.torchrun
def test_mla_under_torchrun():
    """Absorbed decode (DCP 4) and the cached-context prefill (TP 4, DCP 2, a workspace that
    forces several passes) on 4 processes, one torchrun launch."""
    ctx_kw = dict(
        tensor_parallel_size=4,
        decode_context_parallel_size=2,
        context_lens=(40, 3),
        query_lens=(2, 1),
        workspace_size=16,
    )
    calls = [
        ("cpbook.demos.ch03_decode:mla_decode_rank", dict(seq_lens=(40, 5, 2))),
        ("cpbook.demos.ch03_decode:mla_context_rank", ctx_kw),
    ]
    res = run(in_sequence, 4, "torchrun", dict(calls=calls), dist_backend="gloo", report=False)
    for per_rank, trace in zip(res, res.traces):
        assert max(r["max_abs_err"] for r in per_rank) <= 1e-10
        assert all(r["comm"] == r["expected"] for r in per_rank)
        assert [(c.op, c.bytes_sent) for c in trace] == sum((r["comm"] for r in per_rank), [])
        assert all(c.bytes_recv == c.bytes_sent for c in trace)


@pytest.mark.torchrun
def test_v_up_proj_combine_under_torchrun():
    """vLLM v0.34.0's up-projected MLA All2All on 4 processes, on both sides of 8 tokens."""
    kw = dict(dcp_comm_backend="a2a", v_up_proj_combine=True)
    fn = "cpbook.demos.ch03_decode:mla_decode_rank"
    calls = [
        (fn, dict(seq_lens=(40, 5, 2), **kw)),
        (fn, dict(seq_lens=(40, 5, 2, 1, 9, 3, 17, 4), **kw)),
    ]
    res = run(in_sequence, 4, "torchrun", dict(calls=calls), dist_backend="gloo", report=False)
    for per_rank, trace in zip(res, res.traces):
        assert max(r["max_abs_err"] for r in per_rank) <= 1e-10
        assert all(r["comm"] == r["expected"] for r in per_rank)
        assert all(r["load_comm"] == r["load_expected"] for r in per_rank)
        assert [(c.op, c.bytes_sent) for c in trace] == sum(
            (r["load_comm"] + r["comm"] for r in per_rank), []
        )
    assert [r["comm"][1][1] for r in res[0]] == [3 * 2 * 33 * 8 * 3, 8 * 2 * 17 * 8 * 3]


def test_tiny_mla_attention_equals_transformers_deepseek_v2():
    """The tiny MLA model's attention against transformers' ``DeepseekV2Attention`` (code
    nobody here wrote) with the same weights, in float64: the MHA form the reference uses and
    the absorbed form the engine runs both equal it, which pins the softmax scale from outside
    (``1/sqrt(qk_nope_head_dim + qk_rope_head_dim)``: plain RoPE, no YaRN mscale).

    DeepSeek rotates the rope part interleaved, pairs ``(x[2i], x[2i+1])``; the tiny model
    rotates half, pairs ``(x[i], x[i + R/2])``: the rope columns of the query and ``k_pe``
    projections are permuted to match (a dot product over both rope parts is unchanged)."""
    tf = pytest.importorskip("transformers")
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as ds

    from cpbook.engine.models import TinyModel
    from tests.hf_models import float64_transformers

    model = TinyModel.from_name("tiny-mla", seed=7, num_hidden_layers=1)
    c = model.config
    n, C, Dn, R, Dv, H = (c.num_q_heads, c.kv_lora_rank, c.qk_nope_head_dim,
                          c.qk_rope_head_dim, c.v_head_dim, c.hidden_size)  # fmt: skip
    assert C != Dn + R  # a scale taken from the wrong width shows
    cfg = tf.DeepseekV2Config(
        vocab_size=c.vocab_size, hidden_size=H, num_attention_heads=n, num_key_value_heads=n,
        kv_lora_rank=C, q_lora_rank=None, qk_nope_head_dim=Dn, qk_rope_head_dim=R,
        v_head_dim=Dv, rms_norm_eps=c.rms_norm_eps, attention_bias=False,
        max_position_embeddings=64, attn_implementation="eager",
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
    )  # fmt: skip
    lw, mla = model.layers[0], model.mla[0]
    perm = torch.stack([torch.arange(R // 2), torch.arange(R // 2) + R // 2], 1).flatten()
    wq = torch.cat([lw["wq"][..., :Dn], lw["wq"][..., Dn:][..., perm]], -1)
    with float64_transformers():
        attn = ds.DeepseekV2Attention(cfg, 0).to(torch.float64).eval()
        rotary = ds.DeepseekV2RotaryEmbedding(cfg)
        with torch.no_grad():
            attn.q_proj.weight.copy_(wq.reshape(H, n * (Dn + R)).T)
            attn.kv_a_proj_with_mqa.weight.copy_(torch.cat([lw["w_dkv"], lw["w_kr"][:, perm]], 1).T)
            attn.kv_a_layernorm.weight.copy_(lw["kv_norm"])
            attn.kv_b_proj.weight.copy_(torch.cat([mla.W_UK, mla.W_UV], 2).reshape(C, -1).T)
            attn.o_proj.weight.copy_(lw["wo"].reshape(n * Dv, H).T)
            T, start = 11, 5
            h = torch.randn(T, H, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
            pos = torch.arange(start, start + T)
            mask = torch.full((T, T), -math.inf, dtype=torch.float64).triu(1)[None, None]
            ref = attn(h[None], mask, position_embeddings=rotary(h[None], pos[None]))[0][0]
    every, scale = slice(None), model.attn_scale(0)
    q, lat = model.mla_q_and_latent(0, h, pos)
    k, v = mla.expand_kv(lat, every)
    mha = torch.einsum("tnd,ndh->th", dense_attention(q, k, v, True, scale=scale)[0], lw["wo"])
    q_lat, row, _ = model.qkv(0, h, pos, every, every)
    absorbed = model.o_proj(
        0, dense_attention(q_lat, row, row[..., :C], True, scale=scale)[0], every
    )
    assert (mha - ref).abs().max() <= 1e-10
    assert (absorbed - ref).abs().max() <= 1e-10
