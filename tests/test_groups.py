"""groups: vLLM's documented DCP layouts, and the groups built on real ranks."""

import pytest

from cpbook.core.config import ConfigError, ParallelConfig
from cpbook.core.groups import RankGrid
from cpbook.core.launch import run
from tests.rank_fns import grid_groups


@pytest.mark.parametrize("layout", ["v0.14", "current"])
def test_dcp_inside_tp_without_pcp(layout):
    assert RankGrid(8, 1, 4, layout).dcp_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert RankGrid(8, 1, 2, layout).dcp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert RankGrid(8, 1, 4, layout).coords(6).dcp_rank == 2  # dcp_rank = tp_rank % dcp


def test_current_layout_spans_pcp_first():
    # tests/distributed/test_context_parallel_group_layout.py in vLLM
    assert RankGrid(2, 2, 1).dcp_groups() == [[0], [1], [2], [3]]  # DCP 1: no transpose
    assert RankGrid(2, 2, 2).dcp_groups() == [[0, 2], [1, 3]]
    assert RankGrid(2, 2, 4).dcp_groups() == [[0, 2, 1, 3]]
    assert RankGrid(4, 2, 2).dcp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert RankGrid(4, 2, 8).dcp_groups() == [[0, 4, 1, 5, 2, 6, 3, 7]]
    # DCP == PCP: the DCP groups are the PCP groups (the article's claim)
    assert RankGrid(4, 2, 2).dcp_groups() == RankGrid(4, 2, 2).pcp_groups()


def test_dcp1_groups_in_rank_order_with_pcp():
    """vLLM's ``initialize_model_parallel`` (v0.33.0) transposes the rank grid for the DCP
    groups only when DCP > 1: with DCP = 1 the one-rank groups follow rank order."""
    for tp, pcp in ((2, 2), (4, 2), (1, 4), (2, 4)):
        want = [[r] for r in range(tp * pcp)]
        assert (
            RankGrid(tp, pcp, 1).dcp_groups() == want == RankGrid(tp, pcp, 1, "v0.14").dcp_groups()
        )
        assert RankGrid(tp, pcp, 1).groups("dcp") == want


def test_v014_layout_keeps_dcp_inside_tp():
    assert RankGrid(2, 2, 2, "v0.14").dcp_groups() == [[0, 1], [2, 3]]
    with pytest.raises(ConfigError, match="tp-divisible-by-dcp"):
        RankGrid(2, 2, 4, "v0.14")


def test_tp_and_pcp_groups_and_coords():
    g = RankGrid(4, 2, 1)
    assert g.tp_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert g.pcp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    c = g.coords(6)
    assert (c.pcp_rank, c.tp_rank, c.dcp_rank) == (1, 2, 0)
    assert RankGrid.from_config(
        ParallelConfig(2, 2, 2, num_q_heads=4, num_kv_heads=4)
    ).dcp_groups() == [[0, 2], [1, 3]]


def test_bad_grids():
    with pytest.raises(ConfigError, match="grid-dcp-divides-world"):
        RankGrid(3, 1, 2)
    with pytest.raises(ConfigError, match="group-order"):
        RankGrid(2, 1, 1, "v9")
    with pytest.raises(ValueError, match="group-kind"):
        RankGrid(2).groups("ep")


@pytest.mark.parametrize(
    "backend", ["inline", pytest.param("torchrun", marks=pytest.mark.torchrun)]
)
def test_groups_on_ranks(backend):
    res = run(
        grid_groups,
        4,
        fn_kwargs=dict(tp=2, pcp=2, dcp=4),
        backend=backend,
        dist_backend="gloo",
        report=False,
    )
    assert [r["tp"] for r in res] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["pcp"] for r in res] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert all(r["dcp"] == [0, 2, 1, 3] for r in res)  # group order kept (not sorted)
    assert [r["dcp_rank"] for r in res] == [0, 2, 1, 3] == [r["group_rank"] for r in res]
