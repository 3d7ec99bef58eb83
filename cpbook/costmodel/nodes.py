"""Several nodes: which of a deployment's collective groups cross the inter-node link.

A node holds ``gpus_per_node`` GPUs on one scale-up link (NVLink in an HGX / DGX node); GPUs
on different nodes talk over the inter-node link (RDMA, :data:`~cpbook.costmodel.specs.LINKS`'s
``RDMA400`` by default).  vLLM lays the global ranks out as DP x PCP x TP, TP innermost
(``all_ranks = arange(world).reshape(-1, dp, pp, pcp, tp)`` in ``initialize_model_parallel``,
``vllm/distributed/parallel_state.py``, v0.34.0), and its multi-node launch (``--nnodes N
--node-rank R``, ``EngineArgs.create_engine_config`` in ``vllm/engine/arg_utils.py``) runs
``world // N`` consecutive ranks on each node, so node ``R`` holds ranks ``[R * L, (R + 1) * L)``
with ``L = world // N``.  The groups, as rank sets (the order inside a group does not matter
here):

* TP: ``tp`` consecutive ranks; PCP: one TP rank across the PCP slices of a replica (stride
  ``tp``);
* DCP: with PCP 1, ``dcp`` consecutive ranks of a TP group; with PCP, the PCP group
  (``dcp == pcp``) or the whole replica (``dcp == tp * pcp``), v0.34's transpose-then-reshape;
* DP: one (PCP, TP) position across the replicas (stride ``pcp x tp``): the group a MoE layer
  gathers its tokens over without EP (:mod:`cpbook.costmodel.moe_gather`);
* EP: every rank (``dp x pcp x tp``).

A group *spans nodes* when its ranks sit on more than one node; the cost model then prices
its collectives on the inter-node link (:func:`group_link`).  Pure integer arithmetic, no
torch; ``tests/test_costmodel.py`` checks the rank sets against :mod:`cpbook.core.groups`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from cpbook.core.errors import RuleError
from cpbook.costmodel.memory import Deployment
from cpbook.costmodel.specs import LINKS, GPUSpec, LinkSpec, link_of

__all__ = ["GROUP_KINDS", "Nodes", "group_link", "group_ranks", "node_count", "spans_nodes"]

GROUP_KINDS = ("tp", "pcp", "dcp", "dp", "ep")


@dataclass(frozen=True)
class Nodes:
    """How the GPUs sit in nodes: ``gpus_per_node`` on one scale-up link, joined by
    ``inter_node_link``.  Guarantees: ``gpus_per_node`` is a positive int (rule
    ``gpus-per-node``)."""

    gpus_per_node: int = 8
    inter_node_link: LinkSpec = LINKS["RDMA400"]

    def __post_init__(self) -> None:
        n = self.gpus_per_node
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise RuleError("gpus-per-node", "a positive int", gpus_per_node=n)


def node_count(world: int, gpus_per_node: int) -> int:
    """The nodes vLLM's ``--nnodes`` runs ``world`` ranks on: 1 if they fit one node, else the
    fewest ``N`` that divides ``world`` (vLLM requires ``world % nnodes == 0``) with at most
    ``gpus_per_node`` ranks on each."""
    if world <= gpus_per_node:
        return 1
    n = -(-world // gpus_per_node)
    while world % n:
        n += 1
    return n


def group_ranks(deployment: Deployment, kind: str) -> list[list[int]]:
    """The global ranks of every ``kind`` group (one of :data:`GROUP_KINDS`) of ``deployment``,
    each group as a sorted list (DP x PCP x TP layout, TP innermost)."""
    d = deployment
    tp, pcp, dcp, dp = d.tp, d.pcp, d.dcp, d.dp

    def rank(r: int, p: int, t: int) -> int:
        return (r * pcp + p) * tp + t

    if kind == "tp":
        return [[rank(r, p, t) for t in range(tp)] for r in range(dp) for p in range(pcp)]
    if kind == "pcp":
        return [[rank(r, p, t) for p in range(pcp)] for r in range(dp) for t in range(tp)]
    if kind == "dcp":
        if pcp == 1:
            return [
                [rank(r, 0, t0 + j) for j in range(dcp)]
                for r in range(dp)
                for t0 in range(0, tp, dcp)
            ]
        if dcp == pcp:
            return group_ranks(d, "pcp")
        if dcp == 1:
            return [[x] for x in range(d.num_gpus)]
        return [sorted(rank(r, p, t) for p in range(pcp) for t in range(tp)) for r in range(dp)]
    if kind == "dp":
        return [[rank(r, p, t) for r in range(dp)] for p in range(pcp) for t in range(tp)]
    if kind == "ep":
        return [list(range(d.num_gpus))]
    raise RuleError("group-kind", f"kind in {GROUP_KINDS}", kind=kind)


@functools.lru_cache(maxsize=8192)  # deployments are frozen dataclasses
def spans_nodes(deployment: Deployment, kind: str, gpus_per_node: int) -> bool:
    """Whether some ``kind`` group of ``deployment`` has ranks on two nodes or more, with
    ``node_count(num_gpus, gpus_per_node)`` nodes of equal rank counts."""
    world = deployment.num_gpus
    per_node = world // node_count(world, gpus_per_node)
    return any(len({r // per_node for r in g}) > 1 for g in group_ranks(deployment, kind))


def group_link(
    gpu: GPUSpec, deployment: Deployment, kind: str, nodes: Nodes | None, link: LinkSpec | None
) -> LinkSpec:
    """The link a ``kind`` group's collectives run on: ``nodes.inter_node_link`` when the group
    spans nodes, else ``link`` (a caller's override) or the GPU's scale-up link; ``nodes=None``
    is one scale-up domain however many GPUs."""
    if nodes is not None and spans_nodes(deployment, kind, nodes.gpus_per_node):
        return nodes.inter_node_link
    return link or link_of(gpu)
