"""Ring attention planning: who holds which rows, which kernel calls, how many bytes, which ring.

No communication here (the rings themselves are in :mod:`cpbook.pcp.ring`).  A batch of requests,
each with ``T_i`` new tokens and ``C_i`` cached tokens before them, over ``N`` PCP ranks:

* new tokens are split zigzag (DualChunkSwap, :mod:`cpbook.pcp.zigzag`): a rank's
  ``q [num_tokens, Hq, D]`` and ``k, v [num_tokens, Hkv, D]`` are its
  :class:`~cpbook.pcp.zigzag.PCPMetadata` rows, padding included; each request's real rows come
  first;
* cached token ``p`` of a request lives on rank ``(p // I) % N`` (``I`` =
  ``cp_kv_cache_interleave_size``, as vLLM's DCP interleaves its cache): a rank's
  ``k_ctx, v_ctx [num_context, Hkv, D]``, request-major;
* a rank's K/V travel as one block ``[2, Hkv, rows, D]`` holding, per request, its context
  rows then its real new rows (``R_b`` rows for rank ``b``); its queries as the real rows only,
  head-major ``[Hq, T_b, D]``.

Causal masking by absolute position: context is visible to every new token, new key ``j`` to
new query ``i`` iff ``j <= i``.  Under zigzag every remote query chunk sees a prefix of the
other rank's block (its context, then the new chunks before it) or nothing, so
:meth:`RingShards.plan` needs dense calls only, plus one top-left causal call per request on
a rank's own rows; masked pairs are never computed.

Bytes each rank ``r`` sends per layer (:func:`ring_comm_bytes`), ``e`` bytes per element,
``U(a, b)`` the rows of rank ``a`` that see a key of rank ``b``:

========================  ==========================================================
pass_kv, s = 0..N−2       ``2·Hkv·D·e·R_{r−s}``  (the K/V block it holds, to ``r+1``)
pass_q, step 0            ``Hq·D·e·T_r``  (its queries, to ``r+1``)
pass_q, s = 1..N−2        ``Hq·D·e·T_{r−s}``  (forwards the visiting queries)
pass_q, s = 1..N−1        ``Hq·(D+1)·e·U(r−s, r)``  (partial output + LSE, to ``r−s``)
========================  ==========================================================

A K/V block is ``2·(Hkv/Hq)·(C+T)/T`` times a query block: pass-Q moves less per step when the
cache hit rate is high and KV heads are few, Meta's rule (:func:`choose_ring_mode`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Sequence

from cpbook.core.config import ConfigError, check_gqa_group, check_positive
from cpbook.pcp.zigzag import PCPMetadata, PCPPartition, zigzag_partition

if TYPE_CHECKING:
    import torch

__all__ = ["RING_MODES", "Call", "RingShards", "check_mode", "ring_comm_bytes", "choose_ring_mode"]

RING_MODES = ("pass_kv", "pass_q")


def check_mode(mode: str) -> None:
    """Rule ``ring-mode``: ``mode`` is ``"pass_kv"`` or ``"pass_q"``."""
    if mode not in RING_MODES:
        raise ConfigError("ring-mode", f"mode in {RING_MODES}", mode=mode)


@dataclass(frozen=True)
class Call:
    """One kernel call: query rows ``[q_lo, q_hi)`` of the query rank (``p_lo``: where they start
    in its real-rows-only Q block) against rows ``[k_lo, k_hi)`` of the key rank's K/V block;
    ``causal`` only for a rank's own rows (top-left mask, square)."""

    q_lo: int
    q_hi: int
    p_lo: int
    k_lo: int
    k_hi: int
    causal: bool

    @property
    def pairs(self) -> int:
        """(query, key) pairs computed per query head."""
        n = self.q_hi - self.q_lo
        return n * (n + 1) // 2 if self.causal else n * (self.k_hi - self.k_lo)


