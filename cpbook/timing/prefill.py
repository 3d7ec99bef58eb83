"""Prefill timings: PCP prefill attention per partition, chunked prefill per strategy, the
rings (cpbook's pass-KV / pass-Q against PyTorch's), and the collectives the chunked-prefill
link model is fitted to.  Every method runs in :func:`~cpbook.timing.clock.timed_rounds`."""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping, Sequence

import torch

from cpbook.core.comm import comm_bytes
from cpbook.core.config import ParallelConfig
from cpbook.core.context import RankContext
from cpbook.core.errors import RuleError
from cpbook.core.groups import check_grid_world, make_groups
from cpbook.core.heads import kv_heads_of, q_heads_of
from cpbook.core.problems import chunked_prefill_problem
from cpbook.kv.context import context_shard
from cpbook.pcp.chunked import chunked_prefill_attention
from cpbook.pcp.chunked_plan import STRATEGIES, ChunkedPrefillConfig
from cpbook.pcp.prefill import pcp_prefill_attention, pcp_shard
from cpbook.pcp.ring import RingShards, ring_attention
from cpbook.pcp.zigzag import pcp_partition, zigzag_partition
from cpbook.timing.clock import WALL_CLOCK, timed_rounds

__all__ = [
    "chunked_prefill_timing",
    "collective_timing",
    "pcp_prefill_timing",
    "ring_prefill_timing",
    "sdpa_ring_kernel",
]


def _check_mha_world(cfg: ParallelConfig, ctx: RankContext) -> None:
    """The PCP prefill timing's shape: MHA, and the world as its one PCP group."""
    if cfg.num_kv_heads != cfg.num_q_heads:
        raise RuleError(
            "timing-mha",
            "num_kv_heads == num_q_heads (the prefill timing is MHA)",
            num_q_heads=cfg.num_q_heads,
            num_kv_heads=cfg.num_kv_heads,
        )
    check_grid_world(cfg.world_size, ctx.world_size)


def pcp_prefill_timing(
    ctx: RankContext,
    cfg: ParallelConfig | None = None,
    *,
    seq_len: int = 8192,
    repeats: int = 5,
    partitions: Sequence[str] = ("zigzag", "contiguous"),
    single: bool = True,
    seed: int = 0,
    baselines: Mapping[str, Callable[[], Any]] | None = None,
) -> dict[str, float]:
    """Medians of one causal prefill attention (float32, MHA) on the world group as PCP group.

    ``cfg`` gives the attention shape (``num_q_heads`` = ``num_kv_heads`` heads of
    ``head_dim``; default 8 of 64) and ``prefill_context_parallel_size`` = the world size.

    Methods: ``single`` (rank 0 runs the whole prompt with ``F.scaled_dot_product_attention``
    while the others wait), one :func:`pcp_prefill_attention` per partition (K/V all-gather
    included, restore excluded) and any ``baselines`` (name -> zero-argument callable run on
    every rank, e.g. another library's ring attention).  Every run starts from a common
    barrier; the methods take turns, run after run, so drifts of a shared machine hit all of
    them alike.  One warm-up round, then ``repeats``.  Returns this rank's median wall seconds
    per method, its median CPU seconds of the whole process (``<method>_cpu``: every thread,
    communication included) and of the calling thread (``<method>_thread``: the kernels and
    merges), and the max error of its rows against the single-process output
    (``<partition>_err``).  Inputs are laid out head-major for every method (what the fused CPU
    kernel reads fastest), prepared before the clock starts.
    """
    cfg = cfg or ParallelConfig(prefill_context_parallel_size=ctx.world_size)
    _check_mha_world(cfg, ctx)
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (
        torch.randn(seq_len, cfg.num_q_heads, cfg.head_dim, generator=gen).to(ctx.device)
        for _ in range(3)
    )
    q4, k4, v4 = (t.transpose(0, 1)[None].contiguous() for t in (q, k, v))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    ref = sdpa(q4, k4, v4, is_causal=True)[0].transpose(0, 1)
    methods: dict[str, Callable[[], Any]] = {}
    if single:
        methods["single"] = lambda: sdpa(q4, k4, v4, is_causal=True) if ctx.rank == 0 else None
    metas = {}
    for partition in partitions:
        meta = pcp_partition(seq_len, ctx.world_size, partition).metadata(ctx.rank)
        metas[partition] = meta
        ql, kl, vl = (
            pcp_shard(t, meta).transpose(0, 1).contiguous().transpose(0, 1) for t in (q, k, v)
        )
        methods[partition] = functools.partial(pcp_prefill_attention, ql, kl, vl, meta, ctx.world)
    methods.update(baselines or {})
    out, last = timed_rounds(ctx, methods, repeats)
    for partition, meta in metas.items():
        real = ~meta.is_padding
        rows = meta.token_index[real].to(ctx.device)
        err = (last[partition][0][real.to(ctx.device)] - ref[rows]).abs().max().item()
        out[f"{partition}_err"] = err
    return out


