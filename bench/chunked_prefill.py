"""Chunked prefill under PCP × DCP: AllGather-Q vs AllGather-KV, and ring attention, 2 gloo ranks.

    python bench/chunked_prefill.py --json               # grid + ring rows, two torchrun launches
    python bench/chunked_prefill.py --json --contexts 0,4096 --chunks 256 --no-ring  # quick look
    python bench/chunked_prefill.py --json --calibrate   # fit the selector's link model
    python bench/chunked_prefill.py --store              # refresh cpbook/data/chunked_prefill.jsonl
    python bench/chunked_prefill.py --json --dist-backend nccl   # on 2 GPUs (not stored)

Grid rows: one request, ``context`` cached tokens DCP-interleaved over ``dcp = 2`` ranks and a
chunk of ``chunk`` new tokens split zigzag over ``pcp = 2`` (``tp = 1``: both ranks share one
KV head), 8 query heads, 1 KV head, head_dim 64, float32, context pieces of 16384 rows
(:func:`cpbook.timing.chunked_prefill_timing`).  A strategy's ``ms`` is the slowest rank's
median wall time (``--repeats`` runs, three times as many where a run takes milliseconds);
``bytes`` what each rank sent (traced); ``chosen`` what
:func:`cpbook.pcp.chunked_plan.choose_strategy` picks with its default link model.  The
``chunked_prefill_selector`` row gives the selector's agreement with the measurement at the
points where the two strategies differ by more than ``--decisive`` (10 %) and, per chunk, the
measured crossover (the grid contexts it lies between) and the model's, judged by wall time
and by CPU time (the process's, gloo's threads included: what a shared machine's load
disturbs least).  ``ring_prefill`` rows: pass-KV and pass-Q ring
attention (:func:`cpbook.timing.ring_prefill_timing`) against PyTorch's
``_templated_ring_attention`` on the same head–tail shards.  ``--calibrate`` times one
all-gather and one all-to-all per message size and fits ``α + β·bytes``.

``--store`` also writes the run's JSON lines (the ``chunked_prefill_run`` line first, whatever
the output format) over the package data the package reads, ``cpbook/data/chunked_prefill.jsonl``
(:mod:`cpbook.data`: chapter 5's stored run and the calibration's chunked points), once every
launch has finished.  It writes exactly what ran, so ``--contexts``, ``--chunks`` or
``--no-ring`` shrink the stored run; it is refused with ``--calibrate``, whose link rows are
not what the package reads.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPE = dict(num_q_heads=8, num_kv_heads=1, head_dim=64)
GRID = dict(tensor_parallel_size=1, prefill_context_parallel_size=2, decode_context_parallel_size=2)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print JSON lines")
    p.add_argument("--contexts", default="0,1024,2048,4096,16384,65536")
    p.add_argument("--chunks", default="256,1024,4096")
    p.add_argument("--workspace-size", type=int, default=16384)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--decisive", type=float, default=0.10)
    p.add_argument("--no-ring", action="store_true", help="skip the ring_prefill launch")
    p.add_argument("--calibrate", action="store_true", help="fit the link model instead")
    p.add_argument(
        "--store",
        action="store_true",
        help="also write the run's JSON lines to cpbook/data/chunked_prefill.jsonl",
    )
    p.add_argument(
        "--dist-backend",
        choices=("gloo", "nccl"),
        default="gloo",
        help="gloo: CPU tensors (the stored runs); nccl: one GPU per rank",
    )
    p.add_argument("--worker", choices=("grid", "ring", "calibrate"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.store and a.calibrate:
        p.error("--store writes the grid and ring rows the package reads; not with --calibrate")
    if a.store and a.dist_backend != "gloo":
        p.error("--store keeps the CPU (gloo) runs the package reads; not with --dist-backend nccl")
    return a


def _store_path() -> Path:
    """The package's ``chunked_prefill.jsonl`` (where :mod:`cpbook.data` reads it)."""
    import cpbook.data

    return cpbook.data.stored_path("chunked_prefill.jsonl")


