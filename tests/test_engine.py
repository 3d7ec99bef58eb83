"""cpbook.engine.engine: token-exact greedy serving on one rank and on TP x DCP x PCP grids."""

from __future__ import annotations

import json

import pytest
import torch

from cpbook.core.backends import SimWorld
from cpbook.core.config import ConfigError
from cpbook.core.context import RankContext
from cpbook.core.launch import run
from cpbook.demos.ch09_engine import (
    grid_runs,
    max_concurrent_long_requests,
    run_world,
    serve_grid_rank,
)
from cpbook.engine.config import CacheConfig, RunnerConfig, SchedulerConfig
from cpbook.engine.engine import (
    Engine,
    engine_config,
    load_model,
    make_prompts,
    model_config,
    serve_rank,
    valid_grid,
)
from cpbook.engine.models import TinyModel, reference_generate

WORK = dict(num_requests=6, max_new_tokens=6)
SMALL = dict(num_requests=4, max_new_tokens=4)


def sizes(run_kwargs: dict) -> tuple[int, int, int]:
    """``(tp, dcp, pcp)`` of a :func:`grid_runs` entry."""
    p = run_kwargs["parallel_config"]
    return (
        p["tensor_parallel_size"],
        p["decode_context_parallel_size"],
        p["prefill_context_parallel_size"],
    )


MAX_STEPS = 200  # cap for hand-driven engine loops (test_step_api_... finishes in 11 steps)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def references(work: dict) -> dict[str, list[list[int]]]:
    out = {}
    for name in ("tiny-gqa", "tiny-mla"):
        m = TinyModel.from_name(name)
        prompts = make_prompts(work["num_requests"], 0, m.config.vocab_size)
        out[name] = [reference_generate(m, p, work["max_new_tokens"]) for p in prompts]
    return out


@pytest.fixture(scope="module")
def refs() -> dict[str, list[list[int]]]:
    return references(WORK)


def check_grid(runs: list[dict], worlds: list[int], backend: str, refs: dict) -> int:
    """Run every run of each world in one launch; every rank's tokens equal the reference."""
    checked = 0
    for world in worlds:
        res = run(
            serve_grid_rank, world, backend, {"runs": runs}, dist_backend="gloo", report=False
        )
        mine = [r for r in runs if run_world(r) == world]
        assert len(res[0]) == len(mine)
        for j, r in enumerate(res[0]):
            for rank in res:
                assert rank[j]["tokens"] == refs[r["model"]], (
                    world,
                    r["model"],
                    r["tp"],
                    r["dcp"],
                    r["pcp"],
                )
            assert all(e is None for e in r["errors"])
            checked += 1
    return checked


def test_the_grid_from_the_issue():
    assert valid_grid("tiny-gqa") == [
        (1, 1, 1),
        (1, 1, 2),
        (1, 2, 2),
        (2, 1, 1),
        (2, 1, 2),
        (2, 2, 2),
        (4, 1, 1),
        (4, 2, 1),
        (4, 1, 2),
        (4, 2, 2),
    ]
    assert len(valid_grid("tiny-mla")) == 13
    assert (4, 2, 1) in valid_grid("tiny-gqa") and (2, 2, 1) in valid_grid("tiny-mla")


def test_one_rank_logits_match_the_reference_to_1e10():
    """Paged KV, continuous batching, chunked prefill, prefix caching and preemption all happen,
    and every sampled logits row equals the contiguous-cache reference's (float64)."""
    for name in ("tiny-gqa", "tiny-mla"):
        res = run(serve_rank, 1, "inline", {"model": name, "workload": WORK}, report=False)[0]
        m = TinyModel.from_name(name)
        assert res["preemptions"] >= 1 and res["prefix_hit_tokens"] > 0
        kinds = {k for rec in res["history"] for _, k, _, _ in rec.chunks}
        assert kinds == {"prefill", "chunked_prefill", "decode"}
        for p, toks, logits in zip(res["prompts"], res["tokens"], res["logits"]):
            ref, ref_logits = reference_generate(m, p, WORK["max_new_tokens"], True)
            assert toks == ref
            assert (logits - ref_logits).abs().max().item() <= 1e-10