def chunked_prefill_timing(
    ctx: RankContext,
    cfg: ParallelConfig,
    *,
    context_len: int,
    chunk_len: int,
    workspace_size: int = 16384,
    repeats: int = 3,
    seed: int = 0,
) -> dict[str, Any]:
    """Medians of one chunked-prefill attention layer per strategy (float32), on this rank.

    ``cfg``: the TP × PCP × DCP sizes (``world_size`` = this world's), the attention shape and
    ``block_size``.  One request: ``context_len`` cached tokens in the DCP-sharded paged cache,
    a chunk of ``chunk_len`` tokens split zigzag over PCP (:mod:`cpbook.pcp.chunked`).  Inputs
    are prepared before the clock starts; the strategies take turns from common barriers
    (:func:`timed_rounds`), and each run ends at a barrier too, so a run lasts until the last
    rank has its output (AllGather-Q ends in a collective, AllGather-KV does not; without the
    barrier a loaded machine's delays would count for one and not the other).  Returns, per
    strategy, the median wall seconds (``<strategy>``), process CPU seconds
    (``<strategy>_cpu``), the bytes this rank sent in one run (``<strategy>_bytes``, from the
    trace), and ``max_abs_diff`` between the strategies' outputs on the real rows.
    """
    groups = make_groups(ctx, cfg)
    tp_rank = groups.coords.tp_rank
    qh, kvh = q_heads_of(cfg, tp_rank), kv_heads_of(cfg, tp_rank)
    (q,), (k,), (v,) = chunked_prefill_problem(
        cfg, [context_len], [chunk_len], seed=seed, dtype=torch.float32
    )
    c = context_len
    context = context_shard(
        [k[:c, kvh]],
        [v[:c, kvh]],
        cfg.block_size,
        cfg.dcp,
        groups.coords.dcp_rank,
        1,
        device=ctx.device,
    )
    meta = zigzag_partition(chunk_len, cfg.pcp).metadata(groups.coords.pcp_rank)
    ql, kl, vl = (
        pcp_shard(t, meta).contiguous().to(ctx.device) for t in (q[:, qh], k[c:, kvh], v[c:, kvh])
    )
    sent: dict[str, int] = {}

    def method(strategy: str) -> Callable[[], Any]:
        def call() -> Any:  # ends at a barrier: the layer is done when every rank is
            with ctx.traced() as comm:
                res = chunked_prefill_attention(
                    ql,
                    kl,
                    vl,
                    context,
                    meta,
                    groups,
                    ChunkedPrefillConfig(strategy=strategy, workspace_size=workspace_size),
                )
            sent[strategy] = comm_bytes(comm)
            ctx.world.barrier()
            return res

        return call

    out, last = timed_rounds(ctx, {st: method(st) for st in STRATEGIES}, repeats)
    real = (~meta.is_padding).to(ctx.device)
    diff = last[STRATEGIES[0]][0][real] - last[STRATEGIES[1]][0][real]
    out["max_abs_diff"] = diff.abs().max().item()
    out.update({f"{st}_bytes": sent[st] for st in STRATEGIES})
    return out


