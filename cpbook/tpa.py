"""TPA: shard the query projection at TP/DCP granularity so DCP decode needs no query all-gather.

One attention block per rank, ``x [B, hidden] → q_proj → attention under TP × DCP → o_proj``,
for one decode token per request, in two modes:

* ``standard`` (vLLM's DCP): ``q_proj`` is column-sharded over TP, so TP rank ``r`` computes its
  ``h = Hq / tp`` query heads; the DCP group then **all-gathers the query heads**
  (``[B, h, D] → [B, N·h, D]``, a gather on a non-leading dimension: one more copy, vLLM's
  transpose) so that every rank can attend its KV shard with all ``N·h`` heads of its group.
* ``tpa``: ``q_proj`` is sharded over ``tp / dcp`` attention ranks, so every rank of a DCP group
  computes the same ``N·h`` heads itself; **no query all-gather**.  It costs ``N``× the
  ``q_proj`` FLOPs and weights per rank.  For GQA this is vLLM's
  ``--tensor-parallel-size-attention`` (PR #36287, successor #42674, both open in Nov 2026),
  which also lets a DCP group hold several KV heads; for MLA it is ``dcp_q_replicate``
  (``--dcp-q-replicate``, PRs #45964 and #50382, merged), whose absorbed ``W_UK_T`` is gathered
  at load time.

After attention both modes are identical: the combine (``ag_rs``: all-gather the LSE,
reduce-scatter the outputs; or ``a2a``) leaves every rank its own ``h`` heads, ``o_proj`` is
row-sharded over TP and ends in an all-reduce.  Both are exact against one device.

Bytes one rank sends per layer and step (``B`` requests, ``e`` bytes per element, ``Dq`` the
query width — ``D`` for GQA, ``C + R`` for absorbed MLA — and ``Do`` the combined width):

=====================  ============================  ==========
collective             bytes                         mode
=====================  ============================  ==========
AllGather Q            ``B·h·Dq·e·(N−1)``            standard
ag_rs: AllGather LSE   ``B·N·h·e·(N−1)``             both
ag_rs: ReduceScatter   ``B·h·Do·e·(N−1)``            both
o_proj AllReduce       ``2·B·hidden·e·(TP−1)/TP``    both
=====================  ============================  ==========
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from .attention import dense_attention
from .comm import RankContext
from .config import ParallelConfig, kv_heads_of_rank, q_heads_of_rank
from .dcp import (
    dcp_combine,
    dcp_decode_attention,
    decode_comm_bytes,
    local_attention,
    shard_kv_cache,
)
from .groups import ParallelGroups, make_groups
from .mla import TinyMLA, mla_decode_attention

__all__ = [
    "MODES",
    "TPABlock",
    "tpa_config",
    "q_proj_heads",
    "attention_kv_heads",
    "attention_block",
    "reference_block",
    "tpa_comm_bytes",
    "tpa_costs",
    "tpa_problem",
    "tpa_rank",
]

MODES = ("standard", "tpa")


def _mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"[tpa-mode] requires mode in {MODES}; got mode={mode!r}")


def tpa_config(mode: str, **kwargs: Any) -> ParallelConfig:
    """The :class:`ParallelConfig` of ``mode``: ``tpa`` sets ``tensor_parallel_size_attention =
    tp / dcp`` (GQA) or ``dcp_q_replicate`` (MLA); ``standard`` sets neither."""
    _mode(mode)
    if mode == "standard":
        return ParallelConfig(**kwargs)
    if kwargs.get("use_mla"):
        return ParallelConfig(**kwargs, dcp_q_replicate=True)
    tp, dcp = kwargs.get("tensor_parallel_size", 1), kwargs.get("decode_context_parallel_size", 1)
    return ParallelConfig(**kwargs, tensor_parallel_size_attention=max(1, tp // dcp))


def _tpa(config: ParallelConfig) -> bool:
    return config.tensor_parallel_size_attention is not None or config.dcp_q_replicate


def q_proj_heads(config: ParallelConfig, tp_rank: int) -> slice:
    """Query heads this rank's ``q_proj`` computes: its TP heads (standard) or the heads of its
    whole DCP group, ``dcp × num_q_heads / tp`` of them (TPA)."""
    if not _tpa(config):
        return q_heads_of_rank(config, tp_rank)
    n = config.q_heads_per_rank * config.dcp
    g = tp_rank // config.dcp
    return slice(g * n, (g + 1) * n)


def attention_kv_heads(config: ParallelConfig, tp_rank: int) -> slice:
    """KV heads this rank's DCP group attends: one shared head (standard GQA, the latent for MLA)
    or the heads of its attention shard, ``num_kv_heads / tpa`` of them (GQA TPA)."""
    if config.use_mla or config.tensor_parallel_size_attention is None:
        return kv_heads_of_rank(config, tp_rank)
    kv, tpa, a = config.num_kv_heads, config.attention_tp, tp_rank // config.dcp
    if kv >= tpa:
        return slice(a * kv // tpa, (a + 1) * kv // tpa)
    head = a // (tpa // kv)
    return slice(head, head + 1)


@dataclass(frozen=True)
class TPABlock:
    """Weights of one attention block: ``w_q [hidden, Hq·Dq]``, ``w_o [Hq·Dv, hidden]``, and for
    MLA the up-projections (``mla``); ``Dq = D`` (GQA) or ``Dn + R`` (MLA's MHA form)."""

    w_q: torch.Tensor
    w_o: torch.Tensor
    num_q_heads: int
    mla: TinyMLA | None = None

    @property
    def q_dim(self) -> int:
        return self.w_q.shape[1] // self.num_q_heads

    def q(self, x: torch.Tensor, heads: slice) -> torch.Tensor:
        """``q_proj`` for ``heads``: ``x [B, hidden] → [B, len(heads), Dq]`` (column shard)."""
        d = self.q_dim
        return (x @ self.w_q[:, heads.start * d : heads.stop * d]).view(x.shape[0], -1, d)

    def o(self, out: torch.Tensor, heads: slice) -> torch.Tensor:
        """This rank's ``o_proj`` partial sum: ``out [B, len(heads), Dv] → [B, hidden]`` (row
        shard); the TP all-reduce completes it."""
        dv = out.shape[-1]
        return out.reshape(out.shape[0], -1) @ self.w_o[heads.start * dv : heads.stop * dv]


def tpa_problem(
    attention: str,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    hidden_size: int,
    seq_lens: Sequence[int],
    seed: int = 0,
    kv_lora_rank: int = 32,
    qk_rope_head_dim: int = 8,
) -> tuple[TPABlock, torch.Tensor, list, list]:
    """Float64 block weights, hidden states ``x [B, hidden]`` (one decode token per request) and
    the cache of every request: ``k, v [L_i, Hkv, D]`` (GQA) or latent rows ``[L_i, C+R]`` with
    ``v = None`` (MLA; ``head_dim`` is then ``qk_nope_head_dim`` and ``v_head_dim``)."""
    if attention not in ("gqa", "mla"):
        raise ValueError(f"[tpa-attention] requires attention in ('gqa', 'mla'); got {attention!r}")
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64) * scale

    s = hidden_size**-0.5
    x = randn(len(seq_lens), hidden_size)
    if attention == "gqa":
        block = TPABlock(
            randn(hidden_size, num_q_heads * head_dim, scale=s),
            randn(num_q_heads * head_dim, hidden_size, scale=s),
            num_q_heads,
        )
        ks = [randn(n, num_kv_heads, head_dim) for n in seq_lens]
        return block, x, ks, [randn(n, num_kv_heads, head_dim) for n in seq_lens]
    mla = TinyMLA.random(num_q_heads, kv_lora_rank, head_dim, qk_rope_head_dim, head_dim, seed)
    w_q = randn(hidden_size, num_q_heads * (head_dim + qk_rope_head_dim), scale=s)
    block = TPABlock(w_q, randn(num_q_heads * head_dim, hidden_size, scale=s), num_q_heads, mla)
    return block, x, [randn(n, mla.latent_dim) for n in seq_lens], [None] * len(seq_lens)


