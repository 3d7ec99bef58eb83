"""Where a draft model's KV lives under DCP: replicated on every rank, or sharded like the target.

A drafter that runs ``k`` autoregressive steps per engine step has its own KV cache.  Two
placements (vLLM v0.33 has neither settled for DCP: RFC #53673 and PRs #53427 / #53653 argue
them for PCP + MTP, see chapter 10):

* **replicated** — every rank holds the draft's whole KV of every request and runs the draft
  alone: no collective, ``L`` rows per rank (``L`` the request's tokens), the same drafts
  everywhere because every rank computes the same thing;
* **sharded** — the draft's KV uses the target's interleaved DCP layout: ``local_seq_len(L)``
  rows per rank, and each of the ``k`` draft steps is one DCP decode
  (:func:`cpbook.dcp.decode.dcp_decode_attention`) per draft layer, with its AllGather Q and
  combine.

:func:`draft_kv_rows` and :func:`draft_comm_bytes` are the two sides; the chapter's
``draft_placement_rank`` traces a run of each and checks it equals them.
"""

from __future__ import annotations

from cpbook.core.config import ConfigError, ParallelConfig
from cpbook.dcp.decode import decode_comm_bytes
from cpbook.kv.layout import local_seq_len

__all__ = ["DRAFT_PLACEMENTS", "draft_kv_rows", "draft_comm_bytes"]

DRAFT_PLACEMENTS = ("replicated", "sharded")


def _check(placement: str) -> None:
    if placement not in DRAFT_PLACEMENTS:
        raise ConfigError(
            "draft-placement", f"placement in {DRAFT_PLACEMENTS}", placement=placement
        )


def draft_kv_rows(
    placement: str, seq_len: int, dcp: int, dcp_rank: int, interleave: int = 1
) -> int:
    """Draft KV rows rank ``dcp_rank`` holds for a request of ``seq_len`` tokens, per layer:
    ``seq_len`` (replicated) or ``local_seq_len(seq_len)`` (sharded)."""
    _check(placement)
    if placement == "replicated":
        return seq_len
    return local_seq_len(seq_len, dcp, dcp_rank, interleave)


def draft_comm_bytes(
    placement: str,
    num_reqs: int,
    num_speculative_tokens: int,
    config: ParallelConfig,
    q_dim: int,
    out_dim: int,
    elem_bytes: int = 8,
    num_layers: int = 1,
) -> list[tuple[str, int]]:
    """``[(op, bytes sent per rank)]`` of one engine step's drafting on a rank of ``config``:
    none when replicated; ``k × num_layers`` DCP decodes of ``num_reqs`` rows when sharded
    (call order; ``config.q_heads_per_rank`` heads, ``config.dcp_comm_backend``)."""
    _check(placement)
    if placement == "replicated":
        return []
    one = decode_comm_bytes(
        num_reqs,
        config.q_heads_per_rank,
        q_dim,
        out_dim,
        config.dcp,
        config.dcp_comm_backend,
        elem_bytes,
    )
    return one * (num_speculative_tokens * num_layers)
