"""Decode context parallelism (DCP) for GQA: every rank holds a slice of each request's KV.

A DCP group of ``N`` ranks is a contiguous slice of one TP group whose ranks would otherwise
hold copies of the same KV head.  Each rank stores only its interleaved share of every
request's tokens (:mod:`cpbook.kvcache`).  One decode step per layer (vLLM
``FlashAttentionImpl._forward_with_dcp`` and ``vllm/v1/attention/ops/dcp.py``):

1. **AllGather Q** over the DCP group on the head dimension: ``(B, h, D) -> (B, N·h, D)``,
   where ``h = num_q_heads / tp``.  Every gathered head reads the group's one KV head.
2. **Local attention** of all ``N·h`` heads over the local shard, returning the LSE.
3. **Combine** the ``N`` partial results exactly, keeping this rank's ``h`` heads:

   * ``ag_rs`` (vLLM's default, :func:`cp_lse_ag_out_rs`): AllGather the LSE only, scale each
     partial output by ``exp(lse_r − lse_total)`` (:func:`correct_attn_out`), ReduceScatter
     (sum) the outputs over heads;
   * ``a2a`` (vLLM's ``dcp_comm_backend="a2a"``, Helix's choice, :func:`dcp_a2a_lse_reduce`):
     one All2All of outputs with the LSE packed as an extra channel, then a local
     LSE-weighted combine.

Bytes each rank sends per step (= bytes it receives), ``B`` decode requests, ``e`` bytes per
element, ``Dq`` the gathered query width and ``Do`` the partial output width (``D`` for GQA):

=====================  ============================
AllGather Q            ``B·h·Dq·e·(N−1)``
ag_rs: AllGather LSE   ``B·N·h·e·(N−1)``
ag_rs: ReduceScatter   ``B·h·Do·e·(N−1)``
a2a: All2All           ``B·h·(Do+1)·e·(N−1)``
=====================  ============================

No term depends on the context length: DCP moves queries and partial outputs, never KV.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .attention import attention_with_lse, dense_attention, merge_attn_states
from .comm import Group, RankContext
from .config import ConfigError, ParallelConfig, kv_heads_of_rank, q_heads_of_rank
from .groups import make_groups
from .kvcache import PagedKVCache, num_virtual_blocks

__all__ = [
    "COMM_BACKENDS",
    "correct_attn_out",
    "cp_lse_ag_out_rs",
    "dcp_a2a_lse_reduce",
    "dcp_combine",
    "local_attention",
    "dcp_decode_attention",
    "decode_comm_bytes",
    "shard_kv_cache",
    "gqa_decode_problem",
    "gqa_decode_rank",
]

COMM_BACKENDS = ("ag_rs", "a2a")


# ------------------------------------------------------------------------------------------
# the combine: exact LSE correction, two ways
# ------------------------------------------------------------------------------------------
def correct_attn_out(
    out: torch.Tensor, lses: torch.Tensor, rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's ``correct_attn_out``: scale rank ``rank``'s partial output to its share of the total.

    ``out [B, H, D]`` is this rank's output over its keys, ``lses [N, B, H]`` every rank's LSE.
    Returns ``(out · exp(lse_rank − lse_total), lse_total [B, H])``; summing the corrected
    outputs of all ranks gives the exact attention over all keys.  NaN and ``+inf`` LSEs count
    as ``-inf`` (an empty shard); a row empty on every rank gets weight 0 and LSE ``-inf``.
    """
    lses = torch.where(torch.isnan(lses) | (lses == float("inf")), float("-inf"), lses)
    m = lses.max(dim=0).values
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    total = torch.log(torch.exp(lses - m).sum(dim=0)) + m
    factor = torch.exp(lses[rank] - total)
    factor = torch.where(torch.isfinite(factor), factor, torch.zeros_like(factor))
    return out * factor[..., None].to(out.dtype), total


