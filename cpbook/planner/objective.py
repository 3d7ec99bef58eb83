"""What a plan ranks by, and the default that depends on the workload.

:data:`OBJECTIVES` are what :func:`cpbook.planner.plan.plan` can rank by; :data:`AUTO`, its
default, is resolved per workload by :func:`resolve_objective`: a request's latency while the
concurrency is at most :func:`saturation_concurrency` (the batch where decode's KV reads reach
its weight reads, from the cost model's byte counts), output tokens/s per GPU above it.
"""

from __future__ import annotations

from cpbook.core.errors import RuleError
from cpbook.costmodel import gpu_terms as gt
from cpbook.costmodel.memory import kv_bytes_per_token
from cpbook.costmodel.specs import ModelSpec
from cpbook.planner.search_space import ServingWorkload

__all__ = ["AUTO", "OBJECTIVES", "resolve_objective", "saturation_concurrency"]

#: what a plan can rank by: a request's latency (TTFT + the rest of its output at TPOT),
#: output tokens/s per GPU, TTFT, TPOT
OBJECTIVES = ("latency", "throughput", "ttft", "tpot")
#: the default: ``latency`` up to the workload's :func:`saturation_concurrency`,
#: ``throughput`` above it (:func:`resolve_objective`)
AUTO = "auto"


def saturation_concurrency(model: ModelSpec, w: ServingWorkload) -> int:
    """The concurrency at which decode throughput saturates, from the cost model's bytes: the
    least batch ``b`` whose KV reads in one decode step (``b`` requests of ``request_tokens``
    tokens in the first allowed KV dtype) reach the step's weight reads (the dense weights and,
    for MoE, the routed experts ``b`` requests touch, ``gpu_terms.touched_experts``).  Both
    are divided alike by TP and DCP, so it is one number per model and workload.

    Up to it a step is weight-bound: one more request costs little, tokens/s per GPU still
    climbs with the batch (at it, half its ceiling), and a request's latency is what to buy.
    Above it each request adds its own KV reads, tokens/s per GPU is within 2x of its
    ceiling, and throughput per GPU is what to buy.  Guarantees: an int >= 1, non-increasing
    in ``request_tokens``."""
    wb = model.weight_bytes_per_param
    dense = (model.num_params - model.expert_params) * wb
    expert = model.expert_size_params * wb * model.moe_layers
    kv = kv_bytes_per_token(model, w.kv_dtypes[0]) * w.request_tokens

    def weight_bound(b: int) -> bool:
        touched = (
            gt.touched_experts(model.num_experts, model.num_experts_per_tok, b)
            if model.expert_params
            else 0.0
        )
        return b * kv < dense + touched * expert

    lo, hi = 1, 1
    while weight_bound(hi):  # b * kv grows without bound, the weights read are capped
        lo, hi = hi + 1, 2 * hi
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if not weight_bound(mid) else (mid + 1, hi)
    return hi


def resolve_objective(model: ModelSpec, w: ServingWorkload, objective: str) -> tuple[str, str]:
    """``(objective, why)``: :data:`AUTO` resolved by :func:`saturation_concurrency` (up to it
    ``latency``, above it ``throughput``), any of :data:`OBJECTIVES` as given."""
    if objective != AUTO:
        if objective not in OBJECTIVES:
            raise RuleError(
                "plan-objective", f"objective in {(AUTO, *OBJECTIVES)}", objective=objective
            )
        return objective, f"objective {objective} (as asked)"
    sat = saturation_concurrency(model, w)
    if w.concurrency <= sat:
        return "latency", (
            f"objective latency: {w.concurrency:,} in flight, at most the {sat:,} at which "
            f"decode throughput saturates (KV reads reach weight reads), so the lowest latency "
            f"(TTFT + {w.output_tokens - 1:,} tokens at TPOT) that meets the targets wins"
        )
    return "throughput", (
        f"objective throughput: {w.concurrency:,} in flight is above the {sat:,} at "
        f"which decode throughput saturates (KV reads reach weight reads), so output tokens/s "
        f"per GPU wins"
    )
