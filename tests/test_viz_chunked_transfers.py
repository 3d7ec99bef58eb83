"""Chapter 5's transfer figure: drawn from the ranks' real traces, it shows one arrow per
(sender, peer) of every collective and the bytes each trace recorded."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
from matplotlib.patches import FancyArrowPatch  # noqa: E402

from cpbook.core.comm import comm_bytes  # noqa: E402
from cpbook.core.launch import run  # noqa: E402
from cpbook.demos import demo_kwargs  # noqa: E402
from cpbook.demos.ch05_chunked import chunked_prefill_rank  # noqa: E402
from cpbook.pcp.chunked_plan import STRATEGIES, chunked_comm_bytes  # noqa: E402
from cpbook.viz.chunked_transfers import transfer_steps, transfers_figure  # noqa: E402

EXAMPLE = dict(
    context_lens=(12,),
    query_lens=(8,),
    tensor_parallel_size=1,
    prefill_context_parallel_size=2,
    decode_context_parallel_size=2,
    cp_kv_cache_interleave_size=2,
    block_size=4,
    num_q_heads=4,
    num_kv_heads=1,
    head_dim=8,
    workspace_size=8,
)


@pytest.fixture(scope="module")
def traces():
    return {
        st: [
            x["comm"]
            for x in run(
                chunked_prefill_rank,
                2,
                report=False,
                fn_kwargs=demo_kwargs(chunked_prefill_rank, dict(EXAMPLE, strategy=st)),
            )
        ]
        for st in STRATEGIES
    }


def test_steps_name_every_collective_of_the_trace(traces):
    q = transfer_steps("allgather_q", traces["allgather_q"][0], pcp=2, dcp=2)
    assert [(s.what, s.op, s.group) for s in q] == [
        ("Q rows", "all_gather", "DCP"),
        ("partial out + LSE", "all_to_all", "DCP"),
    ]
    kv = transfer_steps("allgather_kv", traces["allgather_kv"][0], pcp=2, dcp=2)
    assert [(s.what, s.group) for s in kv] == [
        ("chunk's new K/V", "PCP"),
        ("context piece 1", "DCP"),
        ("context piece 2", "DCP"),
    ]
    # the bytes are the trace's, which equal the formula
    for st, steps in (("allgather_q", q), ("allgather_kv", kv)):
        kw = demo_kwargs(chunked_prefill_rank, dict(EXAMPLE, strategy=st))
        ws = kw["prefill_config"].workspace_size
        expected = chunked_comm_bytes(st, (12,), (8,), kw["parallel_config"], workspace_size=ws)
        assert [(s.op, s.bytes) for s in steps] == expected


def test_ag_rs_combine_and_pcp_only_traces_are_named():
    rs = [("all_gather", 10), ("all_gather", 2), ("reduce_scatter", 8)]
    assert [s.what for s in transfer_steps("allgather_q", rs, pcp=2, dcp=1)] == [
        "Q rows",
        "LSEs",
        "partial out",
    ]
    assert transfer_steps("allgather_q", rs, pcp=2, dcp=1)[0].group == "PCP"
    only_chunk = transfer_steps("allgather_kv", [("all_gather", 5)], pcp=2, dcp=1)
    assert [(s.what, s.group) for s in only_chunk] == [("chunk's new K/V", "PCP")]


@pytest.mark.parametrize(
    "strategy, comm, rule",
    [
        ("ring", [("all_gather", 1)], "transfer-strategy"),
        ("allgather_q", [("all_to_all", 1)], "transfer-trace"),
        ("allgather_kv", [("all_gather", 1), ("all_gather", 1)], "transfer-trace"),  # dcp 1
    ],
)
def test_traces_of_another_shape_are_rejected(strategy, comm, rule):
    with pytest.raises(ValueError, match=rule):
        transfer_steps(strategy, comm, pcp=2, dcp=1)


def test_figure_draws_one_arrow_per_transfer_with_the_traced_bytes(traces):
    fig = transfers_figure(traces, pcp=2, dcp=2, context_len=12, chunk_len=8, slope=3.25)
    try:
        arrows = [p for ax in fig.axes for p in ax.patches if isinstance(p, FancyArrowPatch)]
        # one arrow per (collective, sender, peer): 2 + 3 collectives, 2 senders, 1 peer each
        assert len(arrows) == (2 + 3) * 2
        assert {a.get_gid() for a in arrows} >= {
            "transfer allgather_q 0 0->1",
            "transfer allgather_kv 2 1->0",
        }
        texts = {t.get_text() for ax in fig.axes for t in ax.texts}
        for st, per_rank in traces.items():
            for trace in per_rank:
                assert {f"{b:,} B" for _, b in trace} <= texts  # two ranks: per peer = sent
                assert f"{comm_bytes(trace):,} B" in texts
        titles = [ax.get_title(loc="left") for ax in fig.axes]
        assert titles == [
            "AllGather-Q: 2,176 B sent per rank",
            "AllGather-KV: 1,280 B sent per rank",
        ]
        footer = " ".join(t.get_text() for t in fig.texts)
        assert "C ≤ 3.25 T" in footer and "AllGather-KV moves less" in footer
    finally:
        plt.close(fig)


def test_figure_rejects_grids_it_cannot_draw(traces):
    with pytest.raises(ValueError, match="transfer-grid"):
        transfers_figure(traces, pcp=4, dcp=4, context_len=12, chunk_len=8, slope=3.25)
    with pytest.raises(ValueError, match="transfer-grid"):
        transfers_figure(traces, pcp=2, dcp=4, context_len=12, chunk_len=8, slope=3.25)
