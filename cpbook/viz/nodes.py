"""Where a deployment's GPUs sit in nodes, which group each belongs to, and which link each
group's collectives cross: NVLink inside a node, RDMA between nodes.

The groups are the cost model's (:func:`cpbook.costmodel.nodes.group_ranks`, vLLM v0.34.0's
DP x PCP x TP rank layout, TP innermost) and a group *spans nodes* exactly when
:func:`cpbook.costmodel.nodes.spans_nodes` says so, so the figure shows the link the planner
priced.  One more kind is vLLM's and not the cost model's: the routed experts of a MoE model
without expert parallelism are sharded with TP over every GPU of every DP replica and PCP rank
(``FusedMoEParallelConfig.flatten_tp_across_dp_and_pcp`` in
``vllm/model_executor/layers/fused_moe/config.py``, v0.34.0), so with DP or PCP above 1 each
MoE layer's collectives span all of them (kind ``"moe"``, drawn when asked for with
``moe=True``).  Data units of the figure are inches.
"""

from __future__ import annotations

from collections.abc import Sequence

from matplotlib.patches import FancyBboxPatch, Rectangle

from cpbook.costmodel.memory import Deployment
from cpbook.costmodel.nodes import group_ranks, node_count, spans_nodes
from cpbook.viz.style import VERMILLION, figure, ink, legible, rank_color, tint

__all__ = ["INTRA_NODE", "INTER_NODE", "active_groups", "group_links", "node_map_figure"]

#: the link a collective crosses inside a node and between nodes
INTRA_NODE, INTER_NODE = "NVLink", "RDMA"
#: row order of the figure, outermost first; "dp" is the replica, not a collective group
_ROWS = ("dp", "pcp", "tp", "dcp", "ep", "moe")
_NAMES = {"dp": "DP", "pcp": "PCP", "tp": "TP", "dcp": "DCP", "ep": "EP", "moe": "MoE"}


def active_groups(deployment: Deployment, moe: bool = False) -> list[str]:
    """The collective group kinds ``deployment`` runs, in :data:`_ROWS` order: ``tp``, ``pcp``
    and ``dcp`` when their size is above 1, ``ep`` with expert parallelism, and for a MoE model
    (``moe``) without it ``moe`` when DP or PCP is above 1 (else its experts' group is TP's)."""
    d = deployment
    on = {"pcp": d.pcp > 1, "tp": d.tp > 1, "dcp": d.dcp > 1, "ep": d.ep}
    on["moe"] = moe and not d.ep and (d.dp > 1 or d.pcp > 1)
    return [k for k in _ROWS if on.get(k)]


def group_links(
    deployment: Deployment, gpus_per_node: int = 8, moe: bool = False
) -> dict[str, str]:
    """``kind -> link`` for each of :func:`active_groups`: :data:`INTER_NODE` when some group of
    that kind has GPUs on two nodes (``--nnodes`` puts ``world // nnodes`` consecutive ranks on
    each node), else :data:`INTRA_NODE`."""
    return {
        # the experts' group holds every rank, as EP's does
        k: INTER_NODE
        if spans_nodes(deployment, "ep" if k == "moe" else k, gpus_per_node)
        else INTRA_NODE
        for k in active_groups(deployment, moe)
    }


