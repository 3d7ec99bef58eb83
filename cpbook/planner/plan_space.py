"""The deployment planner's numbers: one deployment priced, the ranking, the search.

A *deployment* is a :class:`~cpbook.costmodel.memory.Deployment` (DP x TP x PCP GPUs, DCP, EP,
query replication) plus a KV cache dtype.  :func:`~cpbook.planner.search_space.deployments`
enumerates every one that uses at most ``num_gpus`` GPUs and that vLLM v0.34.0 serves for the
model (:func:`~cpbook.planner.vllm_rules.check_deployment`); :func:`estimate` prices one with
the cost model's own functions (memory, :func:`~cpbook.costmodel.latency.ttft`,
:func:`~cpbook.costmodel.latency.tpot`, :func:`~cpbook.costmodel.latency.decode_throughput`);
:func:`brute_force` ranks the unpruned product of every size, the reference
:func:`cpbook.planner.plan.plan` must equal.

A deployment may leave GPUs idle: at a fixed concurrency, more replicas only split the same
batch, so the best use of 16 GPUs can be 8 of them.  Output tokens per second are counted per
GPU *used*, which makes the best objective a non-decreasing function of ``num_gpus``.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace

from cpbook.core.config import ConfigError
from cpbook.core.errors import RuleError
from cpbook.costmodel.knobs import CostKnobs
from cpbook.costmodel.latency import ContinuousBatching, DecodeTime, PrefillTime, tpot, ttft
from cpbook.costmodel.memory import (
    Deployment,
    deployment_kv_budget,
    deployment_kv_bytes_per_token,
    deployment_weight_bytes,
    max_concurrency,
)
from cpbook.costmodel.specs import GPUSpec, ModelSpec
from cpbook.planner.objective import AUTO, OBJECTIVES, resolve_objective
from cpbook.planner.search_space import ServingWorkload, check_num_gpus, deployments
from cpbook.planner.vllm_rules import check_deployment, check_nodes

__all__ = [  # AUTO and OBJECTIVES: cpbook.planner.objective's, re-exported
    "AUTO",
    "DROP_RULES",
    "OBJECTIVES",
    "PARETO_TIMES",
    "RESOLUTION_DIGITS",
    "Cache",
    "Estimate",
    "brute_force",
    "estimate",
    "gpu_seconds_per_token",
    "objective_value",
    "pareto",
    "rank_key",
    "search",
]

#: why an evaluated deployment is dropped, in the order they are tested
DROP_RULES = ("model-fits", "holds-concurrency", "ttft-target", "tpot-target")


@dataclass(frozen=True)
class Estimate:
    """One deployment priced by the cost model.  Memory per GPU: ``weight_bytes``, the KV
    budget left (``kv_budget_bytes``, 0 when the weights do not fit) and one request's KV share
    (``kv_bytes_per_request``, at ``request_tokens``).  ``capacity``: requests held at once on
    all replicas; ``batch = min(concurrency, capacity)``, the batch the times are for.
    ``prefill`` / ``decode``: TTFT of one prompt and the TPOT of the last output token under
    continuous batching (its ``prefill_s``: the prefill chunks each step carries; ``None`` when
    not even one request fits, or when not timed); output tokens per second per
    GPU in steady state and in decode alone (see :func:`estimate`); ``latency_s``: one
    request's TTFT plus its other output tokens at TPOT.  ``drop``: the first of
    :data:`DROP_RULES` it fails, or ``None`` if it serves the workload.

    More than eight parameters: a frozen record of one priced deployment, built by
    :func:`estimate` only.
    """

    deployment: Deployment
    kv_dtype: str
    weight_bytes: float
    kv_budget_bytes: float
    kv_bytes_per_request: float
    capacity: int
    batch: int
    prefill: PrefillTime | None
    decode: DecodeTime | None
    tokens_per_s_per_gpu: float
    decode_tokens_per_s_per_gpu: float
    drop: str | None
    latency_s: float = float("inf")

    @property
    def num_gpus(self) -> int:
        return self.deployment.num_gpus

    @property
    def step_s(self) -> float:
        """The decode step alone (what chapter 6 calls TPOT); +inf when not timed."""
        return self.decode.step_s if self.decode else float("inf")

    @property
    def kv_headroom(self) -> float:
        """The share of a GPU's KV room the busiest replica's requests leave free (0 when it
        holds none): ``1 - ceil(batch / dp) * kv_bytes_per_request / kv_budget_bytes``."""
        if not self.kv_budget_bytes or not self.batch:
            return 0.0
        used = math.ceil(self.batch / self.deployment.dp) * self.kv_bytes_per_request
        return max(0.0, 1 - used / self.kv_budget_bytes)

    @property
    def ttft_s(self) -> float:
        return self.prefill.total_s if self.prefill else float("inf")

    @property
    def tpot_s(self) -> float:
        """TPOT with the prefill chunks of other requests each step carries (continuous
        batching's interference); +inf when not timed."""
        return self.decode.total_s if self.decode else float("inf")

    @property
    def label(self) -> str:
        """``"TP8+DCP8"`` with ``+QR`` for MLA's query replication and ``/fp8`` for FP8 KV."""
        name = self.deployment.label.replace("+TPA", "+QR")
        return name + ("/fp8" if self.kv_dtype == "fp8" else "")

    def key(self) -> tuple:
        """A total order on deployments, fewest GPUs and smallest sizes first."""
        lay = self.deployment
        return (lay.num_gpus, lay.tp, lay.pcp, lay.dcp, lay.dp, lay.ep, lay.tpa, self.kv_dtype)


#: significant figures objectives are compared at: a closer call is below the cost model's
#: resolution (its efficiencies are read off another model's tables, α is assumed), so the
#: tie-breaks decide
RESOLUTION_DIGITS = 2


def objective_value(e: Estimate, objective: str) -> float:
    """What ``objective`` ranks ``e`` by, lower is better: a request's latency, minus the
    output tokens/s per GPU, TTFT or TPOT, rounded to :data:`RESOLUTION_DIGITS` significant
    figures."""
    x = {
        "latency": e.latency_s,
        "throughput": -e.tokens_per_s_per_gpu,
        "ttft": e.ttft_s,
        "tpot": e.tpot_s,
    }[objective]
    return x if x == 0 or math.isinf(x) else float(f"{x:.{RESOLUTION_DIGITS}g}")


def rank_key(objective: str) -> Callable[[Estimate], tuple]:
    """Sort key, best first: :func:`objective_value`, then the other metrics (TTFT before
    TPOT for throughput: the user waits for the first token; tokens/s per GPU first for the
    times), the exact objective, and :meth:`Estimate.key`; ValueError for an unknown
    objective."""
    if objective not in OBJECTIVES:
        raise RuleError("plan-objective", f"objective in {OBJECTIVES}", objective=objective)
    if objective == "throughput":
        return lambda e: (
            objective_value(e, objective),
            e.ttft_s,
            e.tpot_s,
            -e.tokens_per_s_per_gpu,
            e.key(),
        )
    if objective == "latency":
        return lambda e: (
            objective_value(e, objective),
            -e.tokens_per_s_per_gpu,
            e.ttft_s,
            e.tpot_s,
            e.latency_s,
            e.key(),
        )
    if objective == "ttft":
        return lambda e: (
            objective_value(e, objective),
            -e.tokens_per_s_per_gpu,
            e.tpot_s,
            e.ttft_s,
            e.key(),
        )
    return lambda e: (
        objective_value(e, objective),
        -e.tokens_per_s_per_gpu,
        e.ttft_s,
        e.tpot_s,
        e.key(),
    )


Cache = dict[tuple, object]


def _cached(cache: Cache | None, key: tuple, compute: Callable[[], object]) -> object:
    if cache is None:
        return compute()
    if key not in cache:
        cache[key] = compute()
    return cache[key]


def _budget(
    model: ModelSpec, gpu: GPUSpec, deployment: Deployment, w: ServingWorkload
) -> float | None:
    try:
        return deployment_kv_budget(model, gpu, deployment, w.memory_utilization)
    except ValueError:  # [model-fits]
        return None


def estimate(
    model: ModelSpec,
    gpu: GPUSpec,
    deployment: Deployment,
    kv_dtype: str,
    w: ServingWorkload,
    *,
    time_dropped: bool = True,
    cache: Cache | None = None,
) -> Estimate:
    """Price one deployment with the cost model's functions: ``deployment_weight_bytes``,
    ``deployment_kv_budget``, ``deployment_kv_bytes_per_token``, ``max_concurrency``, ``ttft`` of
    one prompt and ``tpot`` of the last output token at ``batch``.

    ``tokens_per_s_per_gpu`` is the steady state of continuous batching at that batch, the
    inverse of the sum of :func:`gpu_seconds_per_token`; without its prefill term it is
    ``decode_throughput``'s ``batch / TPOT / num_gpus`` (``decode_tokens_per_s_per_gpu``).
    ``time_dropped=False`` skips the times of a deployment
    already dropped (for the planner's speed); ``cache`` (one per model and GPU) keeps what
    depends only on the arguments of the call it caches: the deployment's weights, its KV budget
    (and ``gpu_memory_utilization``), and ``ttft`` per prompt and replica (a replica's prefill
    does not depend on the KV dtype, nor on DP for a dense model within one node)."""
    weights = _cached(
        cache, ("weights", deployment), lambda: deployment_weight_bytes(model, deployment)
    )
    per_request = deployment_kv_bytes_per_token(model, deployment, kv_dtype) * w.request_tokens
    budget = _cached(
        cache,
        ("budget", deployment, w.memory_utilization),
        lambda: _budget(model, gpu, deployment, w),
    )

    def dropped(rule: str, capacity: int = 0, b: float = 0.0) -> Estimate:
        return Estimate(
            deployment, kv_dtype, weights, b, per_request, capacity, 0, None, None, 0.0, 0.0, rule
        )

    if budget is None:
        return dropped("model-fits")
    mem = {"gpu_memory_utilization": w.memory_utilization}
    capacity = max_concurrency(model, gpu, deployment, w.request_tokens, kv_dtype, **mem)
    batch = min(w.concurrency, capacity)
    if batch == 0 or (capacity < w.concurrency and not time_dropped):
        return dropped("holds-concurrency", capacity, budget)
    # a MoE model's experts span every GPU of the pool (EP or TP over DP x PCP x TP), and the
    # nodes a replica's groups span depend on the world size, so prefill depends on DP then
    nodes = w.nodes(gpu)
    knobs = CostKnobs(kv_dtype=kv_dtype, nodes=nodes)
    wide = model.expert_params or deployment.num_gpus > nodes.gpus_per_node
    dp = deployment.dp if wide else 1
    shape = ("ttft", w.prompt_tokens, deployment.tp, deployment.pcp, deployment.dcp, dp)
    shape += (deployment.ep, deployment.tpa, nodes)
    first = _cached(
        cache, shape, lambda: ttft(model, gpu, deployment, w.prompt_tokens, knobs=knobs)
    )
    late = w.ttft_target_s is not None and first.total_s > w.ttft_target_s
    step = None
    if time_dropped or not late:
        step = tpot(
            model,
            gpu,
            deployment,
            w.request_tokens,
            batch,
            knobs=knobs,
            batching=ContinuousBatching(w.prompt_tokens, w.output_tokens),
        )
    drop = None
    if capacity < w.concurrency:
        drop = "holds-concurrency"
    elif late:
        drop = "ttft-target"
    elif w.tpot_target_s is not None and step.total_s > w.tpot_target_s:
        drop = "tpot-target"
    e = Estimate(
        deployment,
        kv_dtype,
        weights,
        budget,
        per_request,
        capacity,
        batch,
        first,
        step,
        0.0,
        0.0,
        drop,
    )
    if step is None:
        return e
    prefill, decode = gpu_seconds_per_token(e, w.output_tokens)
    return replace(
        e,
        tokens_per_s_per_gpu=1 / (prefill + decode),
        decode_tokens_per_s_per_gpu=batch / step.step_s / deployment.num_gpus,
        latency_s=first.total_s + (w.output_tokens - 1) * step.total_s,
    )


def gpu_seconds_per_token(e: Estimate, output_tokens: int) -> tuple[float, float]:
    """GPU-seconds one output token costs in steady state, ``(prefill, decode)``: the busiest
    replica serves ``r = ceil(batch / dp)`` requests, each prefilled once (one TTFT) and decoded
    ``output_tokens`` steps in the shared batch, so a cycle of ``r * TTFT + output_tokens *
    step`` yields ``batch * output_tokens`` tokens on ``num_gpus`` GPUs (``step``: the decode
    step alone; the aggregated TPOT, :attr:`Estimate.tpot_s`, spreads the same prefill work
    over the steps)."""
    r = math.ceil(e.batch / e.deployment.dp)
    per = e.num_gpus / (e.batch * output_tokens)
    return r * e.ttft_s * per, output_tokens * e.decode.step_s * per


def search(
    model: ModelSpec,
    gpu: GPUSpec,
    num_gpus: int,
    w: ServingWorkload,
    time_dropped: bool = False,
    cache: Cache | None = None,
) -> tuple[list[Estimate], Counter]:
    """Every deployment of :func:`deployments`, priced (the times of dropped ones only with
    ``time_dropped``); and how many candidates each rule rejected.  ``cache``: one to share
    between searches of the same model and GPU (a fresh one by default)."""
    check_num_gpus(num_gpus)
    rejected: Counter = Counter()
    cache = {} if cache is None else cache
    rows = [
        estimate(model, gpu, deployment, kv, w, time_dropped=time_dropped, cache=cache)
        for deployment, kv in deployments(model, num_gpus, w, rejected, w.nodes(gpu).gpus_per_node)
    ]
    return rows, rejected


def brute_force(
    model: ModelSpec, gpu: GPUSpec, num_gpus: int, w: ServingWorkload, objective: str
) -> list[Estimate]:
    """The deployments that serve ``w``, best first, found without pruning: every
    ``dp, tp, pcp, dcp`` in ``1..num_gpus`` with ``dp * tp * pcp <= num_gpus``, EP and query
    replication on and off, every allowed KV dtype, each checked by :func:`check_deployment` and
    priced by :func:`estimate` without a cache; ``objective`` as :func:`resolve_objective`
    resolves it."""
    check_num_gpus(num_gpus)
    key = rank_key(resolve_objective(model, w, objective)[0])
    sizes = range(1, num_gpus + 1)
    found = []
    for dp, tp, pcp, dcp in itertools.product(sizes, repeat=4):
        if dp * tp * pcp > num_gpus:
            continue
        for ep, tpa, kv in itertools.product((False, True), (False, True), w.kv_dtypes):
            deployment = Deployment(tp=tp, dcp=dcp, pcp=pcp, dp=dp, ep=ep, tpa=tpa)
            try:
                check_deployment(model, deployment, kv, model_runner_v2=w.model_runner_v2)
                check_nodes(deployment, w.nodes(gpu).gpus_per_node, num_gpus)
            except ConfigError:
                continue
            e = estimate(model, gpu, deployment, kv, w)
            if e.drop is None:
                found.append(e)
    return sorted(found, key=key)


PARETO_TIMES = ("ttft_s", "tpot_s")


def pareto(rows: list[Estimate], times: str | tuple[str, ...] = PARETO_TIMES) -> list[Estimate]:
    """The Pareto set of ``rows`` on ``times`` (attributes, lower is better: default TTFT and
    TPOT with prefill interference) and tokens/s per GPU (higher is better), fastest first.

    Guarantees: a row is kept iff no other row is at least as good on every metric and
    better on one; of rows equal on every metric only the first by :meth:`Estimate.key` is
    kept (a tie adds no choice).  Sorted by the metrics, a row is dominated or tied iff a row
    already kept is at least as good on the rest (dominance is transitive)."""
    names = (times,) if isinstance(times, str) else tuple(times)

    def metrics(e: Estimate) -> tuple[float, ...]:
        return (*(getattr(e, t) for t in names), -e.tokens_per_s_per_gpu)

    out: list[Estimate] = []
    kept: list[tuple[float, ...]] = []
    for e in sorted(rows, key=lambda e: (metrics(e), e.key())):
        m = metrics(e)
        if not any(all(a <= b for a, b in zip(k[1:], m[1:])) for k in kept):
            out.append(e)
            kept.append(m)
    return out
