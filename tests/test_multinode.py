"""Two torchrun nodes on one machine: ``run(..., nodes=Nodes(2, node_rank, "127.0.0.1:PORT"))``
from two threads, 2 gloo processes each, one c10d rendezvous.  The groups span both nodes, the
results equal the single-node run's, each node returns its own ranks, and a rank killed on the
second node fails both nodes naming it."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

from cpbook.core.config import ParallelConfig
from cpbook.core.launch import Nodes, run
from cpbook.demos.ch09_engine import grid_runs
from tests.rank_fns import fail_on_rank, kill_on_rank, two_node_suite

pytestmark = pytest.mark.torchrun

#: GQA decode with DCP inside TP (groups [0, 1], [2, 3]: one per node) and over the whole world
#: (DCP 4: one group across both nodes)
DECODE = [
    ParallelConfig(
        tensor_parallel_size=4,
        decode_context_parallel_size=dcp,
        num_q_heads=8,
        num_kv_heads=4 // dcp,
        head_dim=16,
        block_size=8,
    )
    for dcp in (2, 4)
]
#: engine grids whose DCP groups cross the nodes: GQA 2x2x2 (DCP over PCP: [0, 2], [1, 3]) and
#: MLA 4x4x1 (DCP 4 inside TP 4: every rank)
ENGINE = {("tiny-gqa", 2, 2, 2), ("tiny-mla", 4, 4, 1)}
GRIDS = [(4, 1, 2), (4, 1, 4), (2, 2, 2)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_nodes(fn, fn_kwargs: dict, timeout: float = 60.0) -> list:
    """``run`` for node 0 and node 1 in two threads; each entry its RankResults or exception."""
    endpoint = f"127.0.0.1:{free_port()}"
    out: list = [None, None]

    def node(r: int) -> None:
        try:
            out[r] = run(
                fn,
                4,
                "torchrun",
                fn_kwargs,
                nodes=Nodes(2, r, endpoint),
                timeout=timeout,
                dist_backend="gloo",
                job_timeout=240,
                report=False,
            )
        except Exception as e:  # noqa: BLE001 - the test inspects it
            out[r] = e

    threads = [threading.Thread(target=node, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
        time.sleep(0.5)  # node 0's agent first: it hosts the rendezvous store
    for t in threads:
        t.join()
    return out


def engine_runs() -> list[dict]:
    runs = grid_runs(workload=dict(num_requests=4, max_new_tokens=4), max_world=4)
    return [
        r
        for r in runs
        if (
            r["model"],
            r["parallel_config"]["tensor_parallel_size"],
            r["parallel_config"]["decode_context_parallel_size"],
            r["parallel_config"]["prefill_context_parallel_size"],
        )
        in ENGINE
    ]


def test_two_nodes_equal_one():
    kwargs = dict(decode_configs=DECODE, grids=GRIDS, runs=engine_runs())
    one = run(two_node_suite, 4, "inline", kwargs, report=False)
    nodes = two_nodes(two_node_suite, kwargs)
    for res in nodes:
        assert not isinstance(res, Exception), res
    # each node returns its own two ranks, and together they are the world
    assert [len(res) for res in nodes] == [2, 2]
    assert sorted(nodes[0].ranks + nodes[1].ranks) == [0, 1, 2, 3]
    for res in nodes:
        assert res.ranks in ([0, 1], [2, 3])
        for rank, got in zip(res.ranks, res):
            want = one[rank]
            assert got["rank"] == rank
            assert got["groups"] == want["groups"]
            for g, w in zip(got["decode"], want["decode"]):
                assert g["max_abs_err"] <= 1e-10
                assert (g["out"] - w["out"]).abs().max().item() <= 1e-10
                assert g["local_tokens"] == w["local_tokens"]
            assert len(got["engine"]) == len(want["engine"]) == len(ENGINE)
            for g, w in zip(got["engine"], want["engine"]):
                assert g["tokens"] == w["tokens"]
                assert all(e is None for e in g["errors"])
    # the groups really cross the nodes: DCP 4 is the world, GQA 2x2x2's DCP pairs 0 with 2
    assert one[0]["groups"][1]["dcp"] == [0, 1, 2, 3]
    assert one[0]["groups"][2]["dcp"] == [0, 2]
    assert isinstance(nodes[0][0]["decode"][0]["out"], torch.Tensor)


@pytest.mark.parametrize(
    "fn, fn_kwargs, says",
    [
        (
            kill_on_rank,
            dict(victim=3),
            "without a result or a Python error: killed by",
        ),
        (fail_on_rank, dict(bad=3), "ValueError: deliberate failure on rank 3"),
    ],
    ids=["killed", "raises"],
)
def test_a_rank_failing_on_one_node_fails_both(fn, fn_kwargs, says):
    """Global rank 3 (on whichever node c10d gave ranks 2-3) is SIGKILLed (no traceback: its
    node's ``run`` sees the process gone and says so through the store) or raises (its
    traceback, through the store); both nodes' ``run`` raise naming rank 3 and the cause, after
    the 15 s collective timeout at most (pytest-timeout fails a hang; no clock is asserted)."""
    nodes = two_nodes(fn, fn_kwargs, timeout=15.0)
    for res in nodes:
        assert isinstance(res, RuntimeError), res
        msg = str(res)
        assert msg.startswith(f"rank 3 of 4 failed in {fn.__name__} under torchrun"), msg
        assert says in msg, msg