def attention_block(
    x: torch.Tensor,
    block: TPABlock,
    ks: Sequence[torch.Tensor],
    vs: Sequence[torch.Tensor | None],
    config: ParallelConfig,
    groups: ParallelGroups,
    shapes: dict[str, Any] | None = None,
) -> torch.Tensor:
    """One decode step of the block on this rank; returns the full ``[B, hidden]`` output.

    ``ks[i]``/``vs[i]``: this rank's DCP shard of request ``i`` for the KV heads of
    :func:`attention_kv_heads` (MLA: latent rows, ``vs[i] is None``).  The mode is the config's
    (:func:`tpa_config`).  Exact to the dtype's rounding.
    """
    tp_rank, backend = groups.coords.tp_rank, config.dcp_comm_backend
    mine, computed = q_heads_of_rank(config, tp_rank), q_proj_heads(config, tp_rank)
    q = block.q(x, computed)
    if shapes is not None:
        shapes["q_proj"] = tuple(q.shape)
    if block.mla is None and not _tpa(config):
        out = dcp_decode_attention(q, ks, vs, groups.dcp, backend, shapes=shapes)
    elif block.mla is None:
        o, lse = local_attention(q, ks, vs)
        out = dcp_combine(o, lse.to(o.dtype), groups.dcp, backend)
    else:
        mla, dn = block.mla, block.mla.W_UK.shape[2]
        q_nope, q_pe = q[..., :dn], q[..., dn:]
        if not _tpa(config):
            out = mla_decode_attention(q_nope, q_pe, ks, mla, mine, groups.dcp, backend, shapes)
        else:  # dcp_q_replicate: absorb with the group's W_UK, attend, combine, local W_UV
            ql = mla.absorb_q(q_nope, q_pe, computed)
            c = mla.kv_lora_rank
            o, lse = local_attention(
                ql, [k[:, None] for k in ks], [k[:, None, :c] for k in ks], mla.scale
            )
            out = mla.v_up_proj(dcp_combine(o, lse.to(o.dtype), groups.dcp, backend), mine)
    y = groups.tp.all_reduce(block.o(out, mine))
    if shapes is not None:
        shapes.update(attn_out=tuple(out.shape), o_proj=tuple(y.shape))
    return y


