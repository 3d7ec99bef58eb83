"""Chapter 6's per-rank demo: one attention block (``q_proj`` → DCP attention → ``o_proj``)
without and with TPA (:func:`tpa_rank`) and its inputs (:func:`tpa_problem`), checked against
the one-device float64 block (:func:`cpbook.core.reference.tpa_block_reference`)."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from cpbook.core.config import ParallelConfig
from cpbook.core.context import RankContext
from cpbook.core.groups import make_groups
from cpbook.core.heads import attention_kv_heads, q_proj_heads, uses_tpa
from cpbook.core.reference import tpa_block_reference
from cpbook.dcp.mla import MLAWeights
from cpbook.dcp.tpa import TPABlock, attention_block, tpa_comm_bytes, tpa_costs
from cpbook.kv.paged import shard_kv_cache

__all__ = ["TPA_CONFIG", "tpa_problem", "tpa_rank"]

#: chapter 6's deployment: TP 4 = DCP 4, 8 query heads, 2 KV heads, with TPA
#: (``tensor_parallel_size_attention = tp / dcp``).  Without TPA: ``None`` (GQA needs
#: ``num_kv_heads <= tp / dcp`` then).  MLA: ``use_mla=True``, ``num_kv_heads=1``, TPA by
#: ``dcp_q_replicate``; its ``head_dim`` is ``qk_nope_head_dim = v_head_dim``.
TPA_CONFIG = ParallelConfig(
    tensor_parallel_size=4,
    decode_context_parallel_size=4,
    num_q_heads=8,
    num_kv_heads=2,
    head_dim=16,
    block_size=8,
    tensor_parallel_size_attention=1,
)


def tpa_problem(
    config: ParallelConfig,
    hidden_size: int,
    seq_lens: Sequence[int],
    seed: int = 0,
    kv_lora_rank: int = 32,
    qk_rope_head_dim: int = 8,
) -> tuple[TPABlock, torch.Tensor, list, list]:
    """Float64 block weights for ``config``'s heads, hidden states ``x [B, hidden]`` (one decode
    token per request) and the cache of every request: ``k, v [L_i, Hkv, D]`` (GQA) or latent
    rows ``[L_i, C+R]`` with ``v = None`` (MLA; ``head_dim`` is then ``qk_nope_head_dim`` and
    ``v_head_dim``)."""
    gen = torch.Generator().manual_seed(seed)
    hq, hkv, d = config.num_q_heads, config.num_kv_heads, config.head_dim

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64) * scale

    s = hidden_size**-0.5
    x = randn(len(seq_lens), hidden_size)
    if not config.use_mla:
        block = TPABlock(
            randn(hidden_size, hq * d, scale=s), randn(hq * d, hidden_size, scale=s), hq
        )
        ks = [randn(n, hkv, d) for n in seq_lens]
        return block, x, ks, [randn(n, hkv, d) for n in seq_lens]
    mla = MLAWeights.random(hq, kv_lora_rank, d, qk_rope_head_dim, d, seed)
    w_q = randn(hidden_size, hq * (d + qk_rope_head_dim), scale=s)
    block = TPABlock(w_q, randn(hq * d, hidden_size, scale=s), hq, mla)
    return block, x, [randn(n, mla.latent_dim) for n in seq_lens], [None] * len(seq_lens)


def tpa_rank(
    ctx: RankContext,
    *,
    parallel_config: ParallelConfig = TPA_CONFIG,
    hidden_size: int = 64,
    seq_lens: Sequence[int] = (40, 7, 1),
    seed: int = 0,
    dtype: str = "float64",
) -> dict[str, Any]:
    """Chapter 6: one decode step of an attention block on this rank, vs one device.

    TPA runs where ``parallel_config`` says so (:func:`~cpbook.core.heads.uses_tpa`:
    ``tensor_parallel_size_attention`` for GQA, ``dcp_q_replicate`` for MLA; the config was
    validated as it was built, before any collective).  Draws the block and the cache
    (:func:`tpa_problem`), writes this rank's DCP shard of its KV heads into its paged cache,
    runs :func:`attention_block` and compares the ``[B, hidden]`` output with
    :func:`tpa_block_reference`.  Returns ``max_abs_err``, shapes, the traced ``comm``, the
    formula's ``expected``
    (:func:`tpa_comm_bytes`) and the ``q_proj`` costs (:func:`tpa_costs`).
    """
    cfg = parallel_config
    mla = cfg.use_mla
    groups = make_groups(ctx, cfg)
    block, x, ks, vs = tpa_problem(cfg, hidden_size, seq_lens, seed)
    dt, dev, tp_rank = getattr(torch, dtype), ctx.device, groups.coords.tp_rank
    block = block.to(dev, dt)
    kvh = attention_kv_heads(cfg, tp_rank)
    cached_k = [k[:, None] if mla else k[:, kvh] for k in ks]
    cached_v = [None if v is None else v[:, kvh] for v in vs]
    local, _ = shard_kv_cache(
        [k.to(dt) for k in cached_k],
        [None if v is None else v.to(dt) for v in cached_v],
        cfg.block_size,
        cfg.dcp,
        groups.coords.dcp_rank,
        cfg.interleave,
        dev,
    )
    lk = [k[:, 0] if mla else k for k, _, _ in local]
    shapes = {}
    with ctx.traced() as comm:
        y = attention_block(x.to(dev, dt), block, lk, [v for _, v, _ in local], cfg, groups, shapes)
    ref = tpa_block_reference(x, tpa_problem(cfg, hidden_size, seq_lens, seed)[0], ks, vs)
    err = (y.cpu().double() - ref).abs().max().item()
    d = cfg.head_dim
    q_dim, out_dim = (block.mla.latent_dim, block.mla.kv_lora_rank) if mla else (d, d)
    heads = q_proj_heads(cfg, tp_rank)
    print(
        f"tpa={uses_tpa(cfg)}: tp {tp_rank} dcp {groups.coords.dcp_rank}/{cfg.dcp} q_proj heads "
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
            cfg, len(seq_lens), q_dim, out_dim, hidden_size, y.element_size()
        ),
        "costs": tpa_costs(
            cfg, hidden_size, len(seq_lens), block.q_dim, elem_bytes=y.element_size()
        ),
    }
