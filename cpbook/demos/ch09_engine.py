"""Chapter 9's harness around the engine: every valid grid of a model as
:func:`~cpbook.engine.engine.serve_rank` keyword sets (:func:`grid_runs`), one launch that serves
them all (:func:`serve_grid_rank`), the capacity count of long requests
(:func:`max_concurrent_long_requests`), and which layouts vLLM v0.34 itself runs
(:func:`vllm_runs_layout`), and one engine step seen from every rank (:func:`engine_step_rank`)."""

from __future__ import annotations

from typing import Any, Sequence

from cpbook.core.config import ParallelConfig
from cpbook.core.context import RankContext
from cpbook.core.errors import RuleError
from cpbook.engine.config import (
    CacheConfig,
    RunnerConfig,
    SchedulerConfig,
    ServeWorkload,
    config_of,
)
from cpbook.engine.engine import Engine, make_prompts, serve_rank, valid_grid
from cpbook.engine.models import ENGINE_MODELS
from cpbook.engine.scheduler import Request, Scheduler
from cpbook.kv.layout import token_owner
from cpbook.kv.manager import KVCacheManager

__all__ = [
    "engine_step_rank",
    "grid_runs",
    "run_world",
    "max_concurrent_long_requests",
    "serve_grid_rank",
    "vllm_runs_layout",
]


def grid_runs(
    models: Sequence[str] = ("tiny-gqa", "tiny-mla"), max_world: int = 8, **kwargs: Any
) -> list[dict[str, Any]]:
    """:func:`serve_rank` keyword sets for every valid grid of every model (:func:`valid_grid`),
    alternating the DCP combine and the prefill strategy so both of each run: even entries
    ``ag_rs`` + the selector (``auto``), odd ones ``a2a`` + AllGather-Q forced.  ``kwargs`` are
    further :func:`serve_rank` keywords (``workload``, ``cache_config``, ...) shared by all;
    a ``runner_config`` dict there is completed with each run's ``strategy``."""
    runs = []
    for model in models:
        for i, (tp, dcp, pcp) in enumerate(valid_grid(model, max_world=max_world)):
            parallel = dict(
                tensor_parallel_size=tp,
                decode_context_parallel_size=dcp,
                prefill_context_parallel_size=pcp,
                dcp_comm_backend=("ag_rs", "a2a")[i % 2],
            )
            runner = {**kwargs.get("runner_config", {}), "strategy": ("auto", "allgather_q")[i % 2]}
            runs.append(
                {**kwargs, "model": model, "parallel_config": parallel, "runner_config": runner}
            )
    return runs


def run_world(run: dict[str, Any]) -> int:
    """The world size a :func:`serve_rank` keyword set needs: ``tp * pcp`` of its
    ``parallel_config`` (a dict of sizes or a :class:`ParallelConfig`)."""
    cfg = run.get("parallel_config") or {}
    if isinstance(cfg, ParallelConfig):
        return cfg.world_size
    return cfg.get("tensor_parallel_size", 1) * cfg.get("prefill_context_parallel_size", 1)


def vllm_runs_layout(
    model: str, decode_context_parallel_size: int, prefill_context_parallel_size: int
) -> bool:
    """Whether vLLM v0.34.0 runs this layout's model family (the sizes are valid by
    :func:`valid_grid`): PCP > 1 needs an MLA model, and PCP > 1 with DCP > 1 a *sparse* MLA
    model with the ``ag_rs`` combine (``PCPManager.validate_config`` in
    ``vllm/v1/worker/gpu/pcp_manager.py``, PR #56157).  The engine's models are GQA
    (``tiny-gqa``) and dense MLA (``tiny-mla``), so PCP x DCP is never vLLM's here."""
    if prefill_context_parallel_size == 1:
        return True
    return ENGINE_MODELS[model].use_mla and decode_context_parallel_size == 1


def max_concurrent_long_requests(
    config: ParallelConfig, num_kv_blocks: int, prompt_len: int, limit: int = 10_000
) -> int:
    """Admit distinct prompts of ``prompt_len`` tokens (1 new token each) into an empty cache of
    ``num_kv_blocks`` blocks per rank until the scheduler stops admitting; how many got in."""
    sched = Scheduler(
        KVCacheManager.from_config(config, num_kv_blocks),
        max_num_batched_tokens=limit * prompt_len,
        max_num_seqs=limit,
    )
    for i in range(limit):
        sched.add_request(Request(str(i), [i % 7] * prompt_len, 1))
    return len(sched.schedule().admitted)


