"""Collectives by an α–β model, and one decode step's attention per layer (chapter 6)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from cpbook.core.config import ParallelConfig
from cpbook.core.errors import RuleError
from cpbook.core.heads import attention_kv_heads, tpa_config
from cpbook.costmodel import gpu_terms as gt
from cpbook.costmodel.knobs import DEFAULT_HBM_EFFICIENCY, CostKnobs
from cpbook.costmodel.memory import kv_bytes_per_token
from cpbook.costmodel.specs import LINKS, GPUSpec, LinkSpec, ModelSpec, check_tokens
from cpbook.dcp.comm_bytes import (
    V_UP_PROJ_FIRST_MIN_TOKENS,
    check_v_up_proj_combine,
    tpa_comm_bytes,
    tpa_costs,
)

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
#: bytes per LSE value in vLLM's DCP combine: ``cp_lse_ag_out_rs`` all-gathers fp32 LSEs, the
#: ``a2a`` backend packs each fp32 LSE into two 16-bit slots of the output (vLLM v0.34.0,
#: ``vllm/v1/attention/ops/dcp.py``)
LSE_BYTES = 4


def collective_time(op: str, bytes_per_rank: float, group_size: int, link: LinkSpec) -> float:
    """Seconds of one collective: ``alpha + bytes_per_rank / bw``, 0 for a group of one.

    ``bytes_per_rank`` is what one rank *sends* (the convention of the traces and of every
    ``*_comm_bytes`` formula: ``(N-1)·chunk`` for a ring all-gather or reduce-scatter,
    ``2·(N-1)/N·size`` for a ring all-reduce), so the ring's bandwidth term is exact and the
    algorithm's step count is folded into ``alpha``.
    """
    if op not in COLLECTIVES:
        raise RuleError("collective-op", f"op in {COLLECTIVES}", op=op)
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise RuleError("positive-group", "a positive int", group_size=group_size)
    if bytes_per_rank < 0:
        raise RuleError("non-negative-bytes", ">= 0", bytes_per_rank=bytes_per_rank)
    if group_size == 1:
        return 0.0
    return link.alpha_s + bytes_per_rank / link.bw_bytes_per_s


def alpha_from_allreduce(seconds: float, group_size: int, nbytes: int, link: LinkSpec) -> float:
    """The α a measured all-reduce of ``nbytes`` on ``group_size`` GPUs implies: its time minus
    the ring's transfer, ``2·(N−1)/N·nbytes`` sent per rank over ``link``'s bandwidth."""
    sent = 2 * (group_size - 1) * nbytes / group_size
    return seconds - sent / link.bw_bytes_per_s


# ---------------------------------------------------------------- one decode step, per layer

DECODE_MODES = ("no_cp", "dcp", "dcp_tpa")
__all__ = [
    "COLLECTIVES",
    "DECODE_MODES",
    "DEFAULT_HBM_EFFICIENCY",
    "DecodeLayerTime",
    "alpha_from_allreduce",
    "batch_for",
    "collective_time",
    "decode_attention_calls",
    "decode_break_even",
    "decode_layer_time",
    "kv_read_efficiency",
    "tpa_weight_costs",
]


@dataclass(frozen=True)
class DecodeLayerTime:
    """Modelled seconds of one layer's attention in one decode step, on one GPU.

    ``kv_read_s``: streaming this GPU's KV share from HBM; ``comm_s``: the layer's collectives
    (``calls``, ``[(op, group size, bytes sent)]``, α–β each); ``q_proj_extra_s``: reading the
    extra ``q_proj`` weights TPA replicates; ``w_uk_t_extra_s``: for MLA, reading the extra
    absorbed ``W_UK_T`` heads of ``W_UK_T_dcp_qrep``.  Work that is the same in every mode (the
    rest of ``q_proj``, ``o_proj``, the MLP) is left out: it shifts the step but not the
    break-even.
    """

    kv_read_s: float
    comm_s: float
    q_proj_extra_s: float
    calls: tuple[tuple[str, int, int], ...]
    w_uk_t_extra_s: float = 0.0

    @property
    def total_s(self) -> float:
        return self.kv_read_s + self.comm_s + self.q_proj_extra_s + self.w_uk_t_extra_s


def _decode_config(
    model: ModelSpec, mode: str, tp: int, dcp: int, dcp_comm_backend: str
) -> ParallelConfig:
    if mode not in DECODE_MODES:
        raise RuleError("decode-mode", f"mode in {DECODE_MODES}", mode=mode)
    if mode == "dcp_tpa":
        return tpa_config(
            True,
            tensor_parallel_size=tp,
            decode_context_parallel_size=dcp,
            dcp_comm_backend=dcp_comm_backend,
            **model.attention_shape,
        )
    return ParallelConfig.for_model(
        model,
        tensor_parallel_size=tp,
        decode_context_parallel_size=1 if mode == "no_cp" else dcp,
        dcp_comm_backend=dcp_comm_backend,
    )


def decode_attention_calls(
    model: ModelSpec,
    cfg: ParallelConfig,
    tpa: bool,
    num_reqs: int,
    act_bytes: int = 2,
    v_up_proj_combine: bool = False,
) -> tuple[tuple[str, int, int], ...]:
    """One layer's decode-attention collectives on one GPU of ``cfg``, as
    ``(op, group_size, bytes_per_rank)``: :func:`cpbook.dcp.tpa.tpa_comm_bytes` (standard or TPA)
    with MLA's latent widths or GQA's head dim, ``cfg.dcp_comm_backend``'s combine, activations
    of ``act_bytes`` and vLLM's fp32 LSE (:data:`LSE_BYTES`), all-reduces over TP and the rest
    over DCP.  ``v_up_proj_combine`` (MLA, ``a2a``, no PCP) prices vLLM v0.34.0's
    up-projection before the All2All (:func:`cpbook.dcp.mla.dcp_a2a_v_up_proj_lse_reduce`):
    from :data:`~cpbook.dcp.mla.V_UP_PROJ_FIRST_MIN_TOKENS` requests it carries ``v_head_dim``
    (``qk_nope_head_dim`` in the MLA models priced here) values per head instead of
    ``kv_lora_rank``; the ``W_UV`` it reads for every gathered head is not priced.  vLLM takes
    that path only where its direct symmetric-memory All2All is off (off CUDA, or across nodes
    without symmetric memory), so it is off by default here (one H200 node)."""

    if model.use_mla:
        q_dim, out_dim = model.kv_lora_rank + model.qk_rope_head_dim, model.kv_lora_rank
        if v_up_proj_combine:
            check_v_up_proj_combine(cfg.dcp_comm_backend, cfg.pcp)
        if v_up_proj_combine and num_reqs >= V_UP_PROJ_FIRST_MIN_TOKENS:
            out_dim = model.head_dim - model.qk_rope_head_dim
    else:
        q_dim = out_dim = model.head_dim
    calls = tpa_comm_bytes(cfg, num_reqs, q_dim, out_dim, model.hidden_size, act_bytes, LSE_BYTES)
    return tuple((op, cfg.tp if op == "all_reduce" else cfg.dcp, b) for op, b in calls)


def tpa_weight_costs(
    model: ModelSpec, cfg: ParallelConfig, num_reqs: int, act_bytes: int = 2
) -> dict[str, int]:
    """:func:`cpbook.dcp.tpa.tpa_costs` of one layer of ``model`` on a GPU of ``cfg``: the query
    projection (``q_b_proj`` for MLA, ``q_proj`` for GQA) in the model's weight dtype and, for
    MLA, the absorbed ``W_UK_T`` (``qk_nope_head_dim × kv_lora_rank`` per head) in the activation
    dtype, which ``dcp_q_replicate`` all-gathers into ``W_UK_T_dcp_qrep``."""
    q_in = model.q_lora_rank or model.hidden_size
    w_uk_t = 0
    if model.use_mla:
        w_uk_t = (model.head_dim - model.qk_rope_head_dim) * model.kv_lora_rank * act_bytes
    return tpa_costs(cfg, q_in, num_reqs, model.head_dim, model.weight_bytes_per_param, w_uk_t)


def kv_read_efficiency(
    hbm_efficiency: float, num_reqs: int, kv_heads: int, unit: float | None = None
) -> float:
    """Fraction of HBM bandwidth decode attention streams the KV at: ``hbm_efficiency`` once
    the GPU has enough (request x KV head) work units, less below (``unit`` per unit: ``None``
    for the modelled :data:`~cpbook.costmodel.gpu_terms.DECODE_ATTENTION_UNIT_EFFICIENCY`,
    else a measured one-request, one-KV-head fraction)."""
    unit = gt.DECODE_ATTENTION_UNIT_EFFICIENCY if unit is None else unit
    return min(hbm_efficiency, unit * num_reqs * max(kv_heads, 1))


def decode_layer_time(
    model: ModelSpec,
    gpu: GPUSpec,
    context_tokens: float,
    mode: str,
    *,
    tp: int = 8,
    dcp: int = 8,
    num_reqs: int = 1,
    knobs: CostKnobs = CostKnobs(),
) -> DecodeLayerTime:
    """One layer's decode attention on one GPU of a TP group, ``num_reqs`` requests of
    ``context_tokens`` cached tokens each, in ``mode``:

    * ``no_cp``: TP only, every GPU streams its heads' whole KV (MLA: the whole latent);
    * ``dcp``: DCP = ``dcp`` (vLLM's rules), ``1/dcp`` of the tokens, plus the query
      all-gather and the combine;
    * ``dcp_tpa``: the same without the query all-gather (``tensor_parallel_size_attention``
      for GQA, ``dcp_q_replicate`` for MLA), plus reading ``dcp - 1`` more ``q_proj`` shards
      (and for MLA ``dcp - 1`` more shards of the absorbed ``W_UK_T``).

    ``knobs`` (:class:`~cpbook.costmodel.knobs.CostKnobs`) gives the KV dtype, the HBM
    efficiency, the link (default NVLink 4), the combine backend and the activation bytes
    (``mfu`` is not used).  The KV streams at ``hbm_efficiency`` of HBM whatever the batch
    (the whole-model :func:`~cpbook.costmodel.latency.tpot` adds :func:`kv_read_efficiency`'s
    occupancy bound; chapter 8 compares the two); the collectives and their bytes are
    :func:`cpbook.dcp.tpa.tpa_comm_bytes` (activations of ``act_bytes``; all-reduces at the
    CUDA-graph latency :data:`~cpbook.costmodel.gpu_terms.DECODE_ALLREDUCE_ALPHA_S`, the rest at
    ``link``'s α), the extra weights :func:`tpa_weight_costs`; the KV heads a GPU holds
    come from :func:`cpbook.core.heads.attention_kv_heads`.  Every term is linear in
    ``context_tokens``, so :func:`decode_break_even` solves for the crossing exactly.
    """

    check_tokens("context_tokens", context_tokens, integer=False)
    cfg = _decode_config(model, mode, tp, dcp, knobs.dcp_comm_backend)
    link, act_bytes = knobs.link or LINKS["NVLink4"], knobs.act_bytes
    heads = attention_kv_heads(cfg, 0)
    per_head = kv_bytes_per_token(model, knobs.kv_dtype) / model.num_layers / model.num_kv_heads
    kv_bytes = per_head * (heads.stop - heads.start) / cfg.dcp * context_tokens * num_reqs
    hbm = gpu.hbm_bw_bytes_per_s * knobs.hbm_efficiency
    sized = decode_attention_calls(model, cfg, mode == "dcp_tpa", num_reqs, act_bytes)
    extra = tpa_weight_costs(model, cfg, num_reqs, act_bytes)
    graph = replace(link, alpha_s=gt.DECODE_ALLREDUCE_ALPHA_S)
    return DecodeLayerTime(
        kv_read_s=kv_bytes / hbm,
        comm_s=sum(
            collective_time(op, b, n, graph if op == "all_reduce" else link) for op, n, b in sized
        ),
        q_proj_extra_s=extra["extra_weight_bytes"] / hbm,
        calls=sized,
        w_uk_t_extra_s=extra["extra_w_uk_t_bytes"] / hbm,
    )


def decode_break_even(model: ModelSpec, gpu: GPUSpec, mode: str, **kwargs) -> float:
    """Context length (tokens per request) above which ``mode`` beats ``no_cp`` per decode step.

    Both times are linear in the context, ``a + s·L``; the crossing is ``(a_mode - a_no_cp) /
    (s_no_cp - s_mode)``: ``0.0`` if ``mode`` never loses, ``inf`` if it never wins.  ``kwargs``
    go to :func:`decode_layer_time` for both modes.
    """
    if mode == "no_cp":
        raise RuleError("decode-mode", "mode in ('dcp', 'dcp_tpa')", mode=mode)
    big = float(2**20)
    a0, a1 = (decode_layer_time(model, gpu, 0, m, **kwargs).total_s for m in ("no_cp", mode))
    b0, b1 = (decode_layer_time(model, gpu, big, m, **kwargs).total_s for m in ("no_cp", mode))
    saved_per_token = ((b0 - a0) - (b1 - a1)) / big
    if a1 <= a0:
        return 0.0
    if saved_per_token <= 0:
        return math.inf
    return (a1 - a0) / saved_per_token


def batch_for(break_even: Callable[[int], float], target: float, max_batch: int = 1024) -> int:
    """The smallest batch ``b`` in ``[1, max_batch]`` with ``break_even(b) <= target``, by
    bisection: ``break_even`` maps a batch (requests sharing one CP group's collectives) to a
    break-even context and must not increase with it, as :func:`decode_break_even` over
    ``num_reqs`` does (more requests share the same collectives' latency).  E.g. chapter 6's
    ``batch_for(lambda b: decode_break_even(m, g, "dcp", num_reqs=b), 4096)``.  Raises
    ``RuleError`` (rule ``batch-reaches-target``) if even ``max_batch`` does not reach it."""
    if break_even(max_batch) > target:
        raise RuleError(
            "batch-reaches-target",
            "break_even(max_batch) <= target",
            max_batch=max_batch,
            target=target,
        )
    lo, hi = 1, max_batch
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if break_even(mid) <= target else (mid + 1, hi)
    return lo
