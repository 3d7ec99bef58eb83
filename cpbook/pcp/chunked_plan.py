"""What each chunked-prefill strategy sends, and the selector that picks one (no tensors here).

:mod:`cpbook.pcp.chunked` runs AllGather-Q and AllGather-KV; this module predicts, exactly, the
bytes each rank sends per layer and picks the cheaper strategy with a link model.  Notation:
``R`` local chunk rows per PCP rank (zigzag padding included: ``Σ_i padded(T_i) / P``), ``h``
query heads and ``k`` KV heads per rank, ``D``/``Dv`` key/value widths, ``e`` bytes per element,
``N = dcp``, ``P = pcp``, ``G`` the attention group (``N`` ranks if ``N > 1``, else ``P``),
``W = k·(D+Dv)`` the width of one gathered K/V row (``k·D`` for MLA, whose latent value is the
first ``Dv`` columns of the key).  Calls on one-rank groups are skipped (zero bytes, no call):

==============  ==========================  =====  ========================================
strategy        call (in order)             group  bytes sent per rank
==============  ==========================  =====  ========================================
allgather_q     all_gather Q                G      ``R·h·D·e·(G−1)``
                a2a: all_to_all out|LSE     G      ``R·h·(Dv+1)·e·(G−1)``
                ag_rs: all_gather LSE       G      ``R·G·h·e·(G−1)``
                ag_rs: reduce_scatter out   G      ``R·h·Dv·e·(G−1)``
allgather_kv    all_gather new K/V          PCP    ``R·W·e·(P−1)``
                all_gather, each piece      DCP    ``Σ_i rows₀(i)·W·e·(N−1)``
==============  ==========================  =====  ========================================

``rows₀(i)`` is rank 0's share of request ``i``'s context piece (every rank pads to it); the
pieces are ``workspace_size // requests`` tokens, a multiple of ``N·interleave``
(:func:`cpbook.kv.gather.context_gather_comm_bytes`), and sum to ``≈ C_i / N``.  So AllGather-Q's
bytes grow with the chunk and the query heads and never with the context; AllGather-KV's grow with
the context and the KV heads.  With ``dcp = 1`` the context is already everywhere and AllGather-KV
moves only the chunk's K/V, which never costs more than moving Q and outputs.

The selector prices a call list as ``calls·α + bytes·β`` (a link's latency and inverse
bandwidth) and takes the cheaper; ties go to AllGather-KV (no combine afterwards).  Both
strategies do the same attention FLOPs, so the link decides.  The defaults, named for where they
were measured, :data:`CPU_ALPHA_S` and :data:`CPU_BETA_S_PER_BYTE`, were fitted by
``bench/chunked_prefill.py --calibrate`` on this book's 2-core CPU (2 gloo ranks, one thread
each); on any other link pass its own ``alpha`` and ``beta`` (:class:`ChunkedPrefillConfig`,
:func:`choose_strategy` and :class:`~cpbook.engine.engine.Engine` take them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from cpbook.core.comm import comm_bytes
from cpbook.core.config import ConfigError, ParallelConfig, check_comm_backend, check_positive
from cpbook.core.heads import kv_heads_of
from cpbook.kv.gather import context_gather_comm_bytes
from cpbook.pcp.zigzag import padded_len

__all__ = [
    "STRATEGIES",
    "check_strategy",
    "CPU_ALPHA_S",
    "CPU_BETA_S_PER_BYTE",
    "ChunkedPrefillConfig",
    "RankSizes",
    "comm_plan",
    "chunked_comm_bytes",
    "StrategyChoice",
    "select_strategy",
    "choose_strategy",
]

STRATEGIES = ("allgather_q", "allgather_kv")


# gloo, 2 ranks × 1 thread on the book's 2-core CPU, ``bench/chunked_prefill.py --calibrate``
# (30 Nov 2026, quiet machine: all_gather 0.59 ms + 1.8 ns/B, all_to_all 0.55 ms + 2.2 ns/B;
# under other jobs' load the fits rose to 0.7–2 ms and 2–8 ns/B)
CPU_ALPHA_S = 6.0e-4  # s per call


CPU_BETA_S_PER_BYTE = 2.0e-9  # s per byte sent by a rank


def check_strategy(strategy: str, auto: bool = False) -> None:
    """Rule ``chunked-strategy``: one of :data:`STRATEGIES` (or ``"auto"``, the selector, where
    ``auto`` allows it)."""
    allowed = (*STRATEGIES, "auto") if auto else STRATEGIES
    if strategy not in allowed:
        raise ConfigError("chunked-strategy", f"strategy in {allowed}", strategy=strategy)


@dataclass(frozen=True)
class ChunkedPrefillConfig:
    """How one chunked-prefill layer runs: ``strategy`` (one of :data:`STRATEGIES`, or ``"auto"``:
    the selector), the context workspace in gathered rows, the DCP combine backend of
    AllGather-Q, and the link model ``alpha`` (s per call) / ``beta`` (s per byte) the selector
    prices with (``None``: :data:`CPU_ALPHA_S`, :data:`CPU_BETA_S_PER_BYTE`), and the softmax
    ``scale`` (``None``: ``1/sqrt(head_dim)``).  Validated on construction."""

    strategy: str = "auto"
    workspace_size: int = 16384
    dcp_comm_backend: str = "a2a"
    alpha: float | None = None
    beta: float | None = None
    scale: float | None = None

    def __post_init__(self) -> None:
        check_strategy(self.strategy, auto=True)
        check_positive(workspace_size=self.workspace_size)
        check_comm_backend(self.dcp_comm_backend)


@dataclass(frozen=True)
class RankSizes:
    """The per-rank sizes one layer's bytes depend on: query and KV heads per rank (``h``,
    ``k``), key and value widths, ``latent`` (MLA: the value is the key's first ``v_head_dim``
    columns), ``pcp``, ``dcp``, ``interleave``, ``workspace_size`` and bytes per element."""

    q_heads_per_rank: int
    kv_heads_per_rank: int
    head_dim: int
    v_head_dim: int
    latent: bool
    pcp: int
    dcp: int
    interleave: int
    workspace_size: int
    elem_bytes: int

    @classmethod
    def of(
        cls,
        config: ParallelConfig,
        workspace_size: int,
        v_head_dim: int | None = None,
        elem_bytes: int = 8,
    ) -> RankSizes:
        """The sizes of every rank of ``config`` (the same on every rank)."""
        kv = kv_heads_of(config, 0)
        return cls(
            config.q_heads_per_rank,
            kv.stop - kv.start,
            config.head_dim,
            v_head_dim or config.head_dim,
            config.use_mla,
            config.pcp,
            config.dcp,
            config.interleave,
            workspace_size,
            elem_bytes,
        )


def comm_plan(
    strategy: str,
    context_lens: Sequence[int],
    query_lens: Sequence[int],
    sizes: RankSizes,
    dcp_comm_backend: str = "a2a",
) -> list[tuple[str, int]]:
    """The table above from one rank's :class:`RankSizes`."""
    check_strategy(strategy)
    check_comm_backend(dcp_comm_backend)
    e, h, pcp, dcp = sizes.elem_bytes, sizes.q_heads_per_rank, sizes.pcp, sizes.dcp
    d, dv, g = sizes.head_dim, sizes.v_head_dim, dcp if dcp > 1 else pcp
    r = sum(padded_len(t, pcp) for t in query_lens) // pcp
    if strategy == "allgather_q":
        if g == 1:
            return []
        gather_q = ("all_gather", r * h * d * e * (g - 1))
        if dcp_comm_backend == "a2a":
            return [gather_q, ("all_to_all", r * h * (dv + 1) * e * (g - 1))]
        return [
            gather_q,
            ("all_gather", r * g * h * e * (g - 1)),
            ("reduce_scatter", r * h * dv * e * (g - 1)),
        ]
    width = sizes.kv_heads_per_rank * (d if sizes.latent else d + dv)
    calls = [("all_gather", r * width * e * (pcp - 1))] if pcp > 1 else []
    if dcp > 1:
        calls += context_gather_comm_bytes(
            list(context_lens), sizes.workspace_size, dcp, sizes.interleave, width, e
        )
    return calls


