"""PCP prefill vs PyTorch's ring attention vs one process: causal attention on 2 gloo ranks.

    python bench/pcp_prefill.py --json            # one torchrun launch, 2 ranks x 1 thread
    python bench/pcp_prefill.py --world-size 4 --store   # and refresh cpbook/data/pcp_prefill.json
    python bench/pcp_prefill.py --json --dist-backend nccl   # on GPUs, one per rank (not stored)

Identical float32 inputs (``seq_len`` tokens, MHA), laid out head-major for every method before
the clock starts.  Methods take turns run after run (:func:`cpbook.timing.pcp_prefill_timing`),
each run from a common barrier; one warm-up round, then ``--repeats``; a method's time is the
slowest rank's median:

* ``single`` — one process, ``F.scaled_dot_product_attention(is_causal=True)``, 1 thread;
* ``cpbook_zigzag`` / ``cpbook_contiguous`` — :func:`cpbook.pcp.prefill.pcp_prefill_attention`
  (all-gather K/V through ``cpbook.core.comm``, then local causal attention) on DualChunkSwap or
  contiguous shards;
* ``torch_ring_headtail`` — PyTorch's private ``_templated_ring_attention`` with the CPU flash
  SDPA op on ``_HeadTailLoadBalancer`` shards (torch 2.13), K/V rotated by all-gather and by
  all-to-all; the faster of the two is reported.

Prints one JSON line (``--json``) or a short table, with each rank's attention-thread time
per layout (``per_rank_thread_ms``) and when and where it ran (``date_utc``, ``machine``,
``load_avg_1m``).  ``cpbook/data/pcp_prefill.json``, package data the package reads through
:mod:`cpbook.data` (shown in chapter 4, fitted by :mod:`cpbook.costmodel.calibration`), is the
list of two such records, from ``--world-size 2`` and ``--world-size 4``; ``--store`` refreshes
it: the new record replaces the one of the same ``world_size`` (or joins the list), the list is
kept in ``world_size`` order and written as it is now (a JSON list, indent 1).
Wall times depend on the machine's load; ``cpu_ms`` gives each method's slowest-rank median
process CPU time (all threads of the rank, communication included), which a loaded machine
disturbs much less.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _store_path() -> Path:
    """The package's ``pcp_prefill.json`` (where :mod:`cpbook.data` reads it)."""
    import cpbook.data

    return cpbook.data.stored_path("pcp_prefill.json")


def store(record: dict, path: Path | None = None) -> None:
    """Put ``record`` into the stored list at ``path`` (default: the package's copy), replacing
    the record of the same ``world_size``; the list stays in ``world_size`` order."""
    path = _store_path() if path is None else path
    rows = json.loads(path.read_text()) if path.exists() else []
    rows = [r for r in rows if r.get("world_size") != record["world_size"]] + [record]
    rows.sort(key=lambda r: r["world_size"])
    path.write_text(json.dumps(rows, indent=1))
    print(f"stored world_size={record['world_size']} in {path}", file=sys.stderr)


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print JSON lines")
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--num-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument(
        "--dist-backend",
        choices=("gloo", "nccl"),
        default="gloo",
        help="gloo: CPU tensors (the stored runs); nccl: one GPU per rank",
    )
    p.add_argument(
        "--store",
        action="store_true",
        help="also put the record into the package's cpbook/data/pcp_prefill.json",
    )
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.store and a.dist_backend != "gloo":
        p.error("--store keeps the CPU (gloo) runs the package reads; not with --dist-backend nccl")
    return a


