"""Parallel configuration and every rule that validates it.

:class:`ParallelConfig` uses vLLM's field names (``vllm/config/parallel.py``) plus the model's
attention shape.  Constructing an invalid configuration raises :class:`ConfigError` (a
``ValueError``) whose message names the violated rule and the numbers that violate it.

The source article states one red line, ``DCP_size × KV_heads ≤ TP_size``.  vLLM enforces a
finer set of rules; each rule below says which part of the article's line it refines:

``positive-sizes``
    Every size is a positive integer (the article takes this for granted).
``heads-divisible-by-tp``
    ``num_q_heads % tp == 0`` and, for GQA, KV heads either split evenly over TP
    (``num_kv_heads % tp == 0``) or are replicated evenly (``tp % num_kv_heads == 0``).
    This is plain TP, and the replication case is exactly the redundancy DCP removes.
``gqa-group-divisible-by-kv-heads``
    ``num_q_heads % num_kv_heads == 0``: every KV head serves the same number of Q heads.
``mla-single-latent``
    MLA caches one latent vector per token (``num_kv_heads == 1``): the article's "MLA is like
    KV_head = 1".
``tp-divisible-by-dcp``
    ``tp % dcp == 0`` (PCP = 1): a DCP group is a contiguous slice of one TP group, so DCP
    reuses TP ranks and adds no processes.  Refines "DCP ≤ TP / KV_heads" by requiring exact
    division.
``gqa-dcp-needs-replicated-kv``
    GQA with DCP > 1 needs ``tp > num_kv_heads``: DCP only exists to remove KV-head
    replication, so without replication there is nothing to shard.  This is the strict form of
    the article's inequality.
``gqa-dcp-within-replicas``
    GQA: ``dcp <= tp // num_kv_heads``.  The ``tp // num_kv_heads`` consecutive TP ranks that
    copy one KV head form the DCP group (``QKVParallelLinear`` uses
    ``shard_rank = tp_rank // num_kv_head_replicas``).  This *is* the article's
    ``DCP × KV_heads ≤ TP``.
``gqa-q-per-kv-divisible-by-dcp``
    GQA: ``(num_q_heads // num_kv_heads) % dcp == 0``.  The Q heads of one KV group are
    all-gathered and reduce-scattered across the DCP group, so they must split evenly.  The
    article does not state this rule.
``gqa-dcp-group-shares-kv-head``
    GQA: ``(tp // num_kv_heads) % dcp == 0``.  A DCP group is ``dcp`` consecutive TP ranks and
    the ranks copying one KV head are ``tp // num_kv_heads`` consecutive ranks, so the group
    holds a single KV head only if ``dcp`` divides the number of copies.  vLLM's listed checks
    admit TP=12, 2 KV heads, DCP=4, 24 Q heads, whose DCP group [4, 5, 6, 7] would straddle
    KV heads 0 and 1; cpbook rejects it.  This is the article's inequality made exact.
``interleave-le-block-size`` and ``block-size-divisible-by-interleave``
    ``cp_kv_cache_interleave_size <= block_size`` and ``block_size % interleave == 0``: a
    physical block never mixes two interleave stripes of different ranks.  The article leaves
    this case open ("the materials did not provide handling details").
``pcp-dcp-combination``
    With PCP > 1, ``dcp`` must be 1, ``pcp`` or ``tp * pcp`` (vLLM's ``ParallelConfig``).
``spec-cp-interleave-one``
    Speculative decoding with PCP x DCP > 1 needs ``cp_kv_cache_interleave_size == 1``
    unless the attention backend says otherwise (:func:`check_vllm_spec_interleave`).
``comm-backend``
    ``dcp_comm_backend`` is ``"ag_rs"`` (AllGather + ReduceScatter; vLLM's ``None`` default
    picks it unless the model overrides it) or ``"a2a"`` (one All2All, vLLM's newer backend).

TPA — attention heads sharded over ``tensor_parallel_size_attention`` ranks instead of TP
(GQA; vLLM PR #36287, open as of Nov 2026, its rules in ``tests/distributed/test_dcp_a2a.py``),
and MLA's query replication ``dcp_q_replicate`` (PRs #45964, #50382, merged):

``tpa-divides-tp``
    ``tensor_parallel_size % tensor_parallel_size_attention == 0``.
``tpa-dcp-is-tp-over-tpa``
    ``decode_context_parallel_size == tensor_parallel_size // tensor_parallel_size_attention``:
    the ``tp / tpa`` ranks that share one attention-head shard are exactly one DCP group.  With
    TPA the GQA caps above (``gqa-dcp-*``) no longer apply: a DCP group may hold several KV
    heads, so TP=4, 2 KV heads, DCP=4 (rejected by ``gqa-dcp-within-replicas``) is valid.
``tpa-heads-divisible``
    ``num_q_heads % tpa == 0`` and KV heads split or replicate evenly over ``tpa`` ranks.
``tpa-requires-pcp-1``
    cpbook models TPA without PCP.
``dcp-q-replicate-mla-only``
    ``dcp_q_replicate`` (MLA's TPA) needs ``use_mla`` and DCP > 1.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Protocol

from cpbook.core.errors import RuleError

__all__ = [
    "AttentionShaped",
    "COMM_BACKENDS",
    "check_comm_backend",
    "check_gqa_group",
    "ConfigError",
    "RuleError",
    "ParallelConfig",
    "check_positive",
    "check_interleave",
    "check_vllm_spec_interleave",
]


class ConfigError(RuleError):
    """A configuration rule is violated.  ``rule`` names it; the message gives the values."""


def check_positive(**sizes: object) -> None:
    """Rule ``positive-sizes``: every given size is a positive ``int`` (``bool`` is not a size)."""
    for name, v in sizes.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError("positive-sizes", f"{name} to be a positive integer", **{name: v})


COMM_BACKENDS = ("ag_rs", "a2a")


def check_comm_backend(dcp_comm_backend: str) -> None:
    """Rule ``comm-backend``: ``dcp_comm_backend`` is one of :data:`COMM_BACKENDS`."""
    if dcp_comm_backend not in COMM_BACKENDS:
        raise ConfigError(
            "comm-backend",
            "dcp_comm_backend in {'ag_rs', 'a2a'}",
            dcp_comm_backend=dcp_comm_backend,
        )


def check_gqa_group(num_q_heads: int, num_kv_heads: int) -> None:
    """Rule ``gqa-group-divisible-by-kv-heads``: every KV head serves the same number of query
    heads (for a model, or for the heads one rank holds)."""
    if num_q_heads % num_kv_heads:
        raise ConfigError(
            "gqa-group-divisible-by-kv-heads",
            "num_q_heads % num_kv_heads == 0",
            num_q_heads=num_q_heads,
            num_kv_heads=num_kv_heads,
        )


def check_interleave(block_size: int, interleave: int) -> None:
    """The interleave rules: ``interleave <= block_size`` and ``block_size % interleave == 0``."""
    if block_size < interleave:
        raise ConfigError(
            "interleave-le-block-size",
            "cp_kv_cache_interleave_size <= block_size",
            cp_kv_cache_interleave_size=interleave,
            block_size=block_size,
        )
    if block_size % interleave:
        raise ConfigError(
            "block-size-divisible-by-interleave",
            "block_size % cp_kv_cache_interleave_size == 0",
            block_size=block_size,
            cp_kv_cache_interleave_size=interleave,
        )


class AttentionShaped(Protocol):
    """A model description that knows its attention shape: the engine's
    :class:`~cpbook.engine.models.ModelConfig` and the cost model's
    :class:`~cpbook.costmodel.specs.ModelSpec`."""

    @property
    def attention_shape(self) -> dict[str, Any]:
        """``num_q_heads``, ``num_kv_heads``, ``head_dim`` and ``use_mla``."""


@dataclass(frozen=True)
class ParallelConfig:
    """TP × PCP × DCP layout of one model's attention, validated on construction.

    ``world_size = tensor_parallel_size * prefill_context_parallel_size``; DCP reuses TP (and,
    for ``dcp == pcp`` or ``tp * pcp``, PCP) ranks and adds no processes.
    """

    tensor_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    prefill_context_parallel_size: int = 1
    cp_kv_cache_interleave_size: int = 1
    block_size: int = 16
    num_q_heads: int = 8
    num_kv_heads: int = 8
    head_dim: int = 64
    use_mla: bool = False
    dcp_comm_backend: str = "ag_rs"
    tensor_parallel_size_attention: int | None = None
    dcp_q_replicate: bool = False

    @classmethod
    def for_model(cls, model: AttentionShaped, **layout: Any) -> ParallelConfig:
        """The one way to build a config from a model: its attention shape (``num_q_heads``,
        ``num_kv_heads``, ``head_dim``, ``use_mla`` from ``model.attention_shape``) plus the
        layout's vLLM-named sizes in ``layout``; validated like any other."""
        return cls(**model.attention_shape, **layout)

    # -- convenient short names (read-only) --------------------------------------------
    @property
    def tp(self) -> int:
        return self.tensor_parallel_size

    @property
    def dcp(self) -> int:
        return self.decode_context_parallel_size

    @property
    def pcp(self) -> int:
        return self.prefill_context_parallel_size

    @property
    def interleave(self) -> int:
        return self.cp_kv_cache_interleave_size

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.prefill_context_parallel_size

    @property
    def attention(self) -> str:
        return "mla" if self.use_mla else "gqa"

    @property
    def virtual_block_size(self) -> int:
        """Tokens behind one block id: ``block_size * dcp`` (the same id on every DCP rank)."""
        return self.block_size * self.decode_context_parallel_size

    @property
    def q_heads_per_rank(self) -> int:
        """Query heads each TP rank owns."""
        return self.num_q_heads // self.tensor_parallel_size

    @property
    def kv_head_replicas(self) -> int:
        """How many TP ranks hold a copy of each KV head (1 = no replication; MLA: all of TP)."""
        if self.use_mla:
            return self.tensor_parallel_size
        return max(1, self.tensor_parallel_size // self.num_kv_heads)

    @property
    def attention_tp(self) -> int:
        """Ranks the attention heads are split over: ``tensor_parallel_size_attention`` (TPA)
        or ``tensor_parallel_size``."""
        return self.tensor_parallel_size_attention or self.tensor_parallel_size

    # -- validation ---------------------------------------------------------------------
    def __post_init__(self) -> None:
        check_positive(
            **{f.name: getattr(self, f.name) for f in fields(self) if f.type in ("int", int)}
        )
        tp, dcp, pcp = self.tp, self.dcp, self.pcp
        q, kv = self.num_q_heads, self.num_kv_heads
        check_comm_backend(self.dcp_comm_backend)
        if self.use_mla and kv != 1:
            raise ConfigError(
                "mla-single-latent",
                "num_kv_heads == 1 for MLA (one latent per token)",
                num_kv_heads=kv,
            )
        check_gqa_group(q, kv)
        if q % tp:
            raise ConfigError(
                "heads-divisible-by-tp",
                "num_q_heads % tensor_parallel_size == 0",
                num_q_heads=q,
                tensor_parallel_size=tp,
            )
        if self.tensor_parallel_size_attention is not None:
            self._check_tpa()
            return
        if not self.use_mla and (kv % tp if kv >= tp else tp % kv):
            raise ConfigError(
                "heads-divisible-by-tp",
                "num_kv_heads % tp == 0 (kv >= tp) or tp % num_kv_heads == 0 (kv < tp)",
                num_kv_heads=kv,
                tensor_parallel_size=tp,
            )
        check_interleave(self.block_size, self.interleave)
        if self.dcp_q_replicate and (not self.use_mla or dcp == 1):
            raise ConfigError(
                "dcp-q-replicate-mla-only",
                "use_mla and decode_context_parallel_size > 1 for dcp_q_replicate",
                use_mla=self.use_mla,
                decode_context_parallel_size=dcp,
            )
        if pcp > 1:
            if dcp not in (1, pcp, tp * pcp):
                raise ConfigError(
                    "pcp-dcp-combination",
                    "decode_context_parallel_size in {1, pcp, tp*pcp} when pcp > 1",
                    decode_context_parallel_size=dcp,
                    prefill_context_parallel_size=pcp,
                    tensor_parallel_size=tp,
                )
            dcp_in_tp = tp if dcp == tp * pcp else 1  # dcp == pcp spans PCP slices, not TP ranks
        else:
            if tp % dcp:
                raise ConfigError(
                    "tp-divisible-by-dcp",
                    "tensor_parallel_size % decode_context_parallel_size == 0",
                    tensor_parallel_size=tp,
                    decode_context_parallel_size=dcp,
                )
            dcp_in_tp = dcp
        if not self.use_mla and dcp_in_tp > 1:
            if tp <= kv:
                raise ConfigError(
                    "gqa-dcp-needs-replicated-kv",
                    "tensor_parallel_size > num_kv_heads for GQA with DCP",
                    tensor_parallel_size=tp,
                    num_kv_heads=kv,
                    decode_context_parallel_size=dcp,
                )
            if dcp_in_tp > tp // kv:
                raise ConfigError(
                    "gqa-dcp-within-replicas",
                    "decode_context_parallel_size <= tensor_parallel_size // num_kv_heads "
                    "(the article's DCP x KV_heads <= TP)",
                    decode_context_parallel_size=dcp_in_tp,
                    tensor_parallel_size=tp,
                    num_kv_heads=kv,
                )
            if (q // kv) % dcp_in_tp:
                raise ConfigError(
                    "gqa-q-per-kv-divisible-by-dcp",
                    "(num_q_heads // num_kv_heads) % decode_context_parallel_size == 0",
                    num_q_heads=q,
                    num_kv_heads=kv,
                    decode_context_parallel_size=dcp_in_tp,
                )
            if (tp // kv) % dcp_in_tp:
                raise ConfigError(
                    "gqa-dcp-group-shares-kv-head",
                    "(tensor_parallel_size // num_kv_heads) % decode_context_parallel_size == 0",
                    tensor_parallel_size=tp,
                    num_kv_heads=kv,
                    decode_context_parallel_size=dcp_in_tp,
                )

    def _check_tpa(self) -> None:
        """The TPA rules (module docstring); they replace the GQA DCP caps."""
        tp, dcp, tpa = self.tp, self.dcp, self.tensor_parallel_size_attention
        q, kv = self.num_q_heads, self.num_kv_heads
        check_positive(tensor_parallel_size_attention=tpa)
        check_interleave(self.block_size, self.interleave)
        if self.pcp > 1:
            raise ConfigError(
                "tpa-requires-pcp-1",
                "prefill_context_parallel_size == 1 with tensor_parallel_size_attention",
                prefill_context_parallel_size=self.pcp,
            )
        if tp % tpa:
            raise ConfigError(
                "tpa-divides-tp",
                "tensor_parallel_size % tensor_parallel_size_attention == 0",
                tensor_parallel_size=tp,
                tensor_parallel_size_attention=tpa,
            )
        if dcp != tp // tpa:
            raise ConfigError(
                "tpa-dcp-is-tp-over-tpa",
                "decode_context_parallel_size == tensor_parallel_size // "
                "tensor_parallel_size_attention",
                decode_context_parallel_size=dcp,
                tensor_parallel_size=tp,
                tensor_parallel_size_attention=tpa,
            )
        if q % tpa or (not self.use_mla and (kv % tpa if kv >= tpa else tpa % kv)):
            raise ConfigError(
                "tpa-heads-divisible",
                "num_q_heads % tpa == 0 and num_kv_heads % tpa == 0 (kv >= tpa) or "
                "tpa % num_kv_heads == 0 (kv < tpa)",
                num_q_heads=q,
                num_kv_heads=kv,
                tensor_parallel_size_attention=tpa,
            )


def check_vllm_spec_interleave(
    parallel_config: ParallelConfig, backend_supports_interleave: bool = False
) -> None:
    """vLLM's rule ``spec-cp-interleave-one``: with context parallelism (PCP × DCP > 1), *any*
    speculative method needs ``cp_kv_cache_interleave_size == 1`` unless the attention backend
    declares ``supports_mtp_with_cp_non_trivial_interleave_size`` (FlashMLA sparse and
    TokenSpeed MLA do).  ``check_attention_cp_compatibility`` in ``vllm/v1/worker/cp_utils.py``
    (v0.34.0, as v0.33.0) asserts it whenever ``speculative_config`` is set; only its message
    says MTP.  The mini engine's attention verifies any interleave exactly, so the engine does
    not apply it; a vLLM deployment must."""
    c = parallel_config
    if c.pcp * c.dcp > 1 and c.interleave > 1 and not backend_supports_interleave:
        raise ConfigError(
            "spec-cp-interleave-one",
            "cp_kv_cache_interleave_size == 1 for speculative decoding with PCP x DCP > 1 "
            "(unless the backend supports_mtp_with_cp_non_trivial_interleave_size)",
            cp_kv_cache_interleave_size=c.interleave,
            decode_context_parallel_size=c.dcp,
            prefill_context_parallel_size=c.pcp,
        )
