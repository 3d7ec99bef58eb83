"""Figures of issue 25 drawn from real objects: MLA's absorbed decode under DCP
(:mod:`cpbook.viz.mla_flow`), a deployment's TP × DCP rank grid (:mod:`cpbook.viz.rank_grid`)
and one engine step across ranks (:mod:`cpbook.viz.engine_step`).  Each test draws the figure
and checks what it drew against the objects it was drawn from (no pixel comparison)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from cpbook.core.config import ParallelConfig  # noqa: E402
from cpbook.core.launch import run  # noqa: E402
from cpbook.costmodel import MODELS  # noqa: E402
from cpbook.demos import demo_kwargs
from cpbook.demos.ch03_decode import mla_decode_rank  # noqa: E402
from cpbook.demos.ch09_engine import engine_step_rank  # noqa: E402
from cpbook.viz.engine_step import comm_totals, engine_step_figure  # noqa: E402
from cpbook.viz.mla_flow import STAGES, collective_label, mla_decode_flow  # noqa: E402
from cpbook.viz.rank_grid import gpu_holdings, kv_copies, rank_grid_figure  # noqa: E402


def _texts(fig) -> list[str]:
    return [t.get_text() for ax in fig.axes for t in ax.texts] + [
        ax.get_title(loc="left") for ax in fig.axes
    ]


def test_mla_decode_flow_prints_the_runs_shapes_and_traced_bytes():
    seq_lens = (40, 5, 2)
    res = run(
        mla_decode_rank,
        4,
        report=False,
        fn_kwargs=demo_kwargs(mla_decode_rank, dict(seq_lens=seq_lens)),
    )
    fig = mla_decode_flow(list(res), res.traces, seq_lens)
    texts = "\n".join(_texts(fig))
    for stage in STAGES:
        assert stage in texts
    assert all(list(t) == list(res.traces[0]) for t in res.traces)  # one label for all ranks
    for rec in res.traces[0]:
        assert collective_label(rec) in texts
    assert "AllGather (3, 2, 40) float64: 5,760 B sent" in texts  # 3·2·40·8 B to 3 peers
    for r in res:
        s = r["shapes"]
        assert str(s["q_gathered"]) in texts and str(s["out"]) in texts
        assert "+".join(str(k[0]) for k in s["kv_local"]) + " rows × 40" in texts
    plt.close(fig)


@pytest.mark.parametrize(
    "name, tp, dcp, copies_without",
    [("DeepSeek-V3", 8, 8, 8), ("Qwen3-235B-A22B", 8, 2, 2), ("Qwen3-235B-A22B", 8, 1, 2)],
)
def test_rank_grid_counts_kv_copies_on_the_grid(name, tp, dcp, copies_without):
    cfg = ParallelConfig.for_model(
        MODELS[name], tensor_parallel_size=tp, decode_context_parallel_size=dcp
    )
    assert cfg.kv_head_replicas == copies_without
    assert kv_copies(cfg) == copies_without // dcp
    held = gpu_holdings(cfg)
    assert [g["rank"] for g in held] == list(range(tp))
    assert sorted({g["q_heads"].start for g in held}) == list(
        range(0, cfg.num_q_heads, cfg.num_q_heads // tp)
    )
    fig = rank_grid_figure([(name, cfg)])
    texts = "\n".join(_texts(fig))
    assert f"{name}: TP {tp} / DCP {dcp}" in texts
    assert f"stored on {copies_without // dcp} GPU" in texts
    for g in held:
        assert f"GPU {g['rank']}\nq {g['q_heads'].start}–{g['q_heads'].stop - 1}\n" in texts
    assert len(fig.axes[0].patches) == tp
    plt.close(fig)


def test_engine_step_figure_draws_each_ranks_slots_keys_and_trace():
    res = list(run(engine_step_rank, 4, report=False))
    rec = res[0]["record"]
    assert all(r["record"] == rec for r in res)  # one batch for every rank
    kinds = {c[1] for c in rec.chunks}
    assert "decode" in kinds and kinds != {"decode"}
    for c in range(len(rec.chunks)):  # every new token has exactly one owner in a DCP group
        for group in ([0, 1], [2, 3]):
            slots = [res[r]["chunks"][c]["slots"] for r in group]
            assert all(sum(s[t] >= 0 for s in slots) == 1 for t in range(len(slots[0])))
            assert (
                sum(res[r]["chunks"][c]["local_keys"] for r in group)
                == rec.chunks[c][2] + rec.chunks[c][3]
            )
    fig = engine_step_figure(res)
    texts = "\n".join(_texts(fig))
    cells = sum(c[3] for c in rec.chunks)
    ax = fig.axes[0]
    assert len(ax.patches) == len(res) * (cells + 2 * len(rec.chunks))
    for r in res:
        for (op, group), (calls, sent) in comm_totals(r["comm"]).items():
            assert f" {group} ×{calls}: {sent:,} B" in texts
        for rid, tok in r["sampled"].items():
            assert f"req {rid} → {tok}" in texts
    plt.close(fig)


def test_timeline_cells_are_lettered_and_large():
    from cpbook.engine.engine import Engine, make_prompts
    from cpbook.viz.engine import KIND_LETTERS, timeline_figure

    eng = Engine("tiny-gqa", scheduler_config={"max_num_batched_tokens": 16})
    ids = [eng.add_request(p, 3) for p in make_prompts(3, seed=0)]
    while eng.has_unfinished:
        eng.step()
    fig = timeline_figure(eng.history, ids)
    fig.canvas.draw()  # constrained layout places the axes when drawn
    ax = fig.axes[0]
    worked = [c for rec in eng.history for c in rec.chunks]
    letters = [t.get_text() for t in ax.texts]
    assert sorted(letters) == sorted(KIND_LETTERS[c[1]] for c in worked)
    w_in = fig.get_size_inches()[0] * ax.get_position().width / len(eng.history)
    h_in = fig.get_size_inches()[1] * ax.get_position().height / (len(ids) + 0.2)
    assert min(w_in, h_in) >= 0.25, (w_in, h_in)  # readable at the column's width
    plt.close(fig)
