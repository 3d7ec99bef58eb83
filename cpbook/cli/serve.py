"""``python -m cpbook serve``: greedy generation with the chapter 9 engine on ``tp·pcp`` ranks
(inline, ``--backend torchrun``, or as torchrun's worker), rank 0's result printed as a table
or JSON lines, one per request.

What it serves: ``--requests N`` generated prompts (the default), ``--prompt TEXT`` or
``--input FILE|-`` JSON lines (:mod:`cpbook.cli.requests`).  Everything is checked before any
process starts: the grid, a model folder's checkpoint against its ``config.json``
(:func:`cpbook.engine.hf.check_folder`) and each input line (a bad one is reported with its
line number and skipped, or stops the run with ``--strict``).  A request the model's positions
or the KV cache cannot hold is refused alone, with its rule, before any step; when every
request is refused the command says how many and exits 2."""

from __future__ import annotations

import argparse
import json
import os
import sys

from cpbook.cli.options import (
    add_debug,
    add_placement,
    add_timeout,
    end_worker,
    start_worker,
    under_torchrun,
)
from cpbook.cli.requests import InputRequest, load_tokenizer, read_requests
from cpbook.core.errors import RuleError
from cpbook.core.groups import check_grid_world
from cpbook.core.launch import run
from cpbook.engine.engine import engine_config, model_config
from cpbook.engine.hf import check_folder
from cpbook.engine.models import ENGINE_MODELS
from cpbook.engine.spec_decode import SpeculativeConfig, check_draft_vocab
from cpbook.timing import serve_timing

__all__ = ["add_parser", "command"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The ``serve`` sub-command's options."""
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
        help="a text prompt (repeatable; needs the model folder's tokenizer)",
    )
    s.add_argument(
        "--input",
        metavar="FILE|-",
        default=None,
        help='requests as JSON lines, {"prompt": TEXT or [ids], "max_new_tokens": N, "id": '
        "ID} (max_new_tokens and id optional); - reads stdin",
    )
    s.add_argument(
        "--strict", action="store_true", help="--input: a bad line stops the run (default: skip)"
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
    s.add_argument(
        "--requests", type=int, default=6, help="number of generated prompts (without --input)"
    )
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
    add_placement(s, "torchrun's dist backend (default: NCCL when every rank has a GPU)")
    s.add_argument("--json", action="store_true", help="JSON lines: requests, then a summary")
    add_timeout(s)
    add_debug(s)


def _summary(res: dict) -> dict:
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
        "requests": len(res["errors"]),
        "refused": sum(e is not None for e in res["errors"]),
    }
    if res.get("spec"):
        summary["acceptance_rate"] = round(res["spec"]["acceptance_rate"], 4)
        summary["mean_accepted_tokens"] = round(res["spec"]["mean_accepted_tokens"], 4)
    return summary


def _json_lines(res: dict, summary: dict, ids: list, tok=None) -> list[str]:
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
        for i, p, t, e in zip(ids, res["prompts"], res["tokens"], res["errors"])
    ]
    return lines + [json.dumps(summary)]


def _serve_lines(res: dict, as_json: bool, ids: list, tok=None) -> list[str]:
    """Rank 0's result as JSON lines (one per request with its id and prompt's token ids, then
    the summary) or a short table; with a tokenizer also the decoded text; a refused request
    shows its rule instead of tokens."""
    summary = _summary(res)
    if as_json:
        return _json_lines(res, summary, ids, tok)
    lines = [f"{res['model']}  tp={res['tp']} dcp={res['dcp']} pcp={res['pcp']}"]
    for i, p, t, e in zip(ids, res["prompts"], res["tokens"], res["errors"]):
        shown = e or (repr(tok.decode(t)) if tok and t else t)
        lines.append(f"  request {i}: prompt {len(p):3d} tokens -> {shown}")
    refused = f", {summary['refused']} of {summary['requests']} requests refused"
    lines.append(
        f"  {res['steps']} steps, {summary['tokens_per_s']} tokens/s, prefix hits "
        f"{res['prefix_hit_tokens']} tokens, {res['preemptions']} preemptions"
        + (refused if summary["refused"] else "")
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


def _serve_kwargs(
    a: argparse.Namespace, requests: list[InputRequest] | None, spec: dict | None
) -> dict:
    """:func:`cpbook.timing.serve_timing`'s keyword arguments from the options (``requests``:
    the given prompts with their token budgets; None: ``--requests`` generated prompts)."""
    work: dict = dict(num_requests=a.requests, max_new_tokens=a.max_new_tokens)
    if requests is not None:
        work = dict(
            num_requests=len(requests),
            max_new_tokens=[r.max_new_tokens for r in requests],
            prompts=[r.prompt for r in requests],
            request_ids=[r.request_id for r in requests],
        )
    return dict(
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
            dtype=a.dtype or ("float32" if os.path.isdir(a.model) else "float64"),
            seed=a.seed,
            strategy=a.strategy,
        ),
        workload=work,
    )


