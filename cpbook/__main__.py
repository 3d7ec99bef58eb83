"""Command line: ``python -m cpbook demo NAME --world-size N [--backend inline|torchrun]``.

``python -m cpbook serve --model tiny-gqa --tp T --dcp D --pcp P [--json]`` serves generated
prompts with the chapter 9 engine on ``T·P`` ranks (inline, or ``--backend torchrun``, or
started by ``torchrun --nproc-per-node T·P -m cpbook serve ...``).  ``--device cuda:0`` puts
simulated ranks on one GPU; under torchrun each rank's device follows its dist backend.
``--model FOLDER`` serves a Hugging Face checkpoint (:func:`cpbook.engine.hf.from_pretrained`);
with the folder's ``tokenizer.json`` and the ``tokenizers`` extra, ``--prompt TEXT`` is
encoded and the output printed as text; ``--json`` request lines carry the prompt's token ids.
``--spec ngram|draft --num-spec-tokens K`` serves with speculative decoding (chapter 10;
``--draft-model`` an engine model name or folder) and adds the acceptance rate and the mean
tokens per decode step to the summary.

``python -m cpbook plan --model DeepSeek-V3 --gpu H200 --gpus 8 --context 1M --output 1K
--concurrency 16 [--ttft 10s] [--tpot 50ms] [--hf-config PATH] [--json]`` prints the
deployment planner's ``vllm serve`` line, its top layouts and why
(:func:`cpbook.planner.plan.plan`).

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
from cpbook.costmodel.specs import GB, GPUS, get_model
from cpbook.demos import DEMOS, describe, get_demo, parse_params
from cpbook.engine.engine import engine_config, model_config
from cpbook.engine.spec_decode import SpeculativeConfig, check_draft_vocab
from cpbook.planner.hf_config import model_from_hf_config
from cpbook.planner.plan import Plan, estimate_record, plan
from cpbook.planner.plan_advice import fmt_rate, fmt_s
from cpbook.planner.plan_space import OBJECTIVES
from cpbook.planner.search_space import ServingWorkload
from cpbook.planner.vllm_rules import PLAN_KV_DTYPES
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
    s.add_argument(
        "--model",
        default="tiny-gqa",
        help="tiny-gqa, tiny-mla, or a Hugging Face model folder (config.json + *.safetensors)",
    )
    s.add_argument(
        "--prompt",
        action="append",
        help="a text prompt (repeatable; needs the folder's tokenizer.json and `tokenizers`)",
    )
    s.add_argument(
        "--dtype",
        choices=["float32", "float64"],
        default=None,
        help="weights and activations (default: float64 tiny, float32 folder)",
    )
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
    s.add_argument(
        "--spec", default=None, help="speculative decoding method: ngram or draft (chapter 10)"
    )
    s.add_argument("--num-spec-tokens", type=int, default=3, help="num_speculative_tokens k")
    s.add_argument("--prompt-lookup-min", type=int, default=None, help="ngram: shortest n-gram")
    s.add_argument("--prompt-lookup-max", type=int, default=None, help="ngram: longest n-gram")
    s.add_argument(
        "--draft-model",
        default=None,
        help="draft: an engine model name or Hugging Face folder (default: the target's "
        "first layer)",
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
    _plan_parser(sub)
    return p


def _plan_parser(sub: argparse._SubParsersAction) -> None:
    q = sub.add_parser(
        "plan",
        help="the deployment planner: the best layout and its vllm serve flags",
        description="Search every layout vLLM v0.33 accepts for the model on at most --gpus "
        "GPUs, drop those that cannot hold --concurrency requests or miss a target, and rank "
        "the rest (cost-model estimates).",
    )
    q.add_argument("--model", help="a built-in model, or the served name with --hf-config")
    q.add_argument("--hf-config", metavar="PATH", help="a config.json (or its folder)")
    q.add_argument("--gpu", default="H200", help=f"one of {sorted(GPUS)}")
    q.add_argument("--gpus", type=int, default=8, help="GPUs available")
    q.add_argument("--context", default="128K", help="prompt tokens (1M = 2**20, 4K = 4096)")
    q.add_argument("--output", default="1K", help="output tokens per request")
    q.add_argument("--concurrency", type=int, default=1, help="requests in flight")
    q.add_argument("--ttft", help="time-to-first-token target (10s, 500ms)")
    q.add_argument("--tpot", help="time-per-output-token target (50ms)")
    q.add_argument("--objective", choices=OBJECTIVES, default="throughput")
    q.add_argument(
        "--kv-cache-dtype",
        action="append",
        choices=PLAN_KV_DTYPES,
        help="an allowed KV cache dtype (repeatable; default bf16)",
    )
    q.add_argument("--gpu-memory-utilization", type=float, default=None)
    q.add_argument("--top", type=int, default=8, help="rows of the table")
    q.add_argument("--json", action="store_true", help="JSON lines: layouts, then a summary")
    q.add_argument("--debug", action="store_true", help="show the full traceback on errors")


_SUFFIX = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3}


def parse_tokens(flag: str, text: str) -> int:
    """``"1M"`` → 1048576, ``"128K"`` → 131072, ``"4096"`` → 4096; ValueError otherwise."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?)\s*", text)
    tokens = float(m.group(1)) * _SUFFIX[m.group(2).lower()] if m else None
    if tokens is None or tokens != int(tokens):
        raise ValueError(f"[token-count] requires {flag} N[K|M] (whole tokens); got {text!r}")
    return int(tokens)


