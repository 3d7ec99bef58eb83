"""MLA under DCP: the absorbed decode moves Q; the prefill-with-context path moves the latent KV.

MLA caches one latent row per token: ``kv_c`` (``kv_lora_rank`` values) and ``k_pe`` (the
RoPE part, ``qk_rope_head_dim`` values, rotated before caching).  Head ``h`` sees
``k_nope = kv_c @ W_UK[:, h]``, ``k = [k_nope, k_pe]`` and ``v = kv_c @ W_UV[:, h]``.
:class:`MLAWeights` holds ``W_UK`` / ``W_UV`` (random, or a model's: the engine's tiny MLA and
Hugging Face DeepSeek layers carry one); both forms below give the same attention.

**Decode (absorbed / MQA form; vLLM 0.11 ``MLACommonImpl.forward``, current
``mla_attention.py``).**  ``ql_nope = q_nope @ W_UK_T`` turns each query head into a latent
query ``[ql_nope, q_pe]`` (width ``C + R``) that attends the cached latents directly, as MQA
with one KV head.  Under DCP the latent queries of the group are **all-gathered over heads**,
each rank attends its latent shard, the partial latent outputs are combined with the LSE
(:func:`cpbook.dcp.decode.dcp_combine`), and ``_v_up_proj`` maps them through ``W_UV`` on local
heads.  vLLM v0.34.0 adds a third combine, :func:`dcp_a2a_v_up_proj_lse_reduce`, for
``dcp_comm_backend="a2a"`` without PCP where its direct symmetric-memory All2All is off (that
one is on by default on one CUDA node for 16-bit outputs): from 8 tokens on, every rank
up-projects the partial outputs of all gathered heads through ``W_UV_dcp`` (``W_UV`` of the
group's heads, all-gathered once at load), and the All2All carries ``Dv`` values per head
instead of ``C``.

**Prefill with cached context (MHA form; ``_context_parallel_compute_prefill_context``).**
Queries stay put.  The context is walked in chunks that fit a workspace: each rank copies its
latent rows of every request's chunk, padded to rank 0's count, the DCP group
**all-gathers** them, and :func:`reorg_kvcache` drops the padding and lays each request out
contiguously, rank-major (not re-interleaved: attention over the context is non-causal and
RoPE is already in ``k_pe``).  Each chunk is up-projected and attended; chunk results and the
causal attention over the new tokens are merged with
:func:`cpbook.core.attention.merge_attn_states`.

Bytes each rank sends (``N`` = dcp, ``h`` local heads, ``C``/``R`` latent/rope widths, ``e``):
decode ``T`` tokens by moving Q (ag_rs): ``T·h·e·(C+R + C + N·e_lse/e)·(N−1)``; with the
up-projected ``a2a`` from 8 tokens: ``T·h·(e·(C+R) + e·Dv + e_lse)·(N−1)``
(:func:`mla_decode_comm_bytes`);
moving the context KV: ``Σ_chunks rows·(C+R)·e·(N−1)`` ≈ ``L/N·(C+R)·e·(N−1)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from cpbook.core.attention import attention_with_lse, merge_attn_states
from cpbook.core.comm import Group
from cpbook.core.errors import RuleError
from cpbook.dcp.comm_bytes import V_UP_PROJ_FIRST_MIN_TOKENS
from cpbook.dcp.decode import dcp_a2a_lse_reduce, dcp_combine, decode_comm_bytes, local_attention
from cpbook.kv.gather import context_chunk_len, reorg_kvcache
from cpbook.kv.layout import local_seq_len

__all__ = [
    "MLAShape",
    "MLAWeights",
    "V_UP_PROJ_FIRST_MIN_TOKENS",
    "dcp_a2a_v_up_proj_lse_reduce",
    "mla_decode_attention",
    "mla_decode_comm_bytes",
    "mla_context_attention",
    "q_move_bytes",
    "kv_move_bytes",
    "crossover_context_len",
]


@dataclass(frozen=True)
class MLAShape:
    """MLA's widths under vLLM's (DeepSeek's ``config.json``) names: the latent
    ``kv_lora_rank`` (``C``), the per-head ``qk_nope_head_dim`` (``Dn``) and
    ``qk_rope_head_dim`` (``R``) of queries and keys, and ``v_head_dim`` (``Dv``)."""

    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 16

    @property
    def head_dim(self) -> int:
        """The MHA form's query/key width ``Dn + R`` (``ParallelConfig.head_dim`` for MLA)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class MLAWeights:
    """MLA's up-projections: ``W_UK [C, H, Dn]`` and ``W_UV [C, H, Dv]``; ``R`` rope dims.

    ``W_UV_dcp [C, N·h, Dv]`` (vLLM v0.34.0's attribute of that name): ``W_UV`` of the DCP
    group's heads in group order, set by :meth:`with_w_uv_dcp` when the combine up-projects
    before the All2All; ``None`` otherwise."""

    W_UK: torch.Tensor
    W_UV: torch.Tensor
    qk_rope_head_dim: int
    W_UV_dcp: torch.Tensor | None = None

    @classmethod
    def random(
        cls,
        num_q_heads: int = 8,
        kv_lora_rank: int = 32,
        qk_nope_head_dim: int = 16,
        qk_rope_head_dim: int = 8,
        v_head_dim: int = 16,
        seed: int = 0,
        dtype: torch.dtype = torch.float64,
    ) -> "MLAWeights":
        gen = torch.Generator().manual_seed(seed)
        s = kv_lora_rank**-0.5
        uk = (
            torch.randn(
                kv_lora_rank, num_q_heads, qk_nope_head_dim, generator=gen, dtype=torch.float64
            )
            * s
        )
        uv = (
            torch.randn(kv_lora_rank, num_q_heads, v_head_dim, generator=gen, dtype=torch.float64)
            * s
        )
        return cls(uk.to(dtype), uv.to(dtype), qk_rope_head_dim)

    def to(
        self, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> "MLAWeights":
        """The same up-projections on ``device`` and in ``dtype`` (``None``: unchanged)."""
        dcp = None if self.W_UV_dcp is None else self.W_UV_dcp.to(device, dtype)
        return MLAWeights(
            self.W_UK.to(device, dtype), self.W_UV.to(device, dtype), self.qk_rope_head_dim, dcp
        )

    def with_w_uv_dcp(self, heads: slice, group: Group) -> "MLAWeights":
        """These weights with ``W_UV_dcp``: ``W_UV`` of ``heads`` all-gathered over the DCP
        ``group`` (one AllGather of ``C·h·Dv`` values, at load time in vLLM v0.34.0's
        ``process_weights_after_loading``), in the order the query AllGather stacks heads."""
        w_uv_dcp = group.all_gather(self.W_UV[:, heads].contiguous(), dim=1)
        return MLAWeights(self.W_UK, self.W_UV, self.qk_rope_head_dim, w_uv_dcp)

    @property
    def kv_lora_rank(self) -> int:
        return self.W_UK.shape[0]

    @property
    def num_q_heads(self) -> int:
        return self.W_UK.shape[1]

    @property
    def latent_dim(self) -> int:
        """Width of one cached row: ``kv_lora_rank + qk_rope_head_dim``."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def scale(self) -> float:
        """Softmax scale of the MHA form, ``1/sqrt(qk_nope_head_dim + qk_rope_head_dim)``; the
        absorbed form must use the same one."""
        return 1.0 / math.sqrt(self.W_UK.shape[2] + self.qk_rope_head_dim)

    def absorb_q(self, q_nope: torch.Tensor, q_pe: torch.Tensor, heads: slice) -> torch.Tensor:
        """``[q_nope @ W_UK_T, q_pe]``: ``[T, h, Dn]``, ``[T, h, R]`` -> ``[T, h, C + R]``."""
        return torch.cat([torch.einsum("thn,chn->thc", q_nope, self.W_UK[:, heads]), q_pe], dim=-1)

    def v_up_proj(self, o_latent: torch.Tensor, heads: slice) -> torch.Tensor:
        """vLLM's ``_v_up_proj``: ``[T, h, C] -> [T, h, Dv]`` through ``W_UV`` of ``heads``."""
        return torch.einsum("thc,chv->thv", o_latent, self.W_UV[:, heads])

    def expand_kv(self, latent: torch.Tensor, heads: slice) -> tuple[torch.Tensor, torch.Tensor]:
        """MHA keys and values of ``heads`` from latent rows ``[L, C + R]`` (``kv_b_proj``)."""
        kv_c, k_pe = latent.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        k_nope = torch.einsum("lc,chn->lhn", kv_c, self.W_UK[:, heads])
        k = torch.cat([k_nope, k_pe[:, None].expand(-1, k_nope.shape[1], -1)], dim=-1)
        return k, torch.einsum("lc,chv->lhv", kv_c, self.W_UV[:, heads])


# ------------------------------------------------------------------------------------------
# decode: all-gather the absorbed Q over DCP heads
# ------------------------------------------------------------------------------------------
def mla_decode_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    latents: Sequence[torch.Tensor],
    mla: MLAWeights,
    heads: slice,
    group: Group,
    dcp_comm_backend: str = "ag_rs",
    shapes: dict[str, Any] | None = None,
) -> torch.Tensor:
    """vLLM's absorbed MLA decode under DCP; returns ``[B, h, Dv]`` for this rank's ``heads``.

    ``q_nope [B, h, Dn]``, ``q_pe [B, h, R]``: one token per request; ``latents[i] [n_i, C+R]``:
    this rank's cached rows of request ``i``.  Collectives: AllGather of the latent query, then
    the combine (two collectives for ``ag_rs``, one for ``a2a``).  When ``mla.W_UV_dcp`` is set
    (``a2a`` only, as vLLM v0.34.0's ``mla_attention.py``), the combine is
    :func:`dcp_a2a_v_up_proj_lse_reduce`, which returns the up-projected heads itself.
    """
    if mla.W_UV_dcp is not None and dcp_comm_backend != "a2a":
        raise RuleError(
            "v-up-proj-combine-a2a",
            "dcp_comm_backend == 'a2a' when W_UV_dcp is set",
            dcp_comm_backend=dcp_comm_backend,
        )
    decode_q = mla.absorb_q(q_nope, q_pe, heads)  # [B, h, C+R]
    q_all = group.all_gather(decode_q, dim=1)  # [B, N·h, C+R]
    c = mla.kv_lora_rank
    o, lse = local_attention(
        q_all, [x[:, None] for x in latents], [x[:, None, :c] for x in latents], mla.scale
    )
    if shapes is not None:
        shapes.update(
            q=tuple(decode_q.shape),
            q_gathered=tuple(q_all.shape),
            kv_local=[tuple(x.shape) for x in latents],
            out_partial=tuple(o.shape),
        )
    if mla.W_UV_dcp is not None:
        out = dcp_a2a_v_up_proj_lse_reduce(o, lse.to(o.dtype), mla.W_UV_dcp, group)
        if shapes is not None:
            shapes["out"] = tuple(out.shape)
        return out
    o_latent = dcp_combine(o, lse.to(o.dtype), group, dcp_comm_backend)  # [B, h, C]
    if shapes is not None:
        shapes["out_latent"] = tuple(o_latent.shape)
    out = mla.v_up_proj(o_latent, heads)
    if shapes is not None:
        shapes["out"] = tuple(out.shape)
    return out


def dcp_a2a_v_up_proj_lse_reduce(
    out: torch.Tensor, lse: torch.Tensor, w_uv_dcp: torch.Tensor, group: Group
) -> torch.Tensor:
    """vLLM v0.34.0's MLA combine: up-project by ``W_UV``, then All2All and merge by LSE.

    ``out [B, N·h, C]``, ``lse [B, N·h]``: this rank's partial latent outputs of the group's
    heads; ``w_uv_dcp [C, N·h, Dv]``: those heads' ``W_UV`` in group order.  Returns this rank's
    ``h`` heads (the ``group.rank``-th block of ``h``) up-projected, ``[B, h, Dv]``, exact: the
    LSE merge is a per-head weighted sum and ``W_UV`` is linear per head, so projecting first
    gives the same result.  From :data:`V_UP_PROJ_FIRST_MIN_TOKENS` tokens on, each rank
    projects all ``N·h`` heads and the All2All (:func:`~cpbook.dcp.decode.dcp_a2a_lse_reduce`)
    carries ``Dv`` values (+ the LSE) per head; below, it merges the ``C``-wide latent first and
    projects only its own ``h`` heads.
    """
    if out.shape[0] < V_UP_PROJ_FIRST_MIN_TOKENS:
        latent = dcp_a2a_lse_reduce(out, lse, group)  # [B, h, C]
        h = latent.shape[1]
        mine = w_uv_dcp[:, group.rank * h : (group.rank + 1) * h]
        return torch.einsum("thc,chv->thv", latent, mine)
    v = torch.einsum("thc,chv->thv", out, w_uv_dcp)  # [B, N·h, Dv]: every head of the group
    return dcp_a2a_lse_reduce(v, lse, group)


def mla_context_attention(
    q_nope: Sequence[torch.Tensor],
    q_pe: Sequence[torch.Tensor],
    new_latents: Sequence[torch.Tensor],
    context_lens: Sequence[int],
    local_context: Sequence[torch.Tensor],
    mla: MLAWeights,
    heads: slice,
    group: Group,
    interleave: int,
    workspace_size: int,
    stats: dict[str, Any] | None = None,
) -> list[torch.Tensor]:
    """Chunked prefill with a DCP-sharded cached context (vLLM's MHA context path).

    Request ``i`` brings ``T_i`` new tokens (``q_nope[i] [T_i, h, Dn]``, ``q_pe[i] [T_i, h, R]``,
    ``new_latents[i] [T_i, C+R]``, known to every rank) after ``context_lens[i]`` cached tokens,
    of which this rank holds ``local_context[i]`` (its rows in position order).  Returns
    ``[T_i, h, Dv]`` per request, exact.  Per chunk one AllGather of at most ``workspace_size``
    rows in total; ``stats`` (if a dict) receives the chunk length and rows per chunk.

    More than eight parameters: the tensors of one attention call (queries in two parts, new
    and cached latents, their lengths), the weights and heads, and the group with its
    interleave and workspace, as vLLM's ``_context_parallel_compute_prefill_context`` takes them.
    """
    n, me = group.size, group.rank
    chunk = context_chunk_len(sum(c > 0 for c in context_lens), workspace_size, n, interleave)
    num_chunks = max([-(-c // chunk) for c in context_lens] + [0])
    parts: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in context_lens]
    rows = []
    for c in range(num_chunks):
        lens = [min(max(L - c * chunk, 0), chunk) for L in context_lens]
        counts = [[local_seq_len(x, n, r, interleave) for x in lens] for r in range(n)]
        padded = counts[0]  # rank 0 holds the most rows of every chunk
        lo = c * chunk // n
        mine = []
        for i, x in enumerate(local_context):
            got = x[lo : lo + counts[me][i]]
            mine += [got, got.new_zeros(padded[i] - got.shape[0], got.shape[1])]
        gathered = group.all_gather(torch.cat(mine), dim=0)  # [N·toks, C+R]
        rows.append(gathered.shape[0])
        ws, cu = reorg_kvcache(gathered, counts, padded)
        for i in range(len(context_lens)):
            if cu[i + 1] > cu[i]:
                k, v = mla.expand_kv(ws[cu[i] : cu[i + 1]], heads)
                q = torch.cat([q_nope[i], q_pe[i]], dim=-1)
                parts[i].append(attention_with_lse(q, k, v, scale=mla.scale))
    outs = []
    for i, lat in enumerate(new_latents):
        k, v = mla.expand_kv(lat, heads)
        q = torch.cat([q_nope[i], q_pe[i]], dim=-1)
        parts[i].append(attention_with_lse(q, k, v, causal=True, scale=mla.scale))
        outs.append(merge_attn_states([p[0] for p in parts[i]], [p[1] for p in parts[i]])[0])
    if stats is not None:
        stats.update(chunk_len=chunk, num_chunks=num_chunks, rows_per_chunk=rows)
    return outs


def mla_decode_comm_bytes(
    num_tokens: int,
    heads_per_rank: int,
    shape: MLAShape,
    dcp: int,
    dcp_comm_backend: str = "ag_rs",
    v_up_proj_combine: bool = False,
    elem_bytes: int = 8,
    lse_bytes: int | None = None,
) -> list[tuple[str, int]]:
    """Bytes each rank sends in one absorbed decode step, ``[(op, bytes), ...]`` in call order:
    :func:`cpbook.dcp.decode.decode_comm_bytes` with the query width ``C + R`` and a combined
    width of ``C``, or ``Dv`` (``v_head_dim``) when ``v_up_proj_combine`` (``a2a`` only) and
    ``num_tokens >= V_UP_PROJ_FIRST_MIN_TOKENS``.  ``lse_bytes`` defaults to ``elem_bytes``."""
    if v_up_proj_combine and dcp_comm_backend != "a2a":
        raise RuleError(
            "v-up-proj-combine-a2a",
            "dcp_comm_backend == 'a2a' for the up-projected combine",
            dcp_comm_backend=dcp_comm_backend,
        )
    c = shape.kv_lora_rank
    first = v_up_proj_combine and num_tokens >= V_UP_PROJ_FIRST_MIN_TOKENS
    out_dim = shape.v_head_dim if first else c
    q_dim = c + shape.qk_rope_head_dim
    return decode_comm_bytes(
        num_tokens, heads_per_rank, q_dim, out_dim, dcp, dcp_comm_backend, elem_bytes, lse_bytes
    )


def q_move_bytes(
    query_tokens: int,
    heads_per_rank: int,
    kv_lora_rank: int,
    rope_dim: int,
    dcp: int,
    elem_bytes: int = 2,
    lse_bytes: int = 4,
) -> int:
    """Per rank, per layer: AllGather of the latent Q, AllGather of the LSE, ReduceScatter of
    the latent output (``ag_rs``), for ``query_tokens`` tokens.  Independent of the context."""
    t, h, n = query_tokens, heads_per_rank, dcp
    return (
        t
        * h
        * ((kv_lora_rank + rope_dim) * elem_bytes + n * lse_bytes + kv_lora_rank * elem_bytes)
        * (n - 1)
    )


def kv_move_bytes(
    context_len: int, kv_lora_rank: int, rope_dim: int, dcp: int, elem_bytes: int = 2
) -> float:
    """Per rank, per layer: AllGather of the context's latent rows, ``L/N·(C+R)·e·(N−1)``
    (without the padding of the last stripe)."""
    return context_len / dcp * (kv_lora_rank + rope_dim) * elem_bytes * (dcp - 1)


def crossover_context_len(
    query_tokens: int,
    heads_per_rank: int,
    kv_lora_rank: int,
    rope_dim: int,
    dcp: int,
    elem_bytes: int = 2,
    lse_bytes: int = 4,
) -> float:
    """Context length above which moving the latent KV costs more bytes than moving Q."""
    return (
        q_move_bytes(
            query_tokens, heads_per_rank, kv_lora_rank, rope_dim, dcp, elem_bytes, lse_bytes
        )
        * dcp
        / ((kv_lora_rank + rope_dim) * elem_bytes * (dcp - 1))
    )