def chunked_comm_bytes(
    strategy: str,
    context_lens: Sequence[int],
    query_lens: Sequence[int],
    config: ParallelConfig,
    *,
    workspace_size: int,
    v_head_dim: int | None = None,
    elem_bytes: int = 8,
) -> list[tuple[str, int]]:
    """``[(op, bytes sent per rank), ...]`` of one layer of ``strategy`` in call order on every
    rank of ``config`` (validated as it was built; ``use_mla`` means a latent cache without
    values, ``v_head_dim`` ``None`` means ``head_dim``); AllGather-Q combines with
    ``config.dcp_comm_backend``."""
    check_strategy(strategy)
    sizes = RankSizes.of(config, workspace_size, v_head_dim, elem_bytes)
    return comm_plan(strategy, context_lens, query_lens, sizes, config.dcp_comm_backend)


@dataclass(frozen=True)
class StrategyChoice:
    """The selector's answer: the strategy, and per strategy its calls, bytes and seconds."""

    strategy: str
    calls: dict[str, int]
    bytes: dict[str, int]
    seconds: dict[str, float]
    alpha: float
    beta: float


def select_strategy(
    plans: Mapping[str, Sequence[tuple[str, int]]],
    alpha: float | None = None,
    beta: float | None = None,
) -> StrategyChoice:
    """Price each strategy's call list as ``calls·α + bytes·β``; the cheaper wins (ties: KV)."""
    a = CPU_ALPHA_S if alpha is None else alpha
    b = CPU_BETA_S_PER_BYTE if beta is None else beta
    sent = {st: comm_bytes(plans[st]) for st in STRATEGIES}
    secs = {st: len(plans[st]) * a + sent[st] * b for st in STRATEGIES}
    best = min(STRATEGIES[::-1], key=secs.get)
    return StrategyChoice(best, {st: len(plans[st]) for st in STRATEGIES}, sent, secs, a, b)


