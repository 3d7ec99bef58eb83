"""The one place that measures time: helpers the benchmarks in ``bench/`` run on every rank.

Algorithm modules never read a clock, and no test or notebook asserts on what these return: a
busy machine must not fail a check.  Each helper times its methods from a common barrier, in
turns (run after run, every method once per round), so drifts of a shared machine hit all of
them alike, and reports medians after one warm-up round.  Inputs live on ``ctx.device``; on a
GPU every timed call is bracketed by ``torch.cuda.synchronize`` (kernels run asynchronously, so
an unsynchronised clock would time the launch, not the work), and the CPU clocks (``_cpu``,
``_thread``) then measure only the host's share.
"""

from __future__ import annotations

import datetime
import functools
import os
import platform
import statistics
import time
from typing import Any, Callable, Mapping, Sequence

import torch

from cpbook.core.config import ParallelConfig
from cpbook.core.context import RankContext
from cpbook.core.groups import make_groups
from cpbook.core.heads import attention_kv_heads, kv_heads_of, q_heads_of, tpa_config
from cpbook.core.problems import chunked_prefill_problem
from cpbook.dcp.tpa import TPABlock, attention_block
from cpbook.dcp.verify import dcp_verify_attention, local_verify_attention
from cpbook.engine.engine import serve_rank
from cpbook.kv.context import context_shard
from cpbook.kv.layout import DCPShard
from cpbook.pcp.chunked import chunked_prefill_attention
from cpbook.pcp.chunked_plan import STRATEGIES, ChunkedPrefillConfig
from cpbook.pcp.prefill import pcp_prefill_attention, pcp_shard
from cpbook.pcp.ring import RingLayout, ring_attention
from cpbook.pcp.zigzag import pcp_partition, zigzag_partition

__all__ = [
    "machine_record",
    "device_name",
    "synchronize",
    "sdpa_ring_kernel",
    "decode_step_timing",
    "timed_rounds",
    "pcp_prefill_timing",
    "chunked_prefill_timing",
    "collective_timing",
    "ring_prefill_timing",
    "serve_timing",
    "spec_decode_timing",
]


def device_name(device: torch.device | str = "cpu") -> str:
    """What ran the tensors: ``"cpu"``, or ``"cuda:0 (NVIDIA H200)"``."""
    device = torch.device(device)
    if device.type != "cuda":
        return device.type
    return f"{device} ({torch.cuda.get_device_name(device)})"


