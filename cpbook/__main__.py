"""Command line: ``python -m cpbook demo NAME --world-size N [--backend inline|torchrun]``.

Under torchrun (``torchrun --nproc-per-node N -m cpbook demo NAME``) the processes torchrun
started run the demo directly; rank 0 prints the deterministic report.
"""
from __future__ import annotations

import argparse
import ast
import os
import sys

from .comm import DEFAULT_TIMEOUT_S
from .demos import DEMOS, get_demo
from .launch import format_report, gather_results, pick_backend, run, worker_context, worker_run


def _param(text: str) -> tuple[str, object]:
    key, _, value = text.partition("=")
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cpbook", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="run a named demo on N ranks")
    d.add_argument("name", nargs="?", help=f"one of {sorted(DEMOS)}")
    d.add_argument("--list", action="store_true", help="list the demos")
    d.add_argument("--world-size", type=int, default=4)
    d.add_argument("--backend", choices=["inline", "torchrun"], default="inline")
    d.add_argument("--dist-backend", choices=["gloo", "nccl"], default=None)
    d.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S)
    d.add_argument("--param", type=_param, action="append", default=[], metavar="KEY=VALUE",
                   help="keyword argument for the demo (repeatable)")
    a = p.parse_args(argv)
    if a.list or not a.name:
        for name, path in sorted(DEMOS.items()):
            doc = (get_demo(name).__doc__ or "").strip().splitlines()[0]
            print(f"{name:12s} {path:45s} {doc}")
        return 0
    fn, kwargs = get_demo(a.name), dict(a.param)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # we are a torchrun worker
        world = int(os.environ["WORLD_SIZE"])
        ctx = worker_context(a.dist_backend or pick_backend(world, int(os.environ.get("LOCAL_WORLD_SIZE", world))),
                             a.timeout)
        got = gather_results(worker_run(fn, kwargs, ctx), ctx)
        if got is not None:
            print(format_report("torchrun", ctx.backend, [g["stdout"] for g in got], [g["trace"] for g in got]))
        import torch.distributed as dist
        dist.destroy_process_group()
        return 0
    run(fn, a.world_size, a.backend, timeout=a.timeout, dist_backend=a.dist_backend, **kwargs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