def choose_strategy(
    batch_tokens: int | Sequence[int],
    context_tokens: int | Sequence[int],
    config: ParallelConfig,
    *,
    workspace_size: int = 16384,
    v_head_dim: int | None = None,
    elem_bytes: int = 2,
    alpha: float | None = None,
    beta: float | None = None,
) -> StrategyChoice:
    """AllGather-Q or AllGather-KV for one layer of ``config``, by :func:`select_strategy` on
    exact bytes (:func:`chunked_comm_bytes`).

    ``batch_tokens`` / ``context_tokens``: one request's chunk and context lengths, or one per
    request.  ``alpha`` (s per call) and ``beta`` (s per byte) default to :data:`CPU_ALPHA_S` and
    :data:`CPU_BETA_S_PER_BYTE`.
    """
    ts = [batch_tokens] if isinstance(batch_tokens, int) else list(batch_tokens)
    cs = [context_tokens] if isinstance(context_tokens, int) else list(context_tokens)
    if len(ts) != len(cs):
        raise ConfigError(
            "one-context-per-request",
            "as many context lengths as chunks",
            batch_tokens=batch_tokens,
            context_tokens=context_tokens,
        )
    kw = dict(workspace_size=workspace_size, v_head_dim=v_head_dim, elem_bytes=elem_bytes)
    plans = {st: chunked_comm_bytes(st, cs, ts, config, **kw) for st in STRATEGIES}
    return select_strategy(plans, alpha, beta)
