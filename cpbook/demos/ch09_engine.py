"""Chapter 9's harness around the engine: every valid grid of a model as
:func:`~cpbook.engine.engine.serve_rank` keyword sets (:func:`grid_runs`), one launch that serves
them all (:func:`serve_grid_rank`), the capacity count of long requests
(:func:`max_concurrent_long_requests`), and which layouts vLLM v0.33 itself runs
(:func:`vllm_runs_layout`)."""

from __future__ import annotations

from typing import Any, Sequence

from cpbook.core.config import ParallelConfig
from cpbook.core.context import RankContext
from cpbook.engine.engine import serve_rank, valid_grid
from cpbook.engine.models import ENGINE_MODELS
from cpbook.engine.scheduler import Request, Scheduler
from cpbook.kv.manager import KVCacheManager

__all__ = ["grid_runs", "max_concurrent_long_requests", "serve_grid_rank", "vllm_runs_layout"]


def grid_runs(
    models: Sequence[str] = ("tiny-gqa", "tiny-mla"), max_world: int = 8, **kwargs: Any
) -> list[dict[str, Any]]:
    """:func:`serve_rank` keyword sets for every valid grid of every model (:func:`valid_grid`),
    alternating the DCP combine and the prefill strategy so both of each run: even entries
    ``ag_rs`` + the selector (``auto``), odd ones ``a2a`` + AllGather-Q forced."""
    runs = []
    for model in models:
        for i, (tp, dcp, pcp) in enumerate(valid_grid(model, max_world=max_world)):
            runs.append(
                dict(
                    model=model,
                    tensor_parallel_size=tp,
                    decode_context_parallel_size=dcp,
                    prefill_context_parallel_size=pcp,
                    dcp_comm_backend=("ag_rs", "a2a")[i % 2],
                    strategy=("auto", "allgather_q")[i % 2],
                    **kwargs,
                )
            )
    return runs


def vllm_runs_layout(
    model: str, decode_context_parallel_size: int, prefill_context_parallel_size: int
) -> bool:
    """Whether vLLM v0.33.0 runs this layout's model family (the sizes are valid by
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
        if (
            kw.get("tensor_parallel_size", 1) * kw.get("prefill_context_parallel_size", 1)
            != ctx.world_size
        ):
            continue
        res = serve_rank(ctx, **kw)
        res.pop("history")
        res["logits"] = None
        out.append(res)
    return out
