"""Every ``vllm serve`` line the planner can print, run through vLLM's own config classes.

    python -m venv .vllmenv                        # from the book's venv interpreter
    echo "$PWD/.venv/lib/python3.11/site-packages" > .vllmenv/lib/python3.11/site-packages/zz.pth
    .vllmenv/bin/pip install aiohttp pybase64 cachetools cbor2 msgspec cloudpickle uvloop \\
        py-cpuinfo llguidance xgrammar einops compressed-tensors==0.17.0 loguru fastapi \\
        openai openai-harmony partial-json-parser && .vllmenv/bin/pip uninstall -y triton
    PYTHONPATH=$PWD .vllmenv/bin/python bench/vllm_accepts.py --json \\
        [--store bench/results/vllm_accepts.jsonl] [--lines FILE]

The ``.pth`` line lets the bench's environment fall back on the book's (torch, transformers,
pydantic); the packages installed on top are the light ones vLLM's config modules and its
``vllm serve`` argument parser import
(``triton``, pulled in by ``xgrammar``, is not needed).  vLLM itself is never installed:
:mod:`vllm_wheel` downloads the v0.34.0 wheel and :mod:`vllm_config_check` imports its Python
sources (see there for what stands in for a GPU and what is restated).

Candidates, for the built-in models and DeepSeek-V3.2 (a model of :data:`CONFIGS`) on at most
:data:`NUM_GPUS` GPUs in nodes of :data:`GPUS_PER_NODE`:

* ``printed``: every ``(deployment, kv_dtype)`` :func:`~cpbook.planner.search_space.deployments`
  yields, for prompts of :data:`PROMPTS` tokens and 1K output tokens (both KV dtypes allowed),
  as :func:`~cpbook.planner.serve_flags.serve_command` prints it at concurrency 1 (the
  ``--max-num-seqs`` and memory settings are read by no rule): vLLM must accept each;
* ``rejected``: what cpbook's own rules reject and vLLM must reject too: every replica shape a
  sparse-MLA rule of :mod:`cpbook.planner.vllm_rules` rejects (its line built without the
  check), and each printed 1M-token DP-1 line that carries ``VLLM_ALLOW_LONG_MAX_MODEL_LEN=1``,
  without it.

A *failure* is a candidate where the two disagree.  Prints one JSON line per failure
``{"name": "vllm_accepts_failure", "kind", "model", "line", "cpbook_rule", "vllm"}`` and one
summary ``{"name": "vllm_accepts", "vllm", "candidates", "printed", "rejected", "failures",
"rejected_by_rule", ...}``; ``--store`` writes the same lines (summary first).
``tests/test_vllm_rules.py`` rebuilds the candidates without vLLM and checks that cpbook's
rules reject exactly the stored ``rejected_by_rule``.  ``--lines FILE`` checks other lines
instead (JSON lines ``{"model", "line"}``; e.g. an older planner's), all expected accepted.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from cpbook import costmodel as cm  # noqa: E402
from cpbook.core.config import ConfigError  # noqa: E402
from cpbook.data import hf_config_json  # noqa: E402
from cpbook.planner.hf_config import model_from_hf_config  # noqa: E402
from cpbook.planner.search_space import ServingWorkload, deployments  # noqa: E402
from cpbook.planner.serve_flags import Launch, serve_command  # noqa: E402
from cpbook.planner.vllm_rules import PLAN_KV_DTYPES, check_deployment  # noqa: E402

K = 1024
NUM_GPUS, GPUS_PER_NODE = 16, 8
PROMPTS = (32 * K, 128 * K, 1024 * K)
OUTPUT = 1 * K
#: the models checked; their ``config.json`` ships as package data (``cpbook/data/hf_configs/``,
#: the shape, positions, RoPE scaling and quantisation fields vLLM's config classes read)
MODELS = (
    "Llama-3.1-8B",
    "Llama-3.1-70B",
    "Llama-3.1-405B",
    "Qwen2.5-7B-1M",
    "Qwen3-235B-A22B",
    "DeepSeek-V3",
    "Kimi-K2",
    "DeepSeek-V3.2",
)
CONFIGS: dict[str, dict] = {name: hf_config_json(name) for name in MODELS}


def models() -> dict[str, cm.ModelSpec]:
    """cpbook's spec of every model of :data:`CONFIGS` (DeepSeek-V3.2 from its config)."""
    out = {k: cm.MODELS[k] for k in CONFIGS if k in cm.MODELS}
    out["DeepSeek-V3.2"] = model_from_hf_config(CONFIGS["DeepSeek-V3.2"], name="DeepSeek-V3.2")
    return out


