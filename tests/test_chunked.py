"""chunked, chunked_plan: AG-Q and AG-KV exact under PCP × DCP, bytes = formula, selector."""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cpbook.core.comm import comm_bytes
from cpbook.core.config import ConfigError, ParallelConfig
from cpbook.core.context import RankContext
from cpbook.core.groups import make_groups
from cpbook.core.launch import run
from cpbook.demos import demo_kwargs
from cpbook.demos.ch05_chunked import chunked_prefill_rank
from cpbook.kv.context import context_shard
from cpbook.pcp.chunked import (
    allgather_kv_attention,
    allgather_q_attention,
    chunked_prefill_attention,
)
from cpbook.pcp.chunked_plan import (
    STRATEGIES,
    ChunkedPrefillConfig,
    choose_strategy,
    chunked_comm_bytes,
    select_strategy,
)
from cpbook.pcp.zigzag import zigzag_partition


def _cfg(q: int, kv: int, d: int, pcp: int = 1, dcp: int = 1, tp: int = 1) -> ParallelConfig:
    """A chunked-prefill layout (AllGather-Q combines by ``a2a``, chapter 5's default)."""
    return ParallelConfig(
        tensor_parallel_size=tp,
        prefill_context_parallel_size=pcp,
        decode_context_parallel_size=dcp,
        num_q_heads=q,
        num_kv_heads=kv,
        head_dim=d,
        dcp_comm_backend="a2a",
    )


# (tp, pcp, dcp, num_q_heads, num_kv_heads, use_mla): every PCP × DCP pairing vLLM accepts with
# pcp in {1..4}, dcp in {1, 2, 4} (and dcp = pcp = 3), GQA with several KV heads, MQA, MLA
GRIDS = [
    (1, 1, 1, 4, 2, False),
    (2, 1, 2, 4, 1, False),
    (4, 1, 4, 8, 1, False),
    (4, 1, 2, 8, 2, False),
    (1, 2, 1, 4, 2, False),
    (2, 2, 1, 4, 2, False),
    (1, 2, 2, 4, 2, False),
    (2, 2, 2, 4, 1, False),
    (2, 2, 4, 4, 1, False),
    (1, 3, 1, 6, 3, False),
    (1, 3, 3, 6, 1, False),
    (2, 3, 1, 4, 2, False),
    (1, 4, 1, 4, 1, False),
    (1, 4, 4, 4, 2, False),
    (2, 2, 4, 4, 1, True),
    (1, 4, 4, 4, 1, True),
    (2, 1, 2, 4, 1, True),
    (2, 4, 1, 4, 1, True),
]


def _kwargs(grid, rng: random.Random, strategy: str, **over) -> dict:
    tp, pcp, dcp, hq, hkv, mla = grid
    block = rng.choice([2, 4, 8])
    il = rng.choice([d for d in (1, 2, 4) if block % d == 0])
    n = rng.randint(1, 3)
    ctx = [rng.choice([0, rng.randint(1, 3), rng.randint(0, 60)]) for _ in range(n)]
    chunk = [rng.choice([1, rng.randint(1, 2 * pcp), rng.randint(1, 30)]) for _ in range(n)]
    stripes = max(1, sum(c > 0 for c in ctx)) * dcp * il
    kw = dict(
        context_lens=tuple(ctx),
        query_lens=tuple(chunk),
        tensor_parallel_size=tp,
        prefill_context_parallel_size=pcp,
        decode_context_parallel_size=dcp,
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=12 if mla else rng.choice([4, 8]),
        v_head_dim=8 if mla else rng.choice([None, 6]),
        use_mla=mla,
        block_size=block,
        cp_kv_cache_interleave_size=il,
        strategy=strategy,
        workspace_size=rng.randint(stripes, 4 * stripes),
        dcp_comm_backend=rng.choice(["a2a", "ag_rs"]),
        seed=rng.randint(0, 2**31),
    )
    return kw | over


