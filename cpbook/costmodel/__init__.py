"""cpbook's cost model: sourced specs, memory, time, calibration on this machine, and the
deployment planner, with the article's decision path kept as a check on it.

Modules: :mod:`.specs` (GPUs, links, models, every number sourced in ``book/references.bib``),
:mod:`.memory` (weights and KV per GPU, longest request, concurrency), :mod:`.decode` (α–β
collectives and one decode step's attention per layer, chapter 6), :mod:`.gpu_terms` (the GPU
side's efficiencies and fixed costs, read off AIConfigurator's kernel tables),
:mod:`.decode_step` (one decode step of a layout), :mod:`.latency` (TTFT, TPOT
and throughput of whole layouts), :mod:`.calibration` (α, β and throughput of this machine from
``bench/`` runs), :mod:`.decision_path` (the article's three questions, checked against the
planner), :mod:`.hf_config` (model shapes from a ``config.json``), :mod:`.vllm_rules` (what
vLLM v0.33 serves), :mod:`.serve_flags` (the ``vllm serve`` line), and the deployment planner:
:mod:`.plan_space` (the search space, one deployment's numbers), :mod:`.plan_advice` (its
reasons) and :mod:`.plan`.  Every public name is re-exported here, so
``from cpbook import costmodel as cm; cm.X`` keeps working.
"""

from cpbook.costmodel import gpu_terms
from cpbook.costmodel.decision_path import PathAnswer, PathCheck, decision_path, path_vs_plan
from cpbook.costmodel.decode import (
    COLLECTIVES,
    DECODE_MODES,
    DEFAULT_HBM_EFFICIENCY,
    DecodeLayerTime,
    alpha_from_allreduce,
    collective_time,
    decode_break_even,
    decode_layer_time,
    kv_read_efficiency,
    tpa_weight_costs,
)
from cpbook.costmodel.decode_step import decode_step
from cpbook.costmodel.hf_config import SUPPORTED_MODEL_TYPES, model_from_hf_config
from cpbook.costmodel.latency import (
    DEFAULT_MFU,
    DecodeTime,
    PrefillTime,
    decode_bytes_per_step,
    decode_throughput,
    prefill_flops,
    prefill_gemm_flops,
    prefill_throughput,
    tpot,
    tpot_break_even,
    ttft,
)
from cpbook.costmodel.memory import (
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
    weight_bytes_per_gpu,
)
from cpbook.costmodel.plan import Plan, estimate_record, headline, plan
from cpbook.costmodel.plan_advice import WouldFit
from cpbook.costmodel.plan_space import (
    OBJECTIVES,
    Estimate,
    ServingWorkload,
    brute_force,
    deployments,
    estimate,
    objective_value,
    pareto,
)
from cpbook.costmodel.serve_flags import (
    HF_REPOS,
    layout_flags,
    parse_serve_command,
    serve_command,
)
from cpbook.costmodel.specs import (
    ALLREDUCE_BENCH_BYTES,
    ALLREDUCE_BENCH_SOURCE,
    ALLREDUCE_BENCH_US,
    DEFAULT_ACTIVATION_RESERVE_BYTES,
    DEFAULT_GPU_MEMORY_UTILIZATION,
    FP8_DS_MLA_BYTES_PER_TOKEN_PER_LAYER,
    GB,
    GIB,
    GPUS,
    KV_DTYPE_BYTES,
    KV_DTYPES,
    LINKS,
    MODELS,
    GPUSpec,
    LinkSpec,
    ModelSpec,
    get_gpu,
    get_model,
    link_of,
)
from cpbook.costmodel.vllm_rules import PLAN_KV_DTYPES, check_deployment, rule_probes

__all__ = [
    "ALLREDUCE_BENCH_BYTES",
    "ALLREDUCE_BENCH_SOURCE",
    "ALLREDUCE_BENCH_US",
    "alpha_from_allreduce",
    "Estimate",
    "HF_REPOS",
    "OBJECTIVES",
    "PLAN_KV_DTYPES",
    "PathAnswer",
    "PathCheck",
    "Plan",
    "SUPPORTED_MODEL_TYPES",
    "ServingWorkload",
    "WouldFit",
    "brute_force",
    "check_deployment",
    "decision_path",
    "deployments",
    "estimate",
    "estimate_record",
    "headline",
    "layout_flags",
    "objective_value",
    "model_from_hf_config",
    "pareto",
    "parse_serve_command",
    "path_vs_plan",
    "plan",
    "rule_probes",
    "serve_command",
    "DEFAULT_MFU",
    "DecodeTime",
    "PrefillTime",
    "decode_step",
    "decode_throughput",
    "gpu_terms",
    "prefill_gemm_flops",
    "prefill_throughput",
    "tpot",
    "tpot_break_even",
    "ttft",
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
    "KV_DTYPES",
    "LINKS",
    "Layout",
    "LinkSpec",
    "MODELS",
    "ModelSpec",
    "collective_time",
    "decode_break_even",
    "decode_bytes_per_step",
    "decode_layer_time",
    "kv_read_efficiency",
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
    "prefill_flops",
    "tpa_weight_costs",
    "weight_bytes_per_gpu",
]