@dataclass(frozen=True)
class _Rows:
    q_start: tuple[int, ...]  # local row of each request's first query row
    q_real: tuple[int, ...]  # its real rows (a prefix of its local rows)
    q_pack: tuple[int, ...]  # where they start in the real-rows-only Q block
    ctx: tuple[int, ...]  # context tokens of each request held here
    ctx_start: tuple[int, ...]  # where they start in k_ctx / v_ctx
    kv_start: tuple[int, ...]  # where the request starts in the K/V block


@dataclass(frozen=True)
class RingShards:
    """Who holds what in a ring over ``pcp`` ranks (planning only, no communication).

    ``seq_lens`` are the new tokens per request (zigzag over the ranks), ``context_lens`` the
    cached tokens before them (interleaved over the ranks, ``cp_kv_cache_interleave_size``).
    """

    seq_lens: tuple[int, ...]
    context_lens: tuple[int, ...]
    pcp: int
    cp_kv_cache_interleave_size: int = 1

    def __post_init__(self) -> None:
        part = zigzag_partition(tuple(self.seq_lens), self.pcp)  # [pcp-seq-lens], [pcp-size]
        ctx = tuple(self.context_lens)
        if len(ctx) != len(part.seq_lens) or any(
            isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in ctx
        ):
            raise ConfigError(
                "ring-context-lens",
                "one non-negative integer context length per request",
                context_lens=self.context_lens,
                seq_lens=part.seq_lens,
            )
        check_positive(cp_kv_cache_interleave_size=self.cp_kv_cache_interleave_size)
        object.__setattr__(self, "seq_lens", part.seq_lens)
        object.__setattr__(self, "context_lens", ctx)

    @cached_property
    def part(self) -> PCPPartition:
        return zigzag_partition(self.seq_lens, self.pcp)

    def metadata(self, rank: int) -> PCPMetadata:
        return self.part.metadata(rank)

    def _ctx_count(self, length: int, rank: int) -> int:
        i, n = self.cp_kv_cache_interleave_size, self.pcp
        return length // (i * n) * i + min(i, max(0, length % (i * n) - rank * i))

    @cached_property
    def rows(self) -> tuple[_Rows, ...]:
        out = []
        for rank, segs in enumerate(self.part.segments):
            first = {s.request: s.row for s in reversed(segs)}
            real = [0] * len(self.seq_lens)
            for s in segs:
                real[s.request] += max(0, min(s.end, self.seq_lens[s.request]) - s.start)
            ctx = [self._ctx_count(c, rank) for c in self.context_lens]
            out.append(
                _Rows(
                    tuple(first[i] for i in range(len(real))),
                    tuple(real),
                    tuple(_starts(real)),
                    tuple(ctx),
                    tuple(_starts(ctx)),
                    tuple(_starts([c + t for c, t in zip(ctx, real)])),
                )
            )
        return tuple(out)

    def q_rows(self, rank: int) -> int:
        """Real query rows of ``rank`` (its Q block in pass-Q)."""
        return sum(self.rows[rank].q_real)

    def num_context(self, rank: int) -> int:
        return sum(self.rows[rank].ctx)

    def kv_rows(self, rank: int) -> int:
        """Rows of ``rank``'s K/V block: its context plus its real new tokens."""
        return self.num_context(rank) + self.q_rows(rank)

    def context_positions(self, rank: int) -> list[torch.Tensor]:
        """Per request, the positions of the cached tokens ``rank`` holds (its k_ctx order)."""
        import torch  # the plan itself needs no torch: the cost model imports it

        i, n = self.cp_kv_cache_interleave_size, self.pcp
        return [p[(p // i) % n == rank] for p in (torch.arange(c) for c in self.context_lens)]

    def plan(self, a: int, b: int) -> tuple[Call, ...]:
        """The kernel calls of rank ``a``'s queries against rank ``b``'s K/V block.

        ``a == b``: per request one causal call of its real rows on its own new keys (first,
        together covering every real row), then one dense call on its context rows.
        ``a != b``: a query chunk sees the context rows and the new chunks before it, a prefix
        of the request's block rows, so each query chunk needs one dense call; adjacent chunks
        with the same keys are fused.  Calls of ``a != b`` cover disjoint rows.
        """
        if (a, b) not in self._plans:
            self._plans[(a, b)] = self._plan(a, b)
        return self._plans[(a, b)]

    @cached_property
    def _plans(self) -> dict[tuple[int, int], tuple[Call, ...]]:
        return {}

    def _plan(self, a: int, b: int) -> tuple[Call, ...]:
        ra, rb = self.rows[a], self.rows[b]
        reqs = range(len(self.seq_lens))
        if a == b:

            def call(i: int, k_lo: int, k_hi: int, causal: bool) -> Call:
                return Call(
                    ra.q_start[i], ra.q_start[i] + ra.q_real[i], ra.q_pack[i], k_lo, k_hi, causal
                )

            own = ra.kv_start
            return tuple(
                [
                    call(i, own[i] + ra.ctx[i], own[i] + ra.ctx[i] + ra.q_real[i], True)
                    for i in reqs
                    if ra.q_real[i]
                ]
                + [
                    call(i, own[i], own[i] + ra.ctx[i], False)
                    for i in reqs
                    if ra.q_real[i] and ra.ctx[i]
                ]
            )
        calls: list[Call] = []
        for i in reqs:
            keys = [(s.start, e) for s, e in self._real(b, i)]
            for s, e in self._real(a, i):
                seen = sum(ke - ks for ks, ke in keys if ke <= s.start)
                k_lo, k_hi = rb.kv_start[i], rb.kv_start[i] + rb.ctx[i] + seen
                if k_hi == k_lo:
                    continue
                last = calls[-1] if calls else None
                if last and last.q_hi == s.row and (last.k_lo, last.k_hi) == (k_lo, k_hi):
                    calls[-1] = Call(last.q_lo, s.row + e - s.start, last.p_lo, k_lo, k_hi, False)
                else:
                    p_lo = ra.q_pack[i] + s.row - ra.q_start[i]
                    calls.append(Call(s.row, s.row + e - s.start, p_lo, k_lo, k_hi, False))
        return tuple(calls)

    def _real(self, rank: int, request: int):
        """``(segment, real end)`` of ``rank``'s chunks of ``request`` holding real tokens."""
        n = self.seq_lens[request]
        return [
            (s, min(s.end, n))
            for s in self.part.segments[rank]
            if s.request == request and min(s.end, n) > s.start
        ]

    def returned_rows(self, a: int, b: int) -> int:
        """``U(a, b)``: rows of ``a`` that see a key of ``b`` (pass-Q sends these back)."""
        return sum(c.q_hi - c.q_lo for c in self.plan(a, b))


def _starts(counts: Sequence[int]) -> list[int]:
    return [sum(counts[:i]) for i in range(len(counts))]


def ring_comm_bytes(
    mode: str,
    shards: RingShards,
    pcp_rank: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    elem_bytes: int = 8,
) -> list[tuple[str, int]]:
    """The module docstring's table: ``[(op, bytes sent by pcp_rank), ...]`` in call order, for
    the requests, PCP size and interleave of ``shards``.

    ``num_q_heads`` / ``num_kv_heads`` are the heads this rank holds (after TP).
    """
    check_mode(mode)
    lay = shards
    n, r, e = shards.pcp, pcp_rank, elem_bytes
    if mode == "pass_kv":
        return [
            ("sendrecv", 2 * num_kv_heads * head_dim * e * lay.kv_rows((r - s) % n))
            for s in range(n - 1)
        ]
    q_bytes = num_q_heads * head_dim * e
    calls = [("sendrecv", q_bytes * lay.q_rows(r))] if n > 1 else []
    for s in range(1, n):
        if s + 1 < n:
            calls.append(("sendrecv", q_bytes * lay.q_rows((r - s) % n)))
        calls.append(
            ("sendrecv", num_q_heads * (head_dim + 1) * e * lay.returned_rows((r - s) % n, r))
        )
    return calls


def choose_ring_mode(
    new_tokens: int,
    cached_tokens: int,
    num_q_heads: int,
    num_kv_heads: int,
    *,
    pcp: int = 2,
    elem_bytes: int = 2,
    peak_flops: float | None = None,
    bandwidth: float | None = None,
) -> str:
    """Meta's rule (Yang et al., arXiv 2411.01783, §3.4, App. C): ``"pass_kv"`` or ``"pass_q"``.

    ``T`` = ``new_tokens``, ``P`` = ``cached_tokens``, ``N_H`` / ``N_KV`` query / KV heads,
    ``N`` = ``pcp``, ``e`` = ``elem_bytes``, ``C`` = ``peak_flops`` (attention FLOP/s per
    rank), ``BW`` = ``bandwidth`` (bytes/s per rank).  The paper states the choice three ways:

    1. Eq. (1), message size: a pass-KV step moves ``2·(T+P)·D·e·N_KV/N_H`` bytes, a pass-Q
       step ``T·D·e``, so pass-KV iff ``T/(T+P) >= 2·N_KV/N_H`` (the KV-cache *miss* rate
       against twice the KV-head fraction).  One published summary prints the inequality
       the other way round; the message sizes, and the paper's own cases (full prefill,
       ``P = 0`` with GQA: pass-KV; decode, ``T = 1``: pass-Q), fix the direction above.
    2. Algorithm 1 also takes pass-KV when compute hides its transfer, Eq. (2):
       ``T >= N·C·N_KV·e / (2·N_H·BW)`` (independent of ``P``).
    3. Algorithm 5 (Appendix C) charges pass-Q its All2All of partial outputs, Eq. (5):
       pass-Q iff ``T/(T+P) <= 2·N_KV/N_H − 4·T·BW/(N·C·e)`` (and Eq. (2) fails).

    Implemented: form 1 when no hardware numbers are given (the only form that needs none, and
    exactly what :func:`ring_comm_bytes` shows per step); forms 2 + 3 when both ``peak_flops``
    and ``bandwidth`` are given, because cpbook's pass-Q also sends its partial outputs home,
    which Algorithm 1 ignores.  Boundaries go to pass-KV (``>=``).  Counting whole-ring bytes
    instead of per-step messages, pass-Q's returned outputs double its traffic and the
    crossover moves to ``T/(T+P) ≈ N_KV/N_H``.  The formulas are checked against two
    independent summaries of the paper and re-derived above; the paper's empirical fit
    (Appendix D) is specific to its cluster and not used.
    """
    check_positive(
        new_tokens=new_tokens,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        pcp=pcp,
        elem_bytes=elem_bytes,
    )
    if isinstance(cached_tokens, bool) or not isinstance(cached_tokens, int) or cached_tokens < 0:
        raise ConfigError(
            "positive-sizes",
            "cached_tokens to be a non-negative integer",
            cached_tokens=cached_tokens,
        )
    check_gqa_group(num_q_heads, num_kv_heads)
    t, p, hq, hkv = new_tokens, cached_tokens, num_q_heads, num_kv_heads
    if peak_flops is None and bandwidth is None:
        return "pass_kv" if t * hq >= 2 * hkv * (t + p) else "pass_q"
    if not (peak_flops and bandwidth and peak_flops > 0 and bandwidth > 0):
        raise ConfigError(
            "ring-hardware",
            "both peak_flops > 0 and bandwidth > 0, or neither",
            peak_flops=peak_flops,
            bandwidth=bandwidth,
        )
    n, e, c, bw = pcp, elem_bytes, peak_flops, bandwidth
    hidden = t >= n * c * hkv * e / (2 * hq * bw)
    return (
        "pass_kv" if hidden or t / (t + p) >= 2 * hkv / hq - 4 * t * bw / (n * c * e) else "pass_q"
    )