def _check(res, kw) -> None:
    """Exact on every rank, and every rank's trace equals the formula, call by call."""
    assert max(r["max_abs_err"] for r in res) <= 1e-10
    for r, trace in zip(res, res.traces):
        assert r["comm"] == r["expected"] == [(c.op, c.bytes_sent) for c in trace]
    # every context token is held by exactly one rank of each DCP group
    dcp = kw["decode_context_parallel_size"]
    held = [sum(r["context_rows"][i] for r in res) for i in range(len(kw["context_lens"]))]
    assert held == [c * len(res) // dcp for c in kw["context_lens"]]


def _cases(n: int, seed: int = 0):
    rng = random.Random(seed)
    return [_kwargs(GRIDS[i % len(GRIDS)], rng, STRATEGIES[i // len(GRIDS) % 2]) for i in range(n)]


@pytest.mark.parametrize(
    "kw",
    _cases(36),
    ids=lambda k: (
        "tp{tensor_parallel_size}-pcp{prefill_context_parallel_size}-"
        "dcp{decode_context_parallel_size}-{strategy}".format(**k)
    ),
)
def test_exact_and_bytes_match_formula(kw):
    world = kw["tensor_parallel_size"] * kw["prefill_context_parallel_size"]
    res = run(
        chunked_prefill_rank, world, fn_kwargs=demo_kwargs(chunked_prefill_rank, kw), report=False
    )
    _check(res, kw)
    assert {r["strategy"] for r in res} == {kw["strategy"]}


@settings(max_examples=25, deadline=None)
@given(
    grid=st.sampled_from(GRIDS),
    strategy=st.sampled_from([*STRATEGIES, "auto"]),
    seed=st.integers(0, 2**31),
)
def test_exact_on_random_batches(grid, strategy, seed):
    kw = _kwargs(grid, random.Random(seed), strategy)
    _check(
        run(
            chunked_prefill_rank,
            grid[0] * grid[1],
            fn_kwargs=demo_kwargs(chunked_prefill_rank, kw),
            report=False,
        ),
        kw,
    )


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_edge_cases(strategy):
    """No context at all, chunks shorter than 2·pcp (empty shards), one-token chunks behind a
    long context, a workspace of one stripe per request (many pieces), interleave = block."""
    rng = random.Random(1)
    for grid, over in [
        ((1, 4, 4, 4, 1, False), dict(context_lens=(0, 0), query_lens=(1, 7))),
        ((2, 2, 4, 4, 1, False), dict(context_lens=(50, 0, 3), query_lens=(1, 2, 3))),
        (
            (1, 3, 3, 6, 1, False),
            dict(
                context_lens=(61,), query_lens=(5,), workspace_size=3, cp_kv_cache_interleave_size=1
            ),
        ),
        (
            (1, 2, 2, 4, 2, False),
            dict(
                context_lens=(33, 17),
                query_lens=(9, 4),
                block_size=4,
                cp_kv_cache_interleave_size=4,
                workspace_size=16,
            ),
        ),
        (
            (2, 2, 4, 4, 1, True),
            dict(
                context_lens=(29,), query_lens=(3,), workspace_size=4, cp_kv_cache_interleave_size=1
            ),
        ),
    ]:
        kw = _kwargs(grid, rng, strategy, **over)
        res = run(
            chunked_prefill_rank,
            grid[0] * grid[1],
            fn_kwargs=demo_kwargs(chunked_prefill_rank, kw),
            report=False,
        )
        _check(res, kw)
        if strategy == "allgather_kv":  # the gathered context never exceeds the workspace
            assert all(r["stats"]["workspace_rows"] <= kw["workspace_size"] for r in res)


def test_degenerate_grids_move_nothing_they_need_not():
    base = dict(
        context_lens=(40, 9),
        query_lens=(10, 3),
        num_q_heads=4,
        num_kv_heads=1,
        head_dim=8,
        workspace_size=64,
    )
    for st_ in STRATEGIES:  # one rank: nothing to move
        assert chunked_comm_bytes(st_, (40, 9), (10, 3), _cfg(4, 1, 8), workspace_size=64) == []
    # dcp = 1 under PCP: the context is everywhere; AllGather-KV moves only the chunk's K/V
    kw = base | dict(prefill_context_parallel_size=2, decode_context_parallel_size=1)
    res = run(
        chunked_prefill_rank,
        2,
        fn_kwargs=demo_kwargs(chunked_prefill_rank, kw | dict(strategy="allgather_kv")),
        report=False,
    )
    rows = sum(-(-t // 4) * 4 for t in base["query_lens"]) // 2  # zigzag pads to 2·pcp
    assert res[0]["comm"] == [("all_gather", rows * 1 * (8 + 8) * 8)]
    assert res[0]["context_rows"] == [40, 9]
    # pcp = 1: the chunk is everywhere; AllGather-KV moves only context pieces over DCP
    kw = base | dict(
        tensor_parallel_size=2,
        prefill_context_parallel_size=1,
        decode_context_parallel_size=2,
        strategy="allgather_kv",
    )
    res = run(
        chunked_prefill_rank, 2, fn_kwargs=demo_kwargs(chunked_prefill_rank, kw), report=False
    )
    assert [(c.op, c.group) for c in res.traces[0]] == [("all_gather", "dcp")] * 2  # 2 pieces
    assert res[0]["stats"]["num_pieces"] == 2 and res[0]["max_abs_err"] <= 1e-10


def test_bytes_scale_as_the_article_says():
    """Q-side bytes never grow with the context; KV-side bytes grow with it; the selector
    gathers KV for long chunks on short contexts and Q for short chunks on long contexts."""
    cfg, kw = _cfg(8, 1, 64, pcp=2, dcp=2), dict(workspace_size=16384, elem_bytes=2)
    q = [
        comm_bytes(chunked_comm_bytes("allgather_q", [c], [1024], cfg, **kw))
        for c in (0, 4096, 65536)
    ]
    kv = [
        comm_bytes(chunked_comm_bytes("allgather_kv", [c], [1024], cfg, **kw))
        for c in (0, 4096, 65536)
    ]
    assert q[0] == q[1] == q[2] and kv[0] < kv[1] < kv[2]
    grid = [(t, c) for t in (256, 1024, 4096) for c in (0, 4096, 16384, 65536)]
    pick = {(t, c): choose_strategy(t, c, cfg).strategy for t, c in grid}
    assert pick[4096, 0] == "allgather_kv" and pick[256, 65536] == "allgather_q"
    for t, c in grid:  # monotone: more context favours Q, a longer chunk favours KV
        if pick[t, c] == "allgather_q":
            assert all(pick[t, c2] == "allgather_q" for c2 in (4096, 16384, 65536) if c2 > c)
            assert all(pick[t2, c] == "allgather_q" for t2 in (256, 1024) if t2 < t)
    choice = choose_strategy([256, 256], [0, 65536], cfg, alpha=1e-5, beta=1e-10)
    assert choice.seconds["allgather_q"] == pytest.approx(
        1e-5 * choice.calls["allgather_q"] + 1e-10 * choice.bytes["allgather_q"]
    )


def test_selector_ties_go_to_allgather_kv():
    """The documented tie rule (no combine afterwards): equal ``calls·α + bytes·β`` picks KV,
    whatever the link and the order of the plans; one byte less for Q picks Q."""
    same = [("all_gather", 1000), ("all_to_all", 24)]
    for plans in (
        {"allgather_q": same, "allgather_kv": same},
        {"allgather_kv": same, "allgather_q": same},
        {"allgather_q": [], "allgather_kv": []},
    ):
        for alpha, beta in ((None, None), (1.0, 0.0), (0.0, 1.0), (1e-5, 1e-10)):
            assert select_strategy(plans, alpha, beta).strategy == "allgather_kv"
    cheaper_q = {"allgather_q": [("all_gather", 1023)], "allgather_kv": [("all_gather", 1024)]}
    assert select_strategy(cheaper_q, 1.0, 1.0).strategy == "allgather_q"
    # chapter 5's exercise 2: 8 query heads, 1 KV head, D = Dv = 128, bf16, PCP = DCP = 2, a
    # chunk of 2,048 tokens after 14,400 cached: both send 4,210,688 B in 2 calls; one more
    # cached token and AllGather-Q sends less
    ex2 = _cfg(8, 1, 128, pcp=2, dcp=2)
    tie = choose_strategy(2048, 14400, ex2, workspace_size=16384)
    assert tie.bytes == {"allgather_q": 4210688, "allgather_kv": 4210688}
    assert tie.calls == {"allgather_q": 2, "allgather_kv": 2}
    assert tie.strategy == "allgather_kv"
    assert choose_strategy(2048, 14401, ex2, workspace_size=16384).strategy == "allgather_q"
    one = _cfg(8, 2, 16)
    assert choose_strategy(64, 100, one, elem_bytes=8).strategy == "allgather_kv"  # 0 s = 0 s


def test_auto_runs_what_the_selector_picks():
    ran = set()
    for ctx_len, chunk in ((200, 4), (0, 40)):  # a long context, then a long chunk
        kw = dict(
            context_lens=(ctx_len,),
            query_lens=(chunk,),
            num_q_heads=8,
            num_kv_heads=1,
            head_dim=8,
            workspace_size=64,
            strategy="auto",
        )
        res = run(
            chunked_prefill_rank, 2, fn_kwargs=demo_kwargs(chunked_prefill_rank, kw), report=False
        )
        cfg = _cfg(8, 1, 8, pcp=2, dcp=2)
        want = choose_strategy(chunk, ctx_len, cfg, workspace_size=64, elem_bytes=8).strategy
        assert res[0]["strategy"] == res[1]["strategy"] == want
        assert res[0]["max_abs_err"] <= 1e-10 and res[0]["comm"] == res[0]["expected"]
        ran.add(want)
    assert ran == set(STRATEGIES)


@pytest.mark.parametrize(
    "bad, rule",
    [
        (
            dict(num_q_heads=6, tensor_parallel_size=4, decode_context_parallel_size=4),
            "heads-divisible-by-tp",
        ),
        (
            dict(
                tensor_parallel_size=2,
                prefill_context_parallel_size=1,
                decode_context_parallel_size=2,
                num_kv_heads=2,
            ),
            "gqa-dcp-needs-replicated-kv",
        ),
        (
            dict(
                prefill_context_parallel_size=2,
                decode_context_parallel_size=4,
                tensor_parallel_size=2,
                num_kv_heads=1,
                strategy="ring",
            ),
            "chunked-strategy",
        ),
        (
            dict(prefill_context_parallel_size=3, decode_context_parallel_size=2),
            "pcp-dcp-combination",
        ),
        (dict(context_lens=(4, 4), query_lens=(3,)), "chunked-lens"),
        (dict(query_lens=(0,), context_lens=(4,)), "chunked-lens"),
    ],
)
def test_bad_input_rejected_before_any_collective(bad, rule):
    ctx = RankContext(0, 4, "inline", torch.device("cpu"))  # no world: a collective would fail
    kw = dict(prefill_context_parallel_size=2, decode_context_parallel_size=2) | bad
    with pytest.raises(ValueError, match=rf"\[{rule}\]"):
        chunked_prefill_rank(ctx, **demo_kwargs(chunked_prefill_rank, kw))
    assert len(ctx.trace) == 0


def _mismatch(ctx, case: str) -> tuple[str, int]:
    """Build a valid pcp = dcp = 2 rank, then hand a strategy one inconsistent input."""
    cfg = ParallelConfig(
        prefill_context_parallel_size=2,
        decode_context_parallel_size=2,
        tensor_parallel_size=ctx.world_size // 2,
        num_q_heads=4,
        num_kv_heads=1,
        head_dim=8,
    )
    groups = make_groups(ctx, cfg, "v0.14" if case == "layout" else "current")
    c = groups.coords
    meta = zigzag_partition((6,), 2 if case != "meta" else 1).metadata(
        c.pcp_rank if case != "meta" else 0
    )
    k_ctx = [torch.randn(10, 1, 8, dtype=torch.float64)]
    context = context_shard(
        k_ctx,
        [k_ctx[0].clone()],
        8,
        1 if case == "dcp" else 2,
        0 if case == "dcp" else c.dcp_rank,
        1,
    )
    rows = meta.num_tokens
    q = torch.randn(rows, 3 if case == "heads" else 4, 8, dtype=torch.float64)
    k = torch.randn(rows, 2 if case == "heads" else 1, 8, dtype=torch.float64)
    fn = {
        "meta": allgather_q_attention,
        "dcp": allgather_kv_attention,
        "heads": allgather_q_attention,
        "workspace": allgather_kv_attention,
        "strategy": chunked_prefill_attention,
        "layout": allgather_q_attention,
    }[case]
    configs = {
        "allgather_kv_attention": dict(workspace_size=1 if case == "workspace" else 64),
        "chunked_prefill_attention": dict(strategy="pass_q", workspace_size=64),
    }
    first = len(ctx.trace)
    try:
        config = ChunkedPrefillConfig(**configs.get(fn.__name__, {}))
        fn(q, k, k.clone(), context, meta, groups, config)
    except ConfigError as e:
        return e.rule, len(ctx.trace) - first
    return "", len(ctx.trace) - first


@pytest.mark.parametrize(
    "case, rule",
    [
        ("meta", "pcp-group-matches-metadata"),
        ("dcp", "dcp-group-matches-context"),
        ("heads", "gqa-group-divisible-by-kv-heads"),
        ("workspace", "workspace-fits-requests"),
        ("strategy", "chunked-strategy"),
        ("layout", "chunked-dcp-spans-pcp"),
    ],
)
def test_inconsistent_inputs_rejected_before_any_collective(case, rule):
    """(v0.14's DCP groups sit inside TP, so they cannot hold a PCP-split chunk's keys.)"""
    world = 4 if case == "layout" else 2
    res = run(_mismatch, world, fn_kwargs=dict(case=case), report=False)
    assert list(res) == [(rule, 0)] * world


@pytest.mark.torchrun
@pytest.mark.slow
@pytest.mark.parametrize(
    "strategy, grid",
    [
        ("allgather_q", dict(prefill_context_parallel_size=2, decode_context_parallel_size=2)),
        (
            "allgather_kv",
            dict(
                tensor_parallel_size=2,
                prefill_context_parallel_size=1,
                decode_context_parallel_size=2,
                cp_kv_cache_interleave_size=2,
                context_lens=(40, 0),
                query_lens=(3, 9),
            ),
        ),
    ],
)
def test_under_torchrun(strategy, grid):
    kw = dict(strategy=strategy) | grid
    res = run(
        chunked_prefill_rank,
        2,
        backend="torchrun",
        fn_kwargs=demo_kwargs(chunked_prefill_rank, kw),
        dist_backend="gloo",
        report=False,
    )
    assert res.dist_backend == "gloo"
    assert all(r["max_abs_err"] <= 1e-10 for r in res)
    for r, trace in zip(res, res.traces):
        assert r["comm"] == r["expected"] == [(c.op, c.bytes_sent) for c in trace]
