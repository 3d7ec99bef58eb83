"""Chapter 6's per-rank demo: one attention block (``q_proj`` → DCP attention → ``o_proj``) in
the ``standard`` and ``tpa`` modes (:func:`tpa_rank`), its inputs (:func:`tpa_problem`) and its
one-device float64 reference (:func:`reference_block`)."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from cpbook.core.attention import dense_attention
from cpbook.core.context import RankContext
from cpbook.core.groups import make_groups
from cpbook.core.heads import attention_kv_heads, q_proj_heads, tpa_config
from cpbook.dcp.mla import TinyMLA
from cpbook.dcp.tpa import TPABlock, attention_block, tpa_comm_bytes, tpa_costs
from cpbook.kv.paged import shard_kv_cache

__all__ = ["reference_block", "tpa_problem", "tpa_rank"]


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
    block = block.to(dev, dt)
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
    shapes = {}
    with ctx.traced() as comm:
        y = attention_block(x.to(dev, dt), block, lk, [v for _, v, _ in local], cfg, groups, shapes)
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
