"""cpbook.viz.nodes: which groups' collectives cross the link between nodes, and the node map."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
from matplotlib.text import Text  # noqa: E402

from cpbook.core.groups import RankGrid  # noqa: E402
from cpbook.costmodel.memory import Deployment as D  # noqa: E402
from cpbook.viz.nodes import (  # noqa: E402
    INTER_NODE,
    INTRA_NODE,
    active_groups,
    group_links,
    node_map_figure,
)

NV, RDMA = INTRA_NODE, INTER_NODE


@pytest.mark.parametrize(
    "deployment, gpus_per_node, links",
    [
        (D(), 8, {}),  # one GPU: no collective group
        (D(tp=4, dcp=4), 8, {"tp": NV, "dcp": NV}),
        (D(tp=8, dcp=2), 8, {"tp": NV, "dcp": NV}),
        (D(tp=8, dcp=8, dp=2), 8, {"tp": NV, "dcp": NV}),  # a replica per node
        (D(tp=16, dcp=8), 8, {"tp": RDMA, "dcp": NV}),  # DCP 8 stays inside a node
        (D(tp=16, dcp=16), 8, {"tp": RDMA, "dcp": RDMA}),
        (D(tp=8, pcp=2), 8, {"pcp": RDMA, "tp": NV}),  # PCP strides across the nodes
        (D(tp=8, pcp=2, dcp=16), 8, {"pcp": RDMA, "tp": NV, "dcp": RDMA}),
        (D(tp=2, dp=8, ep=True), 8, {"tp": NV, "ep": RDMA}),
        (D(tp=8, dcp=4), 4, {"tp": RDMA, "dcp": NV}),  # nodes of 4 GPUs
        (D(tp=8, dcp=8), 4, {"tp": RDMA, "dcp": RDMA}),
    ],
)
def test_group_links(deployment, gpus_per_node, links):
    assert group_links(deployment, gpus_per_node) == links
    assert list(group_links(deployment, gpus_per_node)) == active_groups(deployment)


@pytest.mark.parametrize(
    "deployment, links",
    [
        (D(tp=8, dcp=8), {"tp": NV, "dcp": NV}),  # one replica: the experts' group is TP's
        (D(tp=8, dcp=8, dp=2), {"tp": NV, "dcp": NV, "moe": RDMA}),
        (D(tp=8, pcp=2), {"pcp": RDMA, "tp": NV, "moe": RDMA}),
        (D(tp=4, dp=2), {"tp": NV, "moe": NV}),  # 8 GPUs: one node
        (D(tp=2, dp=8, ep=True), {"tp": NV, "ep": RDMA}),  # EP: the experts are EP's
    ],
)
def test_moe_experts_span_every_replica(deployment, links):
    """vLLM v0.34.0 shards a MoE model's experts with TP over dp x pcp x tp GPUs
    (FusedMoEParallelConfig.flatten_tp_across_dp_and_pcp) unless expert parallelism is on."""
    assert group_links(deployment, 8, moe=True) == links


@pytest.mark.parametrize(
    "tp, pcp, dcp", [(16, 1, 8), (16, 1, 16), (8, 2, 1), (8, 2, 2), (8, 2, 16), (4, 4, 4)]
)
def test_links_follow_vllms_rank_grid(tp, pcp, dcp):
    """A kind crosses nodes exactly when one of vLLM's groups of that kind (cpbook.core.groups,
    v0.34.0's order) has ranks on two nodes of 8."""
    grid = RankGrid(tp, pcp, dcp)
    links = group_links(D(tp=tp, pcp=pcp, dcp=dcp), 8)
    for kind in links:
        spans = any(len({r // 8 for r in g}) > 1 for g in grid.groups(kind))
        assert links[kind] == (RDMA if spans else NV), kind


def test_node_map_draws_every_gpu_and_names_the_crossing_link():
    deployments = [("small", D(tp=4, dcp=4)), ("two nodes", D(tp=16, dcp=8))]
    fig = node_map_figure(deployments)
    texts = [t.get_text() for t in fig.findobj(Text) if t.get_text()]
    # the GPU row numbers every GPU of each panel
    assert all(str(r) in texts for r in range(16))
    assert texts.count(RDMA) == 2  # TP 16's row, and the label between the two nodes
    assert texts.count("node 1") == 1 and texts.count("node 0") == 2
    assert "two nodes: 16 GPUs, 2 nodes" in texts and "small: 4 GPUs, one node" in texts
    assert min(t.get_fontsize() for t in fig.findobj(Text) if t.get_text()) >= 11
    assert fig.get_figwidth() == 7.2
    plt.close(fig)
    fig = node_map_figure([("replicas", D(tp=8, dcp=8, dp=2))], moe=True)
    texts = [t.get_text() for t in fig.findobj(Text) if t.get_text()]
    assert {"DP", "TP", "DCP", "MoE", "own requests"} <= set(texts)
    assert texts.count(RDMA) == 2  # the experts' row, and the label between the nodes
    plt.close(fig)