def parse_seconds(flag: str, text: str | None) -> float | None:
    """``"10s"`` → 10.0, ``"50ms"`` → 0.05, ``"2"`` → 2.0 (seconds); ValueError otherwise."""
    if text is None:
        return None
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)\s*(s|ms)?\s*", text)
    if not m:
        raise ValueError(f"[duration] requires {flag} N[s|ms]; got {text!r}")
    return float(m.group(1)) * (1e-3 if m.group(2) == "ms" else 1.0)


def _plan_model(a: argparse.Namespace):
    if a.hf_config:
        return model_from_hf_config(a.hf_config, name=a.model)
    if not a.model:
        raise ValueError("[plan-model] requires --model NAME or --hf-config PATH; got neither")
    return get_model(a.model)


def _plan_table(p: Plan, top: int) -> list[str]:
    w = p.workload
    lines = [
        "",
        f"{p.model.name} on up to {p.num_gpus} x {p.gpu.name}: {w.concurrency:,} "
        f"request{'s' if w.concurrency != 1 else ''} of "
        f"{w.prompt_tokens:,} + {w.output_tokens:,} tokens, objective {p.objective} "
        f"(modelled: cpbook.costmodel)",
        f"{'#':>3}  {'layout':24s} {'GPUs':>4} {'weights':>8} {'KV room':>8} {'holds':>6} "
        f"{'TTFT':>9} {'TPOT':>9} {'tok/s/GPU':>10}",
    ]
    for i, e in enumerate(p.ranked[:top], 1):
        lines.append(
            f"{i:>3}  {e.label:24s} {e.num_gpus:>4} {e.weight_bytes / GB:>5.1f} GB "
            f"{e.kv_budget_bytes / GB:>5.1f} GB {e.capacity:>6,} {fmt_s(e.ttft_s):>9} "
            f"{fmt_s(e.tpot_s):>9} {fmt_rate(e.tokens_per_s_per_gpu, 4):>10}"
        )
    return lines + ["", "Why:"] + [f"  - {r}" for r in p.reasons]


def _plan_summary(p: Plan) -> dict:
    w, best = p.workload, p.winner
    return {
        "name": "plan",
        "model": p.model.name,
        "gpu": p.gpu.name,
        "num_gpus": p.num_gpus,
        "prompt_tokens": w.prompt_tokens,
        "output_tokens": w.output_tokens,
        "concurrency": w.concurrency,
        "ttft_target_s": w.ttft_target_s,
        "tpot_target_s": w.tpot_target_s,
        "objective": p.objective,
        "winner": best.label if best else None,
        "command": p.command() if best else None,
        "serving": len(p.ranked),
        "dropped": len(p.dropped),
        "rejected": p.rejected,
        "frontier_ttft": [e.label for e in p.frontier_ttft],
        "frontier_tpot": [e.label for e in p.frontier_tpot],
        "reasons": list(p.reasons),
        "would_fit": list(p.would_fit.lines) if p.would_fit else None,
    }


def _plan(a: argparse.Namespace) -> int:
    model = _plan_model(a)
    memory = {}
    if a.gpu_memory_utilization is not None:
        memory["gpu_memory_utilization"] = a.gpu_memory_utilization
    w = ServingWorkload(
        parse_tokens("--context", a.context),
        parse_tokens("--output", a.output),
        a.concurrency,
        parse_seconds("--ttft", a.ttft),
        parse_seconds("--tpot", a.tpot),
        tuple(dict.fromkeys(a.kv_cache_dtype or ["bf16"])),
        **memory,
    )
    p = plan(model, a.gpu, a.gpus, w, objective=a.objective)
    if a.json:
        for i, e in enumerate(p.ranked, 1):
            print(json.dumps(estimate_record(e, i)))
        for e in p.dropped:
            print(json.dumps(estimate_record(e)))
        print(json.dumps(_plan_summary(p)))
    if p.winner is None:
        f = p.would_fit
        raise ValueError(
            f"[{f.rule}] requires a deployment that serves the workload; got none. "
            + " ".join(f.lines)
        )
    if not a.json:
        print("\n".join([p.command()] + _plan_table(p, a.top)))
    return 0


