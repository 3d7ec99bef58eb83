"""The mini serving engine: scheduler + model runner + paged KV, on one rank or a TP×DCP×PCP grid.

:class:`Engine` is vLLM's ``LLMEngine`` in miniature.  Every rank of the grid builds the same
engine (same model weights from the seed, same deterministic
:class:`~cpbook.engine.scheduler.Scheduler`) and its own
:class:`~cpbook.engine.runner.ModelRunner`; a step is ``schedule -> execute -> update``.
``generate`` is greedy; the step API (``add_request``, ``step``) shows each step's batch.
``speculative_config`` (chapter 10) drafts ``k`` tokens per decode request before each step
(:mod:`cpbook.engine.spec_decode`), verifies them in the step and keeps the greedy-accepted
prefix, so the output equals the non-speculative engine's token for token.
:func:`serve_rank` is the per-rank function behind ``python -m cpbook serve``; chapter 9's grids
run it through :func:`cpbook.demos.ch09_engine.serve_grid_rank`, several configurations in one
launch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

import torch

from cpbook.core.backends import SimWorld
from cpbook.core.config import ConfigError, ParallelConfig
from cpbook.core.context import RankContext
from cpbook.core.errors import RuleError
from cpbook.core.groups import make_groups
from cpbook.engine.config import (  # noqa: F401  (engine_config ... re-exported here)
    CacheConfig,
    RunnerConfig,
    SchedulerConfig,
    ServeWorkload,
    config_of,
    engine_config,
    engine_parallel_config,
    load_model,
    model_config,
    request_fits_model,
    valid_grid,
)
from cpbook.engine.models import TinyModel
from cpbook.engine.runner import ModelRunner
from cpbook.engine.scheduler import ChunkKind, Request, Scheduler, SchedulerOutput
from cpbook.engine.spec_decode import SpeculativeConfig, make_proposer
from cpbook.kv.manager import KVCacheManager

__all__ = [
    "engine_config",
    "single_rank_context",
    "Engine",
    "StepRecord",
    "ChunkRecord",
    "RequestOutput",
    "make_prompts",
    "model_config",
    "load_model",
    "valid_grid",
    "serve_rank",
]


def single_rank_context(device: torch.device | str = "cpu") -> RankContext:
    """A one-rank inline context on ``device``, for an engine used directly (no launcher)."""
    return RankContext(0, 1, "inline", torch.device(device), sim=SimWorld(1))


class ChunkRecord(NamedTuple):
    """One scheduled chunk as the step's record keeps it."""

    request_id: str
    kind: ChunkKind
    start: int
    num_tokens: int


@dataclass(frozen=True)
class StepRecord:
    """What one step did: its :class:`ChunkRecord` list, admissions, preemptions, finished
    requests, batch size, free blocks after it, and the drafts it verified and accepted."""

    step: int
    chunks: tuple[ChunkRecord, ...]
    admitted: tuple[str, ...]
    preempted: tuple[str, ...]
    finished: tuple[str, ...]
    num_batched_tokens: int
    num_free_blocks: int
    drafted: int = 0
    accepted: int = 0


@dataclass(frozen=True)
class RequestOutput:
    """A request's result: its greedy tokens, or ``error`` (then ``tokens`` is empty)."""

    request_id: str
    prompt_len: int
    tokens: tuple[int, ...]
    error: str | None
    preemptions: int
    prefix_hit_tokens: int


