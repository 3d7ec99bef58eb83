"""cpbook's cost model: sourced specs, memory, time, calibration on this machine, and the
article's decision path as code.

Modules: :mod:`.specs` (GPUs, links, models, every number sourced in ``book/references.bib``),
:mod:`.memory` (weights and KV per GPU, longest request, concurrency), :mod:`.decode` (α–β
collectives and one decode step's attention per layer, chapter 6), :mod:`.latency` (TTFT, TPOT
and throughput of whole layouts), :mod:`.calibration` (α, β and throughput of this machine from
``bench/`` runs) and :mod:`.recommend` (the decision path).  Every public name is re-exported
here, so ``from cpbook import costmodel as cm; cm.X`` keeps working.
"""

from .decode import (
    COLLECTIVES,
    DECODE_MODES,
    DEFAULT_HBM_EFFICIENCY,
    DecodeLayerTime,
    collective_time,
    decode_break_even,
    decode_layer_time,
)
from .latency import decode_bytes_per_step, prefill_flops
from .memory import (
    Layout,
    kv_budget_bytes_per_gpu,
    kv_bytes_for_context,
    kv_bytes_per_token,
    kv_bytes_per_token_per_gpu,
    kv_replication,
    layout_kv_budget,
    layout_kv_bytes_per_token,
    layout_max_context,
    layout_weight_bytes,
    max_concurrency,
    max_context_tokens,
    parallel_config,
    weight_bytes_per_gpu,
)
from .specs import (
    DEFAULT_ACTIVATION_RESERVE_BYTES,
    DEFAULT_GPU_MEMORY_UTILIZATION,
    FP8_DS_MLA_BYTES_PER_TOKEN_PER_LAYER,
    GB,
    GIB,
    GPUS,
    KV_DTYPE_BYTES,
    LINKS,
    MODELS,
    GPUSpec,
    LinkSpec,
    ModelSpec,
    get_gpu,
    get_model,
    link_of,
)

__all__ = [
    "COLLECTIVES",
    "DECODE_MODES",
    "DEFAULT_ACTIVATION_RESERVE_BYTES",
    "DEFAULT_GPU_MEMORY_UTILIZATION",
    "DEFAULT_HBM_EFFICIENCY",
    "DecodeLayerTime",
    "FP8_DS_MLA_BYTES_PER_TOKEN_PER_LAYER",
    "GB",
    "GIB",
    "GPUS",
    "GPUSpec",
    "KV_DTYPE_BYTES",
    "LINKS",
    "Layout",
    "LinkSpec",
    "MODELS",
    "ModelSpec",
    "collective_time",
    "decode_break_even",
    "decode_bytes_per_step",
    "decode_layer_time",
    "get_gpu",
    "get_model",
    "kv_budget_bytes_per_gpu",
    "kv_bytes_for_context",
    "kv_bytes_per_token",
    "kv_bytes_per_token_per_gpu",
    "kv_replication",
    "layout_kv_budget",
    "layout_kv_bytes_per_token",
    "layout_max_context",
    "layout_weight_bytes",
    "link_of",
    "max_concurrency",
    "max_context_tokens",
    "parallel_config",
    "prefill_flops",
    "weight_bytes_per_gpu",
]