def machine_record(device: torch.device | str = "cpu", dist_backend: str = "none") -> dict:
    """When and where numbers were taken: UTC date and minute, CPU model and count, 1-minute
    load average, the device the tensors lived on (:func:`device_name`) and the dist backend
    between ranks (``"gloo"``, ``"nccl"``, ``"inline"`` for simulated ranks, ``"none"``).
    Every ``bench/`` script prints it first, so stored results carry it."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "machine": f"{os.cpu_count()} x {cpu}",
        "cores": os.cpu_count(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "device": device_name(device),
        "dist_backend": dist_backend,
    }


def synchronize(device: torch.device | str) -> None:
    """Wait for every kernel queued on ``device`` (a no-op on the CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def timed_rounds(
    ctx: RankContext,
    methods: Mapping[str, Callable[[], Any]],
    repeats: int,
    clocks: Mapping[str, Callable[[], float]] | None = None,
) -> tuple[dict[str, float], dict[str, Any]]:
    """Run every method ``repeats + 1`` times in turns, each run from a world barrier.

    Returns ``({method + clock_suffix: median seconds over the last repeats}, {method: last
    return value})``.  Default clocks: ``""`` wall (``perf_counter``), ``"_cpu"`` process CPU
    time (every thread of the rank) and ``"_thread"`` CPU time of the calling thread.  On a GPU
    each run is bracketed by :func:`synchronize`, so the wall clock includes the kernels.
    """
    clocks = clocks or {
        "": time.perf_counter,
        "_cpu": time.process_time,
        "_thread": time.thread_time,
    }
    runs: dict[str, list[float]] = {m + c: [] for m in methods for c in clocks}
    last: dict[str, Any] = {}
    for _ in range(repeats + 1):
        for name, fn in methods.items():
            synchronize(ctx.device)  # nothing queued before counts ...
            ctx.world.barrier()
            start = {c: clock() for c, clock in clocks.items()}
            last[name] = fn()
            synchronize(ctx.device)  # ... and the method's own kernels do
            for c, clock in clocks.items():
                runs[name + c].append(clock() - start[c])
    return {key: statistics.median(t[1:]) for key, t in runs.items()}, last


def pcp_prefill_timing(
    ctx: RankContext,
    seq_len: int = 8192,
    num_heads: int = 8,
    head_dim: int = 64,
    repeats: int = 5,
    layouts: Sequence[str] = ("zigzag", "contiguous"),
    single: bool = True,
    seed: int = 0,
    baselines: Mapping[str, Callable[[], Any]] | None = None,
) -> dict[str, float]:
    """Medians of one causal prefill attention (float32, MHA) on the world group as PCP group.

    Methods: ``single`` (rank 0 runs the whole prompt with ``F.scaled_dot_product_attention``
    while the others wait), one :func:`pcp_prefill_attention` per layout (K/V all-gather
    included, restore excluded) and any ``baselines`` (name -> zero-argument callable run on
    every rank, e.g. another library's ring attention).  Every run starts from a common
    barrier; the methods take turns, run after run, so drifts of a shared machine hit all of
    them alike.  One warm-up round, then ``repeats``.  Returns this rank's median wall seconds
    per method, its median CPU seconds of the whole process (``<method>_cpu``: every thread,
    communication included) and of the calling thread (``<method>_thread``: the kernels and
    merges), and the max error of its rows against the single-process output
    (``<layout>_err``).  Inputs are laid out head-major for every method (what the fused CPU
    kernel reads fastest), prepared before the clock starts.
    """
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (
        torch.randn(seq_len, num_heads, head_dim, generator=gen).to(ctx.device) for _ in range(3)
    )
    q4, k4, v4 = (t.transpose(0, 1)[None].contiguous() for t in (q, k, v))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    ref = sdpa(q4, k4, v4, is_causal=True)[0].transpose(0, 1)
    methods: dict[str, Callable[[], Any]] = {}
    if single:
        methods["single"] = lambda: sdpa(q4, k4, v4, is_causal=True) if ctx.rank == 0 else None
    metas = {}
    for layout in layouts:
        meta = metas[layout] = pcp_partition(seq_len, ctx.world_size, layout).metadata(ctx.rank)
        ql, kl, vl = (
            pcp_shard(t, meta).transpose(0, 1).contiguous().transpose(0, 1) for t in (q, k, v)
        )
        methods[layout] = functools.partial(pcp_prefill_attention, ql, kl, vl, meta, ctx.world)
    methods.update(baselines or {})
    out, last = timed_rounds(ctx, methods, repeats)
    for layout, meta in metas.items():
        real = ~meta.is_padding
        rows = meta.token_index[real].to(ctx.device)
        out[f"{layout}_err"] = (last[layout][0][real.to(ctx.device)] - ref[rows]).abs().max().item()
    return out


def chunked_prefill_timing(
    ctx: RankContext,
    *,
    context_len: int,
    chunk_len: int,
    tensor_parallel_size: int = 1,
    prefill_context_parallel_size: int = 2,
    decode_context_parallel_size: int = 2,
    num_q_heads: int = 8,
    num_kv_heads: int = 1,
    head_dim: int = 64,
    workspace_size: int = 16384,
    block_size: int = 16,
    repeats: int = 3,
    seed: int = 0,
) -> dict[str, Any]:
    """Medians of one chunked-prefill attention layer per strategy (float32), on this rank.

    One request: ``context_len`` cached tokens in the DCP-sharded paged cache, a chunk of
    ``chunk_len`` tokens split zigzag over PCP (:mod:`cpbook.pcp.chunked`).  Inputs are prepared
    before the clock starts; the strategies take turns from common barriers
    (:func:`timed_rounds`), and each run ends at a barrier too, so a run lasts until the last
    rank has its output (AllGather-Q ends in a collective, AllGather-KV does not; without the
    barrier a loaded machine's delays would count for one and not the other).  Returns, per
    strategy, the median wall seconds (``<strategy>``), process CPU seconds
    (``<strategy>_cpu``), the bytes this rank sent in one run (``<strategy>_bytes``, from the
    trace), and ``max_abs_diff`` between the strategies' outputs on the real rows.
    """

    cfg = ParallelConfig(
        tensor_parallel_size=tensor_parallel_size,
        block_size=block_size,
        prefill_context_parallel_size=prefill_context_parallel_size,
        decode_context_parallel_size=decode_context_parallel_size,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
    )
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
        block_size,
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
            sent[strategy] = sum(b for _, b in comm)
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
    out, _ = timed_rounds(ctx, methods, repeats, {"": time.perf_counter})
    return out


def ring_prefill_timing(
    ctx: RankContext,
    *,
    seq_len: int = 8192,
    num_heads: int = 8,
    head_dim: int = 64,
    repeats: int = 5,
    seed: int = 0,
) -> dict[str, float]:
    """Medians of one causal prefill attention (float32, MHA) by cpbook's two rings and PyTorch's.

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
        torch.randn(seq_len, num_heads, head_dim, generator=gen).to(ctx.device) for _ in range(3)
    )
    sdpa = torch.nn.functional.scaled_dot_product_attention
    ref = sdpa(*(t.transpose(0, 1) for t in (q, k, v)), is_causal=True).transpose(0, 1)
    meta = zigzag_partition(seq_len, ctx.world_size).metadata(ctx.rank)
    heads = [pcp_shard(t, meta).transpose(0, 1).contiguous() for t in (q, k, v)]  # [H, T, D]
    layout = RingLayout((seq_len,), (0,), ctx.world_size)
    rows = [t.transpose(0, 1) for t in heads]
    methods: dict[str, Callable[[], Any]] = {
        mode: functools.partial(ring_attention, *rows, layout, ctx.world, mode)
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


def decode_step_timing(
    ctx: RankContext,
    *,
    contexts: Sequence[int] = (1024, 4096),
    num_q_heads: int = 16,
    head_dim: int = 128,
    hidden_size: int = 1024,
    repeats: int = 5,
    seed: int = 0,
) -> dict[int, dict[str, float]]:
    """Medians of one decode step of one request's attention block (float32, GQA with one KV
    head, ``tp = world``) per context length, three ways in turns from a common barrier:
    ``no_cp`` (TP only: every rank reads the whole KV), ``dcp`` (DCP = TP: 1/N of the KV, plus
    the query all-gather and the combine) and ``dcp_tpa`` (the same without the all-gather).

    Returns ``{context: {method: seconds, method + "_err": max error vs no_cp}}`` for this rank.
    """

    n, out = ctx.world_size, {}
    kw = dict(
        tensor_parallel_size=n,
        num_q_heads=num_q_heads,
        num_kv_heads=1,
        head_dim=head_dim,
        block_size=16,
    )
    cfgs = {
        "no_cp": tpa_config(False, **kw),
        "dcp": tpa_config(False, **kw, decode_context_parallel_size=n),
        "dcp_tpa": tpa_config(True, **kw, decode_context_parallel_size=n),
    }
    groups = {m: make_groups(ctx, c) for m, c in cfgs.items()}
    gen = torch.Generator().manual_seed(seed)
    s = hidden_size**-0.5
    block = TPABlock(
        torch.randn(hidden_size, num_q_heads * head_dim, generator=gen) * s,
        torch.randn(num_q_heads * head_dim, hidden_size, generator=gen) * s,
        num_q_heads,
    ).to(ctx.device)
    x = torch.randn(1, hidden_size, generator=gen).to(ctx.device)
    for c in contexts:
        k, v = (torch.randn(c, 1, head_dim, generator=gen).to(ctx.device) for _ in range(2))
        methods = {}
        for m, cfg in cfgs.items():
            kvh = attention_kv_heads(cfg, groups[m].coords.tp_rank)
            rank = groups[m].coords.dcp_rank
            mine = torch.arange(rank, c, cfg.dcp, device=ctx.device)  # interleave 1: its tokens
            kk, vv = k[mine][:, kvh].contiguous(), v[mine][:, kvh].contiguous()
            methods[m] = functools.partial(attention_block, x, block, [kk], [vv], cfg, groups[m])
        medians, last = timed_rounds(ctx, methods, repeats)
        out[c] = {m: medians[m] for m in methods}
        out[c].update({f"{m}_err": (last[m] - last["no_cp"]).abs().max().item() for m in methods})
    return out


def serve_timing(ctx: RankContext, **kwargs: Any) -> dict[str, Any]:
    """:func:`cpbook.engine.engine.serve_rank` (same arguments) plus ``wall_s``, this rank's seconds
    for the whole run (engine construction included), and ``tokens_per_s``, the new tokens
    over it.  ``python -m cpbook serve`` reports these."""

    synchronize(ctx.device)
    start = time.perf_counter()
    res = serve_rank(ctx, **kwargs)
    synchronize(ctx.device)
    wall = time.perf_counter() - start
    new = sum(len(t) for t in res["tokens"])
    return {
        **res,
        "wall_s": wall,
        "tokens_per_s": new / wall if wall else None,
        "device": device_name(ctx.device),
        "dist_backend": ctx.backend,
    }


def spec_decode_timing(
    ctx: RankContext,
    *,
    contexts: Sequence[int] = (1024, 4096),
    num_speculative_tokens: Sequence[int] = (1, 3),
    num_q_heads: int = 16,
    head_dim: int = 128,
    repeats: int = 5,
    seed: int = 0,
) -> dict[int, dict[str, float]]:
    """Medians of one decode (or verification) step's attention for one request of each
    context (float32, one KV head, ``num_q_heads / world`` heads per rank), in turns from a
    common barrier: ``no_cp`` (TP only: the whole KV on every rank, one row), ``dcp`` (DCP =
    world: the interleaved shard, AllGather Q and the ``ag_rs`` combine, one row), and per ``k``
    ``dcp_spec{k}`` (the same with ``k + 1`` rows,
    :func:`cpbook.dcp.verify.dcp_verify_attention`) and ``no_cp_spec{k}`` (``k + 1`` rows over
    the whole KV).  Returns ``{context: {method: seconds}}`` for this rank."""
    n, r, out = ctx.world_size, ctx.rank, {}
    gen = torch.Generator().manual_seed(seed)
    h = num_q_heads // n
    for c in contexts:
        k, v = (torch.randn(c, 1, head_dim, generator=gen).to(ctx.device) for _ in range(2))
        mine = torch.arange(r, c, n, device=ctx.device)  # interleave 1: this rank's tokens
        ks, vs = k[mine].contiguous(), v[mine].contiguous()
        rows = [0, *num_speculative_tokens]
        q = {j: torch.randn(j + 1, h, head_dim, generator=gen).to(ctx.device) for j in rows}
        methods = {}
        for j in rows:
            name = "" if j == 0 else f"_spec{j}"
            start = c - j - 1  # the step's rows are the last j + 1 positions
            methods["no_cp" + name] = functools.partial(
                local_verify_attention, q[j], [k], [v], [start], [j + 1], DCPShard()
            )
            methods["dcp" + name] = functools.partial(
                dcp_verify_attention, q[j], [ks], [vs], [start], [j + 1], ctx.world, 1
            )
        medians, _ = timed_rounds(ctx, methods, repeats)
        out[c] = {m: medians[m] for m in methods}
    return out