class Engine:
    """Greedy generation with continuous batching, chunked prefill, prefix caching, preemption.

    ``Engine(model, parallel_config, scheduler_config=..., cache_config=...,
    speculative_config=..., runner_config=..., ctx=...)``, like vLLM's engine built from a
    ``VllmConfig``: ``model`` is a name of :data:`cpbook.engine.models.ENGINE_MODELS` (weights
    from ``runner_config.seed``), a Hugging Face model folder
    (:func:`cpbook.engine.hf.from_pretrained`, in ``runner_config.dtype``) or a
    :class:`TinyModel` (:func:`load_model`).  ``parallel_config`` is a
    :class:`~cpbook.core.config.ParallelConfig` of this model or a dict of its vLLM-named sizes
    (``tensor_parallel_size``, ``decode_context_parallel_size``, ...; ``None``: one rank), which
    the engine completes with the model's attention shape and ``cache_config.block_size``
    (:meth:`~cpbook.core.config.ParallelConfig.for_model`), so the two cannot disagree.  The
    other configs (:mod:`cpbook.engine.config`, and
    :class:`~cpbook.engine.spec_decode.SpeculativeConfig`) are instances or dicts of their
    fields; ``speculative_config``'s ``model`` is an engine model name (seeded ``seed + 1``) or a
    Hugging Face folder.  ``ctx`` is this rank's context (default: a single inline rank on the
    CPU; the weights, caches and every step's tensors live on ``ctx.device``).  Every rank of
    ``ctx``'s world must build the engine with the same arguments and drive it the same way.
    """

    def __init__(
        self,
        model: str | TinyModel,
        parallel_config: ParallelConfig | dict[str, Any] | None = None,
        *,
        scheduler_config: SchedulerConfig | dict[str, Any] | None = None,
        cache_config: CacheConfig | dict[str, Any] | None = None,
        speculative_config: SpeculativeConfig | dict[str, Any] | None = None,
        runner_config: RunnerConfig | dict[str, Any] | None = None,
        ctx: RankContext | None = None,
    ) -> None:
        spec = SpeculativeConfig.of(speculative_config)
        sched = config_of(SchedulerConfig, scheduler_config)
        cache = config_of(CacheConfig, cache_config)
        run = config_of(RunnerConfig, runner_config)
        model = load_model(model, run.dtype, run.seed)
        cfg = engine_parallel_config(model.config, parallel_config, cache)
        self.ctx = ctx or single_rank_context()
        self.model, self.config = model.to(self.ctx.device), cfg  # weights on the rank's device
        self.scheduler_config, self.cache_config, self.runner_config = sched, cache, run
        self.groups = make_groups(self.ctx, cfg)  # raises grid-matches-world before collectives
        self.kv = KVCacheManager.from_config(cfg, cache.num_gpu_blocks, cache.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, sched.max_num_batched_tokens, sched.max_num_seqs)
        self.runner = ModelRunner(self.model, cfg, self.groups, cache.num_gpu_blocks, run)
        self.speculative_config = spec
        draft = None
        if spec is not None and spec.method == "draft" and spec.model:
            draft = load_model(spec.model, run.dtype, run.seed + 1).to(self.ctx.device)
        self.proposer = (
            None if spec is None else make_proposer(spec, self.model, draft, cfg, self.groups)
        )
        self.logits: dict[str, list[torch.Tensor]] = {}
        self.history: list[StepRecord] = []
        self._next_id = 0

    def add_request(
        self, prompt: Sequence[int], max_new_tokens: int, request_id: str | None = None
    ) -> str:
        """Queue a prompt; returns its id.  A request too long for the model
        (:func:`~cpbook.engine.config.request_fits_model`) or the cache fails alone, before
        any step."""
        rid = request_id if request_id is not None else str(self._next_id)
        self._next_id += 1
        bad = [t for t in prompt if not 0 <= int(t) < self.model.config.vocab_size]
        if bad:
            raise ConfigError(
                "tokens-in-vocab",
                "0 <= token < vocab_size",
                token=bad[0],
                vocab_size=self.model.config.vocab_size,
            )
        refused = request_fits_model(self.model.config, len(prompt), max_new_tokens, rid)
        self.scheduler.add_request(
            Request(rid, [int(t) for t in prompt], max_new_tokens, error=refused)
        )
        self.logits[rid] = []
        return rid

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def _propose(self) -> None:
        """Draft up to ``k`` tokens for every decoding request (fewer near ``max_new_tokens``,
        so a step never emits more than the request still needs)."""
        k = self.speculative_config.num_speculative_tokens
        for req in self.scheduler.running:
            room = min(k, req.max_new_tokens - len(req.output) - 1)
            if req.prefill_done and room > 0:
                req.spec_token_ids = self.proposer.propose(req.request_id, req.all_tokens, room)

    def step(self) -> StepRecord:
        """Draft (with speculation), schedule, run and update one step, roll back rejected
        draft rows on this rank; returns what happened."""
        if self.proposer is not None:
            self._propose()
        out: SchedulerOutput = self.scheduler.schedule()
        sampled, rows = ({}, {}) if not out.chunks else self.runner.execute(out)
        upd = self.scheduler.update(out, sampled)
        for rid, n in upd.emitted.items():
            r = rows[rid]
            self.logits[rid].append(r if len(r) == n else r[:n])
        for rb in upd.rollbacks:
            self.runner.rollback(rb.block_table, rb.start, rb.end)
        for r in upd.finished:
            if self.proposer is not None:
                self.proposer.release(r.request_id)
        rec = StepRecord(
            out.step,
            tuple(ChunkRecord(c.request_id, c.kind, c.start, c.num_tokens) for c in out.chunks),
            out.admitted,
            out.preempted,
            tuple(r.request_id for r in upd.finished),
            out.num_batched_tokens,
            self.kv.num_free_blocks,
            upd.drafted,
            upd.accepted,
        )
        self.history.append(rec)
        return rec

    def output(self, request_id: str) -> RequestOutput:
        r = self.scheduler.requests[request_id]
        return RequestOutput(
            r.request_id,
            len(r.prompt),
            tuple(r.output),
            r.error,
            r.preemptions,
            r.prefix_hit_tokens,
        )

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int | Sequence[int],
        max_steps: int = 10_000,
        request_ids: Sequence[str] | None = None,
    ) -> list[RequestOutput]:
        """Greedy-generate ``max_new_tokens`` (one count, or one per prompt) for every prompt
        (all queued at once, named ``request_ids`` if given)."""
        news = (
            [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else max_new_tokens
        )
        names = request_ids or [None] * len(prompts)
        ids = [self.add_request(*a) for a in zip(prompts, news, names, strict=True)]
        for _ in range(max_steps):
            if not self.has_unfinished:
                break
            self.step()
        else:
            raise RuleError(
                "engine-progress", "finishing within max_steps steps", max_steps=max_steps
            )
        return [self.output(i) for i in ids]

    @property
    def prefix_hit_tokens(self) -> int:
        return self.kv.stats["hit_tokens"]

    @property
    def spec_metrics(self) -> dict[str, float]:
        """Drafted and accepted tokens, the acceptance rate (accepted / drafted) and the mean
        tokens emitted per decode (request, step): ``1 +`` accepted drafts, bonus included."""
        st = self.scheduler.spec_stats
        return {
            "drafted": st["drafted"],
            "accepted": st["accepted"],
            "acceptance_rate": st["accepted"] / st["drafted"] if st["drafted"] else 0.0,
            "mean_accepted_tokens": st["emitted"] / st["decode_steps"]
            if st["decode_steps"]
            else 0.0,
        }


def make_prompts(
    num_requests: int,
    seed: int = 0,
    vocab_size: int = 96,
    shared_prefix_len: int = 24,
    max_len: int = 48,
) -> list[list[int]]:
    """Deterministic prompts: mixed lengths (up to ``max_len``, some longer than one chunk of
    32 tokens); every third request starts with one shared prefix of ``shared_prefix_len``."""
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randint(vocab_size, (shared_prefix_len,), generator=gen).tolist()
    out = []
    for i in range(num_requests):
        n = int(torch.randint(3, max_len + 1, (1,), generator=gen))
        body = torch.randint(vocab_size, (n,), generator=gen).tolist()
        out.append(shared + body[: max(n - shared_prefix_len, 1)] if i % 3 == 0 else body)
    return out


def serve_rank(
    ctx: RankContext,
    *,
    model: str = "tiny-gqa",
    parallel_config: ParallelConfig | dict[str, Any] | None = None,
    scheduler_config: SchedulerConfig | dict[str, Any] | None = None,
    cache_config: CacheConfig | dict[str, Any] | None = None,
    speculative_config: SpeculativeConfig | dict[str, Any] | None = None,
    runner_config: RunnerConfig | dict[str, Any] | None = None,
    workload: ServeWorkload | dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Serve ``workload`` (a :class:`~cpbook.engine.config.ServeWorkload` or a dict of its
    fields; its default prompts are :func:`make_prompts` of ``num_requests``, seeded by the
    runner's ``seed``) greedily on this rank of the grid, on an :class:`Engine` of the given
    configs (``num_gpu_blocks`` defaults to 20 blocks per rank here).

    The configuration is validated (and the grid checked against the world size) before any
    collective.  Returns per-request ``tokens`` and the ``logits`` rows they came from, the
    step count, prefix-cache hits, preemptions, the prefill strategies used and this rank's
    traced ``comm`` (:func:`cpbook.timing.serve_timing` adds the wall time), and with
    ``speculative_config`` the engine's :attr:`Engine.spec_metrics` as ``spec``.  Exactness is
    checked by the caller against :func:`cpbook.engine.models.reference_generate` (a whole engine
    run has no closed-form byte count, so there is no ``expected`` list).
    """
    work = config_of(ServeWorkload, workload)
    with ctx.traced() as comm:
        eng = Engine(
            model,
            parallel_config,
            scheduler_config=scheduler_config,
            cache_config=cache_config
            if isinstance(cache_config, CacheConfig)
            else CacheConfig(**{"num_gpu_blocks": 20, **(cache_config or {})}),
            speculative_config=speculative_config,
            runner_config=runner_config,
            ctx=ctx,
        )
        prompts = work.prompts
        if prompts is None:
            prompts = make_prompts(
                work.num_requests, eng.runner_config.seed, eng.model.config.vocab_size
            )
        prompts = [list(map(int, p)) for p in prompts]
        outs = eng.generate(prompts, work.max_new_tokens, request_ids=work.request_ids)
    cfg = eng.config
    c = eng.groups.coords
    spec = eng.spec_metrics if eng.speculative_config is not None else None
    tail = (
        ""
        if spec is None
        else f"; acceptance {spec['acceptance_rate']:.2f}, "
        f"{spec['mean_accepted_tokens']:.2f} tokens per decode step"
    )
    print(
        f"{model} tp {cfg.tp} dcp {cfg.dcp} pcp {cfg.pcp}, rank {ctx.rank} (tp {c.tp_rank}, "
        f"pcp {c.pcp_rank}, dcp {c.dcp_rank}): {len(eng.history)} steps, "
        f"{eng.scheduler.num_preemptions} preemptions, {eng.prefix_hit_tokens} prefix-hit "
        f"tokens{tail}; request 0 -> {list(outs[0].tokens)}"
    )
    return {
        "model": model,
        "tp": cfg.tp,
        "dcp": cfg.dcp,
        "pcp": cfg.pcp,
        "rank": ctx.rank,
        "prompts": prompts,
        "tokens": [list(o.tokens) for o in outs],
        "errors": [o.error for o in outs],
        "logits": [
            torch.cat(eng.logits[o.request_id]) if eng.logits[o.request_id] else None for o in outs
        ],
        "dcp_comm_backend": cfg.dcp_comm_backend,
        "steps": len(eng.history),
        "prefix_hit_tokens": eng.prefix_hit_tokens,
        "preemptions": eng.scheduler.num_preemptions,
        "strategies": dict(eng.runner.strategies),
        "history": eng.history,
        "spec": spec,
        "comm": comm,
    }
