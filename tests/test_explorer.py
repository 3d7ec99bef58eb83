"""cpbook.widgets.explorer: precomputed states, static HTML, nbval sanitizing, live widget."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from cpbook.widgets.explorer import (  # noqa: E402
    NBVAL_PNG_PATTERN,
    NBVAL_PNG_REPLACE,
    Control,
    explorer,
    pre,
)

ROOT = Path(__file__).resolve().parents[1]


def text_render(a: int, b: str) -> str:
    return pre(f"a={a} b={b} -> {a if b == 'x' else 0}")


def fig_render(n: int, colour: str = "C0"):
    fig, ax = plt.subplots(figsize=(2, 1.5))
    ax.bar(range(n), range(1, n + 1), color=colour)
    return fig, pre(f"{n} bars")


def visible_panel(html: str) -> str:
    """The one panel without ``hidden`` (up to the next panel, caption or script)."""
    pieces = re.split(r'(?=<div class="cpx-panel")|(?=<p class="cpx-caption")|(?=<script)', html)
    panels = [p for p in pieces if p.startswith('<div class="cpx-panel"')]
    shown = [
        p for p in panels if not p.startswith('<div class="cpx-panel" aria-live="polite" hidden')
    ]
    assert len(shown) == 1
    return shown[0]


def test_grid_dedup_and_default():
    ex = explorer(text_render, {"a": [1, 2, 3], "b": ["x", "y"]}, value={"a": 2})
    assert len(ex.states) == 6
    # b = "y" gives "-> 0" for every a, but a is printed too: 6 distinct panels
    assert len(ex.panels) == 6
    html = ex.to_html()
    assert "a=2 b=x -&gt; 2" in visible_panel(html)
    assert '<input type="range" min="0" max="2" step="1" value="1"' in html  # numbers: slider
    assert '<option value="0" selected>x</option>' in html  # strings: drop-down
    assert repr(ex) == "Explorer(a[3], b[2]: 6 states, 6 panels)"


def test_equal_outputs_share_a_panel():
    ex = explorer(lambda a, b: pre(str(a % 2)), {"a": [1, 2, 3, 4], "b": [0, 1]})
    assert len(ex.states) == 8 and len(ex.panels) == 2
    assert ex.states[(0, 0)] == ex.states[(2, 1)] != ex.states[(1, 0)]
    assert '"2.1": 0' in ex.to_html()


def test_figures_inline_with_alt_and_deterministic_html():
    kw = dict(alt="{n} bars in {colour}", caption="Move n.")
    controls = {"n": [1, 2, 3], "colour": Control(["C0", "C1"], names=["blue", "orange"])}
    ex = explorer(fig_render, controls, **kw)
    html = ex.to_html()
    assert html.count('<img class="cpx-img" src="data:image/png;base64,') == 6
    assert 'alt="3 bars in orange"' in html
    assert "http" not in html  # nothing to fetch
    assert plt.get_fignums() == []  # every figure closed
    assert explorer(fig_render, controls, **kw).to_html() == html
    assert ex.nbytes == len(html.encode()) < 60_000


def test_figure_needs_alt_and_bad_controls_are_rejected():
    with pytest.raises(ValueError, match="explorer-alt"):
        explorer(fig_render, {"n": [1, 2]})
    with pytest.raises(ValueError, match="explorer-control"):
        Control([1, 2], names=["one"])
    with pytest.raises(ValueError, match="explorer-value"):
        explorer(text_render, {"a": [1], "b": ["x"]}, value={"c": 1})
    with pytest.raises(ValueError, match="explorer-value"):
        explorer(text_render, {"a": [1], "b": ["x"]}, value={"a": 5})
    with pytest.raises(TypeError, match="not a Figure or str"):
        explorer(lambda a: 3, {"a": [1]})


def _sanitizers() -> list[tuple[str, str]]:
    """The patterns nbval applies to notebook outputs: conftest's first, then the cfg file's."""
    cfg = (ROOT / "tests" / "nbval_sanitize.cfg").read_text()
    pairs = re.findall(r"^regex: (.*)$\n^replace: (.*)$", cfg, flags=re.M)
    return [(NBVAL_PNG_PATTERN, NBVAL_PNG_REPLACE), *pairs]


def _sanitize(s: str) -> str:
    for regex, replace in _sanitizers():
        s = re.sub(regex, replace, s)
    return s


def test_nbval_ignores_only_the_png_payload():
    controls = {"n": [1, 2]}
    blue = explorer(fig_render, controls, alt="{n} bars").to_html()
    red = explorer(lambda n: fig_render(n, "C3"), controls, alt="{n} bars").to_html()
    assert blue != red  # different image bytes ...
    assert _sanitize(blue) == _sanitize(red)  # ... which nbval does not compare
    # a changed readout, alt text, control or state is still a difference
    changed = explorer(lambda n: fig_render(n + 1, "C3"), controls, alt="{n} bars").to_html()
    assert _sanitize(changed) != _sanitize(blue)
    other_alt = explorer(fig_render, controls, alt="{n} bar(s)").to_html()
    assert _sanitize(other_alt) != _sanitize(blue)
    # images elsewhere (not written by the explorer) are left alone
    foreign = '<img src="data:image/png;base64,AAAA">'
    assert _sanitize(foreign) == foreign


def test_conftest_registers_the_pattern():
    text = (ROOT / "conftest.py").read_text()
    assert "collector.sanitize_patterns[NBVAL_PNG_PATTERN] = NBVAL_PNG_REPLACE" in text


def test_live_widget_follows_its_controls():
    pytest.importorskip("ipywidgets")
    ex = explorer(text_render, {"a": [1, 2, 3], "b": ["x", "y"]})
    view = ex.widget()
    controls, out = view.children[0].children, view.children[1]
    assert out.children[0].value == text_render(1, "x")
    controls[0].value = 2  # the slider's options are (name, index) pairs
    assert out.children[0].value == text_render(3, "x")
    controls[1].value = 1
    assert out.children[0].value == text_render(3, "y")
    bundle = ex._repr_mimebundle_()
    assert {"text/plain", "text/html", "application/vnd.jupyter.widget-view+json"} <= set(bundle)
    assert bundle["text/html"] == ex.to_html()


NB_SOURCE = """\
import matplotlib.pyplot as plt
from cpbook.widgets.explorer import explorer, pre

