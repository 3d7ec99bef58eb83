"""groups: vLLM's DCP group orders (v0.14, v0.33.0, v0.34.0), pinned to vLLM's own
construction, and the groups built on real ranks."""

import itertools

import pytest
import torch

from cpbook.core.config import ConfigError, ParallelConfig
from cpbook.core.groups import ANCHOR_ORDER, GROUP_ORDERS, RankGrid
from cpbook.core.launch import run
from tests.rank_fns import grid_groups

#: 125 (tp, pcp, dcp) triples: every axis in {1, 2, 4, 8, 16}
SIZES = (1, 2, 4, 8, 16)
TRIPLES = list(itertools.product(SIZES, repeat=3))


def vllm_dcp_groups(release: str, tp: int, pcp: int, dcp: int) -> list[list[int]]:
    """The DCP groups as vLLM's ``initialize_model_parallel`` builds them, its statements
    reproduced literally (``vllm/distributed/parallel_state.py``, DP = PP = 1, no elastic EP):
    v0.33.0 lines 2158-2164 and 2251-2257, v0.34.0 lines 2164-2170 and 2257-2266."""
    world_size, data_parallel_size, pipeline_model_parallel_size = tp * pcp, 1, 1
    all_ranks = torch.arange(world_size).reshape(
        -1, data_parallel_size, pipeline_model_parallel_size, pcp, tp
    )
    dcp_size = dcp or 1
    dcp_ranks = all_ranks
    if dcp_size > 1:
        # DCP spans PCP first, then TP for full TP x PCP groups.
        dcp_ranks = dcp_ranks.transpose(-1, -2)
    group_ranks = dcp_ranks.reshape(-1, dcp_size).unbind(0)
    if release == "v0.33":
        return [x.tolist() for x in group_ranks]
    return [sorted(x.tolist()) for x in group_ranks]  # v0.34.0


def vllm_accepts(tp: int, pcp: int, dcp: int) -> bool:
    """``ParallelConfig``'s DCP rule (``vllm/config/parallel.py``, v0.33.0 and v0.34.0):
    without PCP, ``tp % dcp == 0``; with PCP, ``dcp in (1, pcp, tp * pcp)``."""
    return tp % dcp == 0 if pcp == 1 else dcp in (1, pcp, tp * pcp)


def test_orders_and_anchor():
    assert GROUP_ORDERS == ("v0.14", "v0.33", "v0.34") and ANCHOR_ORDER == "v0.34"
    assert RankGrid(2, 2, 4).order == "v0.34" == RankGrid(2, 2, 4, "current").order


@pytest.mark.parametrize("order", GROUP_ORDERS)
def test_dcp_inside_tp_without_pcp(order):
    assert RankGrid(8, 1, 4, order).dcp_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert RankGrid(8, 1, 2, order).dcp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert RankGrid(8, 1, 4, order).coords(6).dcp_rank == 2  # dcp_rank = tp_rank % dcp


#: vLLM's own expected values: tests/distributed/test_context_parallel_group_layout.py
#: (v0.33.0) and the same layouts under v0.34.0's sorted groups
PINNED = {
    (2, 2, 1): ([[0], [1], [2], [3]], [[0], [1], [2], [3]]),  # DCP 1: no transpose
    (2, 2, 2): ([[0, 2], [1, 3]], [[0, 2], [1, 3]]),
    (2, 2, 4): ([[0, 2, 1, 3]], [[0, 1, 2, 3]]),
    (4, 2, 2): ([[0, 4], [1, 5], [2, 6], [3, 7]], [[0, 4], [1, 5], [2, 6], [3, 7]]),
    (4, 2, 8): ([[0, 4, 1, 5, 2, 6, 3, 7]], [list(range(8))]),
}


@pytest.mark.parametrize("grid", sorted(PINNED))
def test_pinned_groups_of_both_releases(grid):
    v033, v034 = PINNED[grid]
    assert RankGrid(*grid, "v0.33").dcp_groups() == v033 == vllm_dcp_groups("v0.33", *grid)
    assert RankGrid(*grid, "v0.34").dcp_groups() == v034 == vllm_dcp_groups("v0.34", *grid)


