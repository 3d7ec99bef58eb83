"""What the planner searches: the workload a deployment must serve, and every deployment on at
most ``num_gpus`` GPUs that vLLM v0.34.0 serves for a model.

:func:`deployments` is a flat generator over the product of the deployment axes (TP x PCP, the DCP
sizes ``ParallelConfig`` admits, query replication for MLA with DCP, then DP x EP), filtered by
:func:`~cpbook.planner.vllm_rules.check_deployment`; :mod:`cpbook.planner.plan_space` prices what
it yields.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, replace

from cpbook.core.config import ConfigError
from cpbook.core.errors import RuleError
from cpbook.costmodel.memory import Deployment
from cpbook.costmodel.nodes import Nodes
from cpbook.costmodel.specs import LINKS, GPUSpec, ModelSpec, check_tokens
from cpbook.planner.vllm_rules import check_deployment, check_kv_dtype, check_nodes

__all__ = [
    "MAX_PLAN_GPUS",
    "VLLM_GPU_MEMORY_UTILIZATION",
    "ServingWorkload",
    "check_num_gpus",
    "deployments",
]

#: what vLLM v0.34.0's ``gpu_memory_utilization=None`` (its default) resolves to on CUDA and
#: ROCm, where the extensible KV cache is on by default: 1.0, the cache sized from the memory
#: measured free after CUDA-graph capture (``CacheConfig.resolved_gpu_memory_utilization``,
#: ``vllm/config/cache.py``; 0.92 without the extensible cache).  The planner prices this
#: unless told otherwise, and then prints no ``--gpu-memory-utilization``.
VLLM_GPU_MEMORY_UTILIZATION = 1.0

#: the most GPUs one plan searches: the search is over every (TP, PCP, DCP, DP, EP), so its
#: cost grows with the count; a larger count is refused by rule ``plan-gpus-supported``
MAX_PLAN_GPUS = 256


@dataclass(frozen=True)
class ServingWorkload:
    """What a deployment must serve: ``concurrency`` requests in flight, each a prompt of
    ``prompt_tokens`` tokens followed by ``output_tokens`` generated ones; optional targets on
    time to first token and time per output token; the KV cache dtypes allowed (cpbook's
    names, ``bf16`` and ``fp8``); vLLM's ``gpu_memory_utilization`` (``None``: vLLM's
    default, :data:`VLLM_GPU_MEMORY_UTILIZATION`); whether Model Runner V2 (the only one
    that runs PCP; v0.34.0's only GPU runner, v0.33.0's default) is on; and how the GPUs sit
    in nodes: ``gpus_per_node`` (``None``: the GPU's own, 8 for an HGX / DGX node) joined by
    ``inter_node_link`` (a key of :data:`~cpbook.costmodel.specs.LINKS`), see :meth:`nodes`."""

    prompt_tokens: int
    output_tokens: int = 1
    concurrency: int = 1
    ttft_target_s: float | None = None
    tpot_target_s: float | None = None
    kv_dtypes: tuple[str, ...] = ("bf16",)
    gpu_memory_utilization: float | None = None
    model_runner_v2: bool = True
    gpus_per_node: int | None = None
    inter_node_link: str = "RDMA400"

    def __post_init__(self) -> None:
        check_tokens("prompt_tokens", self.prompt_tokens, minimum=1)
        check_tokens("output_tokens", self.output_tokens, minimum=1)
        check_tokens("concurrency", self.concurrency, minimum=1)
        for name in ("ttft_target_s", "tpot_target_s"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise RuleError("positive-target", f"{name} > 0", **{name: v})
        if not self.kv_dtypes or len(set(self.kv_dtypes)) != len(self.kv_dtypes):
            raise RuleError(
                "kv-dtype-choices", "distinct KV dtypes, at least one", kv_dtypes=self.kv_dtypes
            )
        for kv in self.kv_dtypes:
            check_kv_dtype(kv)
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise RuleError(
                "gpu-memory-utilization",
                "0 < gpu_memory_utilization <= 1",
                gpu_memory_utilization=self.gpu_memory_utilization,
            )
        if self.inter_node_link not in LINKS:
            raise RuleError(
                "inter-node-link", f"a key of LINKS {sorted(LINKS)}", link=self.inter_node_link
            )
        if self.gpus_per_node is not None:
            Nodes(self.gpus_per_node)  # rule gpus-per-node

    def nodes(self, gpu: GPUSpec) -> Nodes:
        """The nodes the cost model prices with: ``gpus_per_node`` (default ``gpu``'s) GPUs per
        node, joined by ``inter_node_link``."""
        per_node = self.gpus_per_node or gpu.gpus_per_node
        return Nodes(per_node, LINKS[self.inter_node_link])

    @property
    def memory_utilization(self) -> float:
        """The ``gpu_memory_utilization`` priced: as given, or vLLM's default."""
        if self.gpu_memory_utilization is None:
            return VLLM_GPU_MEMORY_UTILIZATION
        return self.gpu_memory_utilization

    @property
    def request_tokens(self) -> int:
        """Tokens one request caches by its last output token: what capacity and TPOT use."""
        return self.prompt_tokens + self.output_tokens


def check_num_gpus(num_gpus: object) -> None:
    """Rule ``positive-gpus``: a GPU count is a positive ``int``; rule ``plan-gpus-supported``:
    at most :data:`MAX_PLAN_GPUS` (the search's cost grows with the count)."""
    if isinstance(num_gpus, bool) or not isinstance(num_gpus, int) or num_gpus < 1:
        raise RuleError("positive-gpus", "num_gpus >= 1", num_gpus=num_gpus)
    if num_gpus > MAX_PLAN_GPUS:
        raise RuleError(
            "plan-gpus-supported",
            f"num_gpus <= {MAX_PLAN_GPUS} (the largest count the search supports)",
            num_gpus=num_gpus,
        )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _dcp_sizes(tp: int, pcp: int) -> list[int]:
    """DCP sizes ``ParallelConfig`` admits: divisors of TP, or with PCP ``{1, pcp, tp * pcp}``."""
    return _divisors(tp) if pcp == 1 else sorted({1, pcp, tp * pcp})


def _tpa_choices(model: ModelSpec, dcp: int) -> tuple[bool, ...]:
    """Query replication is tried for MLA with DCP only."""
    return (False, True) if model.use_mla and dcp > 1 else (False,)


def _replica_shapes(model: ModelSpec, num_gpus: int) -> Iterator[Deployment]:
    """Every one-replica shape (``dp = 1``, no EP) of at most ``num_gpus`` GPUs, TP then PCP
    then DCP then TPA ascending: the product of the deployment axes, filtered."""
    sizes = itertools.product(range(1, num_gpus + 1), repeat=2)
    return (
        Deployment(tp=tp, dcp=dcp, pcp=pcp, tpa=tpa)
        for tp, pcp in sizes
        if tp * pcp <= num_gpus
        for dcp in _dcp_sizes(tp, pcp)
        for tpa in _tpa_choices(model, dcp)
    )


def _served(
    model: ModelSpec, d: Deployment, kv_dtype: str, rejected: Counter | None, weight: int, **kw
) -> bool:
    """Whether :func:`check_deployment` accepts ``d``; if not, ``rejected[rule] += weight``
    (the candidates the rejection stands for)."""
    try:
        check_deployment(model, d, kv_dtype, **kw)
    except ConfigError as e:
        if rejected is not None:
            rejected[e.rule] += weight
        return False
    return True


def _launches(
    d: Deployment, gpus_per_node: int, num_gpus: int, rejected: Counter | None, weight: int
) -> bool:
    """Whether vLLM's multi-node launch can run ``d`` in the pool
    (:func:`~cpbook.planner.vllm_rules.check_nodes`); if not, ``rejected[rule] += weight``."""
    try:
        check_nodes(d, gpus_per_node, num_gpus)
    except ConfigError as e:
        if rejected is not None:
            rejected[e.rule] += weight
        return False
    return True


def deployments(
    model: ModelSpec,
    num_gpus: int,
    w: ServingWorkload,
    rejected: Counter | None = None,
    gpus_per_node: int | None = None,
) -> Iterator[tuple[Deployment, str]]:
    """Every ``(deployment, kv_dtype)`` on at most ``num_gpus`` GPUs that vLLM serves for
    ``model``.  DCP sizes tried: divisors of TP (PCP = 1), or ``{1, pcp, tp * pcp}`` (the only
    ones ``ParallelConfig`` admits with PCP); EP for MoE models, query replication for MLA with
    DCP.  Each replica shape goes through :func:`check_deployment` once per KV dtype (its rules
    read the KV dtype, not DP), each EP deployment again; with ``gpus_per_node`` (default:
    ``w.gpus_per_node``, else one node) a deployment wider than a node must be launchable on
    the pool's nodes (:func:`~cpbook.planner.vllm_rules.check_nodes`); ``rejected`` counts the
    candidates each rule rejects."""
    eps = (False, True) if model.expert_params else (False,)
    per_node = gpus_per_node or w.gpus_per_node or num_gpus
    for shape in _replica_shapes(model, num_gpus):
        dps = range(1, num_gpus // shape.num_gpus + 1)
        weight = len(dps) * len(eps)
        kvs = [
            kv
            for kv in w.kv_dtypes
            if _served(model, shape, kv, rejected, weight, model_runner_v2=w.model_runner_v2)
        ]
        if not kvs:
            continue
        for dp, ep in itertools.product(dps, eps):
            d = replace(shape, dp=dp, ep=ep)
            if not _launches(d, per_node, num_gpus, rejected, len(kvs)):
                continue
            yield from ((d, kv) for kv in kvs if not ep or _served(model, d, kv, rejected, 1))
