"""Dense single-device float64 references: the oracle every distributed path is checked against.

Each function recomputes, on the host in float64, what one rank's distributed attention must
return for its heads and rows, from the whole inputs of :mod:`cpbook.core.problems`.  They know
nothing of groups or caches; objects of higher layers they read (MLA weights, a PCP partition's
metadata, a TPA block) are taken by their attributes, so this layer imports none of them.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from cpbook.core.attention import dense_attention

__all__ = [
    "decode_reference",
    "verify_reference",
    "mla_reference",
    "pcp_prefill_reference",
    "tpa_block_reference",
]


def decode_reference(
    q: torch.Tensor, ks: Sequence[torch.Tensor], vs: Sequence[torch.Tensor]
) -> torch.Tensor:
    """One decode step: request ``i``'s query ``q[i]`` over all its keys ``ks[i]`` (non-causal);
    ``[B, Hq, Dv]`` in float64."""
    return torch.cat(
        [
            dense_attention(q[i : i + 1].double(), ks[i].double(), vs[i].double())[0]
            for i in range(len(ks))
        ]
    )


def verify_reference(
    q: torch.Tensor,
    ks: Sequence[torch.Tensor],
    vs: Sequence[torch.Tensor],
    context_lens: Sequence[int],
    num_rows: Sequence[int],
) -> torch.Tensor:
    """A verification (or chunk) step: request ``i``'s ``num_rows[i]`` query rows (``q``,
    request by request) at positions ``context_lens[i] …``, causal over ``ks[i]``;
    ``[Σ num_rows, Hq, Dv]`` in float64."""
    parts, at = [], 0
    for k, v, c, r in zip(ks, vs, context_lens, num_rows):
        parts.append(dense_attention(q[at : at + r].double(), k.double(), v.double(), True, c)[0])
        at += r
    return torch.cat(parts)


def mla_reference(
    mla: Any,
    q_nope: Sequence[torch.Tensor],
    q_pe: Sequence[torch.Tensor],
    latents: Sequence[torch.Tensor],
    context_lens: Sequence[int],
    heads: slice,
) -> list[torch.Tensor]:
    """MLA in its MHA form (``mla``: :class:`~cpbook.dcp.mla.MLAWeights`, copied to the host in
    float64): request ``i``'s new tokens after ``context_lens[i]`` cached ones, causal, for
    ``heads``; one ``[T_i, h, Dv]`` per request."""
    m64 = mla.to("cpu", torch.float64)
    outs = []
    for a, b, x, c in zip(q_nope, q_pe, latents, context_lens):
        k, v = m64.expand_kv(x.double(), heads)
        q = torch.cat([a, b], dim=-1)[:, heads].double()
        outs.append(dense_attention(q, k, v, causal=True, q_offset=c, scale=m64.scale)[0])
    return outs


def pcp_prefill_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: Any, block: int = 256
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal prefill of the whole batch (``q, k, v`` request-major) for the real rows of one PCP
    rank, in its local row order (``meta``: :class:`~cpbook.pcp.zigzag.PCPMetadata`), computed
    ``block`` queries at a time; padding rows stay 0 and ``-inf``."""
    out = torch.zeros(meta.num_tokens, q.shape[1], v.shape[-1], dtype=torch.float64)
    lse = torch.full((meta.num_tokens, q.shape[1]), float("-inf"), dtype=torch.float64)
    cu = meta.cu_seq_lens
    for seg, qlen, klen in zip(meta.segments, meta.query_lens, meta.key_lens):
        base = cu[seg.request]
        for i in range(0, qlen, block):
            n = min(block, qlen - i)
            rows = slice(base + seg.start + i, base + seg.start + i + n)
            o, l = dense_attention(
                q[rows].double(),
                k[base : base + klen].double(),
                v[base : base + klen].double(),
                causal=True,
                q_offset=seg.start + i,
                k_offset=0,
            )
            out[seg.row + i : seg.row + i + n], lse[seg.row + i : seg.row + i + n] = o, l
    return out, lse


def tpa_block_reference(
    x: torch.Tensor, block: Any, ks: Sequence[torch.Tensor], vs: Sequence[torch.Tensor | None]
) -> torch.Tensor:
    """An attention block (``block``: :class:`~cpbook.dcp.tpa.TPABlock`) on one device in
    float64: ``q_proj``, every head over every cached token, ``o_proj``; ``[B, hidden]``."""
    heads = slice(0, block.num_q_heads)
    q = block.q(x.double(), heads)
    outs = []
    for i in range(x.shape[0]):
        if block.mla is None:
            outs.append(dense_attention(q[i : i + 1], ks[i].double(), vs[i].double())[0])
        else:
            k, v = block.mla.expand_kv(ks[i].double(), heads)
            outs.append(dense_attention(q[i : i + 1], k, v, scale=block.mla.scale)[0])
    return block.o(torch.cat(outs), heads)