def test_dcp_equal_pcp_is_the_pcp_group_in_both_releases():
    for order in ("v0.33", "v0.34"):
        assert RankGrid(4, 2, 2, order).dcp_groups() == RankGrid(4, 2, 2, order).pcp_groups()


@pytest.mark.parametrize("release", ["v0.33", "v0.34"])
def test_every_grid_matches_vllms_construction(release):
    for tp, pcp, dcp in TRIPLES:
        if (tp * pcp) % dcp:
            continue
        grid = RankGrid(tp, pcp, dcp, release)
        assert grid.dcp_groups() == vllm_dcp_groups(release, tp, pcp, dcp), (tp, pcp, dcp)
        # vLLM's rank_in_group is the index in the listed group
        assert all(
            grid.coords(r).dcp_rank == grid.group_of("dcp", r).index(r)
            for r in range(grid.world_size)
        )


def test_which_grids_the_sorting_changes():
    """Of the 125 triples, 105 form a grid ((tp * pcp) % dcp == 0) and 20 of those list a DCP
    group differently in v0.33.0 and v0.34.0; vLLM's ``ParallelConfig`` accepts 6 of the 20:
    exactly the DCP groups spanning the whole TP × PCP world with TP > 1 and PCP > 1."""
    grids = [t for t in TRIPLES if (t[0] * t[1]) % t[2] == 0]
    differ = [t for t in grids if vllm_dcp_groups("v0.33", *t) != vllm_dcp_groups("v0.34", *t)]
    assert [
        t for t in grids if RankGrid(*t, "v0.33").dcp_groups() != RankGrid(*t).dcp_groups()
    ] == differ
    accepted = [t for t in differ if vllm_accepts(*t)]
    assert (len(TRIPLES), len(grids), len(differ), len(accepted)) == (125, 105, 20, 6)
    whole = [(tp, pcp, tp * pcp) for tp in SIZES[1:] for pcp in SIZES[1:] if tp * pcp <= 16]
    assert accepted == whole
    # and there the DCP rank is the global rank in v0.34.0, tp_rank * pcp + pcp_rank in v0.33.0
    for tp, pcp, dcp in accepted:
        new, old = RankGrid(tp, pcp, dcp), RankGrid(tp, pcp, dcp, "v0.33")
        for r in range(tp * pcp):
            assert new.coords(r).dcp_rank == r
            assert old.coords(r).dcp_rank == (r % tp) * pcp + r // tp


def test_dcp1_groups_in_rank_order_with_pcp():
    """vLLM transposes the rank grid for the DCP groups only when DCP > 1: with DCP = 1 the
    one-rank groups follow rank order."""
    for tp, pcp in ((2, 2), (4, 2), (1, 4), (2, 4)):
        want = [[r] for r in range(tp * pcp)]
        for order in GROUP_ORDERS:
            assert RankGrid(tp, pcp, 1, order).dcp_groups() == want
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
@pytest.mark.parametrize("order", ["v0.33", "v0.34"])
def test_groups_on_ranks(backend, order):
    """On real ranks a collective's output follows the group's listed order in both releases'
    orders (cpbook's communicators map list position to torch's sorted order)."""
    res = run(
        grid_groups,
        4,
        fn_kwargs=dict(tp=2, pcp=2, dcp=4, order=order),
        backend=backend,
        dist_backend="gloo",
        report=False,
    )
    listed = [0, 2, 1, 3] if order == "v0.33" else [0, 1, 2, 3]
    assert [r["tp"] for r in res] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["pcp"] for r in res] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert all(r["dcp"] == listed for r in res)
    assert [r["dcp_rank"] for r in res] == [listed.index(r) for r in range(4)]
    assert [r["dcp_rank"] for r in res] == [r["group_rank"] for r in res]
