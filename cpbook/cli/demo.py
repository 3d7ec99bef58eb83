"""``python -m cpbook demo NAME``: a chapter's per-rank function on N ranks (inline, or under
torchrun), its report printed; ``--list`` the demos, ``NAME --help`` NAME's parameters."""

from __future__ import annotations

import argparse
import os

from cpbook.cli.options import (
    add_debug,
    add_placement,
    add_timeout,
    end_worker,
    start_worker,
    under_torchrun,
)
from cpbook.core.errors import RuleError
from cpbook.core.launch import format_report, gather_results, run, worker_run
from cpbook.demos import DEMOS, describe, get_demo, parse_params

__all__ = ["add_parser", "command"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The ``demo`` sub-command's options."""
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
    add_placement(d)
    add_timeout(d)
    d.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="keyword argument of the demo (repeatable)",
    )
    add_debug(d)


def _list() -> None:
    for name, (chapter, path) in sorted(DEMOS.items(), key=lambda kv: (kv[1][0], kv[0])):
        doc = (get_demo(name).__doc__ or "").strip().splitlines()[0]
        print(f"ch{chapter} {name:12s} {path:34s} {doc}")


def command(a: argparse.Namespace, p: argparse.ArgumentParser) -> int:
    """Help, the list, or the demo run; 0 when it ran (its errors raise)."""
    if a.help and a.name:
        print(describe(a.name))
        return 0
    if a.help:
        p._subparsers._group_actions[0].choices["demo"].print_help()
        return 0
    if a.list or not a.name:
        _list()
        return 0
    fn = get_demo(a.name)
    kwargs = parse_params(fn, a.param)
    if under_torchrun():  # the processes torchrun started run the demo; rank 0 reports
        ctx = start_worker(a, int(os.environ["WORLD_SIZE"]))
        got = gather_results(worker_run(fn, kwargs, ctx), ctx)
        if got is not None:
            print(
                format_report(
                    "torchrun", ctx.backend, [g["stdout"] for g in got], [g["trace"] for g in got]
                )
            )
        end_worker()
        return 0
    if a.world_size < 1:
        raise RuleError("world-size", "--world-size >= 1", world_size=a.world_size)
    run(
        fn,
        a.world_size,
        a.backend,
        kwargs,
        timeout=a.timeout,
        dist_backend=a.dist_backend,
        device=a.device,
    )
    return 0
