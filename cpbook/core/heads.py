"""Head placement: which query and KV heads a TP rank computes and attends.

* :func:`q_heads_of` / :func:`kv_heads_of` — plain TP: a contiguous block of
  ``num_q_heads / tp`` query heads; KV heads split over TP, or one head replicated over
  ``tp // num_kv_heads`` consecutive ranks (vLLM ``QKVParallelLinear``); MLA: the latent.
* :func:`q_proj_heads` / :func:`attention_kv_heads` — the same under TPA, where ``q_proj`` is
  sharded over ``tp / dcp`` attention ranks (GQA ``tensor_parallel_size_attention``, MLA
  ``dcp_q_replicate``; rules in :mod:`cpbook.core.config`).
* :func:`tpa_config` — the :class:`~cpbook.core.config.ParallelConfig` with TPA (``tpa=True``)
  or without; :func:`uses_tpa` reads it back from a config.

These are configuration, not the TPA algorithm (:mod:`cpbook.dcp.tpa`): the cost model, the
engine and the mechanisms all place heads through them."""

from __future__ import annotations

from typing import Any

from cpbook.core.config import ParallelConfig

__all__ = [
    "q_heads_of",
    "kv_heads_of",
    "tpa_config",
    "uses_tpa",
    "q_proj_heads",
    "attention_kv_heads",
]


def q_heads_of(config: ParallelConfig, tp_rank: int) -> slice:
    """The query heads TP rank ``tp_rank`` owns (a contiguous block of ``num_q_heads / tp``)."""
    h = config.q_heads_per_rank
    return slice(tp_rank * h, (tp_rank + 1) * h)


def kv_heads_of(config: ParallelConfig, tp_rank: int) -> slice:
    """The KV heads TP rank ``tp_rank`` holds: split over TP, or one head replicated over
    ``tp // num_kv_heads`` consecutive ranks (vLLM ``QKVParallelLinear``); MLA: the latent."""
    kv, tp = config.num_kv_heads, config.tp
    if config.use_mla:
        return slice(0, 1)
    if kv >= tp:
        return slice(tp_rank * kv // tp, (tp_rank + 1) * kv // tp)
    head = tp_rank // (tp // kv)
    return slice(head, head + 1)


def tpa_config(tpa: bool, **kwargs: Any) -> ParallelConfig:
    """The :class:`ParallelConfig` of ``kwargs`` with or without TPA: ``tpa=True`` sets
    ``tensor_parallel_size_attention = tp / dcp`` (GQA) or ``dcp_q_replicate`` (MLA);
    ``tpa=False`` sets neither."""
    if not tpa:
        return ParallelConfig(**kwargs)
    if kwargs.get("use_mla"):
        return ParallelConfig(**kwargs, dcp_q_replicate=True)
    tp, dcp = kwargs.get("tensor_parallel_size", 1), kwargs.get("decode_context_parallel_size", 1)
    return ParallelConfig(**kwargs, tensor_parallel_size_attention=max(1, tp // dcp))


def uses_tpa(config: ParallelConfig) -> bool:
    """Whether ``config`` runs TPA (``tensor_parallel_size_attention`` or ``dcp_q_replicate``)."""
    return config.tensor_parallel_size_attention is not None or config.dcp_q_replicate


def q_proj_heads(config: ParallelConfig, tp_rank: int) -> slice:
    """Query heads this rank's ``q_proj`` computes: its TP heads (standard) or the heads of its
    whole DCP group, ``dcp × num_q_heads / tp`` of them (TPA)."""
    if not uses_tpa(config):
        return q_heads_of(config, tp_rank)
    n = config.q_heads_per_rank * config.dcp
    g = tp_rank // config.dcp
    return slice(g * n, (g + 1) * n)


def attention_kv_heads(config: ParallelConfig, tp_rank: int) -> slice:
    """KV heads this rank's DCP group attends: one shared head (standard GQA, the latent for MLA)
    or the heads of its attention shard, ``num_kv_heads / tpa`` of them (GQA TPA)."""
    if config.use_mla or config.tensor_parallel_size_attention is None:
        return kv_heads_of(config, tp_rank)
    kv, tpa, a = config.num_kv_heads, config.attention_tp, tp_rank // config.dcp
    if kv >= tpa:
        return slice(a * kv // tpa, (a + 1) * kv // tpa)
    head = a // (tpa // kv)
    return slice(head, head + 1)
