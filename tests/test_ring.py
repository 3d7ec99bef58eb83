"""ring: pass-KV and pass-Q are exact, move the bytes the formula says, skip masked blocks,
reject bad input before communicating, and Meta's rule picks the mode it should."""

import pytest
import torch

from cpbook.core.config import ParallelConfig
from cpbook.core.launch import run
from cpbook.demos import demo_kwargs
from cpbook.demos.ch05_chunked import ring_prefill_rank
from cpbook.pcp.ring import ring_attention
from cpbook.pcp.ring_plan import RingShards, choose_ring_mode

# (pcp, tp, seq_lens, context_lens, q heads, kv heads, interleave)
CASES = [
    (1, 1, (37, 64), (0, 48), 8, 2, 1),
    (2, 1, (37, 64), (0, 48), 8, 2, 1),
    (2, 2, (16,), (0,), 8, 2, 1),
    (3, 1, (5, 1, 64), (3, 0, 17), 4, 4, 1),
    (3, 1, (50, 7), (100, 2), 6, 3, 2),
    (4, 1, (5, 1, 64), (3, 0, 17), 4, 1, 1),
    (4, 1, (1,), (9,), 8, 2, 4),
    (4, 1, (100,), (0,), 4, 2, 1),
    (2, 2, (9, 30), (31, 0), 8, 1, 1),
]


def _pairs(seq_lens, context_lens):
    return sum(c * t + t * (t + 1) // 2 for c, t in zip(context_lens, seq_lens))


@pytest.mark.parametrize("mode", ["pass_kv", "pass_q"])
@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: f"pcp{c[0]}-tp{c[1]}-{c[2]}-ctx{c[3]}-h{c[4]}/{c[5]}"
)
def test_exact_bytes_and_work(case, mode):
    pcp, tp, lens, ctx, hq, hkv, inter = case
    res = run(
        ring_prefill_rank,
        pcp * tp,
        report=False,
        fn_kwargs=demo_kwargs(
            ring_prefill_rank,
            dict(
                seq_lens=lens,
                context_lens=ctx,
                tensor_parallel_size=tp,
                num_q_heads=hq,
                num_kv_heads=hkv,
                mode=mode,
                cp_kv_cache_interleave_size=inter,
                seed=pcp + len(lens),
            ),
        ),
    )
    for r in res:
        assert r["max_abs_err"] <= 1e-10
        assert r["comm"] == r["expected"]
        assert r["steps"] == pcp
    for t in range(tp):  # every (query, key) pair once, none masked: the causal count exactly
        assert sum(r["work"] for r in res if r["tp_rank"] == t) == _pairs(lens, ctx)
    if mode == "pass_kv":  # a rank computes exactly what its own queries see
        shards = RingShards(lens, ctx, pcp)
        for r in res:
            meta = shards.metadata(r["pcp_rank"])
            mine = sum(
                ctx[s.request] * q + (2 * s.start + q + 1) * q // 2
                for s, q in zip(meta.segments, meta.query_lens)
            )
            assert r["work"] == mine


@pytest.mark.parametrize("seed", range(4))
def test_random_batches(seed):
    g = torch.Generator().manual_seed(seed)

    def draw(lo, hi):
        return int(torch.randint(lo, hi + 1, (), generator=g))

    pcp, reqs = draw(1, 4), draw(1, 3)
    lens = tuple(draw(1, 40) for _ in range(reqs))
    ctx = tuple(draw(0, 40) * draw(0, 1) for _ in range(reqs))
    hq, hkv = [(4, 4), (4, 2), (8, 1), (6, 2)][draw(0, 3)]
    for mode in ("pass_kv", "pass_q"):
        kw = dict(
            seq_lens=lens,
            context_lens=ctx,
            num_q_heads=hq,
            num_kv_heads=hkv,
            mode=mode,
            cp_kv_cache_interleave_size=[1, 2, 4][draw(0, 2)],
            seed=seed,
        )
        res = run(
            ring_prefill_rank, pcp, report=False, fn_kwargs=demo_kwargs(ring_prefill_rank, kw)
        )
        assert all(r["max_abs_err"] <= 1e-10 and r["comm"] == r["expected"] for r in res)
        assert sum(r["work"] for r in res) == _pairs(lens, ctx)