def serve_grid_rank(ctx: RankContext, *, runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """:func:`serve_rank` for every run (a dict of its keyword arguments) whose grid fills this
    world (``tensor_parallel_size * prefill_context_parallel_size == world_size``), in order;
    one launch checks many configurations.  Logits and history are dropped from the results."""
    out = []
    for kw in runs:
        if run_world(kw) != ctx.world_size:
            continue
        res = serve_rank(ctx, **kw)
        res.pop("history")
        res["logits"] = None
        out.append(res)
    return out


STEP_PARALLEL = {"tensor_parallel_size": 4, "decode_context_parallel_size": 2}
STEP_SCHEDULER = {"max_num_batched_tokens": 16}
STEP_WORKLOAD = {"num_requests": 4, "max_new_tokens": 4}


def engine_step_rank(
    ctx: RankContext,
    *,
    model: str = "tiny-gqa",
    parallel_config: ParallelConfig | dict[str, Any] | None = None,
    scheduler_config: SchedulerConfig | dict[str, Any] | None = None,
    cache_config: CacheConfig | dict[str, Any] | None = None,
    runner_config: RunnerConfig | dict[str, Any] | None = None,
    workload: ServeWorkload | dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run an engine on this rank of a TP x DCP grid up to its first step that batches a decode
    with a prompt chunk, and return what that step was on this rank.  The defaults: TP 4 x DCP
    2 (:data:`STEP_PARALLEL`), a budget of 16 tokens per step (:data:`STEP_SCHEDULER`), 4
    requests of 4 new tokens (:data:`STEP_WORKLOAD`).

    ``record``: the step's :class:`~cpbook.engine.engine.StepRecord` (the scheduler's batch, the
    same on every rank); ``coords``: this rank's ``(tp_rank, dcp_rank)``; ``heads``: its query
    heads ``(start, stop)``; per scheduled chunk ``slots`` (its new tokens' slots in this rank's
    paged cache, ``-1`` where another DCP rank stores the token) and ``local_keys`` (the keys of
    the request this rank holds after the step, of ``keys``); ``comm``: the step's traced
    ``(op, group, bytes_sent)``; ``sampled``: the greedy token of each request that sampled.
    """
    eng = Engine(
        model,
        STEP_PARALLEL if parallel_config is None else parallel_config,
        scheduler_config=STEP_SCHEDULER if scheduler_config is None else scheduler_config,
        cache_config=cache_config,
        runner_config=runner_config,
        ctx=ctx,
    )
    work = config_of(ServeWorkload, STEP_WORKLOAD if workload is None else workload)
    seed = eng.runner_config.seed
    for p in make_prompts(work.num_requests, seed, eng.model.config.vocab_size):
        eng.add_request(p, work.max_new_tokens)
    reqs = eng.scheduler.requests
    while True:
        first, before = len(ctx.trace), {rid: len(r.output) for rid, r in reqs.items()}
        rec = eng.step()
        kinds = {c[1] for c in rec.chunks}
        if "decode" in kinds and kinds != {"decode"}:
            break
        if not eng.has_unfinished:
            raise RuleError(
                "engine-step-mixed",
                "a step batching a decode with a prompt chunk",
                steps=len(eng.history),
                max_num_batched_tokens=eng.scheduler_config.max_num_batched_tokens,
            )
    cache, c = eng.runner.caches[0], eng.groups.coords
    chunks = []
    for rid, kind, start, n in rec.chunks:
        table = eng.kv.block_table(rid)
        slots = cache.slot_mapping(list(range(start, start + n)), table).tolist()
        keys = start + n
        local = int(
            (token_owner(list(range(keys)), cache.dcp, cache.interleave) == c.dcp_rank).sum()
        )
        chunks.append(dict(request_id=rid, kind=kind, slots=slots, keys=keys, local_keys=local))
    sampled = {rid: r.output[-1] for rid, r in reqs.items() if len(r.output) > before[rid]}
    heads = eng.runner.heads
    return {
        "record": rec,
        "coords": (c.tp_rank, c.dcp_rank),
        "heads": (heads.start, heads.stop),
        "chunks": chunks,
        "comm": [(r.op, r.group, r.bytes_sent) for r in ctx.trace[first:]],
        "sampled": sampled,
    }