@dataclass(frozen=True)
class Candidate:
    """One line to check: ``kind`` ``printed`` (cpbook prints it: vLLM must accept) or
    ``rejected`` (``cpbook_rule`` rejects it: vLLM must reject)."""

    kind: str
    model: str
    line: str
    cpbook_rule: str | None


def _line(model: cm.ModelSpec, d: cm.Deployment, kv: str, max_model_len: int) -> str:
    return serve_command(
        model,
        d,
        kv,
        max_model_len=max_model_len,
        max_num_seqs=1,
        gpu_memory_utilization=0.9,
        launch=Launch(GPUS_PER_NODE),
    )


def candidates() -> Iterator[Candidate]:
    """Every candidate line, deterministic order, each once (no vLLM needed)."""
    seen: set[str] = set()
    for name, model in models().items():
        for prompt in PROMPTS:
            w = ServingWorkload(prompt, OUTPUT, 1, kv_dtypes=PLAN_KV_DTYPES)
            for d, kv in deployments(model, NUM_GPUS, w, gpus_per_node=GPUS_PER_NODE):
                line = _line(model, d, kv, w.request_tokens)
                if line not in seen:
                    seen.add(line)
                    yield Candidate("printed", name, line, None)
                env = "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 "
                if prompt == PROMPTS[-1] and d.dp == 1 and line.startswith(env):
                    bare = line[len(env) :]
                    if bare not in seen:
                        seen.add(bare)
                        yield Candidate("rejected", name, bare, "max-model-len-within-positions")
        if not model.sparse_mla:
            continue
        sizes = range(1, NUM_GPUS + 1)
        for tp, pcp, dcp, kv in itertools.product(sizes, sizes, sizes, PLAN_KV_DTYPES):
            d = cm.Deployment(tp=tp, pcp=pcp, dcp=dcp)
            if tp * pcp > NUM_GPUS:
                continue
            try:
                check_deployment(model, d, kv)
                continue
            except ConfigError as e:
                if not e.rule.startswith("sparse-mla-"):
                    continue
                rule = e.rule
            line = _line(model, d, kv, 4 * K)
            if line not in seen:
                seen.add(line)
                yield Candidate("rejected", name, line, rule)


def run(cands: list[Candidate]) -> tuple[list[dict], dict]:
    """vLLM's verdict on each candidate: the failures (JSON-ready) and the summary."""
    from vllm_config_check import check_line, vllm_version

    failures, by_rule, printed_ok = [], Counter(), 0
    kinds = Counter(c.kind for c in cands)
    for c in cands:
        ok, message = check_line(c.line, CONFIGS[c.model])
        if c.kind == "printed" and ok:
            printed_ok += 1
        elif c.kind == "rejected" and not ok:
            by_rule[c.cpbook_rule] += 1
        else:
            failures.append(
                {
                    "name": "vllm_accepts_failure",
                    "kind": c.kind,
                    "model": c.model,
                    "line": c.line,
                    "cpbook_rule": c.cpbook_rule,
                    "vllm": message[:400],
                }
            )
    summary = {
        "name": "vllm_accepts",
        "vllm": vllm_version(),
        "models": sorted({c.model for c in cands}),
        "num_gpus": NUM_GPUS,
        "gpus_per_node": GPUS_PER_NODE,
        "prompts": list(PROMPTS),
        "candidates": len(cands),
        "printed": kinds["printed"],
        "printed_accepted": printed_ok,
        "rejected": kinds["rejected"],
        "rejected_by_rule": dict(sorted(by_rule.items())),
        "failures": len(failures),
    }
    return failures, summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="JSON lines (the only output)")
    ap.add_argument("--store", type=Path, help="also write the summary and failures here")
    ap.add_argument("--lines", type=Path, help="check these lines instead (JSON lines)")
    a = ap.parse_args()
    if a.lines:
        rows = [json.loads(s) for s in a.lines.read_text().splitlines() if s.strip()]
        cands = [Candidate("printed", r["model"], r["line"], None) for r in rows]
    else:
        cands = list(candidates())
    failures, summary = run(cands)
    out = [summary, *failures]
    for row in failures + [summary]:
        print(json.dumps(row))
    if a.store:
        a.store.write_text("".join(json.dumps(r) + "\n" for r in out))


if __name__ == "__main__":
    main()
