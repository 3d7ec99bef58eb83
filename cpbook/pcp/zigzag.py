"""Who owns which prompt token under PCP: DualChunkSwap (zigzag), contiguous and striped partitions.

A prefill request of ``seq_len`` tokens is padded at its end to a multiple of ``2 * pcp``
and cut into ``2 * pcp`` chunks of ``chunk_size = ceil(seq_len / (2 * pcp))`` tokens.
Partitions (:data:`PARTITIONS`; each request of a batch is partitioned on its own, as vLLM's
``PCPManager`` does):

* ``"zigzag"`` — DualChunkSwap / head-tail: rank ``r`` holds chunk ``r`` then chunk
  ``2*pcp - 1 - r``.  Every rank gets the same causal work.
* ``"contiguous"`` — rank ``r`` holds chunks ``2r`` and ``2r + 1`` (one contiguous piece).
* ``"striped"`` — Striped Attention: rank ``r`` holds positions ``r, r + pcp, ...``.

A rank's local tensor holds, request after request, its segments in the order above, padding
rows included, so every rank holds the same number of rows and a plain all-gather collects
them.  :class:`PCPMetadata` is what one rank needs for attention: true global ``positions``
(for RoPE), per-chunk ``query_lens`` and ``key_lens``, the padding mask and the restore order.

Where vLLM's zigzag differs (v0.34.0, ``PCPManager`` in ``vllm/v1/worker/gpu/pcp_manager.py``,
Model Runner V2, the runner that has PCP); the real tokens of a partitioned request land on the
same ranks and chunks in both:

* **No per-request padding.**  ``PCPManager._iter_rank_chunks`` cuts a request of ``L`` tokens
  into chunks of ``ceil(L / (2 * pcp))`` and leaves the last chunk short
  (``min(chunk_size, L - offset)``, empty chunks skipped); only each rank's whole local batch is
  padded, to the largest rank's token count (``_build_batch_layout``).  cpbook pads every
  request to a multiple of ``2 * pcp`` instead: more padding rows, the same real rows.
* **Short-last-chunk prompts run whole with DCP > 1.**  ``PCPManager.replicated_requests``
  gives every PCP rank the whole query of a prefill whose last chunk would be empty,
  ``(2 * pcp - 1) * ceil(L / (2 * pcp)) >= L`` (PCP 2: ``L`` in {1, 2, 3, 5, 6, 9}; never for
  ``L > (2 * pcp - 1)**2``), as it does for decodes, when ``decode_context_parallel_size > 1``
  (which ``PCPManager.validate_config`` allows for sparse MLA only); with DCP = 1 such a prompt
  is partitioned, its empty chunk skipped.  cpbook always partitions.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Sequence

from cpbook.core.errors import RuleError

if TYPE_CHECKING:
    import torch

__all__ = [
    "PARTITIONS",
    "Segment",
    "PCPPartition",
    "PCPMetadata",
    "pcp_partition",
    "zigzag_partition",
    "padded_len",
    "causal_work",
    "causal_pairs",
]

PARTITIONS = ("zigzag", "contiguous", "striped")


def _lens(seq_lens: int | Sequence[int]) -> tuple[int, ...]:
    lens = (seq_lens,) if isinstance(seq_lens, int) else tuple(seq_lens)
    if not lens or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in lens):
        raise RuleError(
            "pcp-seq-lens", "one or more positive integer request lengths", seq_lens=seq_lens
        )
    return lens


def _offsets(lens: Sequence[int]) -> list[int]:
    """``[0, l0, l0 + l1, ...]``: where each request starts in a request-major concatenation."""
    return list(itertools.accumulate(lens, initial=0))


def _check(pcp: int, partition: str) -> None:
    if isinstance(pcp, bool) or not isinstance(pcp, int) or pcp < 1:
        raise RuleError("pcp-size", "a positive integer pcp", pcp=pcp)
    if partition not in PARTITIONS:
        raise RuleError("pcp-partition", f"partition in {PARTITIONS}", partition=partition)


def padded_len(seq_len: int, pcp: int) -> int:
    """``seq_len`` rounded up to a multiple of ``2 * pcp`` (cpbook's per-request padding; vLLM
    pads none, see the module docstring)."""
    m = 2 * pcp
    return -(-seq_len // m) * m


def causal_pairs(start: int, end: int, seq_len: int) -> int:
    """(query, key) pairs the causal queries at positions ``[start, end)`` compute, per head.

    Query ``p`` sees keys ``0..p``: ``p + 1`` pairs; positions ``>= seq_len`` are padding (0).
    """
    end = min(end, seq_len)
    return max(0, (end * (end + 1) - start * (start + 1)) // 2)


@dataclass(frozen=True)
class Segment:
    """Positions ``[start, end)`` of request ``request``, held at local rows
    ``[row, row + end - start)``."""

    request: int
    start: int
    end: int
    row: int


def _segments(padded: int, pcp: int, rank: int, partition: str) -> list[tuple[int, int]]:
    c = padded // (2 * pcp)
    if partition == "zigzag":
        tail = 2 * pcp - 1 - rank
        return [(rank * c, (rank + 1) * c), (tail * c, (tail + 1) * c)]
    if partition == "contiguous":
        return [(2 * rank * c, 2 * (rank + 1) * c)]
    return [(p, p + 1) for p in range(rank, padded, pcp)]


@dataclass(frozen=True)
class PCPMetadata:
    """One PCP rank's view of a partitioned batch (tensors on CPU, ``int64``/``bool``).

    Per local token (``num_tokens`` rows): ``positions`` (global position in its request, for
    RoPE), ``request_ids``, ``token_index`` (row in the unpadded request-major concatenation;
    ``-1`` for padding, like vLLM's ``PAD_SLOT_ID``) and ``is_padding``.  Per segment (vLLM's
    "virtual request"): ``query_lens`` (real query tokens), ``num_computed_tokens`` (keys before
    the segment) and ``key_lens`` (keys the segment attends: ``[0, key_len)`` of its request).
    ``restore_index`` puts the rank-major all-gather of every rank's rows back in sequence order.
    """

    pcp_rank: int
    pcp: int
    partition: str
    seq_lens: tuple[int, ...]
    segments: tuple[Segment, ...]
    num_tokens: int
    positions: torch.Tensor
    request_ids: torch.Tensor
    token_index: torch.Tensor
    is_padding: torch.Tensor
    restore_index: torch.Tensor

    @property
    def query_lens(self) -> list[int]:
        return [max(0, min(s.end, self.seq_lens[s.request]) - s.start) for s in self.segments]

    @property
    def num_computed_tokens(self) -> list[int]:
        return [min(s.start, self.seq_lens[s.request]) for s in self.segments]

    @property
    def key_lens(self) -> list[int]:
        return [min(s.end, self.seq_lens[s.request]) for s in self.segments]

    @property
    def query_start_loc(self) -> list[int]:
        """Local row where each segment starts, plus ``num_tokens`` (vLLM's ``query_start_loc``)."""
        return [s.row for s in self.segments] + [self.num_tokens]

    @property
    def cu_seq_lens(self) -> list[int]:
        """Offsets of the requests in the unpadded request-major concatenation."""
        return _offsets(self.seq_lens)


@dataclass(frozen=True)
class PCPPartition:
    """A batch of prefill requests partitioned over ``pcp`` ranks (module docstring)."""

    seq_lens: tuple[int, ...]
    pcp: int
    partition: str = "zigzag"

    def __post_init__(self) -> None:
        object.__setattr__(self, "seq_lens", _lens(self.seq_lens))
        _check(self.pcp, self.partition)

    @property
    def padded_lens(self) -> tuple[int, ...]:
        return tuple(padded_len(n, self.pcp) for n in self.seq_lens)

    @property
    def pads(self) -> tuple[int, ...]:
        """Padding tokens appended to each request."""
        return tuple(p - n for p, n in zip(self.padded_lens, self.seq_lens))

    @property
    def pad(self) -> int:
        """Padding tokens of a single-request partition."""
        if len(self.seq_lens) != 1:
            raise RuleError(
                "single-request", "one request for .pad (use .pads)", seq_lens=self.seq_lens
            )
        return self.pads[0]

    @property
    def chunk_sizes(self) -> tuple[int, ...]:
        """``ceil(seq_len / (2 * pcp))`` per request."""
        return tuple(p // (2 * self.pcp) for p in self.padded_lens)

    @property
    def tokens_per_rank(self) -> int:
        return sum(self.padded_lens) // self.pcp

    @cached_property
    def segments(self) -> tuple[tuple[Segment, ...], ...]:
        """Per rank, its segments in local-row order (request by request)."""
        out = []
        for rank in range(self.pcp):
            row, segs = 0, []
            for req, padded in enumerate(self.padded_lens):
                for s, e in _segments(padded, self.pcp, rank, self.partition):
                    segs.append(Segment(req, s, e, row))
                    row += e - s
            out.append(tuple(segs))
        return tuple(out)

    @cached_property
    def rank_tokens(self) -> list[list[int]]:
        """Per rank, the tokens it holds in local order, as indices into the *padded*
        request-major concatenation (for one request: the global positions; padding
        tokens are those ``>= seq_len``)."""
        offs = _offsets(self.padded_lens)
        return [
            [offs[s.request] + p for s in segs for p in range(s.start, s.end)]
            for segs in self.segments
        ]

    @cached_property
    def restore_index(self) -> torch.Tensor:
        """``gathered[restore_index]`` is the unpadded request-major sequence, where ``gathered``
        is every rank's local rows concatenated in rank order (``[pcp * tokens_per_rank]``)."""
        import torch  # the partition's sizes need no torch: the cost model imports them

        cu = _offsets(self.seq_lens)
        idx = torch.empty(cu[-1], dtype=torch.int64)
        t = self.tokens_per_rank
        for rank, segs in enumerate(self.segments):
            for s in segs:
                e = min(s.end, self.seq_lens[s.request])
                if e > s.start:
                    idx[cu[s.request] + s.start : cu[s.request] + e] = torch.arange(
                        rank * t + s.row, rank * t + s.row + e - s.start
                    )
        return idx

    def work(self) -> list[int]:
        """Causal (query, key) pairs per head each rank computes (padding excluded)."""
        return [
            sum(causal_pairs(s.start, s.end, self.seq_lens[s.request]) for s in segs)
            for segs in self.segments
        ]

    def metadata(self, pcp_rank: int) -> PCPMetadata:
        """What PCP rank ``pcp_rank`` needs to run its part of the prefill."""
        if not 0 <= pcp_rank < self.pcp:
            raise RuleError("pcp-rank", "0 <= pcp_rank < pcp", pcp_rank=pcp_rank, pcp=self.pcp)
        import torch  # see restore_index

        segs = self.segments[pcp_rank]
        cu = _offsets(self.seq_lens)
        pos = torch.cat([torch.arange(s.start, s.end) for s in segs])
        req = torch.cat([torch.full((s.end - s.start,), s.request) for s in segs])
        lens = torch.tensor(self.seq_lens)[req]
        pad = pos >= lens
        index = torch.where(pad, -1, torch.tensor(cu)[req] + pos)
        return PCPMetadata(
            pcp_rank,
            self.pcp,
            self.partition,
            self.seq_lens,
            segs,
            self.tokens_per_rank,
            pos,
            req,
            index,
            pad,
            self.restore_index,
        )


def pcp_partition(
    seq_lens: int | Sequence[int], pcp: int, partition: str = "zigzag"
) -> PCPPartition:
    """Partition one request (``int``) or a batch (sequence of lengths) over ``pcp`` ranks."""
    return PCPPartition(_lens(seq_lens), pcp, partition)


def zigzag_partition(seq_len: int | Sequence[int], pcp: int) -> PCPPartition:
    """DualChunkSwap: rank ``r`` holds chunks ``r`` and ``2*pcp - 1 - r`` of every request."""
    return pcp_partition(seq_len, pcp, "zigzag")


def causal_work(seq_lens: int | Sequence[int], pcp: int, partition: str = "zigzag") -> list[int]:
    """Exact causal (query, key) pairs per head that each rank computes, for ``partition``."""
    return pcp_partition(seq_lens, pcp, partition).work()