def cp_lse_ag_out_rs(
    out: torch.Tensor, lse: torch.Tensor, group: Group, return_lse: bool = False
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``ag_rs`` combine: AllGather the LSE, correct, ReduceScatter the outputs over heads.

    ``out [B, N·h, D]``, ``lse [B, N·h]`` over this rank's keys; returns ``[B, h, D]`` (this
    rank's heads, exact over the group's keys) and, with ``return_lse``, their LSE ``[B, h]``.
    Two collectives: ``all_gather`` of ``B·N·h`` LSE values and ``reduce_scatter`` of the output.
    """
    lses = group.all_gather(lse[None], dim=0)  # [N, B, N·h]: the LSE only
    out, total = correct_attn_out(out, lses, group.rank)
    out = group.reduce_scatter(out, dim=1)
    if return_lse:
        return out, total.chunk(group.size, dim=1)[group.rank]
    return out


def dcp_a2a_lse_reduce(
    out: torch.Tensor, lse: torch.Tensor, group: Group, return_lse: bool = False
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``a2a`` combine: one All2All of (output | LSE), then a local LSE-weighted combine.

    Same contract as :func:`cp_lse_ag_out_rs`.  The LSE travels as one extra channel of the
    output (vLLM packs it the same way, PR #41160), so ``out`` and ``lse`` share a dtype here.
    """
    if out.dtype != lse.dtype:
        raise ValueError(
            f"[a2a-pack-dtype] requires out and lse of one dtype to pack them; "
            f"got out={out.dtype}, lse={lse.dtype}"
        )
    packed = torch.cat([out, lse[..., None]], dim=-1)[None]  # [1, B, N·h, D+1]
    got = group.all_to_all(packed, scatter_dim=2, gather_dim=0)  # [N, B, h, D+1]
    merged, total = merge_attn_states(list(got[..., :-1]), list(got[..., -1]))
    return (merged, total) if return_lse else merged


