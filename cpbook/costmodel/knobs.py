"""The cost model's GPU-side and backend knobs, one frozen value every time function takes.

Every function that prices time (:func:`~cpbook.costmodel.decode.decode_layer_time`,
:func:`~cpbook.costmodel.decode_step.decode_step`, :func:`~cpbook.costmodel.latency.ttft`,
:func:`~cpbook.costmodel.latency.tpot`) reads the same eight assumptions from one
:class:`CostKnobs` instead of eight keywords each; the defaults are the book's base case.
"""

from __future__ import annotations

from dataclasses import dataclass

from cpbook.core.errors import RuleError
from cpbook.costmodel.nodes import Nodes
from cpbook.costmodel.specs import KV_DTYPES, LinkSpec, check_hbm_efficiency

__all__ = ["CostKnobs", "DEFAULT_HBM_EFFICIENCY"]

#: Fraction of the datasheet HBM bandwidth a decode-attention kernel reaches; FlashMLA reports
#: up to 3000 GB/s on an H800 SXM5 (3.35 TB/s HBM3), about 0.9 — 0.8 leaves room for short rows.
DEFAULT_HBM_EFFICIENCY = 0.8


@dataclass(frozen=True)
class CostKnobs:
    """The assumptions a modelled time depends on besides the model, GPU and deployment.

    ``kv_dtype``: the KV cache's dtype (a key of :data:`~cpbook.costmodel.specs.KV_DTYPES`);
    ``hbm_efficiency``: the fraction of HBM bandwidth weights and KV stream at;
    ``mfu``: ``None`` for the GPU-side terms of :mod:`~cpbook.costmodel.gpu_terms`, else one
    MFU (decode: the GEMMs'; prefill: the former model, every FLOP at it);
    ``link``: the TP (and, in decode, the DCP) link, ``None`` for the default (the GPU's
    scale-up link; :func:`~cpbook.costmodel.decode.decode_layer_time`: NVLink 4);
    ``dcp_comm_backend``: vLLM's DCP combine (``"ag_rs"`` or ``"a2a"``);
    ``act_bytes``: bytes per activation element on the wire;
    ``kv_unit_efficiency``: the fraction of HBM one request's one KV head streams its KV at in
    the whole-model decode step (:func:`~cpbook.costmodel.decode.kv_read_efficiency`), ``None``
    for the modelled :data:`~cpbook.costmodel.gpu_terms.DECODE_ATTENTION_UNIT_EFFICIENCY`
    (a measured one: :func:`~cpbook.costmodel.break_even.stored_kv_read`);
    ``nodes``: how the GPUs sit in nodes (:class:`~cpbook.costmodel.nodes.Nodes`): a TP, PCP,
    DCP or EP group that spans nodes runs on its inter-node link; ``None`` (the default) prices
    every group on the scale-up link, one domain however many GPUs.
    Guarantees: a constructed value passes the rules ``hbm-efficiency`` (also for
    ``kv_unit_efficiency``), ``mfu`` and ``kv-dtype``.
    """

    kv_dtype: str = "bf16"
    hbm_efficiency: float = DEFAULT_HBM_EFFICIENCY
    mfu: float | None = None
    link: LinkSpec | None = None
    dcp_comm_backend: str = "ag_rs"
    act_bytes: int = 2
    kv_unit_efficiency: float | None = None
    nodes: Nodes | None = None

    def __post_init__(self) -> None:
        check_hbm_efficiency(self.hbm_efficiency)
        if self.kv_unit_efficiency is not None:
            check_hbm_efficiency(self.kv_unit_efficiency)
        if self.mfu is not None and not 0 < self.mfu <= 1:
            raise RuleError("mfu", "0 < mfu <= 1", mfu=self.mfu)
        if self.kv_dtype not in KV_DTYPES:
            raise RuleError("kv-dtype", f"kv_dtype in {sorted(KV_DTYPES)}", kv_dtype=self.kv_dtype)
