"""Per-rank functions the tests run on both backends (importable by torchrun workers)."""

from __future__ import annotations

import os
import signal
import threading

import torch

from cpbook.core.context import RankContext
from cpbook.core.groups import ANCHOR_ORDER, RankGrid, make_groups
from cpbook.dcp.decode import dcp_combine
from cpbook.demos import demo_kwargs
from cpbook.demos.ch03_decode import gqa_decode_rank
from cpbook.demos.ch09_engine import serve_grid_rank


def every_collective(ctx: RankContext) -> dict:
    """Exercise every Group call on the world and on an uneven partition; integer-valued data."""
    r, n = ctx.rank, ctx.world_size
    g = ctx.world
    t = (torch.arange(6 * n, dtype=torch.float64) + 100 * r).reshape(2 * n, 3)
    out = {
        "all_gather0": g.all_gather(t, dim=0),
        "all_gather1": g.all_gather(t, dim=1),
        "all_gather_v": g.all_gather_v(torch.full((r + 1, 2), float(r)), dim=0)[0],
        "reduce_scatter0": g.reduce_scatter(t, dim=0),
        "reduce_scatter1": g.reduce_scatter(t.T.contiguous(), dim=1),
        "all_reduce": g.all_reduce(t),
        "all_to_all": g.all_to_all(t, scatter_dim=0, gather_dim=1),
        "ring": g.sendrecv(t + 0.5, dst=(r + 1) % n, src=(r - 1) % n),
    }
    if r == 0:
        g.send(t[:1].contiguous(), dst=n - 1)
    if r == n - 1:
        out["recv"] = g.recv(t[:1], src=0)
    g.barrier()
    odd = ctx.new_group([[0, n - 1], list(range(1, n - 1))] if n > 2 else [[0], [1]], "odd")
    out["odd"] = odd.all_gather(torch.tensor([float(r)]))
    out["odd_ranks"] = list(odd.ranks)
    return out


def reordered_collectives(ctx: RankContext, *, legacy: bool = False) -> dict:
    """Every collective on the world in reverse order (group rank ``i`` is global rank
    ``n-1-i``), and a 0-dim all-gather.  ``legacy=True`` takes, on gloo, the paths of an older
    torch and of NCCL: groups made sorted and reordered by cpbook (no ``sort_ranks=False``),
    the single-tensor all-gather instead of the point-to-point one."""
    import cpbook.core.backends as backends

    if legacy:
        backends.new_group_keeps_order = lambda: False
        backends.TorchGroup.P2P_ALL_GATHER = ()
    n, dev = ctx.world_size, ctx.device
    g = ctx.new_group([list(range(n))[::-1]], "reversed")
    t = (torch.arange(6 * n, dtype=torch.float64, device=dev) + 100 * ctx.rank).reshape(2 * n, 3)
    return {
        "order": None if ctx.sim is not None else g.order,
        "all_gather": g.all_gather(t, dim=1),
        "parts": g.all_gather_async(t[:1], parts=True).wait(),
        "zero_dim": g.all_gather_async(t[0, 0], parts=True).wait(),
        "reduce_scatter": g.reduce_scatter(t, dim=0),
        "all_to_all": g.all_to_all(t, scatter_dim=0, gather_dim=1),
        "ring": g.sendrecv(t + 0.5, dst=(g.rank + 1) % n, src=(g.rank - 1) % n),
    }


def grid_groups(ctx: RankContext, tp: int, pcp: int, dcp: int, order: str = ANCHOR_ORDER) -> dict:
    """Build the TP/PCP/DCP groups in a vLLM release's ``order`` and all-gather global ranks
    inside each."""
    pg = make_groups(ctx, RankGrid(tp, pcp, dcp, order))
    me = torch.tensor([float(ctx.rank)])
    return {k: [int(x) for x in getattr(pg, k).all_gather(me)] for k in ("tp", "pcp", "dcp")} | {
        "dcp_rank": pg.coords.dcp_rank,
        "group_rank": pg.dcp.rank,
    }


def combine_rank(
    ctx: RankContext, outs: torch.Tensor, lses: torch.Tensor, dcp_comm_backend: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """The DCP combine over the world of this rank's partial ``(outs[rank], lses[rank])``:
    ``outs [N, B, N·h, D]``, ``lses [N, B, N·h]``; returns this rank's heads and their LSE."""
    r = ctx.rank
    return dcp_combine(outs[r], lses[r], ctx.world, dcp_comm_backend, return_lse=True)


def fail_on_rank(ctx: RankContext, bad: int = 1) -> int:
    """Rank ``bad`` raises before the collective; the others wait in it."""
    if ctx.rank == bad:
        raise ValueError(f"deliberate failure on rank {bad}")
    ctx.world.all_gather(torch.ones(1))
    return ctx.rank


def skip_collective(ctx: RankContext) -> int:
    """Rank 0 waits in an all_gather nobody else calls: it must time out, not hang."""
    if ctx.rank == 0:
        ctx.world.all_gather(torch.ones(1))
    return ctx.rank


def echo_timeout(ctx: RankContext, *, timeout: int, threads: int) -> tuple[int, int]:
    """Return the function's own ``timeout`` and ``threads`` (not the launcher's)."""
    ctx.world.barrier()
    return timeout, threads


def in_sequence(ctx: RankContext, calls: list[tuple[str, dict]]) -> list:
    """Run several per-rank functions (``"module:function"``, kwargs) one after another on the
    same processes: one torchrun launch checks several configurations."""
    import importlib

    out = []
    for path, kwargs in calls:
        mod, name = path.split(":")
        fn = getattr(importlib.import_module(mod), name)
        out.append(fn(ctx, **demo_kwargs(fn, kwargs)))
    return out


def kill_on_rank(ctx: RankContext, *, victim: int) -> float:
    """One all-reduce with every rank alive, then ``victim`` kills its own process (SIGKILL: no
    traceback, no result) and the others wait in a second all-reduce that cannot complete."""
    x = ctx.world.all_reduce(torch.ones(1, dtype=torch.float64))
    if ctx.rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    return float(ctx.world.all_reduce(x)[0])


def block_on_rank(ctx: RankContext, *, victim: int, block_s: float = 600.0) -> float:
    """One all-reduce with every rank alive, then ``victim`` stops answering (waits
    ``block_s`` seconds outside any collective: for ever, as far as a test goes) while the
    others enter a second all-reduce: they must time out and blame ``victim``."""
    x = ctx.world.all_reduce(torch.ones(1, dtype=torch.float64))
    if ctx.rank == victim:
        threading.Event().wait(block_s)
    return float(ctx.world.all_reduce(x)[0])


def two_node_suite(ctx: RankContext, *, decode_configs: list, grids: list, runs: list) -> dict:
    """One launch, several checks: the groups of each ``(tp, pcp, dcp)`` grid, a GQA decode
    step per ParallelConfig, and an engine run per :func:`serve_rank` keyword set."""
    return {
        "rank": ctx.rank,
        "groups": [grid_groups(ctx, *g) for g in grids],
        "decode": [gqa_decode_rank(ctx, parallel_config=c) for c in decode_configs],
        "engine": serve_grid_rank(ctx, runs=runs),
    }
