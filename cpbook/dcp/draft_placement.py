"""Where a draft model's KV lives under DCP: replicated on every rank, or sharded like the target.

A drafter that runs ``k`` autoregressive steps per engine step has its own KV cache.  vLLM
v0.34.0 offers both placements through ``SpeculativeConfig.draft_decode_context_parallel_size``
(``vllm/config/speculative.py``: 1 or the target's DCP), see :func:`vllm_default_draft_dcp`:

* **replicated** (draft DCP 1) — every rank of a DCP group holds the draft's whole KV of every
  request and attends it alone: no DCP collective, ``L`` rows per rank (``L`` the request's
  tokens); vLLM marks these layers ``dcp_sharded=False`` (``get_kv_cache_spec`` in
  ``vllm/v1/worker/gpu/model_runner.py``);
* **sharded** (draft DCP = the target's) — the draft's KV uses the target's interleaved DCP
  layout: ``local_seq_len(L)`` rows per rank, and each draft forward is one DCP decode
  (:func:`cpbook.dcp.decode.dcp_decode_attention`) per draft layer, with its AllGather Q and
  combine.

:func:`draft_kv_rows` and :func:`draft_comm_bytes` are the two sides for ``k`` one-row draft
steps; :func:`draft_step_comm_bytes` prices the mini engine's draft forwards (any rows per
forward, with the draft's TP all-reduces).  The chapter's ``draft_placement_rank`` and
``draft_engine_rank`` trace runs of each and check they equal them.
"""

from __future__ import annotations

from typing import Sequence

from cpbook.core.config import ConfigError, ParallelConfig
from cpbook.dcp.comm_bytes import config_decode_comm_bytes
from cpbook.kv.layout import local_seq_len

__all__ = [
    "DRAFT_PLACEMENTS",
    "DFLASH_METHODS",
    "draft_kv_rows",
    "draft_comm_bytes",
    "draft_step_comm_bytes",
    "vllm_default_draft_dcp",
]

DRAFT_PLACEMENTS = ("replicated", "sharded")
# v0.34.0's drafters built on DFlashSpeculatorConfig (vllm/v1/worker/gpu/spec_decode/): their
# draft defaults to DCP 1 unless it is a full-attention MLA model
DFLASH_METHODS = ("dflash", "dspark")


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
    one = config_decode_comm_bytes(num_reqs, config, q_dim, out_dim, elem_bytes)
    return one * (num_speculative_tokens * num_layers)


def draft_step_comm_bytes(
    rows_per_call: Sequence[int],
    config: ParallelConfig,
    q_dim: int,
    out_dim: int,
    hidden_size: int,
    elem_bytes: int = 8,
    num_layers: int = 1,
) -> list[tuple[str, int]]:
    """``[(op, bytes sent per rank)]`` of draft forwards of ``rows_per_call`` rows each, on a rank
    of the draft's ``config`` (the target's TP, the draft's DCP), in call order: per forward and
    draft layer, a DCP decode of its rows when ``config.dcp > 1`` (``config_decode_comm_bytes``),
    then two TP all-reduces of ``rows × hidden_size`` values when ``config.tp > 1``."""
    calls: list[tuple[str, int]] = []
    tp = config.tp
    for rows in rows_per_call:
        layer: list[tuple[str, int]] = []
        if config.dcp > 1:
            layer += config_decode_comm_bytes(rows, config, q_dim, out_dim, elem_bytes)
        if tp > 1:
            layer += [("all_reduce", 2 * rows * hidden_size * elem_bytes * (tp - 1) // tp)] * 2
        calls += layer * num_layers
    return calls


def vllm_default_draft_dcp(
    method: str,
    decode_context_parallel_size: int,
    draft_use_mla: bool = False,
    draft_sliding_window: bool = False,
) -> int:
    """The draft DCP vLLM v0.34.0 picks when ``draft_decode_context_parallel_size`` is unset:
    the target's (``SpeculatorConfig.default_draft_decode_context_parallel_size``,
    ``vllm/v1/worker/gpu/spec_decode/speculator_config.py``: ``draft_model``, EAGLE, MTP), but
    1 for DFlash and DSpark unless the draft is full-attention MLA
    (``vllm/v1/worker/gpu/spec_decode/dflash/config.py``).  Prompt lookup (``ngram``) has no
    draft model: 1 here, nothing to place."""
    if method == "ngram":
        return 1
    if method in DFLASH_METHODS and not (draft_use_mla and not draft_sliding_window):
        return 1
    return decode_context_parallel_size
