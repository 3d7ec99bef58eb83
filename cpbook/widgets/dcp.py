"""Chapter 3 explorer: what one rank sends per decode step and layer, by DCP size, combine
backend and batch, against the KV bytes it reads (bars in plain HTML)."""

from __future__ import annotations

import html

from cpbook.core.comm import comm_bytes
from cpbook.dcp.decode import decode_comm_bytes
from cpbook.viz.style import BLUE, GREEN, ORANGE, PURPLE
from cpbook.widgets.explorer import Control, Explorer

__all__ = ["comm_bars_html", "comm_explorer"]

_COLOURS = {"all_gather": BLUE, "reduce_scatter": ORANGE, "all_to_all": GREEN}
# what each call of ``decode_comm_bytes`` carries, in call order
_NAMES = {
    "ag_rs": ["AllGather Q", "AllGather LSE", "ReduceScatter out"],
    "a2a": ["AllGather Q", "All2All out + LSE"],
}


def _kb(n: float) -> str:
    return f"{n / 1024:,.1f} KiB" if n < 2**20 else f"{n / 2**20:,.1f} MiB"


def comm_bars_html(
    dcp: int,
    dcp_comm_backend: str,
    num_reqs: int,
    context: int,
    heads_per_rank: int = 8,
    head_dim: int = 128,
    elem_bytes: int = 2,
    scale: float | None = None,
) -> str:
    """One bar per collective (bytes one rank sends, formula of ``cpbook.dcp.decode``), then the KV
    bytes the rank reads (one KV head, ``context`` tokens per request split ``dcp`` ways).
    Bar lengths are relative to ``scale`` bytes (default: the longest bar of this state)."""
    calls = decode_comm_bytes(
        num_reqs, heads_per_rank, head_dim, head_dim, dcp, dcp_comm_backend, elem_bytes
    )
    kv = num_reqs * 2 * head_dim * elem_bytes * -(-context // dcp)
    names = _NAMES[dcp_comm_backend]
    rows = [(f"{i + 1}. {names[i]}", n, _COLOURS[op]) for i, (op, n) in enumerate(calls)]
    sent = comm_bytes(calls)
    rows += [("sent, total", sent, "#555555"), ("KV read", kv, PURPLE)]
    scale = scale or max(n for _, n, _ in rows)
    out = [
        '<div style="display:grid;grid-template-columns:auto 1fr;gap:.2em .6em;'
        'align-items:center;max-width:40em;font-size:.9em">'
    ]
    for label, n, colour in rows:
        width = 80 * min(n / scale, 1)  # the longest bar leaves room for its value
        out.append(
            f"<span>{html.escape(label)}</span><span style='display:flex;align-items:center;"
            f"gap:.4em'><span style='display:inline-block;height:1em;width:{width:.2f}%;"
            f"min-width:1px;background:{colour}'></span><span style='white-space:nowrap'>{_kb(n)}"
            "</span></span>"
        )
    out.append("</div>")
    ratio = kv / sent if sent else float("inf")
    out.append(
        f"<p>DCP={dcp}, <code>{dcp_comm_backend}</code>, {num_reqs} "
        f"request{'s' if num_reqs > 1 else ''} of "
        f"{context // 1024}K tokens: {len(calls)} collectives, {_kb(sent)} sent per rank and "
        f"layer; the rank reads {_kb(kv)} of KV, "
        + (f"{ratio:,.0f}× what it sends.</p>" if sent else "and sends nothing.</p>")
    )
    return "".join(out)


def comm_explorer(
    dcps: tuple[int, ...] = (1, 2, 4, 8),
    backends: tuple[str, ...] = ("ag_rs", "a2a"),
    batches: tuple[int, ...] = (1, 16, 128),
    contexts: tuple[int, ...] = (8192, 131072),
    heads_per_rank: int = 8,
    head_dim: int = 128,
    **value,
) -> Explorer:
    """DCP size × combine backend × batch × context, bf16; each state's bars are relative to
    its longest (the KV read, except for tiny contexts)."""
    return Explorer(
        lambda dcp, backend, batch, context: comm_bars_html(
            dcp, backend, batch, context, heads_per_rank, head_dim, 2
        ),
        {
            "dcp": Control(list(dcps), label="DCP"),
            "backend": Control(list(backends), label="dcp_comm_backend"),
            "batch": Control(list(batches), label="requests"),
            "context": Control(list(contexts), names=[f"{c // 1024}K" for c in contexts]),
        },
        value=value,
        caption=(
            f"One rank, one decode step, one layer: {heads_per_rank} query heads per rank of "
            f"size {head_dim}, one KV head, bf16. Each bar is drawn relative to the longest one, "
            "the KV the rank reads."
        ),
    )