def dcp_combine(
    out: torch.Tensor,
    lse: torch.Tensor,
    group: Group,
    dcp_comm_backend: str = "ag_rs",
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Dispatch to :func:`cp_lse_ag_out_rs` (``"ag_rs"``) or :func:`dcp_a2a_lse_reduce`
    (``"a2a"``)."""
    if dcp_comm_backend not in COMM_BACKENDS:
        raise ConfigError(
            "comm-backend",
            "dcp_comm_backend in {'ag_rs', 'a2a'}",
            dcp_comm_backend=dcp_comm_backend,
        )
    fn = cp_lse_ag_out_rs if dcp_comm_backend == "ag_rs" else dcp_a2a_lse_reduce
    return fn(out, lse, group, return_lse)


# ------------------------------------------------------------------------------------------
# one decode step
# ------------------------------------------------------------------------------------------
def local_attention(
    q: torch.Tensor,
    ks: Sequence[torch.Tensor],
    vs: Sequence[torch.Tensor],
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Request ``i``'s query ``q[i]`` against its local keys ``ks[i]`` (non-causal: decode).

    ``q [B, H, D]``; ``ks[i] [n_i, Hkv, D]``, ``vs[i] [n_i, Hkv, Dv]``, ``n_i`` possibly 0.
    Returns ``out [B, H, Dv]`` and ``lse [B, H]`` (``-inf`` and zeros for an empty shard).
    """
    if len(ks) != q.shape[0] or len(vs) != q.shape[0]:
        raise ValueError(
            f"[one-shard-per-request] requires len(ks) == len(vs) == q.shape[0]; "
            f"got {len(ks)}, {len(vs)}, {q.shape[0]}"
        )
    parts = [
        attention_with_lse(q[i : i + 1], k, v, scale=scale) for i, (k, v) in enumerate(zip(ks, vs))
    ]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def dcp_decode_attention(
    q: torch.Tensor,
    ks: Sequence[torch.Tensor],
    vs: Sequence[torch.Tensor],
    group: Group,
    dcp_comm_backend: str = "ag_rs",
    scale: float | None = None,
    shapes: dict[str, Any] | None = None,
) -> torch.Tensor:
    """One DCP decode step: AllGather Q heads, attend the local shard, combine exactly.

    ``q [B, h, D]``: this rank's query heads (one decode token per request); ``ks[i]``/``vs[i]``:
    the local tokens of request ``i`` for the group's shared KV head(s).  Returns ``[B, h, Dv]``,
    the attention over every token of the group for this rank's heads.  If ``shapes`` is a
    dict, the shape of each stage is recorded in it.  Exact to the dtype's rounding.
    """
    q_all = group.all_gather(q, dim=1)  # [B, N·h, D]
    out, lse = local_attention(q_all, ks, vs, scale)
    lse = lse.to(out.dtype)  # the LSE travels in the output's dtype (float32/64 here)
    final = dcp_combine(out, lse, group, dcp_comm_backend)
    if shapes is not None:
        shapes.update(
            q=tuple(q.shape),
            q_gathered=tuple(q_all.shape),
            kv_local=[tuple(k.shape) for k in ks],
            out_partial=tuple(out.shape),
            lse=tuple(lse.shape),
            out=tuple(final.shape),
        )
    return final


def decode_comm_bytes(
    num_reqs: int,
    heads_per_rank: int,
    q_dim: int,
    out_dim: int,
    dcp: int,
    dcp_comm_backend: str = "ag_rs",
    elem_bytes: int = 8,
) -> list[tuple[str, int]]:
    """The module docstring's formulas: ``[(op, bytes sent per rank), ...]`` in call order."""
    b, h, n, e = num_reqs, heads_per_rank, dcp, elem_bytes
    calls = [("all_gather", b * h * q_dim * e * (n - 1))]
    if dcp_comm_backend == "ag_rs":
        return calls + [
            ("all_gather", b * n * h * e * (n - 1)),
            ("reduce_scatter", b * h * out_dim * e * (n - 1)),
        ]
    if dcp_comm_backend == "a2a":
        return calls + [("all_to_all", b * h * (out_dim + 1) * e * (n - 1))]
    raise ConfigError(
        "comm-backend", "dcp_comm_backend in {'ag_rs', 'a2a'}", dcp_comm_backend=dcp_comm_backend
    )


# ------------------------------------------------------------------------------------------
# head layout and KV placement
# ------------------------------------------------------------------------------------------
def shard_kv_cache(
    ks: Sequence[torch.Tensor],
    vs: Sequence[torch.Tensor | None],
    block_size: int,
    dcp_size: int,
    dcp_rank: int,
    interleave: int,
    device: torch.device | str = "cpu",
) -> tuple[list[tuple], PagedKVCache]:
    """Write every request's full K/V through this rank's slot mapping, read its tokens back.

    Request ``i`` gets the next ``ceil(L_i / (block_size·dcp_size))`` virtual block ids (the same
    on every rank).  Only the tokens this rank owns land in its :class:`PagedKVCache`.  Returns
    ``[(k_local, v_local | None, positions), ...]`` per request and the cache.  ``vs[i] is None``
    for MLA (one latent per token, no V cache).
    """
    if not ks or len(ks) != len(vs) or len({v is None for v in vs}) != 1:
        raise ValueError(
            f"[kv-per-request] requires one k and one v (all tensors or all None) per "
            f"request, at least one request; got {len(ks)} k and {len(vs)} v"
        )
    nblocks = [num_virtual_blocks(k.shape[0], block_size, dcp_size) for k in ks]
    k0 = ks[0]
    cache = PagedKVCache(
        max(1, sum(nblocks)),
        block_size,
        k0.shape[1],
        k0.shape[2],
        0 if vs[0] is None else vs[0].shape[2],
        dcp_size=dcp_size,
        dcp_rank=dcp_rank,
        interleave=interleave,
        dtype=k0.dtype,
        device=device,
    )
    tables, start = [], 0
    for k, v, nb in zip(ks, vs, nblocks):
        table = torch.arange(start, start + nb)
        start += nb
        positions = torch.arange(k.shape[0])
        cache.write(
            k.to(device), None if v is None else v.to(device), cache.slot_mapping(positions, table)
        )
        tables.append(table)
    return [cache.read(t, k.shape[0]) for t, k in zip(tables, ks)], cache


# ------------------------------------------------------------------------------------------
# the per-rank demo: GQA decode under TP × DCP
# ------------------------------------------------------------------------------------------
def gqa_decode_problem(
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    seq_lens: Sequence[int],
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
):
    """Random decode inputs, identical on every rank: ``q [B, Hq, D]`` (one token per request)
    and per request ``k, v [L_i, Hkv, D]`` (its whole context, the current token included)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(len(seq_lens), num_q_heads, head_dim, generator=gen, dtype=torch.float64)
    ks = [
        torch.randn(n, num_kv_heads, head_dim, generator=gen, dtype=torch.float64) for n in seq_lens
    ]
    vs = [
        torch.randn(n, num_kv_heads, head_dim, generator=gen, dtype=torch.float64) for n in seq_lens
    ]
    return q.to(dtype), [k.to(dtype) for k in ks], [v.to(dtype) for v in vs]


def gqa_decode_rank(
    ctx: RankContext,
    *,
    tensor_parallel_size: int = 6,
    decode_context_parallel_size: int = 3,
    num_q_heads: int = 12,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    seq_lens: Sequence[int] = (48,),
    block_size: int = 8,
    cp_kv_cache_interleave_size: int = 1,
    dcp_comm_backend: str = "ag_rs",
    dtype: str = "float64",
    seed: int = 0,
) -> dict[str, Any]:
    """One GQA decode step on this rank of a TP × DCP world, checked against dense attention.

    The config is validated (:class:`ParallelConfig`) before any
    collective.  Every rank draws the same inputs from ``seed``, writes only its tokens of its
    KV head into its paged cache, and runs :func:`dcp_decode_attention` on its query heads.
    Returns this rank's output, shapes, local token counts and positions, the step's traced
    ``(op, bytes_sent)``, the formula's prediction and the max error against float64 dense
    attention for this rank's heads.
    """
    cfg = ParallelConfig(
        tensor_parallel_size=tensor_parallel_size,
        decode_context_parallel_size=decode_context_parallel_size,
        cp_kv_cache_interleave_size=cp_kv_cache_interleave_size,
        block_size=block_size,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dcp_comm_backend=dcp_comm_backend,
    )
    groups = make_groups(ctx, cfg)
    tp_rank, dcp_rank = groups.coords.tp_rank, groups.coords.dcp_rank
    q, ks, vs = gqa_decode_problem(
        num_q_heads, num_kv_heads, head_dim, seq_lens, seed, getattr(torch, dtype)
    )
    qh, kvh = q_heads_of_rank(cfg, tp_rank), kv_heads_of_rank(cfg, tp_rank)
    local, cache = shard_kv_cache(
        [k[:, kvh] for k in ks],
        [v[:, kvh] for v in vs],
        block_size,
        cfg.dcp,
        dcp_rank,
        cfg.interleave,
        ctx.device,
    )
    first, shapes = len(ctx.trace), {}
    out = dcp_decode_attention(
        q[:, qh].to(ctx.device),
        [k for k, _, _ in local],
        [v for _, v, _ in local],
        groups.dcp,
        dcp_comm_backend,
        shapes=shapes,
    )
    step = [(r.op, r.bytes_sent) for r in ctx.trace[first:]]
    ref = torch.cat(
        [
            dense_attention(q[i : i + 1].double(), ks[i].double(), vs[i].double())[0]
            for i in range(len(seq_lens))
        ]
    )[:, qh]
    err = (out.cpu().double() - ref).abs().max().item()
    local_tokens = [int(k.shape[0]) for k, _, _ in local]
    print(
        f"tp {tp_rank} dcp {dcp_rank}/{cfg.dcp} kv head {kvh.start} "
        f"q heads {qh.start}-{qh.stop - 1}: "
        f"Q {shapes['q']} -> {shapes['q_gathered']}"
    )
    print(
        f"local KV tokens {local_tokens} of {list(seq_lens)}, out {shapes['out']}, "
        f"exact: {err <= 1e-10}"
    )
    return {
        "out": out.cpu(),
        "max_abs_err": err,
        "shapes": shapes,
        "local_tokens": local_tokens,
        "kv_head": kvh.start,
        "positions": [p.cpu() for _, _, p in local],
        "q_heads": (qh.start, qh.stop),
        "kv_bytes": sum(local_tokens) * cache.bytes_per_token,
        "comm": step,
        "expected": decode_comm_bytes(
            len(seq_lens),
            cfg.q_heads_per_rank,
            head_dim,
            head_dim,
            cfg.dcp,
            dcp_comm_backend,
            q.element_size(),
        ),
    }
