"""The intro's two figures, drawn from the package's own objects: one request's timeline under
PCP and DCP (:mod:`cpbook.viz.timeline`) and where CP touches a serving engine
(:mod:`cpbook.viz.system`).  Each test draws the figure and checks what it drew against the
objects it was drawn from (no pixel comparison), and that the committed PNGs are current."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

from pathlib import Path  # noqa: E402

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from cpbook.core.attention import merge_attn_states  # noqa: E402
from cpbook.core.comm import Group  # noqa: E402
from cpbook.kv.layout import slot_mapping, token_owner  # noqa: E402
from cpbook.kv.manager import KVCacheManager  # noqa: E402
from cpbook.pcp.zigzag import causal_work  # noqa: E402
from cpbook.viz import system, timeline  # noqa: E402

FIGURES = Path(__file__).resolve().parents[1] / "book" / "figures"


def _texts(fig) -> str:
    return "\n".join(t.get_text() for ax in fig.axes for t in ax.texts)


@pytest.mark.parametrize("prompt, pcp", [(16, 2), (24, 3), (13, 2)])
def test_timeline_owners_are_the_packages(prompt, pcp):
    owners = timeline.pcp_owners(prompt, pcp)
    assert sorted(set(owners)) == list(range(pcp))
    if prompt % (2 * pcp) == 0:  # zigzag: every rank the same causal work
        work = [sum(t + 1 for t, r in enumerate(owners) if r == k) for k in range(pcp)]
        assert work == causal_work(prompt, pcp, "zigzag")
        assert len(set(work)) == 1
    assert timeline.dcp_owners(10, 4, 2) == token_owner(range(10), 4, 2).tolist()


def test_timeline_draws_every_token_on_its_owner():
    prompt, pcp, dcp, interleave, steps = 16, 2, 4, 2, 3
    fig = timeline.request_timeline(prompt, pcp, dcp, interleave, steps)
    texts = _texts(fig)
    for r in range(pcp):
        assert f"PCP rank {r}" in texts
    for r in range(dcp):
        assert f"DCP rank {r}" in texts
    assert "PCP = 2" in texts and "DCP = 4" in texts and "LSE" in texts
    numbers = [t.get_text() for t in fig.axes[0].texts if t.get_text().isdigit()]
    assert numbers.count("3") == 2  # once in prefill, once in the KV cache
    assert len(numbers) == prompt + prompt + steps
    plt.close(fig)


def test_system_figure_names_the_packages_objects():
    fig = system.system_figure()
    texts = _texts(fig)
    for name in ("Scheduler", "KVCacheManager", "ModelRunner", "PCPPartition"):
        assert name in texts, name
    assert "kv.layout.slot_mapping" in texts
    assert "core.attention.merge_attn_states" in texts
    assert "core.comm.Group" in texts
    for op in ("all_gather", "reduce_scatter", "all_to_all"):
        assert op in texts and callable(getattr(Group, op))
    assert merge_attn_states.__name__ in texts
    # the worked numbers come from the objects
    assert KVCacheManager(8, 4, dcp=2).virtual_block_size == 8
    assert "one id = 8 tokens" in texts
    slots = slot_mapping(range(8), [5], 4, 2, 1, 1).tolist()
    assert "tokens 0–7 → " + " ".join(map(str, slots)) in texts
    assert slots == [-1, 20, -1, 21, -1, 22, -1, 23]
    plt.close(fig)


@pytest.mark.parametrize("module", [timeline, system], ids=["timeline", "system"])
def test_the_committed_png_is_written_by_the_module(module, tmp_path):
    out = module.write(tmp_path)
    assert out.name == module.FILENAME and out.stat().st_size > 10_000
    committed = FIGURES / module.FILENAME
    assert committed.exists(), f"run: python -m {module.__name__} --write book/figures/"