def collective_timing(ctx: RankContext, sizes: Sequence[int], repeats: int = 5) -> dict[str, float]:
    """Median wall seconds of one ``all_gather`` and one ``all_to_all`` on the world group, per
    message size in bytes sent by each rank (float32 payloads); keys ``"<op>_<bytes>"``.  The
    link model ``α + β·bytes`` of :mod:`cpbook.pcp.chunked_plan` is fitted to these."""
    n, methods = ctx.world_size, {}
    for size in sizes:
        dev = ctx.device
        gather = torch.zeros(max(1, size // 4 // max(1, n - 1)), device=dev)  # sends b·(n−1) B
        a2a = torch.zeros(n * max(1, size // 4 * n // max(1, n - 1) // n), device=dev)
        methods[f"all_gather_{size}"] = functools.partial(ctx.world.all_gather, gather)
        methods[f"all_to_all_{size}"] = functools.partial(ctx.world.all_to_all, a2a)
    out, _ = timed_rounds(ctx, methods, repeats, WALL_CLOCK)
    return out


def ring_prefill_timing(
    ctx: RankContext,
    *,
    seq_len: int = 8192,
    num_q_heads: int = 8,
    head_dim: int = 64,
    repeats: int = 5,
    seed: int = 0,
) -> dict[str, float]:
    """Medians of one causal prefill attention (float32, MHA: ``num_q_heads`` heads for Q, K and
    V) by cpbook's two rings and PyTorch's.

    Methods, on DualChunkSwap (head-tail) shards of one ``seq_len`` prompt (a multiple of
    ``2 * world_size``), the world group as PCP group: ``pass_kv`` and ``pass_q``
    (:func:`cpbook.pcp.ring.ring_attention`) and PyTorch's private ``_templated_ring_attention``
    (torch 2.13, the device's fused SDPA op, :func:`sdpa_ring_kernel`) on the same shards, rotating
    K/V by all-gather (``torch_ring_allgather``) and by all-to-all (``torch_ring_alltoall``);
    ``torch_ring`` is the faster of the two on this rank.  PyTorch's ring needs
    ``torch.distributed`` (run under torchrun); inline it is skipped.  Inputs are head-major
    ``[H, T, D]`` storage, prepared before the clock.  Returns this rank's median wall seconds
    per method, ``<method>_cpu`` and ``<method>_thread`` CPU seconds (:func:`timed_rounds`),
    and ``<method>_err``, the max error of its rows against one-process causal SDPA.
    """

    gen = torch.Generator().manual_seed(seed)
    q, k, v = (
        torch.randn(seq_len, num_q_heads, head_dim, generator=gen).to(ctx.device) for _ in range(3)
    )
    sdpa = torch.nn.functional.scaled_dot_product_attention
    ref = sdpa(*(t.transpose(0, 1) for t in (q, k, v)), is_causal=True).transpose(0, 1)
    meta = zigzag_partition(seq_len, ctx.world_size).metadata(ctx.rank)
    heads = [pcp_shard(t, meta).transpose(0, 1).contiguous() for t in (q, k, v)]  # [H, T, D]
    shards = RingShards((seq_len,), (0,), ctx.world_size)
    rows = [t.transpose(0, 1) for t in heads]
    methods: dict[str, Callable[[], Any]] = {
        mode: functools.partial(ring_attention, *rows, shards, ctx.world, mode)
        for mode in ("pass_kv", "pass_q")
    }
    if ctx.backend != "inline":
        import torch.distributed as dist
        from torch.distributed.tensor.experimental._context_parallel._attention import (
            _templated_ring_attention,
            set_rotate_method,
        )

        op, extra = sdpa_ring_kernel(ctx.device)

        def torch_ring(rotate: str) -> Callable[[], Any]:
            def call() -> Any:
                set_rotate_method(rotate)
                out = _templated_ring_attention(
                    dist.group.WORLD, 2, op, *(t[None] for t in heads), is_causal=True, **extra
                )[0]
                return out[0].transpose(0, 1), None

            return call

        methods.update({f"torch_ring_{rot}": torch_ring(rot) for rot in ("allgather", "alltoall")})
    out, last = timed_rounds(ctx, methods, repeats)
    if ctx.backend != "inline":
        fast = min(("torch_ring_allgather", "torch_ring_alltoall"), key=out.get)
        out.update({"torch_ring" + c: out[fast + c] for c in ("", "_cpu", "_thread")})
        last["torch_ring"] = last[fast]
    for name, (o, _) in last.items():
        out[f"{name}_err"] = (o - ref[meta.token_index.to(ctx.device)]).abs().max().item()
    return out


def sdpa_ring_kernel(device: torch.device) -> tuple[Any, dict[str, Any]]:
    """The fused SDPA op (and its extra arguments) PyTorch's ring attention calls on
    ``device``: the CPU flash kernel on the CPU, the memory-efficient one (float32, with its
    LSE) on a GPU."""
    if device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu, {}
    return torch.ops.aten._scaled_dot_product_efficient_attention, {
        "attn_bias": None,
        "compute_log_sumexp": True,
    }