def store(lines: list[str], path: Path | None = None) -> None:
    """Write the run's JSON ``lines`` to ``path`` (default: the package's copy), one a line."""
    path = _store_path() if path is None else path
    path.write_text("".join(line + "\n" for line in lines))
    print(f"stored {len(lines)} lines in {path}", file=sys.stderr)


def _gather(ctx, mine: dict) -> list[dict] | None:
    import torch.distributed as dist

    every = [None] * ctx.world_size
    dist.all_gather_object(every, mine)
    return every if ctx.rank == 0 else None


def _config():
    """The layout the selector prices (AllGather-Q combines by a2a, as the timed runs)."""
    from cpbook.core.config import ParallelConfig

    return ParallelConfig(**SHAPE, **GRID, dcp_comm_backend="a2a")


def _crossover(chunk: int, a: argparse.Namespace) -> int | None:
    """Smallest context at which the selector prefers AllGather-Q (bisection), or None."""
    from cpbook.pcp.chunked_plan import choose_strategy

    def q_wins(c: int) -> bool:
        return (
            choose_strategy(
                chunk, c, _config(), elem_bytes=4, workspace_size=a.workspace_size
            ).strategy
            == "allgather_q"
        )

    lo, hi = 0, 1 << 24
    if q_wins(lo) or not q_wins(hi):
        return lo if q_wins(lo) else None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if q_wins(mid) else (mid, hi)
    return hi


def _verdict(points: list[tuple], a: argparse.Namespace) -> dict:
    """Agreement of the selector with the faster strategy where they differ by > --decisive,
    and per chunk the measured crossover: the grid contexts between which AllGather-Q becomes
    (and stays) faster, next to the model's crossover context."""
    decisive = [
        (t, c, min(ms, key=ms.get), chosen)
        for t, c, ms, chosen in points
        if max(ms.values()) > (1 + a.decisive) * min(ms.values())
    ]
    agree = sum(fast == chosen for _, _, fast, chosen in decisive)
    crossover = []
    for t in _ints(a.chunks):
        row = [(c, ms["allgather_q"] < ms["allgather_kv"]) for tt, c, ms, _ in points if tt == t]
        first = next((i for i in range(len(row)) if all(q for _, q in row[i:])), len(row))
        crossover.append(
            {
                "chunk": t,
                "above": row[first - 1][0] if first else None,
                "at_most": row[first][0] if first < len(row) else None,
            }
        )
    return {
        "decisive_points": len(decisive),
        "agree": agree,
        "agreement": round(agree / len(decisive), 3) if decisive else None,
        "disagree": [[t, c, f] for t, c, f, ch in decisive if f != ch],
        "crossover": crossover,
    }


def _grid(ctx, a: argparse.Namespace) -> None:
    from cpbook.core.config import ParallelConfig
    from cpbook.pcp.chunked_plan import STRATEGIES, choose_strategy
    from cpbook.timing import chunked_prefill_timing

    wall, cpu = [], []
    for chunk in _ints(a.chunks):
        for context in _ints(a.contexts):
            small = chunk * (context + chunk) <= 1 << 24  # milliseconds: more runs against noise
            every = _gather(
                ctx,
                chunked_prefill_timing(
                    ctx,
                    ParallelConfig(**SHAPE, **GRID),
                    context_len=context,
                    chunk_len=chunk,
                    workspace_size=a.workspace_size,
                    repeats=a.repeats * (3 if small else 1),
                ),
            )
            if every is None:
                continue
            choice = choose_strategy(
                chunk, context, _config(), elem_bytes=4, workspace_size=a.workspace_size
            )
            ms = {st: 1e3 * max(r[st] for r in every) for st in STRATEGIES}
            cpu_ms = {st: 1e3 * max(r[f"{st}_cpu"] for r in every) for st in STRATEGIES}
            for st in STRATEGIES:
                print(
                    json.dumps(
                        {
                            "name": "chunked_prefill",
                            "ranks": ctx.world_size,
                            "context": context,
                            "chunk": chunk,
                            "strategy": st,
                            "ms": round(ms[st], 2),
                            "bytes": every[0][f"{st}_bytes"],
                            "chosen": choice.strategy,
                            "cpu_ms": round(cpu_ms[st], 2),
                            "model_ms": round(1e3 * choice.seconds[st], 3),
                            "max_abs_diff": float(f"{max(r['max_abs_diff'] for r in every):.2e}"),
                        }
                    ),
                    flush=True,
                )
            wall.append((chunk, context, ms, choice.strategy))
            cpu.append((chunk, context, cpu_ms, choice.strategy))
    if ctx.rank:
        return
    print(
        json.dumps(
            {
                "name": "chunked_prefill_selector",
                "points": len(wall),
                "decisive_margin": a.decisive,
                "wall": _verdict(wall, a),
                "cpu": _verdict(cpu, a),
                "model_crossover": {t: _crossover(t, a) for t in _ints(a.chunks)},
                "loadavg_1min": round(os.getloadavg()[0], 2),
            }
        ),
        flush=True,
    )