def _membership(deployment: Deployment, kind: str) -> dict[int, tuple[int, int]]:
    """``rank -> (group index, rank in group)`` for ``kind`` ("dp": the replica; "moe": every
    rank, its flattened TP rank the global rank)."""
    if kind == "dp":
        per = deployment.num_gpus // deployment.dp
        return {r: (r // per, r // per) for r in range(deployment.num_gpus)}
    if kind == "moe":
        return {r: (0, r) for r in range(deployment.num_gpus)}
    return {
        r: (g, i)
        for g, ranks in enumerate(group_ranks(deployment, kind))
        for i, r in enumerate(ranks)
    }


def node_map_figure(
    deployments: Sequence[tuple[str, Deployment]],
    gpus_per_node: int = 8,
    width: float = 7.2,
    moe: bool = False,
):
    """One panel per ``(title, deployment)`` (the title names the model and layout): a column
    per GPU, framed by node; under each GPU, a row per group kind (DP replica, PCP, TP, DCP,
    EP, and for a MoE model (``moe``) its experts' group) whose cell colour is the GPU's group
    and whose number is its rank in that group; on the right, the link the kind's collectives
    cross (:func:`group_links`; RDMA in vermillion)."""
    left, right, gap, cell_h, head = 0.6, 1.25, 0.4, 0.34, 0.78
    worlds = [d.num_gpus for _, d in deployments]
    max_nodes = max(node_count(w, gpus_per_node) for w in worlds)
    col = min(0.6, (width - left - right - gap * (max_nodes - 1)) / max(worlds))
    panels = []
    for title, d in deployments:
        rows = ["dp"] * (d.dp > 1) + active_groups(d, moe)
        panels.append((title, d, rows, head + cell_h * (len(rows) + 1) + 0.25))
    fig, ax = figure(figsize=(width, sum(p[3] for p in panels)))
    y0 = sum(p[3] for p in panels)
    for title, d, rows, height in panels:
        y0 -= height
        top = y0 + height - 0.2
        nnodes = node_count(d.num_gpus, gpus_per_node)
        per_node = d.num_gpus // nnodes
        where = "one node" if nnodes == 1 else f"{nnodes} nodes"
        ax.text(0, top, f"{title}: {d.num_gpus} GPUs, {where}", weight="bold", va="center")

        def x_of(rank: int) -> float:
            return left + rank * col + (rank // per_node) * gap

        for n in range(nnodes):
            x = x_of(n * per_node) - 0.05
            w = per_node * col + 0.1
            ax.add_patch(
                FancyBboxPatch(
                    (x, y0 + 0.05),
                    w,
                    top - 0.3 - y0,
                    boxstyle="round,pad=0,rounding_size=0.06",
                    facecolor="#F4F4F4",
                    edgecolor="#888888",
                    lw=0.8,
                )
            )
            ax.text(x + w / 2, top - 0.42, f"node {n}", ha="center", va="center")
        if nnodes > 1:
            for n in range(1, nnodes):
                ax.text(
                    x_of(n * per_node) - gap / 2,
                    y0 + 0.3,
                    INTER_NODE,
                    rotation=90,
                    ha="center",
                    va="bottom",
                    color=VERMILLION,
                    weight="bold",
                )
        links = group_links(d, gpus_per_node, moe)
        for i, kind in enumerate(["gpu", *rows]):
            y = top - 0.62 - cell_h * (i + 1)
            ax.text(left - 0.1, y + cell_h / 2, _NAMES.get(kind, "GPU"), ha="right", va="center")
            member = None if kind == "gpu" else _membership(d, kind)
            for r in range(d.num_gpus):
                g, k = (0, r) if member is None else member[r]
                face = "white" if member is None else tint(rank_color(g), 0.35)
                ax.add_patch(
                    Rectangle(
                        (x_of(r), y), col, cell_h, facecolor=face, edgecolor="#555555", lw=0.6
                    )
                )
                ax.text(
                    x_of(r) + col / 2,
                    y + cell_h / 2,
                    str(k),
                    ha="center",
                    va="center",
                    color=ink(face),
                )
            link = {"gpu": "", "dp": "own requests"}.get(kind, links.get(kind))
            ax.text(
                x_of(d.num_gpus - 1) + col + 0.12,
                y + cell_h / 2,
                link,
                va="center",
                color=VERMILLION if link == INTER_NODE else "black",
                weight="bold" if link == INTER_NODE else "normal",
            )
    ax.set_xlim(0, width)
    ax.set_ylim(0, sum(p[3] for p in panels))
    ax.axis("off")
    return legible(fig)
