"""Command line: ``python -m cpbook demo NAME --world-size N [--backend inline|torchrun]``.

Under torchrun (``torchrun --nproc-per-node N -m cpbook demo NAME``) the processes torchrun
started run the demo directly; rank 0 prints the deterministic report.  Errors print one line,
``cpbook: error: [rule] requires …; got …``, and exit with status 2 (``--debug``: the traceback).
"""

from __future__ import annotations

import argparse
import os
import re
import sys

from .comm import DEFAULT_TIMEOUT_S
from .demos import DEMOS, describe, get_demo, parse_params
from .launch import format_report, gather_results, pick_backend, run, worker_context, worker_run

_RULE = re.compile(r"(\[[\w-]+\] requires .*)")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m cpbook", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser(
        "demo",
        add_help=False,
        help="run a named demo on N ranks",
        description="Run a chapter's per-rank function on N ranks. "
        "'demo NAME --help' lists NAME's parameters.",
    )
    d.add_argument("name", nargs="?", help=f"one of {sorted(DEMOS)}")
    d.add_argument("-h", "--help", action="store_true", help="this help, or NAME's parameters")
    d.add_argument("--list", action="store_true", help="list the demos")
    d.add_argument("--world-size", type=int, default=4)
    d.add_argument("--backend", choices=["inline", "torchrun"], default="inline")
    d.add_argument("--dist-backend", choices=["gloo", "nccl"], default=None)
    d.add_argument(
        "--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds per collective"
    )
    d.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="keyword argument of the demo (repeatable)",
    )
    d.add_argument("--debug", action="store_true", help="show the full traceback on errors")
    return p


def _root_message(e: BaseException) -> str:
    """The ``[rule] requires …`` line behind ``e`` (its cause chain, or a rank's traceback)."""
    while e is not None:
        if isinstance(e, ValueError):
            return str(e)
        found = _RULE.findall(str(e))
        if found:
            return found[-1]
        e = e.__cause__
    return ""


def _demo(a: argparse.Namespace, p: argparse.ArgumentParser) -> int:
    if a.help and a.name:
        print(describe(a.name))
        return 0
    if a.help:
        p._subparsers._group_actions[0].choices["demo"].print_help()
        return 0
    if a.list or not a.name:
        for name, (chapter, path) in sorted(DEMOS.items(), key=lambda kv: (kv[1][0], kv[0])):
            doc = (get_demo(name).__doc__ or "").strip().splitlines()[0]
            print(f"ch{chapter} {name:12s} {path:34s} {doc}")
        return 0
    fn = get_demo(a.name)
    kwargs = parse_params(fn, a.param)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # we are a torchrun worker
        world = int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        ctx = worker_context(a.dist_backend or pick_backend(world, local), a.timeout)
        got = gather_results(worker_run(fn, kwargs, ctx), ctx)
        if got is not None:
            print(
                format_report(
                    "torchrun", ctx.backend, [g["stdout"] for g in got], [g["trace"] for g in got]
                )
            )
        import torch.distributed as dist

        dist.destroy_process_group()
        return 0
    if a.world_size < 1:
        raise ValueError(f"[world-size] requires --world-size >= 1; got {a.world_size}")
    run(fn, a.world_size, a.backend, kwargs, timeout=a.timeout, dist_backend=a.dist_backend)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    a = p.parse_args(argv)
    try:
        return _demo(a, p)
    except Exception as e:  # noqa: BLE001 - one line for a command-line user, all with --debug
        if a.debug:
            raise
        msg = _root_message(e) or f"{type(e).__name__}: {e}".splitlines()[0]
        print(f"cpbook: error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