def test_inline_grid_subset(refs):
    """One DCP layout per kind: inside TP (GQA 4x2x1), over PCP (GQA 1x2x2), MLA inside TP
    (2x2x1) and over the whole world (2x4x2).  All 23 layouts run inline in
    notebooks/09_engine.ipynb, which nbval re-executes."""
    pick = {
        ("tiny-gqa", 1, 2, 2),
        ("tiny-mla", 2, 2, 1),
        ("tiny-gqa", 4, 2, 1),
        ("tiny-mla", 2, 4, 2),
    }
    runs = [r for r in grid_runs(workload=WORK) if (r["model"], *sizes(r)) in pick]
    assert check_grid(runs, [2, 4], "inline", refs) == 4


@pytest.mark.torchrun
def test_torchrun_world_2_subset():
    runs = [
        r
        for r in grid_runs(workload=SMALL)
        if (r["model"], *sizes(r)) in {("tiny-gqa", 1, 2, 2), ("tiny-mla", 2, 2, 1)}
    ]
    assert check_grid(runs, [2], "torchrun", references(SMALL)) == 2


@pytest.mark.torchrun
@pytest.mark.slow
def test_torchrun_full_grid():
    """Every valid TP x DCP x PCP configuration of both models, one launch per world size."""
    assert check_grid(grid_runs(workload=SMALL), [2, 4, 8], "torchrun", references(SMALL)) == 21


def test_dcp4_admits_4x_the_long_requests():
    """Same blocks per rank (64 of 4 slots); requests of 64 tokens: 4 fit, 16 under DCP 4."""
    one = max_concurrent_long_requests(engine_config("tiny-mla", 4, 1), 64, 63)
    four = max_concurrent_long_requests(engine_config("tiny-mla", 4, 4), 64, 63)
    assert (one, four) == (4, 16)


def test_step_api_and_a_request_longer_than_the_cache():
    eng = Engine(
        "tiny-gqa",
        cache_config=CacheConfig(num_gpu_blocks=12),
        scheduler_config=SchedulerConfig(max_num_batched_tokens=16),
    )
    prompts = make_prompts(3, 1)
    ids = [eng.add_request(p, 4) for p in prompts]
    too_long = eng.add_request(list(range(60)), 4)
    first = eng.step()
    assert first.num_batched_tokens <= 16 and first.admitted
    for _ in range(MAX_STEPS):  # a livelock (e.g. leaked blocks) fails here, never hangs
        if not eng.has_unfinished:
            break
        eng.step()
    else:
        pytest.fail(f"requests unfinished after {MAX_STEPS} steps: {eng.history[-1]}")
    bad = eng.output(too_long)
    assert bad.tokens == () and "[request-fits-cache]" in bad.error
    for rid, p in zip(ids, prompts):
        assert list(eng.output(rid).tokens) == reference_generate(eng.model, p, 4)


def test_invalid_config_and_wrong_world_fail_before_any_collective():
    """Rank 0 of a 2-rank world alone: a collective would time out; the errors come first."""
    ctx = RankContext(0, 2, "inline", torch.device("cpu"), timeout=5.0, sim=SimWorld(2, 5.0))
    with pytest.raises(ConfigError, match=r"^\[gqa-dcp-needs-replicated-kv\]"):
        serve_rank(
            ctx,
            parallel_config={"tensor_parallel_size": 2, "decode_context_parallel_size": 2},
        )
    with pytest.raises(ConfigError, match=r"^\[grid-matches-world\]"):
        serve_rank(ctx, parallel_config={"tensor_parallel_size": 4})
    assert len(ctx.trace) == 0
    with pytest.raises(ConfigError, match=r"^\[known-model\]"):
        engine_config("tiny-moe")


def test_engine_is_deterministic_across_strategies():
    outs = []
    for strategy in ("allgather_q", "allgather_kv"):
        eng = Engine(
            "tiny-mla",
            cache_config=CacheConfig(num_gpu_blocks=32),
            runner_config=RunnerConfig(strategy=strategy),
        )
        outs.append([o.tokens for o in eng.generate(make_prompts(4, 2), 3)])
        assert dict(eng.runner.strategies).keys() == {strategy}
    assert outs[0] == outs[1]
    assert torch.get_default_dtype() == torch.float32  # the engine did not change it