def render(n):
    fig, ax = plt.subplots(figsize=(2, 1.5))
    ax.bar(range(n), range(1, n + 1))
    return fig, pre(f"{n} bars")

explorer(render, {"n": [1, 2, 3]}, alt="{n} bars")"""


@pytest.mark.slow
def test_real_nbval_ignores_the_pngs_and_compares_the_rest(tmp_path):
    """Strict nbval with the repository's conftest: a stored explorer whose PNG bytes differ
    passes; one whose readout differs fails."""
    import os
    import subprocess
    import sys

    import nbformat

    # the stored output: what the cell displays (computed here, not by a kernel)
    namespace: dict = {}
    exec(NB_SOURCE.rsplit("\n", 1)[0], namespace)
    shown = eval(NB_SOURCE.rsplit("\n", 1)[1], namespace)
    cell = nbformat.v4.new_code_cell(NB_SOURCE, execution_count=1)
    cell.outputs = [
        nbformat.v4.new_output(
            "execute_result",
            {"text/plain": repr(shown), "text/html": shown.to_html()},
            execution_count=1,
        )
    ]
    nb = nbformat.v4.new_notebook(cells=[cell])
    html = shown.to_html()
    png = re.search(r'class="cpx-img" src="data:image/png;base64,([A-Za-z0-9+/=]{40})', html)
    variants = {
        "png_changed": html.replace(png.group(1), "A" * 40),
        "text_changed": html.replace("2 bars</pre>", "3 bars</pre>"),
    }
    for name, text in variants.items():
        assert text != html
        nb.cells[0].outputs[0]["data"]["text/html"] = text
        nbformat.write(nb, tmp_path / f"{name}.ipynb")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--nbval",
            "--nbval-current-env",
            "-p",
            "conftest",
            "-p",
            "no:cacheprovider",
            "-q",
            "-rA",
            "png_changed.ipynb",
            "text_changed.ipynb",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert "PASSED png_changed.ipynb::Cell 0" in run.stdout, run.stdout
    assert "FAILED text_changed.ipynb::Cell 0" in run.stdout, run.stdout


def test_chapter_explorers_default_states():
    from cpbook.dcp.decode import decode_comm_bytes
    from cpbook.widgets.dcp import comm_explorer
    from cpbook.widgets.kvcache import layout_explorer
    from cpbook.widgets.memory import kv_explorer

    layout = layout_explorer(interleave=4, dcp=4)
    shown = visible_panel(layout.to_html())
    assert "D20 -&gt; rank 1, slot 84" in shown and "D27 -&gt; rank 2, slot 87" in shown
    assert len(layout.panels) == len(layout.states) == 10

    comm = comm_explorer(dcp=4, backend="a2a", batch=16, context=131_072)
    sent = sum(n for _, n in decode_comm_bytes(16, 8, 128, 128, 4, "a2a", 2))
    assert f"2 collectives, {sent / 1024:,.1f} KiB sent" in visible_panel(comm.to_html())

    kv = kv_explorer(model="Llama-3.1-70B", dcp=2)
    assert "rejected by vLLM" in visible_panel(kv.to_html())
    assert "TP=8, DCP=2 on 8×H200" in visible_panel(kv.to_html())  # the default node


def test_kv_explorer_lets_the_reader_pick_gpu_and_tp():
    from cpbook.costmodel import GPUS, MODELS, kv_bytes_per_token_per_gpu
    from cpbook.widgets.memory import kv_explorer

    kv = kv_explorer(model="Llama-3.1-70B", tokens=131_072, dcp=1, tp=4, gpu="B200")
    assert set(kv.controls["gpu"].values) == set(GPUS) and kv.controls["tp"].values == [4, 8]
    shown = visible_panel(kv.to_html())
    assert "TP=4, DCP=1 on 4×B200" in shown
    per_gpu = kv_bytes_per_token_per_gpu(MODELS["Llama-3.1-70B"], 4, 1) * 131_072
    assert f"{per_gpu / 1e9:.2f} GB" in shown
    # every (tp, gpu) pair has its own states, and the page stays small
    assert len(kv.states) == 3 * 8 * 4 * 2 * len(GPUS) and kv.nbytes < 400_000
    small = kv_explorer(model="DeepSeek-V3", tokens=2**20, dcp=4, tp=4, gpu="H100")
    assert "the weights alone do not fit" in visible_panel(small.to_html())


@pytest.mark.usefixtures("one_torch_thread")
def test_engine_timeline_explorer_runs_the_engine_in_every_state():
    from cpbook.widgets.engine import timeline_explorer

    ex = timeline_explorer(budgets=(16, 32), num_kv_blocks=(20, 64), budget=32, blocks=64)
    assert len(ex.states) == 4
    html = ex.to_html()
    assert html.count("tokens == reference: True") == 4
    shown = visible_panel(html)
    assert "budget 32 tokens/step, 64 KV blocks" in shown
    steps = int(re.search(r"(\d+) steps", shown).group(1))
    assert shown.count("<i") == 7 * steps + 5  # one cell per request and step, 5 in the legend


def test_plan_explorer_states_are_the_planners_answers():
    """Chapter 8's deployment explorer: each state is plan()'s answer for its controls, with
    the winner's vllm serve line, or what would fit; counts of one are singular."""
    from cpbook.planner import ServingWorkload, plan
    from cpbook.widgets.plan import OUTPUT_TOKENS, plan_explorer, plan_readout

    ex = plan_explorer(
        ("DeepSeek-V3", "Llama-3.1-8B"), (4096, 2**20), (1, 16), (8,), ("H200", "H100"),
        model="DeepSeek-V3", context=2**20, concurrency=1, gpu="H200",
    )  # fmt: skip
    assert len(ex.states) == 16
    for idx in ex.states:
        model, context, concurrency, gpus, gpu = ex._values(idx).values()
        p = plan(model, gpu, gpus, ServingWorkload(context, OUTPUT_TOKENS, concurrency))
        assert ex._parts[idx] == [("html", plan_readout(p))]
    shown = visible_panel(ex.to_html())
    assert "<b>TP8+DCP8+QR</b> on 8 of 8 GPUs: DCP8: without it 0 of 1 fit." in shown
    assert "vllm serve deepseek-ai/DeepSeek-V3 --tensor-parallel-size 8" in shown
    assert "Holds 5 requests of 1,049,600 tokens (1 in flight)" in shown
    assert "<b>Nothing fits</b> on 8 × H200 SXM [holds-concurrency]" in ex.to_html()
    assert not re.search(r"\b1 (such )?requests\b", ex.to_html())


