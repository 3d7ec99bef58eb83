"""cpbook.viz.spec: chapter 10's figures draw, and Fig 10.2's legends cover no curve."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402

from cpbook.viz.spec import break_even_figure, verify_mask_figure  # noqa: E402


def _measured():
    return [
        dict(k=3, context=c, no_cp_ms_per_token=c / 1e3, dcp_ms_per_token=2 + c / 4e3,
             dcp_spec_ms_per_token=1.5 + c / 5e3, no_cp_spec_ms_per_token=c / 2e3)
        for c in (1024, 4096, 16384, 65536, 262144)
    ]  # fmt: skip


def test_break_even_legends_lie_outside_their_axes():
    modelled = {
        f"k = {k}, vs {base}": [(a / 20, 170_000 * (1 - a / (k + 1))) for a in range(20)]
        for k in (1, 3)
        for base in ("plain no CP", "no CP + spec")
    }
    fig = break_even_figure(_measured(), 3, modelled)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        legend = ax.get_legend()
        assert legend is not None and len(legend.get_texts()) == 4
        box, area = legend.get_window_extent(renderer), ax.get_window_extent(renderer)
        assert box.y1 <= area.y0, "the legend overlaps the plotting area"
        for line in ax.get_lines():  # and no drawn point falls inside it
            for x, y in line.get_transform().transform(line.get_xydata()):
                assert not box.contains(x, y)
    plt.close(fig)


def test_verify_mask_figure_draws():
    fig = verify_mask_figure(start=13, num_rows=4, dcp=4)
    assert len(fig.axes) == 1
    plt.close(fig)
