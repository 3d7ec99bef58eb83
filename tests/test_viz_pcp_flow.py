"""Chapter 4's per-rank PCP prefill figure (:mod:`cpbook.viz.pcp_flow`), drawn from a real
run of :func:`cpbook.demos.ch04_pcp.pcp_prefill_rank` on simulated ranks: what it prints must be
the run's holdings, work and traced bytes (no pixel comparison)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from cpbook.core.config import ParallelConfig  # noqa: E402
from cpbook.core.launch import run  # noqa: E402
from cpbook.demos.ch04_pcp import pcp_prefill_rank  # noqa: E402
from cpbook.pcp.zigzag import causal_work  # noqa: E402
from cpbook.viz.pcp_flow import STAGES, gather_label, pcp_prefill_flow  # noqa: E402


def _texts(fig) -> str:
    return "\n".join(
        [t.get_text() for ax in fig.axes for t in ax.texts]
        + [ax.get_title(loc="left") for ax in fig.axes]
    )


@pytest.mark.parametrize("pcp, seq_len", [(2, 22), (3, 24)])
def test_pcp_prefill_flow_prints_the_runs_holdings_work_and_traced_bytes(pcp, seq_len):
    cfg = ParallelConfig(num_q_heads=4, num_kv_heads=2, head_dim=8)
    res = run(
        pcp_prefill_rank,
        pcp,
        report=False,
        fn_kwargs=dict(parallel_config=cfg, seq_lens=(seq_len,), hidden_size=32),
    )
    assert all(r["max_abs_err"] <= 1e-10 and r["restored"] for r in res)
    fig = pcp_prefill_flow(list(res), res.traces, seq_len)
    texts = _texts(fig)
    for stage in STAGES:
        assert stage in texts
    assert [r["work"] for r in res] == causal_work(seq_len, pcp)
    for r, trace in zip(res, res.traces):
        k, v, out = trace  # the layer's K and V all-gathers, then the restore
        assert [(c.op, c.bytes_sent) for c in (k, v)] == r["expected"]
        assert [(out.op, out.bytes_sent)] == r["restore_expected"]
        for rec, what in ((k, "K"), (v, "V"), (out, "out")):
            assert gather_label(rec, what) in texts
        assert f"{r['work']:,} (query, key) pairs per head" in texts
    if (pcp, seq_len) == (2, 22):
        assert "positions [0, 6) + [18, 22) + 2 pad" in texts
        assert "positions [6, 18)" in texts
        assert "K (2, 12, 8): 1,536 B sent" in texts  # 12 rows · 2 heads · 8 · 8 B, 1 peer
        assert "out (12, 4, 8): 3,072 B sent" in texts
    assert fig.get_size_inches()[0] == pytest.approx(7.2)
    assert min(t.get_fontsize() for ax in fig.axes for t in ax.texts) >= 11
    plt.close(fig)