def _tokenizer(model: str):
    """The folder's ``tokenizer.json`` through the optional ``tokenizers`` package, or None."""
    path = os.path.join(model, "tokenizer.json")
    if not os.path.isfile(path):
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None
    return Tokenizer.from_file(path)


def _serve_lines(res: dict, as_json: bool, tok=None) -> list[str]:
    """Rank 0's result as JSON lines (one per request with its prompt's token ids, then the
    summary) or a short table; with a tokenizer also the decoded text."""
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
    if res.get("spec"):
        summary["acceptance_rate"] = round(res["spec"]["acceptance_rate"], 4)
        summary["mean_accepted_tokens"] = round(res["spec"]["mean_accepted_tokens"], 4)
    if as_json:
        lines = [
            json.dumps(
                {
                    "name": "request",
                    "id": i,
                    "prompt_len": len(p),
                    "prompt": p,
                    "tokens": t,
                    **({"text": tok.decode(t)} if tok else {}),
                    **({"error": e} if e else {}),
                }
            )
            for i, (p, t, e) in enumerate(zip(res["prompts"], res["tokens"], res["errors"]))
        ]
        return lines + [json.dumps(summary)]
    lines = [f"{res['model']}  tp={res['tp']} dcp={res['dcp']} pcp={res['pcp']}"]
    for i, (p, t, e) in enumerate(zip(res["prompts"], res["tokens"], res["errors"])):
        shown = e or (repr(tok.decode(t)) if tok and t else t)
        lines.append(f"  request {i}: prompt {len(p):3d} tokens -> {shown}")
    lines.append(
        f"  {res['steps']} steps, {summary['tokens_per_s']} tokens/s, prefix hits "
        f"{res['prefix_hit_tokens']} tokens, {res['preemptions']} preemptions"
        + (
            f", acceptance {summary['acceptance_rate']:.2f}, "
            f"{summary['mean_accepted_tokens']:.2f} tokens per decode step"
            if "acceptance_rate" in summary
            else ""
        )
    )
    return lines


def _spec_config(a: argparse.Namespace) -> dict | None:
    """``--spec ...`` as a ``speculative_config`` dict, validated (and the draft's vocabulary
    checked against the target's) before any process starts."""
    if a.spec is None:
        return None
    spec = dict(
        method=a.spec,
        num_speculative_tokens=a.num_spec_tokens,
        prompt_lookup_min=a.prompt_lookup_min,
        prompt_lookup_max=a.prompt_lookup_max,
        model=a.draft_model,
    )
    SpeculativeConfig(**spec)
    if a.spec == "draft" and a.draft_model:
        check_draft_vocab(model_config(a.draft_model).vocab_size, model_config(a.model).vocab_size)
    return spec


def _serve(a: argparse.Namespace) -> int:

    engine_config(a.model, a.tp, a.dcp, a.pcp)  # a bad grid fails here, before any process
    spec = _spec_config(a)
    folder = os.path.isdir(a.model)
    tok = _tokenizer(a.model) if folder else None
    prompts = None
    if a.prompt:
        if tok is None:
            raise ValueError(
                "[serve-prompt-text] requires --model FOLDER with tokenizer.json and the "
                f"`tokenizers` package installed; got --model {a.model!r}"
            )
        prompts = [tok.encode(t).ids for t in a.prompt]
    kwargs = dict(
        model=a.model,
        parallel_config=dict(
            tensor_parallel_size=a.tp,
            decode_context_parallel_size=a.dcp,
            prefill_context_parallel_size=a.pcp,
            dcp_comm_backend=a.dcp_comm_backend,
        ),
        cache_config=dict(num_gpu_blocks=a.num_kv_blocks),
        speculative_config=spec,
        runner_config=dict(
            dtype=a.dtype or ("float32" if folder else "float64"), seed=a.seed, strategy=a.strategy
        ),
        workload=dict(num_requests=a.requests, max_new_tokens=a.max_new_tokens, prompts=prompts),
    )
    world = a.tp * a.pcp
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # we are a torchrun worker
        check_grid_world(world, int(os.environ["WORLD_SIZE"]))
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        ctx = worker_context(a.dist_backend or pick_backend(world, local), a.timeout)
        res = serve_timing(ctx, **kwargs)
        if ctx.rank == 0:
            print("\n".join(_serve_lines(res, a.json, tok)))
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
    print("\n".join(_serve_lines(res, a.json, tok)))
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
        return {"demo": lambda: _demo(a, p), "serve": lambda: _serve(a), "plan": lambda: _plan(a)}[
            a.cmd
        ]()
    except BrokenPipeError:  # the reader closed our stdout (``| head``): stop quietly, exit 0
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as e:  # noqa: BLE001 - one line for a command-line user, all with --debug
        if a.debug:
            raise
        msg = _root_message(e) or f"{type(e).__name__}: {e}".splitlines()[0]
        print(f"cpbook: error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
