"""Chapter 6's explorer: one decode layer's modelled time without CP, with DCP and with TPA."""

from __future__ import annotations

from cpbook import costmodel as cm
from cpbook.viz.style import BLUE, ORANGE, PURPLE
from cpbook.widgets.bars import bar_chart
from cpbook.widgets.explorer import Control, Explorer, explorer, pre

__all__ = ["CONTEXTS", "ALPHAS_US", "BATCHES", "decode_readout", "decode_explorer"]

CONTEXTS = (4096, 16384, 65536, 131072, 262144, 1048576)
ALPHAS_US = (2, 5, 10, 15, 25)
BATCHES = (1, 8, 64)
_NAMES = {"no_cp": "no CP", "dcp": "DCP", "dcp_tpa": "DCP + TPA"}


def _tokens(x: float) -> str:
    if x == float("inf"):
        return "never"
    return f"{x / 1024:,.0f}K" if x >= 1024 else f"{x:,.0f}"


def decode_readout(
    context: int, alpha_us: float, batch: int, model: str = "DeepSeek-V3", gpu: str = "H200"
) -> str:
    """HTML: the three modes' KV read, collectives and TPA's extra weight reads, and the
    break-evens."""
    m, g, nvl = cm.MODELS[model], cm.GPUS[gpu], cm.LINKS["NVLink4"]
    link = cm.LinkSpec(nvl.name, alpha_us * 1e-6, nvl.bw_bytes_per_s, nvl.source)
    kw = dict(num_reqs=batch, knobs=cm.CostKnobs(link=link))
    times = {mode: cm.decode_layer_time(m, g, context, mode, **kw) for mode in cm.DECODE_MODES}
    rows = [
        (
            _NAMES[mode],
            [
                (t.kv_read_s * 1e6, BLUE),
                (t.comm_s * 1e6, ORANGE),
                ((t.q_proj_extra_s + t.w_uk_t_extra_s) * 1e6, PURPLE),
            ],
            f"{t.total_s * 1e6:,.1f} us",
        )
        for mode, t in times.items()
    ]
    chart = bar_chart(
        rows,
        title=f"one layer, one decode step: {model}, 8 x {gpu}, TP = DCP = "
        f"8, batch {batch}, {context // 1024:,}K tokens, "
        f"alpha {alpha_us} us",
        legend=[
            ("KV read", BLUE),
            ("collectives", ORANGE),
            ("TPA's extra weights (q_proj, W_UK_T)", PURPLE),
        ],
    )
    even = {mode: cm.decode_break_even(m, g, mode, **kw) for mode in ("dcp", "dcp_tpa")}
    fastest = min(times, key=lambda k: times[k].total_s)
    text = (
        f"fastest here     {_NAMES[fastest]}\n"
        f"DCP beats no CP  above {_tokens(even['dcp'])} tokens\n"
        f"TPA beats no CP  above {_tokens(even['dcp_tpa'])} tokens"
    )
    return chart + pre(text)


def decode_explorer() -> Explorer:
    """Context × collective latency × batch: 90 precomputed states of :func:`decode_readout`."""
    return explorer(
        decode_readout,
        {
            "context": Control(
                CONTEXTS, names=[f"{n // 1024:,}K" for n in CONTEXTS], label="context"
            ),
            "alpha_us": Control(
                ALPHAS_US, names=[f"{a} us" for a in ALPHAS_US], label="alpha per collective"
            ),
            "batch": Control(BATCHES, label="requests decoding"),
        },
        value={"context": 131072, "alpha_us": 15, "batch": 1},
        caption="cpbook.costmodel's decode_layer_time and decode_break_even, the model of this "
        "chapter: DeepSeek-V3 on 8 x H200, bf16 KV, beta = 450 GB/s, eta = 0.8, ag_rs.",
    )