# ---- the reader's environment: JupyterLab with live explorers ----------------------------------


def test_jupyter_lab_and_its_widget_manager_are_installed():
    """After ``pip install -r requirements.txt``, ``jupyter lab notebooks/`` starts JupyterLab,
    and JupyterLab has the ipywidgets manager the live explorers need."""
    assert shutil.which("jupyter-lab"), "jupyter lab: command `jupyter-lab` not found"
    out = subprocess.run(
        [sys.executable, "-m", "jupyter", "labextension", "list"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    listing = out.stdout + out.stderr
    assert out.returncode == 0, listing
    assert re.search(r"@jupyter-widgets/jupyterlab-manager\s.*enabled", listing), listing


def test_an_explorer_renders_live_in_a_kernel():
    """In a kernel an explorer is a live ipywidgets view: the cell's result is a widget view
    whose model the kernel opened over a comm (nbclient, as the front end, stores its state)."""
    import nbclient
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell(
            "from cpbook.widgets.explorer import explorer\n"
            "explorer(lambda n: f'n = {n}', {'n': [1, 2]})"
        )
    ]
    client = nbclient.NotebookClient(nb, timeout=120, kernel_name="python3")
    client.store_widget_state = True
    client.execute()
    data = nb.cells[0].outputs[-1]["data"]
    view = data["application/vnd.jupyter.widget-view+json"]
    state = nb.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]
    assert view["model_id"] in state
    assert "text/html" in data  # the kernel-free view the book shows