def _requests(a: argparse.Namespace, tok) -> list[InputRequest] | None:
    """The ``--prompt`` or ``--input`` requests (None: generated prompts).  Bad input lines are
    printed to stderr and skipped (``--strict``: the first one raises); no valid line at all
    raises ``serve-input-empty``."""
    if a.prompt and a.input:
        raise RuleError("serve-input-one", "--prompt or --input, not both", input=a.input)
    if a.prompt:
        lines = [json.dumps({"prompt": t}) for t in a.prompt]
        source = "--prompt"
    elif a.input:
        if a.input == "-":
            if under_torchrun():
                raise RuleError("serve-input-stdin", "--input FILE under torchrun's workers")
            lines, source = sys.stdin.read().splitlines(), "<stdin>"
        else:
            try:
                with open(a.input, encoding="utf-8") as f:
                    lines, source = f.read().splitlines(), a.input
            except (OSError, UnicodeDecodeError) as e:
                raise RuleError(
                    "serve-input-file", "a readable UTF-8 --input file", input=a.input, error=str(e)
                ) from None
    else:
        return None
    vocab = model_config(a.model).vocab_size
    good, bad = read_requests(lines, source, vocab, a.max_new_tokens, tok)
    if bad and (a.strict or a.prompt):
        raise bad[0]
    for e in bad:
        print(f"cpbook: skipped: {e}", file=sys.stderr)
    if not good:
        raise RuleError(
            "serve-input-empty", "at least one valid request line", input=source, bad=len(bad)
        )
    if a.prompt:
        good = [InputRequest(str(i), r.prompt, r.max_new_tokens) for i, r in enumerate(good)]
    return good


def _all_refused(res: dict) -> RuleError | None:
    """The error when no request was served (each was refused with its own rule)."""
    errors = res["errors"]
    if errors and all(e is not None for e in errors):
        return RuleError(
            "serve-some-request",
            "at least one request the model and the KV cache can hold (each refusal above)",
            refused=len(errors),
            requests=len(errors),
        )
    return None


def command(a: argparse.Namespace, p: argparse.ArgumentParser | None = None) -> int:
    """Serve on ``tp·pcp`` ranks and print rank 0's result; 0 when at least one request was
    served (errors raise, and so does a run whose every request was refused)."""
    engine_config(a.model, a.tp, a.dcp, a.pcp)  # a bad grid fails here, before any process
    folder = a.model not in ENGINE_MODELS and os.path.isdir(a.model)
    if folder:
        check_folder(a.model)  # the checkpoint against config.json, before any process
    spec = _spec_config(a)
    tok = load_tokenizer(a.model) if folder else None
    requests = _requests(a, tok)
    ids = [r.request_id for r in requests] if requests else list(range(a.requests))
    kwargs = _serve_kwargs(a, requests, spec)
    world = a.tp * a.pcp
    if under_torchrun():  # we are a torchrun worker; rank 0 prints
        check_grid_world(world, int(os.environ["WORLD_SIZE"]))
        ctx = start_worker(a, world)
        res = serve_timing(ctx, **kwargs)
        end_worker()
        if ctx.rank != 0:
            return 0 if _all_refused(res) is None else 2
    else:
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
    print("\n".join(_serve_lines(res, a.json, ids, tok)))
    refused = _all_refused(res)
    if refused is not None:
        raise refused
    return 0