def _ring(ctx, a: argparse.Namespace) -> None:
    from cpbook.timing import ring_prefill_timing

    every = _gather(
        ctx, ring_prefill_timing(ctx, seq_len=8192, num_q_heads=8, head_dim=64, repeats=5, seed=0)
    )
    if every is None:
        return
    torch_ms = 1e3 * max(r["torch_ring"] for r in every)
    for mode in ("pass_kv", "pass_q"):
        ms = 1e3 * max(r[mode] for r in every)
        print(
            json.dumps(
                {
                    "name": "ring_prefill",
                    "mode": mode,
                    "seq_len": 8192,
                    "ms": round(ms, 1),
                    "torch_ring_ms": round(torch_ms, 1),
                    "ratio_vs_torch_ring": round(ms / torch_ms, 3),
                }
            ),
            flush=True,
        )


def _calibrate(ctx, a: argparse.Namespace) -> None:
    import torch

    from cpbook.timing import collective_timing

    sizes = [1 << k for k in range(10, 26)]
    every = _gather(ctx, collective_timing(ctx, sizes, repeats=max(5, a.repeats)))
    if every is None:
        return
    for op in ("all_gather", "all_to_all"):
        t = torch.tensor([max(r[f"{op}_{s}"] for r in every) for s in sizes], dtype=torch.float64)
        x = torch.tensor(sizes, dtype=torch.float64)
        design = torch.stack([torch.ones_like(x), x], dim=1) / t[:, None]  # relative error
        fit = torch.linalg.lstsq(design, torch.ones_like(t)[:, None]).solution[:, 0]
        alpha, beta = fit.tolist()
        print(
            json.dumps(
                {
                    "name": "chunked_prefill_link",
                    "op": op,
                    "alpha_s": float(f"{alpha:.3e}"),
                    "beta_s_per_byte": float(f"{beta:.3e}"),
                    "ms": {s: round(1e3 * float(v), 3) for s, v in zip(sizes, t)},
                }
            ),
            flush=True,
        )


def _worker(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from cpbook.core.launch import worker_context

    torch.set_num_threads(1)
    ctx = worker_context(a.dist_backend, 1200.0)
    {"grid": _grid, "ring": _ring, "calibrate": _calibrate}[a.worker](ctx, a)
    dist.destroy_process_group()


def _launch(a: argparse.Namespace, worker: str, argv: list[str]) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        str(Path(__file__).resolve()),
        f"--worker={worker}",
        *argv,
    ]
    path = [str(ROOT), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(p for p in path if p))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=7200)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode or not lines:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"torchrun ({worker}) failed with code {proc.returncode}")
    return lines


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = _args(argv)
    if a.worker:
        _worker(a)
        return 0
    launches = ["calibrate"] if a.calibrate else ["grid"] + ([] if a.no_ring else ["ring"])
    from cpbook.timing import machine_record

    dev = "cuda:0" if a.dist_backend == "nccl" else "cpu"  # rank r runs on cuda:r
    stored = [json.dumps({"name": "chunked_prefill_run", **machine_record(dev, a.dist_backend)})]
    print(stored[0], flush=True)
    for worker in launches:
        for line in _launch(a, worker, argv):
            stored.append(line)
            print(
                line if a.json else "  ".join(f"{k}={v}" for k, v in json.loads(line).items()),
                flush=True,
            )
    if a.store:
        store(stored)
    return 0


if __name__ == "__main__":
    sys.exit(main())