def reference_block(
    x: torch.Tensor, block: TPABlock, ks: Sequence[torch.Tensor], vs: Sequence[torch.Tensor | None]
) -> torch.Tensor:
    """The block on one device in float64: every head over every cached token."""
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


def tpa_comm_bytes(
    mode: str,
    num_reqs: int,
    heads_per_rank: int,
    q_dim: int,
    out_dim: int,
    dcp: int,
    tp: int,
    hidden_size: int,
    dcp_comm_backend: str = "ag_rs",
    elem_bytes: int = 8,
) -> list[tuple[str, int]]:
    """The module docstring's table: ``[(op, bytes sent per rank), ...]`` in call order.

    ``tpa`` is ``standard`` without its first entry, the query all-gather.
    """
    _mode(mode)
    calls = decode_comm_bytes(
        num_reqs, heads_per_rank, q_dim, out_dim, dcp, dcp_comm_backend, elem_bytes
    )
    b = num_reqs * hidden_size * elem_bytes
    return (calls if mode == "standard" else calls[1:]) + [("all_reduce", 2 * b * (tp - 1) // tp)]


def tpa_costs(
    config: ParallelConfig, hidden_size: int, num_reqs: int, q_dim: int, elem_bytes: int = 2
) -> dict[str, int]:
    """Per rank and layer: ``q_proj`` FLOPs and weight bytes, and the extra that ``tpa`` pays
    (``dcp − 1`` more head shards of the same size).

    ``q_dim`` is the per-head output width of ``q_proj`` (``D``, or ``Dn + R`` for MLA); MLA's
    absorption ``q_nope @ W_UK_T`` grows by the same factor and is not counted here.
    """
    h, n = config.q_heads_per_rank, config.dcp
    flops = 2 * num_reqs * hidden_size * h * q_dim
    weights = hidden_size * h * q_dim * elem_bytes
    tpa = _tpa(config)
    return {
        "q_proj_flops": flops * (n if tpa else 1),
        "q_proj_weight_bytes": weights * (n if tpa else 1),
        "extra_flops": flops * (n - 1) if tpa else 0,
        "extra_weight_bytes": weights * (n - 1) if tpa else 0,
    }


def tpa_rank(
    ctx: RankContext,
    *,
    mode: str = "tpa",
    attention: str = "gqa",
    tensor_parallel_size: int = 4,
    decode_context_parallel_size: int = 4,
    num_q_heads: int = 8,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    hidden_size: int = 64,
    seq_lens: Sequence[int] = (40, 7, 1),
    block_size: int = 8,
    cp_kv_cache_interleave_size: int = 1,
    dcp_comm_backend: str = "ag_rs",
    seed: int = 0,
    dtype: str = "float64",
) -> dict[str, Any]:
    """Chapter 6: one decode step of an attention block in ``mode`` on this rank, vs one device.

    Validates the config (:func:`tpa_config`) before any collective, draws the block and the
    cache (:func:`tpa_problem`), writes this rank's DCP shard of its KV heads into its paged
    cache, runs :func:`attention_block` and compares the ``[B, hidden]`` output with
    :func:`reference_block`.  Returns ``max_abs_err``, shapes, the traced ``comm``, the
    formula's ``expected`` (:func:`tpa_comm_bytes`) and the ``q_proj`` costs (:func:`tpa_costs`).
    """
    mla = attention == "mla"
    cfg = tpa_config(
        mode,
        tensor_parallel_size=tensor_parallel_size,
        decode_context_parallel_size=decode_context_parallel_size,
        num_q_heads=num_q_heads,
        num_kv_heads=1 if mla else num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        use_mla=mla,
        cp_kv_cache_interleave_size=cp_kv_cache_interleave_size,
        dcp_comm_backend=dcp_comm_backend,
    )
    groups = make_groups(ctx, cfg)
    block, x, ks, vs = tpa_problem(
        attention, num_q_heads, num_kv_heads, head_dim, hidden_size, seq_lens, seed
    )
    dt, dev, tp_rank = getattr(torch, dtype), ctx.device, groups.coords.tp_rank
    block = TPABlock(
        block.w_q.to(dt),
        block.w_o.to(dt),
        num_q_heads,
        None
        if block.mla is None
        else TinyMLA(block.mla.W_UK.to(dt), block.mla.W_UV.to(dt), block.mla.qk_rope_head_dim),
    )
    kvh = attention_kv_heads(cfg, tp_rank)
    cached_k = [k[:, None] if mla else k[:, kvh] for k in ks]
    cached_v = [None if v is None else v[:, kvh] for v in vs]
    local, _ = shard_kv_cache(
        [k.to(dt) for k in cached_k],
        [None if v is None else v.to(dt) for v in cached_v],
        block_size,
        cfg.dcp,
        groups.coords.dcp_rank,
        cfg.interleave,
        dev,
    )
    lk = [k[:, 0] if mla else k for k, _, _ in local]
    first, shapes = len(ctx.trace), {}
    y = attention_block(x.to(dev, dt), block, lk, [v for _, v, _ in local], cfg, groups, shapes)
    comm = [(r.op, r.bytes_sent) for r in ctx.trace[first:]]
    err = (
        (
            y.cpu().double()
            - reference_block(
                x,
                tpa_problem(
                    attention, num_q_heads, num_kv_heads, head_dim, hidden_size, seq_lens, seed
                )[0],
                ks,
                vs,
            )
        )
        .abs()
        .max()
        .item()
    )
    q_dim, out_dim = (block.mla.latent_dim, block.mla.kv_lora_rank) if mla else (head_dim, head_dim)
    heads = q_proj_heads(cfg, tp_rank)
    print(
        f"{mode}: tp {tp_rank} dcp {groups.coords.dcp_rank}/{cfg.dcp} q_proj heads "
        f"{heads.start}-{heads.stop - 1}, kv heads {kvh.start}-{kvh.stop - 1}, "
        f"exact: {err <= 1e-10}"
    )
    return {
        "max_abs_err": err,
        "shapes": shapes,
        "comm": comm,
        "q_proj_heads": (heads.start, heads.stop),
        "kv_heads": (kvh.start, kvh.stop),
        "expected": tpa_comm_bytes(
            mode,
            len(seq_lens),
            cfg.q_heads_per_rank,
            q_dim,
            out_dim,
            cfg.dcp,
            cfg.tp,
            hidden_size,
            dcp_comm_backend,
            y.element_size(),
        ),
        "costs": tpa_costs(
            cfg, hidden_size, len(seq_lens), block.q_dim, elem_bytes=y.element_size()
        ),
    }