def test_serve_cli_json_and_errors(capsys):
    from cpbook.__main__ import main

    assert (
        main(
            [
                "serve",
                "--model",
                "tiny-mla",
                "--tp",
                "2",
                "--dcp",
                "2",
                "--requests",
                "3",
                "--max-new-tokens",
                "3",
                "--json",
            ]
        )
        == 0
    )
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x["name"] for x in lines] == ["request"] * 3 + ["engine_summary"]
    ref = reference_generate(TinyModel.from_name("tiny-mla"), make_prompts(3, 0)[1], 3)
    assert lines[1]["tokens"] == ref and lines[1]["prompt_len"] == len(make_prompts(3, 0)[1])
    assert {
        "model",
        "tp",
        "dcp",
        "pcp",
        "steps",
        "tokens_per_s",
        "prefix_hit_tokens",
        "preemptions",
    } <= set(lines[-1])
    assert main(["serve", "--model", "tiny-gqa", "--tp", "2", "--dcp", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("cpbook: error: [gqa-dcp-needs-replicated-kv] requires")


@pytest.mark.torchrun
@pytest.mark.slow
def test_serve_under_torchrun_and_a_world_mismatch():
    """``torchrun -m cpbook serve``: rank 0 prints the JSON lines; a world that is not
    ``tp * pcp`` stops with the rule before any collective."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def serve(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node=2",
                "-m",
                "cpbook",
                "serve",
                "--dist-backend",
                "gloo",
                *args,
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )

    ok = serve(
        "--model",
        "tiny-mla",
        "--tp",
        "1",
        "--dcp",
        "2",
        "--pcp",
        "2",
        "--requests",
        "3",
        "--max-new-tokens",
        "3",
        "--json",
    )
    assert ok.returncode == 0, ok.stderr[-2000:]
    lines = [json.loads(x) for x in ok.stdout.splitlines() if x.startswith("{")]
    assert [x["name"] for x in lines] == ["request"] * 3 + ["engine_summary"]
    assert lines[1]["tokens"] == reference_generate(
        TinyModel.from_name("tiny-mla"), make_prompts(3, 0)[1], 3
    )
    bad = serve("--model", "tiny-gqa", "--tp", "4", "--dcp", "2")
    assert bad.returncode != 0
    assert "cpbook: error: [grid-matches-world] requires tp * pcp == world_size" in bad.stderr


def test_configs_as_objects_or_dicts_and_their_rules():
    """A ParallelConfig of the model, or a dict of its sizes, builds the same engine; one of
    another model, or of another block size than the cache's, names its rule."""
    cfg = engine_config("tiny-gqa", 2, 1, 1)
    ctx = RankContext(0, 2, "inline", torch.device("cpu"), timeout=5.0, sim=SimWorld(2, 5.0))
    with pytest.raises(ConfigError, match=r"^\[config-matches-model\]"):
        Engine("tiny-mla", cfg, ctx=ctx)
    with pytest.raises(ConfigError, match=r"^\[block-size-agrees\]"):
        Engine("tiny-gqa", cfg, cache_config=CacheConfig(block_size=8), ctx=ctx)
    with pytest.raises(ConfigError, match=r"^\[positive-sizes\]"):
        SchedulerConfig(max_num_seqs=0)
    assert len(ctx.trace) == 0
    a = Engine("tiny-gqa", {"block_size": 4}, scheduler_config={"max_num_seqs": 2})
    b = Engine("tiny-gqa", engine_config("tiny-gqa"), scheduler_config=SchedulerConfig(2))
    assert a.config == b.config and a.scheduler.max_num_seqs == 2
    prompts = make_prompts(3, 4)
    assert [o.tokens for o in a.generate(prompts, 3)] == [o.tokens for o in b.generate(prompts, 3)]


def test_one_model_name_resolution(tmp_path):
    """An engine model name wins over a folder of that name; a folder without config.json
    and an unknown name name their rules."""
    assert load_model("tiny-mla").config == model_config("tiny-mla")
    with pytest.raises(ConfigError, match=r"^\[hf-folder\]"):
        model_config(str(tmp_path))
    with pytest.raises(ConfigError, match=r"^\[known-model\]"):
        load_model("tiny-moe")
