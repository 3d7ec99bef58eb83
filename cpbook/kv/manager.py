"""The KV-cache manager of one DCP group: block ids, prefix caching, per-rank usage.

The scheduler side of vLLM never sees ranks.  Under DCP one block id stands for a virtual block
of ``block_size * dcp`` tokens (vLLM 0.11 multiplies ``block_size`` by ``dcp_world_size``
in the scheduler and KV-cache manager; newer versions call ``resolve_dcp_kv_block_size``), and
every rank of the group backs that id with one physical block of ``block_size`` slots.  So:

* a request of ``L`` tokens takes ``ceil(L / (block_size * dcp))`` ids, the same on every rank;
* prefix caching hashes whole virtual blocks, so hits come in multiples of ``block_size * dcp``
  tokens (vLLM's ``find_longest_cache_hit``), and at least one token is always recomputed;
* freed blocks keep their hash and stay reusable until the allocator evicts them (LRU order).

:class:`AllocationError` (not a configuration error) says the free ids ran out.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence

import torch

from cpbook.core.config import ConfigError, ParallelConfig, check_positive
from cpbook.core.errors import RuleError
from cpbook.kv.layout import block_fill, check_layout, num_virtual_blocks

__all__ = ["AllocationError", "KVCacheManager", "PrefixHit"]


class AllocationError(RuleError, RuntimeError):
    """The cache has too few free block ids for a request: a state of the cache, not a bad
    configuration (a scheduler queues or preempts on it).  ``rule`` names the check."""


@dataclass(frozen=True)
class PrefixHit:
    """Result of one allocation: virtual blocks (and tokens) served from the prefix cache."""

    num_blocks: int
    num_tokens: int


@dataclass
class _Request:
    blocks: list[int]
    num_tokens: int
    token_ids: list[int] | None
    hashes: list[str] = field(default_factory=list)  # one per full virtual block, chained


class KVCacheManager:
    """Allocates virtual block ids for the requests of one DCP group (ids shared by all ranks).

    ``num_blocks`` ids, each backed by one physical block of ``block_size`` slots on every one of
    ``dcp`` ranks.  Every method keeps the invariant that a block id is held by at most one
    request unless it is a full, hashed block shared through the prefix cache.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        dcp: int = 1,
        interleave: int = 1,
        enable_prefix_caching: bool = False,
    ) -> None:
        check_positive(num_blocks=num_blocks)
        check_layout(dcp, interleave, block_size)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.dcp, self.interleave = dcp, interleave
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[str | None] = [None] * num_blocks
        self.cached: dict[str, int] = {}  # block hash -> block id
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(
            range(num_blocks)
        )  # LRU first
        self.requests: dict[str, _Request] = {}
        self.stats = {"requests": 0, "query_tokens": 0, "hit_tokens": 0, "hit_blocks": 0}

    @classmethod
    def from_config(
        cls, config: ParallelConfig, num_blocks: int, enable_prefix_caching: bool = False
    ) -> "KVCacheManager":
        """A manager for ``config``'s DCP group (``block_size``, ``dcp``, interleave)."""
        return cls(
            num_blocks,
            config.block_size,
            config.decode_context_parallel_size,
            config.cp_kv_cache_interleave_size,
            enable_prefix_caching,
        )

    @property
    def virtual_block_size(self) -> int:
        """Tokens behind one block id: ``block_size * dcp``."""
        return self.block_size * self.dcp

    @property
    def num_free_blocks(self) -> int:
        """Ids with no owner (some may still hold a cached prefix until evicted)."""
        return len(self.free_queue)

    # -- prefix hashes ------------------------------------------------------------------------
    def _hashes(self, token_ids: Sequence[int], start: int, parent: str | None) -> list[str]:
        """Chained hashes of the full virtual blocks of ``token_ids`` from block ``start`` on."""
        vb, out = self.virtual_block_size, []
        for b in range(start, len(token_ids) // vb):
            block = tuple(token_ids[b * vb : (b + 1) * vb])
            parent = hashlib.sha256(repr((parent, block)).encode()).hexdigest()[:16]
            out.append(parent)
        return out

    def _register_full_blocks(self, req: _Request) -> None:
        if not (self.enable_prefix_caching and req.token_ids is not None):
            return
        if len(req.token_ids) // self.virtual_block_size == len(req.hashes):
            return  # no block filled since the last call
        new = self._hashes(req.token_ids, len(req.hashes), req.hashes[-1] if req.hashes else None)
        for b, h in enumerate(new, start=len(req.hashes)):
            blk = req.blocks[b]
            if self.block_hash[blk] is None and h not in self.cached:
                self.block_hash[blk], self.cached[h] = h, blk
        req.hashes += new

    # -- allocation ---------------------------------------------------------------------------
    def _take(self, n: int) -> list[int]:
        if n > len(self.free_queue):
            raise AllocationError(
                "enough-free-blocks",
                "free block ids for the request",
                needed=n,
                free=len(self.free_queue),
            )
        out = []
        for _ in range(n):
            blk, _ = self.free_queue.popitem(last=False)
            if self.block_hash[blk] is not None:  # evict the cached prefix it held
                del self.cached[self.block_hash[blk]]
                self.block_hash[blk] = None
            self.ref_cnt[blk] = 1
            out.append(blk)
        return out

    def cached_prefix(self, token_ids: Sequence[int]) -> list[int]:
        """Block ids :meth:`allocate` would reuse for a request of ``token_ids``: the longest
        chain of cached full virtual blocks within all but the last token.  Changes nothing
        (a scheduler asks it before admitting; empty without prefix caching)."""
        hit: list[int] = []
        if not self.enable_prefix_caching:
            return hit
        for h in self._hashes(list(token_ids[: max(len(token_ids) - 1, 0)]), 0, None):
            if h not in self.cached:
                break
            hit.append(self.cached[h])
        return hit

    def allocate(
        self, request_id: str, num_tokens: int, token_ids: Sequence[int] | None = None
    ) -> PrefixHit:
        """Give a new request the ids for ``num_tokens`` tokens; reuse cached full virtual blocks.

        ``token_ids`` (length ``num_tokens``) enables prefix caching for this request.  The hit is
        the longest chain of cached full virtual blocks within the first ``num_tokens - 1`` tokens.
        Raises :class:`AllocationError` (rule ``enough-free-blocks``) and changes nothing if ids
        run out.
        """
        if request_id in self.requests:
            raise ConfigError(
                "new-request-id", "a request id not already allocated", request_id=request_id
            )
        need = num_virtual_blocks(num_tokens, self.block_size, self.dcp)
        if token_ids is not None and len(token_ids) != num_tokens:
            raise ConfigError(
                "token-ids-length",
                "len(token_ids) == num_tokens",
                len_token_ids=len(token_ids),
                num_tokens=num_tokens,
            )
        caching = self.enable_prefix_caching and token_ids is not None
        hit = self.cached_prefix(token_ids) if caching else []
        fresh = need - len(hit)
        reusable = sum(1 for b in hit if self.ref_cnt[b] == 0)
        if fresh > len(self.free_queue) - reusable:
            raise AllocationError(
                "enough-free-blocks",
                "free block ids for the request",
                needed=fresh,
                free=len(self.free_queue) - reusable,
            )
        if caching:
            self.stats["requests"] += 1
            self.stats["query_tokens"] += num_tokens
        for b in hit:
            if self.ref_cnt[b] == 0:
                del self.free_queue[b]
            self.ref_cnt[b] += 1
        req = _Request(
            hit + self._take(fresh), num_tokens, None if token_ids is None else list(token_ids)
        )
        self.requests[request_id] = req
        self._register_full_blocks(req)
        result = PrefixHit(len(hit), len(hit) * self.virtual_block_size)
        self.stats["hit_blocks"] += result.num_blocks
        self.stats["hit_tokens"] += result.num_tokens
        return result

    def append(
        self, request_id: str, num_new_tokens: int = 1, token_ids: Sequence[int] | None = None
    ) -> list[int]:
        """Grow a request by ``num_new_tokens`` (decode); returns the ids newly allocated."""
        req = self._get(request_id)
        if type(num_new_tokens) is not int or num_new_tokens < 1:
            check_positive(num_new_tokens=num_new_tokens)
        if (token_ids is None) != (req.token_ids is None) or (
            token_ids is not None and len(token_ids) != num_new_tokens
        ):
            raise ConfigError(
                "token-ids-length",
                "token_ids of length num_new_tokens exactly when the "
                "request was allocated with token_ids",
                num_new_tokens=num_new_tokens,
                len_token_ids=None if token_ids is None else len(token_ids),
            )
        vb = self.virtual_block_size  # ceil((tokens + new) / vb) ids in all
        need = -(-(req.num_tokens + num_new_tokens) // vb) - len(req.blocks)
        new = self._take(need) if need > 0 else []
        req.blocks += new
        req.num_tokens += num_new_tokens
        if token_ids is not None:
            req.token_ids += list(token_ids)
        self._register_full_blocks(req)
        return new

    def truncate(self, request_id: str, num_tokens: int) -> list[int]:
        """Shrink a request to its first ``num_tokens`` tokens (a speculative step's rollback).

        Ids past ``ceil(num_tokens / (block_size·dcp))`` are released (returned, last first),
        the token ids and prefix hashes past ``num_tokens`` are dropped, and every prefix-cache
        entry this request registered for a virtual block no longer full is forgotten, so no
        cached hash names a block holding rejected tokens."""
        req = self._get(request_id)
        if (
            isinstance(num_tokens, bool)
            or not isinstance(num_tokens, int)
            or not (0 <= num_tokens <= req.num_tokens)
        ):
            raise ConfigError(
                "truncate-within-request",
                "0 <= num_tokens <= the request's tokens",
                num_tokens=num_tokens,
                request_tokens=req.num_tokens,
            )
        full = num_tokens // self.virtual_block_size
        for b in range(full, len(req.hashes)):
            blk = req.blocks[b]
            if self.block_hash[blk] == req.hashes[b]:
                self.uncache([blk])
        req.hashes = req.hashes[:full]
        keep = num_virtual_blocks(num_tokens, self.block_size, self.dcp)
        released = req.blocks[keep:][::-1]
        req.blocks = req.blocks[:keep]
        for blk in released:
            self.ref_cnt[blk] -= 1
            if self.ref_cnt[blk] == 0:
                self.free_queue[blk] = None
        req.num_tokens = num_tokens
        if req.token_ids is not None:
            req.token_ids = req.token_ids[:num_tokens]
        return released

    def free(self, request_id: str) -> None:
        """Release a request's ids (tail first, so its last blocks are evicted first)."""
        req = self._get(request_id)
        del self.requests[request_id]
        for blk in reversed(req.blocks):
            self.ref_cnt[blk] -= 1
            if self.ref_cnt[blk] == 0:
                self.free_queue[blk] = None

    def uncache(self, block_ids: Sequence[int]) -> None:
        """Forget the prefix-cache entries of ``block_ids`` (hashes are registered when ids are
        allocated; a scheduler that frees a request before its blocks' K/V was computed must
        drop them).  The ids themselves stay owned or free as they were."""
        for blk in block_ids:
            h = self.block_hash[blk]
            if h is not None:
                del self.cached[h]
                self.block_hash[blk] = None

    def _get(self, request_id: str) -> _Request:
        if request_id not in self.requests:
            raise ConfigError("known-request-id", "an allocated request id", request_id=request_id)
        return self.requests[request_id]

    # -- reports ------------------------------------------------------------------------------
    def block_table(self, request_id: str) -> torch.Tensor:
        """The request's virtual block ids (int64), identical on every rank of the group."""
        return torch.tensor(self._get(request_id).blocks, dtype=torch.long)

    def block_ids(self, request_id: str) -> tuple[int, ...]:
        """:meth:`block_table` as a tuple (what a scheduler hands on every step, no tensor)."""
        return tuple(self._get(request_id).blocks)

    def num_tokens(self, request_id: str) -> int:
        return self._get(request_id).num_tokens

    def rank_usage(self) -> list[dict[str, float]]:
        """Per rank: ids allocated (= physical blocks reserved), blocks holding tokens, tokens,
        fill.

        Shared prefix blocks count once.  ``fill = tokens / (blocks * block_size)``.
        """
        per_block: dict[int, torch.Tensor] = {}
        for req in self.requests.values():
            fill = block_fill(req.num_tokens, self.block_size, self.dcp, self.interleave)
            for b, blk in enumerate(req.blocks):
                per_block[blk] = fill[:, b]  # a shared block is full in every request holding it
        cols = (
            torch.stack(list(per_block.values()), dim=1)
            if per_block
            else torch.zeros(self.dcp, 0, dtype=torch.long)
        )
        n = cols.shape[1]
        return [
            {
                "rank": r,
                "blocks": n,
                "used_blocks": int((cols[r] > 0).sum()),
                "tokens": int(cols[r].sum()),
                "fill": round(int(cols[r].sum()) / (n * self.block_size), 6) if n else 0.0,
            }
            for r in range(self.dcp)
        ]