def _torch_ring(ctx, a: argparse.Namespace, rotate: str):
    """A zero-argument callable running PyTorch's head-tail ring attention on this rank's shard
    (rotating K/V by ``rotate``), returning the local output as ``[tokens, heads, head_dim]``."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor.experimental._context_parallel._attention import (
        _templated_ring_attention,
        set_rotate_method,
    )
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import (
        _HeadTailLoadBalancer,
    )

    from cpbook.pcp.zigzag import zigzag_partition
    from cpbook.timing import sdpa_ring_kernel

    idx = _HeadTailLoadBalancer(a.seq_len, ctx.world_size, "cpu")._generate_indices()[0].long()
    mine = idx.view(ctx.world_size, -1)[ctx.rank]
    assert mine.tolist() == zigzag_partition(a.seq_len, ctx.world_size).rank_tokens[ctx.rank]
    gen = torch.Generator().manual_seed(0)  # the inputs of cpbook.timing.pcp_prefill_timing
    q, k, v = (torch.randn(a.seq_len, a.num_heads, a.head_dim, generator=gen) for _ in range(3))
    q4, k4, v4 = (t[mine].transpose(0, 1)[None].contiguous().to(ctx.device) for t in (q, k, v))
    op, extra = sdpa_ring_kernel(ctx.device)

    def ring():
        set_rotate_method(rotate)
        out = _templated_ring_attention(
            dist.group.WORLD, 2, op, q4, k4, v4, is_causal=True, **extra
        )[0]
        return out[0].transpose(0, 1)

    return ring


def _worker(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from cpbook.core.config import ParallelConfig
    from cpbook.core.launch import worker_context
    from cpbook.pcp.prefill import pcp_prefill_attention, pcp_shard
    from cpbook.pcp.zigzag import pcp_partition
    from cpbook.timing import machine_record, pcp_prefill_timing

    torch.set_num_threads(1)
    ctx = worker_context(a.dist_backend, 600.0)
    rings = {f"torch_ring_{rot}": _torch_ring(ctx, a, rot) for rot in ("allgather", "alltoall")}
    heads = dict(num_q_heads=a.num_heads, num_kv_heads=a.num_heads, head_dim=a.head_dim)
    cfg = ParallelConfig(prefill_context_parallel_size=ctx.world_size, **heads)
    mine = pcp_prefill_timing(ctx, cfg, seq_len=a.seq_len, repeats=a.repeats, baselines=rings)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(a.seq_len, a.num_heads, a.head_dim, generator=gen).to(ctx.device)
        for _ in range(3)
    )
    meta = pcp_partition(a.seq_len, ctx.world_size).metadata(ctx.rank)
    ours = pcp_prefill_attention(*(pcp_shard(t, meta) for t in (q, k, v)), meta, ctx.world)[0]
    for name, ring in rings.items():
        mine[f"{name}_diff"] = (ring() - ours).abs().max().item()
    every = [None] * ctx.world_size
    dist.all_gather_object(every, mine)
    if ctx.rank == 0:

        def slowest(key: str) -> float:
            return max(r[key] for r in every)

        methods = ("single", "zigzag", "contiguous", "torch_ring_allgather", "torch_ring_alltoall")
        ms = {m: round(1e3 * slowest(m), 1) for m in methods}
        cpu = {m: round(1e3 * slowest(f"{m}_cpu"), 1) for m in methods}
        fast = min(("torch_ring_allgather", "torch_ring_alltoall"), key=ms.get)
        ring = ms[fast]
        print(
            json.dumps(
                {
                    "name": "pcp_prefill",
                    "seq_len": a.seq_len,
                    "world_size": ctx.world_size,
                    "single_ms": ms["single"],
                    "cpbook_zigzag_ms": ms["zigzag"],
                    "cpbook_contiguous_ms": ms["contiguous"],
                    "torch_ring_headtail_ms": ring,
                    "ratio_vs_torch_ring": round(ms["zigzag"] / ring, 3),
                    "speedup_vs_single": round(ms["single"] / ms["zigzag"], 3),
                    "max_abs_err": float(
                        f"{max(slowest('zigzag_err'), slowest('contiguous_err')):.2e}"
                    ),
                    "torch_ring_allgather_ms": ms["torch_ring_allgather"],
                    "torch_ring_alltoall_ms": ms["torch_ring_alltoall"],
                    "cpu_ms": {
                        "single": cpu["single"],
                        "cpbook_zigzag": cpu["zigzag"],
                        "cpbook_contiguous": cpu["contiguous"],
                        "torch_ring_headtail": cpu[fast],
                    },
                    "torch_ring_max_abs_diff": float(
                        f"{max(slowest(f'{r}_diff') for r in rings):.2e}"
                    ),
                    "per_rank_thread_ms": {
                        m: [round(1e3 * r[f"{m}_thread"], 1) for r in every]
                        for m in ("zigzag", "contiguous")
                    },
                    "num_heads": a.num_heads,
                    "head_dim": a.head_dim,
                    "dtype": "float32",
                    "repeats": a.repeats,
                    "threads_per_rank": torch.get_num_threads(),
                    **machine_record(ctx.device, ctx.backend),
                }
            ),
            flush=True,
        )
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    if a.worker:
        _worker(a)
        return 0
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={a.world_size}",
        str(Path(__file__).resolve()),
        "--worker",
        f"--seq-len={a.seq_len}",
        f"--num-heads={a.num_heads}",
        f"--head-dim={a.head_dim}",
        f"--repeats={a.repeats}",
        f"--dist-backend={a.dist_backend}",
    ]
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join(p for p in [str(ROOT), os.environ.get("PYTHONPATH", "")] if p),
    )
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=1800)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode or not lines:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"torchrun failed with code {proc.returncode}")
    for line in lines:
        if a.json:
            print(line)
        else:
            for key, value in json.loads(line).items():
                print(f"{key:26s} {value}")
    if a.store:
        (record,) = (json.loads(line) for line in lines)
        store(record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
