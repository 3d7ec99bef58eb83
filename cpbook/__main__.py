"""Command line: ``python -m cpbook demo NAME --world-size N [--backend inline|torchrun]``.

``python -m cpbook serve --model tiny-gqa --tp T --dcp D --pcp P [--json]`` serves generated
prompts with the chapter 9 engine on ``T·P`` ranks (inline, or ``--backend torchrun``, or
started by ``torchrun --nproc-per-node T·P -m cpbook serve ...``).  ``--device cuda:0`` puts
simulated ranks on one GPU; under torchrun each rank's device follows its dist backend.

Under torchrun (``torchrun --nproc-per-node N -m cpbook demo NAME``) the processes torchrun
started run the demo directly; rank 0 prints the deterministic report.  Errors print one line,
``cpbook: error: [rule] requires …; got …``, and exit with status 2 (``--debug``: the traceback).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

from cpbook.core.comm import DEFAULT_TIMEOUT_S
from cpbook.core.groups import check_grid_world
from cpbook.core.launch import (
    format_report,
    gather_results,
    pick_backend,
    run,
    worker_context,
    worker_run,
)
from cpbook.demos import DEMOS, describe, get_demo, parse_params
from cpbook.engine.engine import engine_config
from cpbook.timing import serve_timing

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
    d.add_argument("--device", default="cpu", help="simulated ranks' device (cuda:0: one GPU)")
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
    s = sub.add_parser(
        "serve",
        help="serve generated prompts with the mini engine on TP x DCP x PCP ranks",
        description="Greedy generation with the chapter 9 engine (paged KV, continuous "
        "batching, chunked prefill, prefix caching) on tp*pcp ranks.",
    )
    s.add_argument("--model", choices=["tiny-gqa", "tiny-mla"], default="tiny-gqa")
    s.add_argument("--tp", type=int, default=1, help="tensor_parallel_size")
    s.add_argument("--dcp", type=int, default=1, help="decode_context_parallel_size")
    s.add_argument("--pcp", type=int, default=1, help="prefill_context_parallel_size")
    s.add_argument("--requests", type=int, default=6, help="number of generated prompts")
    s.add_argument("--seed", type=int, default=0, help="seed of the weights and the prompts")
    s.add_argument("--max-new-tokens", type=int, default=8)
    s.add_argument("--num-kv-blocks", type=int, default=20, help="KV blocks per rank")
    s.add_argument("--dcp-comm-backend", choices=["ag_rs", "a2a"], default="ag_rs")
    s.add_argument(
        "--strategy",
        choices=["auto", "allgather_q", "allgather_kv"],
        default="auto",
        help="chunked-prefill strategy (auto: the chapter 5 selector)",
    )
    s.add_argument("--backend", choices=["inline", "torchrun"], default="inline")
    s.add_argument(
        "--dist-backend",
        choices=["gloo", "nccl"],
        default=None,
        help="torchrun's dist backend (default: NCCL when every rank has a GPU)",
    )
    s.add_argument("--device", default="cpu", help="simulated ranks' device (cuda:0: one GPU)")
    s.add_argument("--json", action="store_true", help="JSON lines: requests, then a summary")
    s.add_argument(
        "--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds per collective"
    )
    s.add_argument("--debug", action="store_true", help="show the full traceback on errors")
    return p


def _serve_lines(res: dict, as_json: bool) -> list[str]:
    """Rank 0's result as JSON lines (one per request, then the summary) or a short table."""
    summary = {
        "name": "engine_summary",
        "model": res["model"],
        "tp": res["tp"],
        "dcp": res["dcp"],
        "pcp": res["pcp"],
        "steps": res["steps"],
        "tokens_per_s": round(res["tokens_per_s"], 1),
        "prefix_hit_tokens": res["prefix_hit_tokens"],
        "preemptions": res["preemptions"],
    }
    if as_json:
        lines = [
            json.dumps(
                {
                    "name": "request",
                    "id": i,
                    "prompt_len": len(p),
                    "tokens": t,
                    **({"error": e} if e else {}),
                }
            )
            for i, (p, t, e) in enumerate(zip(res["prompts"], res["tokens"], res["errors"]))
        ]
        return lines + [json.dumps(summary)]
    lines = [f"{res['model']}  tp={res['tp']} dcp={res['dcp']} pcp={res['pcp']}"]
    for i, (p, t, e) in enumerate(zip(res["prompts"], res["tokens"], res["errors"])):
        lines.append(f"  request {i}: prompt {len(p):3d} tokens -> {e or t}")
    lines.append(
        f"  {res['steps']} steps, {summary['tokens_per_s']} tokens/s, prefix hits "
        f"{res['prefix_hit_tokens']} tokens, {res['preemptions']} preemptions"
    )
    return lines


def _serve(a: argparse.Namespace) -> int:

    engine_config(a.model, a.tp, a.dcp, a.pcp)  # a bad grid fails here, before any process
    kwargs = dict(
        model=a.model,
        tensor_parallel_size=a.tp,
        decode_context_parallel_size=a.dcp,
        prefill_context_parallel_size=a.pcp,
        dcp_comm_backend=a.dcp_comm_backend,
        num_requests=a.requests,
        max_new_tokens=a.max_new_tokens,
        num_kv_blocks=a.num_kv_blocks,
        strategy=a.strategy,
        seed=a.seed,
    )
    world = a.tp * a.pcp
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # we are a torchrun worker
        check_grid_world(world, int(os.environ["WORLD_SIZE"]))
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        ctx = worker_context(a.dist_backend or pick_backend(world, local), a.timeout)
        res = serve_timing(ctx, **kwargs)
        if ctx.rank == 0:
            print("\n".join(_serve_lines(res, a.json)))
        import torch.distributed as dist

        dist.destroy_process_group()
        return 0
    res = run(
        serve_timing,
        world,
        a.backend,
        kwargs,
        timeout=a.timeout,
        dist_backend=a.dist_backend,
        report=False,
        device=a.device,
    )[0]
    print("\n".join(_serve_lines(res, a.json)))
    return 0


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


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    a = p.parse_args(argv)
    try:
        return _demo(a, p) if a.cmd == "demo" else _serve(a)
    except Exception as e:  # noqa: BLE001 - one line for a command-line user, all with --debug
        if a.debug:
            raise
        msg = _root_message(e) or f"{type(e).__name__}: {e}".splitlines()[0]
        print(f"cpbook: error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
