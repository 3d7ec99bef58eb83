"""Chapter 5's explorer: AllGather-Q against AllGather-KV bytes, by heads, chunk and context."""

from __future__ import annotations

from cpbook.core.comm import comm_bytes
from cpbook.core.config import ParallelConfig
from cpbook.pcp.chunked_plan import chunked_comm_bytes
from cpbook.viz.style import GREEN, PURPLE, tint
from cpbook.widgets.bars import bar_chart
from cpbook.widgets.explorer import Control, Explorer, explorer, pre

__all__ = ["HEADS", "CHUNKS", "CONTEXTS", "bytes_readout", "bytes_explorer"]

HEADS = (1, 4, 8, 16)
CHUNKS = (512, 2048, 8192)
CONTEXTS = (0, 4096, 16384, 65536, 262144)
#: One layer, per rank: head size 128 (K and V), bf16, PCP = DCP = 2, interleave 1,
#: context pieces of 16,384 rows.
SETUP = dict(
    num_kv_heads=1,
    head_dim=128,
    prefill_context_parallel_size=2,
    decode_context_parallel_size=2,
    dcp_comm_backend="a2a",
)
#: the rest of a strategy's bytes: the light shade of its colour (the first collective's)
_LIGHT_GREEN, _LIGHT_PURPLE = tint(GREEN), tint(PURPLE)


def _fmt(b: float) -> str:
    return f"{b / 2**20:,.2f} MiB"


def bytes_readout(heads: int, chunk: int, context: int) -> str:
    """HTML: each strategy's bytes per rank (first collective, then the rest) and the winner."""
    plans = {
        st: chunked_comm_bytes(
            st,
            (context,),
            (chunk,),
            ParallelConfig(num_q_heads=heads, **SETUP),
            workspace_size=16384,
            elem_bytes=2,
        )
        for st in ("allgather_q", "allgather_kv")
    }
    q_first, q_rest = plans["allgather_q"][0][1], comm_bytes(plans["allgather_q"][1:])
    kv = [b for _, b in plans["allgather_kv"]]
    kv_first, kv_rest = kv[0], sum(kv[1:])
    total_q, total_kv = q_first + q_rest, kv_first + kv_rest
    rows = [
        ("AllGather-Q", [(q_first, GREEN), (q_rest, _LIGHT_GREEN)], _fmt(total_q)),
        ("AllGather-KV", [(kv_first, PURPLE), (kv_rest, _LIGHT_PURPLE)], _fmt(total_kv)),
    ]
    chart = bar_chart(
        rows,
        title=f"bytes one rank sends per layer: {heads} query head(s) per "
        f"KV head, chunk {chunk:,}, {context:,} cached tokens",
        legend=[
            ("gather Q", GREEN),
            ("out + LSE (All2All)", _LIGHT_GREEN),
            ("gather new K/V", PURPLE),
            ("gather context", _LIGHT_PURPLE),
        ],
    )
    d = SETUP["head_dim"]
    crossover = chunk * (heads * (2 * d + 1) / (2 * d) - 1)
    winner = "AllGather-KV" if total_kv <= total_q else "AllGather-Q"
    ratio = min(total_q, total_kv) / max(total_q, total_kv)
    text = (
        f"fewer bytes  {winner} ({ratio:.2f}x)\n"
        f"crossover    C* = {max(crossover, 0):,.0f} cached\n"
        f"calls        Q: {len(plans['allgather_q'])}, KV: {len(plans['allgather_kv'])}"
    )
    return chart + pre(text)


def bytes_explorer() -> Explorer:
    """Heads × chunk × context: 60 precomputed states of :func:`bytes_readout`."""
    return explorer(
        bytes_readout,
        {
            "heads": Control(HEADS, label="query heads per KV head"),
            "chunk": Control(CHUNKS, names=[f"{n:,}" for n in CHUNKS], label="chunk T"),
            "context": Control(CONTEXTS, names=[f"{n:,}" for n in CONTEXTS], label="cached C"),
        },
        value={"heads": 8, "chunk": 2048, "context": 16384},
        caption="Bytes from chunked_comm_bytes, the formula every traced run of this chapter "
        "matches: one layer, PCP = DCP = 2, head size 128, bf16. The crossover is "
        "C* = T (h/k (2D+1)/2D - 1); AllGather-KV makes one call for the new K/V and "
        "one per context piece of 16,384 rows.",
    )
