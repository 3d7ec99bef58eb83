"""The mini engine's scheduler: continuous batching, chunked prefill, prefix caching, preemption.

One :meth:`Scheduler.schedule` call builds one engine step, in vLLM V1's order
(``vllm/v1/core/sched/scheduler.py``): first the *running* requests (a decode token each, or the
next chunk of an unfinished prefill), then *waiting* requests in arrival order, while the
step's token budget (``max_num_batched_tokens``), the sequence cap (``max_num_seqs``) and the
free KV blocks last.  Blocks come from :class:`~cpbook.kv.manager.KVCacheManager` (virtual
blocks of ``block_size * dcp`` tokens, prefix caching).  Simplifications, stated:

* a request's whole prompt gets its blocks when it is admitted (vLLM allocates chunk by chunk),
  then one block at a time as it decodes;
* a cached prefix block is reused only once its K/V has been written (vLLM caches a block only
  when it is full of computed tokens); a request whose prefix is still being computed waits;
* when a running request needs a block and none is free, the most recently admitted running
  request is preempted: its blocks are freed and it goes back to the head of the queue, to be
  recomputed (vLLM's ``RECOMPUTE``) — its prompt and the tokens it already produced;
* a request that could never fit (prompt + ``max_new_tokens`` over the whole cache) fails alone,
  with an error naming the rule; every other request is served;
* speculative decoding (chapter 10): a decode request's ``spec_token_ids`` (set by the engine's
  drafter) ride in its decode chunk after the last sampled token, so the chunk verifies
  ``1 + k`` rows; :meth:`Scheduler.update` keeps the greedy-accepted prefix plus the bonus token
  (:func:`~cpbook.engine.spec_decode.greedy_accept`) and rolls the rest back: the manager is
  truncated to the accepted length (:meth:`~cpbook.kv.manager.KVCacheManager.truncate`: blocks a
  rejected row opened are freed, no prefix hash names rejected tokens), and the rejected
  positions are returned (:class:`SchedulerUpdate`'s ``rollbacks``) for the runner to
  invalidate on every rank.

The scheduler is pure Python and deterministic: every rank runs the same one and reaches the
same decision without communicating (vLLM schedules on one process and broadcasts instead).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import StrEnum
from typing import NamedTuple

from cpbook.core.config import ConfigError, check_positive
from cpbook.engine.spec_decode import greedy_accept
from cpbook.kv.layout import num_virtual_blocks
from cpbook.kv.manager import AllocationError, KVCacheManager

__all__ = [
    "RequestStatus",
    "ChunkKind",
    "Request",
    "ScheduledChunk",
    "SchedulerOutput",
    "Rollback",
    "SchedulerUpdate",
    "Scheduler",
]


class RequestStatus(StrEnum):
    """Where a request is (vLLM's ``RequestStatus``, fewer states)."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ERROR = "error"


class ChunkKind(StrEnum):
    """What a scheduled chunk does: ``decode`` (the last sampled token and any drafts),
    ``prefill`` (the whole remaining prompt) or ``chunked_prefill`` (a part of it)."""

    DECODE = "decode"
    PREFILL = "prefill"
    CHUNKED_PREFILL = "chunked_prefill"


@dataclass
class Request:
    """One generation request and its progress (vLLM's ``Request``)."""

    request_id: str
    prompt: list[int]
    max_new_tokens: int
    output: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    error: str | None = None
    prefill_done: bool = False
    preemptions: int = 0
    prefix_hit_tokens: int = 0
    spec_token_ids: list[int] = field(default_factory=list)  # drafts for the next decode step

    @property
    def all_tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def tokens_with_spec(self) -> list[int]:
        return self.prompt + self.output + self.spec_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    def token_slice(self, start: int, end: int) -> list[int]:
        """``tokens_with_spec[start:end]`` without building the whole list."""
        n = len(self.prompt)
        if start >= n and not self.spec_token_ids:  # a decode step: output tokens only
            return self.output[start - n : end - n]
        out: list[int] = []
        for part in (self.prompt, self.output, self.spec_token_ids):
            if start < len(part) and end > 0:
                out.extend(part[max(start, 0) : end])
            start, end = start - len(part), end - len(part)
        return out


@dataclass(frozen=True)
class ScheduledChunk:
    """Tokens ``[start, start + num_tokens)`` of one request in this step.

    ``kind``: a :class:`ChunkKind` (``decode``: the last sampled token after a finished
    prefill, then any draft tokens; ``prefill``: the whole remaining prompt in one chunk;
    ``chunked_prefill``: a part of it).  ``sample``: the chunk reaches the request's last
    token, so its last row (a decode chunk: every row) yields a token.
    """

    request_id: str
    kind: ChunkKind
    start: int
    token_ids: tuple[int, ...]
    block_table: tuple[int, ...]
    sample: bool

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class SchedulerOutput:
    """One step: decode chunks first, then prefill chunks (vLLM's batch reorder)."""

    step: int
    chunks: tuple[ScheduledChunk, ...]
    admitted: tuple[str, ...]
    preempted: tuple[str, ...]

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Rollback(NamedTuple):
    """Rejected draft rows of one request: positions ``[start, end)`` under ``block_table``,
    for every rank's runner to invalidate."""

    request_id: str
    block_table: tuple[int, ...]
    start: int
    end: int


@dataclass(frozen=True)
class SchedulerUpdate:
    """What :meth:`Scheduler.update` did with one step's samples: the requests that
    ``finished``, the tokens each sampling request gained (``emitted``), the ``rollbacks`` of
    rejected drafts, and the step's ``drafted`` / ``accepted`` draft counts."""

    finished: tuple[Request, ...]
    emitted: dict[str, int]
    rollbacks: tuple[Rollback, ...]
    drafted: int = 0
    accepted: int = 0


class Scheduler:
    """FCFS continuous batching over one :class:`KVCacheManager` (the DCP group's block ids)."""

    def __init__(
        self, kv_manager: KVCacheManager, max_num_batched_tokens: int = 32, max_num_seqs: int = 8
    ) -> None:
        check_positive(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs)
        self.kv = kv_manager
        self.max_num_batched_tokens, self.max_num_seqs = max_num_batched_tokens, max_num_seqs
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.written: set[int] = set()  # block ids whose whole virtual block holds computed K/V
        self.step_count = 0
        self.num_preemptions = 0
        self.spec_stats = {"decode_steps": 0, "drafted": 0, "accepted": 0, "emitted": 0}

    # -- requests ---------------------------------------------------------------------------
    def add_request(self, request: Request) -> Request:
        """Queue ``request``; one that arrives refused (``error`` set) or can never fit the cache
        is failed at once (status ``"error"``, rule ``request-fits-cache``), the others are
        unaffected."""
        if request.request_id in self.requests:
            raise ConfigError(
                "new-request-id", "a request id not already added", request_id=request.request_id
            )
        check_positive(prompt_len=len(request.prompt), max_new_tokens=request.max_new_tokens)
        self.requests[request.request_id] = request
        if request.error is not None:  # refused by the engine (the model's positions)
            request.status = "error"
            return request
        total = len(request.prompt) + request.max_new_tokens
        need = num_virtual_blocks(total, self.kv.block_size, self.kv.dcp)
        if need > self.kv.num_blocks:
            request.status = RequestStatus.ERROR
            request.error = str(
                AllocationError(
                    "request-fits-cache",
                    "prompt + max_new_tokens within the whole KV cache",
                    request_id=request.request_id,
                    tokens=total,
                    blocks_needed=need,
                    num_blocks=self.kv.num_blocks,
                )
            )
            return request
        self.waiting.append(request)
        return request

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step ---------------------------------------------------------------------------
    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        blocks = self.kv.block_ids(req.request_id)
        self.kv.free(req.request_id)
        self.kv.uncache([b for b in blocks if b not in self.written and not self.kv.ref_cnt[b]])
        req.status, req.num_computed_tokens = RequestStatus.WAITING, 0
        req.prefill_done = False
        req.spec_token_ids = []
        req.preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _grow(self, req: Request, upto: int) -> None:
        """Make the manager hold ``upto`` tokens of ``req`` (raises AllocationError)."""
        have = self.kv.num_tokens(req.request_id)
        if upto > have:
            new = self.kv.append(req.request_id, upto - have, req.token_slice(have, upto))
            self.written.difference_update(new)

    def _chunk(self, req: Request, n: int) -> ScheduledChunk:
        start = req.num_computed_tokens
        end = start + n
        kind = (
            ChunkKind.DECODE
            if req.prefill_done
            else ChunkKind.PREFILL
            if end == req.num_tokens and start == req.prefix_hit_tokens
            else ChunkKind.CHUNKED_PREFILL
        )
        return ScheduledChunk(
            req.request_id,
            kind,
            start,
            tuple(req.token_slice(start, end)),
            self.kv.block_ids(req.request_id),
            end >= req.num_tokens,
        )

    def schedule(self) -> SchedulerOutput:
        """Pick this step's chunks within the token budget; admit, and preempt if needed."""
        budget, chunks, preempted, admitted = self.max_num_batched_tokens, [], [], []
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            todo = req.num_tokens - req.num_computed_tokens
            n = min(todo + (len(req.spec_token_ids) if req.prefill_done else 0), budget)
            while True:
                try:
                    self._grow(req, req.num_computed_tokens + n)
                    break
                except AllocationError:
                    victim = self.running[-1]
                    self._preempt(victim)
                    preempted.append(victim.request_id)
                    if victim is req:
                        break
            if req.status is not RequestStatus.RUNNING:
                continue
            chunks.append(self._chunk(req, n))
            budget -= n
            i += 1
        while (
            self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted
        ):  # vLLM admits nobody in a step that preempted
            req = self.waiting[0]
            tokens = req.all_tokens
            if any(b not in self.written for b in self.kv.cached_prefix(tokens)):
                break  # its cached prefix is still being computed: wait for it
            try:
                hit = self.kv.allocate(req.request_id, len(tokens), tokens)
            except AllocationError:
                break
            self.written.difference_update(self.kv.block_ids(req.request_id)[hit.num_blocks :])
            self.waiting.popleft()
            req.status, req.num_computed_tokens = RequestStatus.RUNNING, hit.num_tokens
            req.prefix_hit_tokens = hit.num_tokens
            self.running.append(req)
            admitted.append(req.request_id)
            n = min(len(tokens) - hit.num_tokens, budget)
            chunks.append(self._chunk(req, n))
            budget -= n
        self.step_count += 1
        chunks.sort(key=lambda c: c.kind is not ChunkKind.DECODE)
        return SchedulerOutput(self.step_count, tuple(chunks), tuple(admitted), tuple(preempted))

    def update(self, out: SchedulerOutput, sampled: dict[str, int | list[int]]) -> SchedulerUpdate:
        """Advance every scheduled request by its chunk and append its sampled tokens; returns
        a :class:`SchedulerUpdate` (the finished requests' blocks are freed).

        ``sampled[id]``: the greedy token of each row of a decode chunk (of the last row of a
        prefill chunk); a bare ``int`` is one row.  A decode chunk keeps :func:`greedy_accept`
        of its drafts; its rejected rows are truncated from the manager and returned as
        :class:`Rollback` records."""
        finished, rollbacks, emitted = [], [], {}
        drafted = accepted = 0
        vb = self.kv.virtual_block_size
        rows = {k: [v] if isinstance(v, int) else list(v) for k, v in sampled.items()}
        for c in out.chunks:
            req = self.requests[c.request_id]
            new = rows.get(c.request_id, [])[-1:]
            decode = c.kind is ChunkKind.DECODE
            if decode:
                drafts = list(c.token_ids[1:])
                new = greedy_accept(drafts, rows[c.request_id])
                drafted += len(drafts)
                accepted += len(new) - 1
                st = self.spec_stats
                st["decode_steps"] += 1
                st["drafted"] += len(drafts)
                st["accepted"] += len(new) - 1
                st["emitted"] += len(new)
                req.spec_token_ids = []
            keep = len(new) if decode else c.num_tokens
            req.num_computed_tokens = c.start + keep
            if keep < c.num_tokens:  # rejected rows: undo them everywhere
                self.kv.truncate(req.request_id, req.num_computed_tokens)
                rollbacks.append(
                    Rollback(
                        req.request_id,
                        c.block_table,
                        req.num_computed_tokens,
                        c.start + c.num_tokens,
                    )
                )
            # the virtual blocks this chunk filled (those before it were recorded already)
            self.written.update(c.block_table[c.start // vb : req.num_computed_tokens // vb])
            if not c.sample:
                continue
            req.prefill_done = True
            emitted[req.request_id] = len(new)
            req.output.extend(new)
            if len(req.output) >= req.max_new_tokens:
                req.status = RequestStatus.FINISHED
                self.running.remove(req)
                self.kv.free(req.request_id)
                finished.append(req)
        return SchedulerUpdate(tuple(finished), emitted, tuple(rollbacks), drafted, accepted)
