"""Speculative decoding under DCP: time per output token without CP, with DCP, with DCP + spec.

    python bench/spec_decode.py --json     # gloo, 2 ranks, 1 thread each, float32

1. **Acceptance** (no clock): the mini engine serves a repetitive workload (4 prompts, each a
   random motif of 6-9 tokens repeated 4 times, 96 new tokens, ``tiny-mla``) with n-gram
   drafting (``prompt_lookup_min`` 1, ``prompt_lookup_max`` 8) at ``k`` = 1 and 3, on 2 inline
   ranks with DCP 2, and checks the tokens equal the non-speculative engine's.  ``m``, the mean
   tokens per decode step (bonus included), comes from there.
2. **Time** (one torchrun launch, 2 gloo ranks): per context 1K → 256K, one request's decode
   attention step (16 query heads, one KV head, head_dim 128), every method interleaved run
   after run from a common barrier (:func:`cpbook.timing.spec_decode_timing`): ``no_cp`` (one
   row over the whole KV), ``dcp`` (one row over half of it, query all-gather and combine),
   ``dcp_spec{k}`` (``k + 1`` rows, :func:`cpbook.dcp.verify.dcp_verify_attention`) and
   ``no_cp_spec{k}``.  The slowest rank's median; a speculative step's time per output token is
   its step time divided by ``m``.

Rows, after a ``{"name": "spec_decode_run", ...}`` line (when and where) and one
``{"name": "spec_acceptance", "k": k, ...}`` per ``k``::

    {"name": "spec_decode", "ranks": 2, "context": C, "k": k, "no_cp_ms_per_token": ...,
     "dcp_ms_per_token": ..., "dcp_spec_ms_per_token": ..., "no_cp_spec_ms_per_token": ...,
     "mean_accepted": m}
    {"name": "spec_break_even", "ranks": 2, "k": k, "mean_accepted": m, "dcp_tokens": ...,
     "dcp_spec_tokens": ..., "dcp_spec_vs_spec_tokens": ...}

``dcp_tokens``: where DCP starts to beat no CP; ``dcp_spec_tokens``: where DCP + spec beats a
non-speculative no-CP decode; ``dcp_spec_vs_spec_tokens``: where it beats no CP speculating
with the same drafts (log-linear interpolation; the first context if it wins everywhere,
``null`` if never).  Target (issue 21): at ``k`` = 3 with ``m >= 2``, ``dcp_spec_tokens <= 0.6
× dcp_tokens``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_step import break_even  # noqa: E402  (the same interpolation as chapter 6's bench)

from cpbook.core.launch import run  # noqa: E402
from cpbook.engine.engine import serve_rank  # noqa: E402
from cpbook.timing import machine_record, spec_decode_timing  # noqa: E402

CONTEXTS = (1024, 4096, 16384, 65536, 262144)
KS = (1, 3)


def repetitive_prompts(seed: int = 3) -> list[list[int]]:
    """4 prompts, each a random motif of 6 + i tokens repeated 4 times."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(96, (6 + i,), generator=gen).tolist() * 4 for i in range(4)]


def acceptance(k: int, max_new_tokens: int = 96) -> dict:
    """The engine's n-gram acceptance at ``k`` on 2 inline ranks (DCP 2), and whether its
    tokens equal the non-speculative engine's."""
    kw = dict(
        model="tiny-mla",
        parallel_config=dict(tensor_parallel_size=2, decode_context_parallel_size=2),
        cache_config=dict(num_gpu_blocks=200),
        workload=dict(prompts=repetitive_prompts(), max_new_tokens=max_new_tokens),
    )
    spec = dict(method="ngram", num_speculative_tokens=k, prompt_lookup_min=1, prompt_lookup_max=8)
    plain = run(serve_rank, 2, "inline", kw, report=False)[0]
    fast = run(serve_rank, 2, "inline", {**kw, "speculative_config": spec}, report=False)[0]
    return {
        "name": "spec_acceptance",
        "k": k,
        "model": "tiny-mla",
        "acceptance_rate": round(fast["spec"]["acceptance_rate"], 4),
        "mean_accepted": round(fast["spec"]["mean_accepted_tokens"], 4),
        "steps": fast["steps"],
        "steps_without_spec": plain["steps"],
        "token_exact": fast["tokens"] == plain["tokens"],
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print JSON lines (the default output)")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--contexts", type=int, nargs="+", default=list(CONTEXTS))
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    print(json.dumps({"name": "spec_decode_run", **machine_record("cpu", "gloo")}), flush=True)
    m = {}
    for k in KS:
        row = acceptance(k)
        m[k] = row["mean_accepted"]
        print(json.dumps(row), flush=True)
    res = run(
        spec_decode_timing,
        2,
        "torchrun",
        dict(contexts=tuple(a.contexts), num_speculative_tokens=KS, repeats=a.repeats),
        dist_backend="gloo",
        report=False,
    )

    def ms(c: int, method: str) -> float:
        return 1e3 * max(r[c][method] for r in res)

    for k in KS:
        col: dict[str, list[float]] = {"no_cp": [], "dcp": [], "dcp_spec": [], "no_cp_spec": []}
        for c in a.contexts:
            row = {
                "no_cp_ms_per_token": ms(c, "no_cp"),
                "dcp_ms_per_token": ms(c, "dcp"),
                "dcp_spec_ms_per_token": ms(c, f"dcp_spec{k}") / m[k],
                "no_cp_spec_ms_per_token": ms(c, f"no_cp_spec{k}") / m[k],
            }
            for key, v in row.items():
                col[key.removesuffix("_ms_per_token")].append(v)
            print(
                json.dumps(
                    {
                        "name": "spec_decode",
                        "ranks": 2,
                        "context": c,
                        "k": k,
                        **{key: round(v, 4) for key, v in row.items()},
                        "mean_accepted": m[k],
                    }
                ),
                flush=True,
            )
        print(
            json.dumps(
                {
                    "name": "spec_break_even",
                    "ranks": 2,
                    "k": k,
                    "mean_accepted": m[k],
                    "dcp_tokens": break_even(a.contexts, col["no_cp"], col["dcp"]),
                    "dcp_spec_tokens": break_even(a.contexts, col["no_cp"], col["dcp_spec"]),
                    "dcp_spec_vs_spec_tokens": break_even(
                        a.contexts, col["no_cp_spec"], col["dcp_spec"]
                    ),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