@pytest.mark.parametrize("pcp", [2, 3, 4])
def test_zigzag_needs_one_call_per_step(pcp):
    """One request, no context: a rank's own block is one causal call, every other rank's block
    one dense call of half the work (the masked half is skipped) in both modes."""
    for mode in ("pass_kv", "pass_q"):
        res = run(
            ring_prefill_rank,
            pcp,
            report=False,
            fn_kwargs=demo_kwargs(
                ring_prefill_rank, dict(seq_lens=(16 * pcp,), context_lens=(0,), mode=mode)
            ),
        )
        assert [r["kernel_calls"] for r in res] == [pcp] * pcp
        assert len({r["work"] for r in res}) == 1  # balanced
    shards = RingShards((16 * pcp,), (0,), pcp)  # chunks of 8, 16 rows per rank
    for a in range(pcp):
        for b in range(pcp):
            (call,) = shards.plan(a, b)
            assert (call.causal, call.pairs) == ((True, 16 * 17 // 2) if a == b else (False, 128))


def test_pass_q_moves_less_with_a_high_hit_rate_and_few_kv_heads():
    kw = dict(seq_lens=(32,), context_lens=(1024,), num_q_heads=8, num_kv_heads=1)
    sent = {
        m: sum(
            r["bytes_sent"]
            for r in run(
                ring_prefill_rank,
                4,
                report=False,
                fn_kwargs=demo_kwargs(ring_prefill_rank, dict(kw, mode=m)),
            )
        )
        for m in ("pass_kv", "pass_q")
    }
    assert sent["pass_q"] < sent["pass_kv"]
    assert choose_ring_mode(32, 1024, 8, 1) == "pass_q"
    full = {
        m: run(
            ring_prefill_rank,
            4,
            report=False,
            fn_kwargs=demo_kwargs(
                ring_prefill_rank, dict(kw, context_lens=(0,), seq_lens=(256,), mode=m)
            ),
        )
        for m in ("pass_kv", "pass_q")
    }
    assert sum(r["bytes_sent"] for r in full["pass_kv"]) < sum(
        r["bytes_sent"] for r in full["pass_q"]
    )
    assert choose_ring_mode(256, 0, 8, 1) == "pass_kv"


def test_ring_holds_less_than_an_all_gather():
    """pass-KV holds at most two K/V blocks (plus one partial result), never all N."""
    res = run(
        ring_prefill_rank,
        4,
        report=False,
        fn_kwargs=demo_kwargs(
            ring_prefill_rank,
            dict(seq_lens=(256,), context_lens=(0,), num_q_heads=4, num_kv_heads=4),
        ),
    )
    block = 2 * 4 * 16 * 8 * 64  # K and V, 4 heads, D 16, float64, 64 rows per rank
    for r in res:
        assert 2 * block <= r["peak_temp_bytes"] < 3 * block


def _bad(ctx, case):
    shards = RingShards((8,), (4,), ctx.world_size)
    rows, nctx = shards.metadata(ctx.rank).num_tokens, shards.num_context(ctx.rank)
    q, k = (
        torch.zeros(rows, 4, 8, dtype=torch.float64),
        torch.zeros(rows, 2, 8, dtype=torch.float64),
    )
    kc = torch.zeros(nctx, 2, 8, dtype=torch.float64)
    args = {
        "mode": (q, k, k, shards, ctx.world, "pass_x", kc, kc),
        "shapes": (q[1:], k, k, shards, ctx.world, "pass_kv", kc, kc),
        "heads": (
            torch.zeros(rows, 3, 8, dtype=torch.float64),
            k,
            k,
            shards,
            ctx.world,
            "pass_q",
            kc,
            kc,
        ),
        "context": (q, k, k, shards, ctx.world, "pass_q", kc[1:], kc[1:]),
        "dtype": (q.half(), k.half(), k.half(), shards, ctx.world, "pass_q", kc.half(), kc.half()),
        "group": (q, k, k, RingShards((8,), (4,), 3), ctx.world, "pass_kv", kc, kc),
    }[case]
    try:
        ring_attention(*args)
    except ValueError as e:
        return str(e), len(ctx.trace)
    return None, len(ctx.trace)


@pytest.mark.parametrize(
    "case,rule",
    [
        ("mode", "ring-mode"),
        ("shapes", "ring-shapes"),
        ("heads", "ring-shapes"),
        ("context", "ring-context-rows"),
        ("dtype", "ring-dtype"),
        ("group", "ring-group-matches-shards"),
    ],
)
def test_bad_input_fails_before_any_collective(case, rule):
    for msg, traced in run(_bad, 2, report=False, fn_kwargs={"case": case}):
        assert msg is not None and msg.startswith(f"[{rule}] requires") and traced == 0


@pytest.mark.parametrize(
    "kwargs,rule",
    [
        (dict(num_q_heads=6, num_kv_heads=4), "gqa-group-divisible-by-kv-heads"),
        (dict(context_lens=(1,)), "ring-context-lens"),
        (dict(context_lens=(-1, 0)), "ring-context-lens"),
        (dict(mode="ring"), "ring-mode"),
        (dict(seq_lens=(0, 3)), "pcp-seq-lens"),
        (dict(tensor_parallel_size=3, num_q_heads=12, num_kv_heads=3), "world-divisible-by-tp"),
    ],
)
def test_bad_config_names_the_rule(kwargs, rule):
    """Rejected as the config is built (ValueError) or on the ranks before any collective."""
    with pytest.raises((RuntimeError, ValueError), match=rf"\[{rule}\] requires"):
        run(ring_prefill_rank, 2, report=False, fn_kwargs=demo_kwargs(ring_prefill_rank, kwargs))


def test_meta_rule_boundaries():
    # Eq. (1): pass-KV iff T/(T+P) >= 2·N_KV/N_H; exactly on the line goes to pass-KV
    assert choose_ring_mode(1, 3, 8, 1) == "pass_kv"  # 1/4 == 2/8
    assert choose_ring_mode(1, 4, 8, 1) == "pass_q"
    assert choose_ring_mode(100, 700, 128, 8) == "pass_kv"  # 12.5 % miss, Llama-3 405B heads
    assert choose_ring_mode(100, 701, 128, 8) == "pass_q"
    assert choose_ring_mode(4096, 0, 32, 8) == "pass_kv"  # full prefill, GQA
    assert choose_ring_mode(4096, 0, 8, 8) == "pass_q"  # MHA: a Q block is half a K/V block
    assert choose_ring_mode(1, 10**6, 64, 8) == "pass_q"  # decode
    # Algorithm 5: C = 8e14 FLOP/s, BW = 5e10 B/s, N = 4, e = 2 -> Eq. (2) hides from T = 4000
    hw = dict(pcp=4, elem_bytes=2, peak_flops=8e14, bandwidth=5e10)
    assert choose_ring_mode(4000, 10**9, 128, 8, **hw) == "pass_kv"
    assert choose_ring_mode(3999, 10**9, 128, 8, **hw) == "pass_q"  # 4e-6 < 2.5e-5 (Eq. 5)
    # the All2All charge lowers the miss-rate line from 12.5 % to 12.5 % - T/32000
    assert choose_ring_mode(1000, 9000, 128, 8) == "pass_q"
    assert choose_ring_mode(1000, 9000, 128, 8, **hw) == "pass_kv"  # 10 % >= 9.375 %
    assert choose_ring_mode(1000, 9667, 128, 8, **hw) == "pass_q"  # 9.37 % < 9.375 %
    for bad, rule in [
        (dict(new_tokens=0), "positive-sizes"),
        (dict(num_kv_heads=3), "gqa-group"),
        (dict(peak_flops=1e12), "ring-hardware"),
        (dict(cached_tokens=-1), "positive"),
    ]:
        args = dict(new_tokens=8, cached_tokens=8, num_q_heads=8, num_kv_heads=2) | bad
        with pytest.raises(ValueError, match=rf"\[{rule}"):
            choose_ring_mode(**args)


def test_layout_places_context_interleaved():
    shards = RingShards((6, 3), (10, 0), 2, cp_kv_cache_interleave_size=2)
    assert [p.tolist() for p in shards.context_positions(0)] == [[0, 1, 4, 5, 8, 9], []]
    assert [shards.num_context(r) for r in (0, 1)] == [6, 4]
    assert [shards.kv_rows(r) for r in (0, 1)] == [6 + 3, 4 + 6]  # context + real new rows


def both_modes(ctx, **kw):
    """Both rings in one launch (torchrun starts are slow on a busy machine)."""
    return [ring_prefill_rank(ctx, mode=m, **kw) for m in ("pass_kv", "pass_q")]


@pytest.mark.torchrun
@pytest.mark.slow
def test_torchrun_matches_inline():
    cfg = ParallelConfig(num_q_heads=4, num_kv_heads=2, head_dim=16)
    kw = dict(seq_lens=(45, 16, 1), context_lens=(20, 0, 7), parallel_config=cfg)
    inline = run(both_modes, 3, report=False, fn_kwargs=kw)
    real = run(both_modes, 3, backend="torchrun", dist_backend="gloo", report=False, fn_kwargs=kw)
    assert real.dist_backend == "gloo"
    for a, b in zip(inline, real):
        for x, y in zip(a, b):
            assert y["max_abs_err"] <= 1e-10 and y["comm"] == y["expected"] == x["comm"]
    assert inline.stdout == real.stdout
    assert [list(t) for t in inline.traces] == [list(t) for t in real.traces]
