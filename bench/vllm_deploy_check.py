"""Chapter 11's ``vllm serve`` lines run through vLLM v0.34.0's own code, on a CPU.

    .vllmenv/bin/python bench/vllm_deploy_check.py --json [--store]

The environment (``.vllmenv``, gitignored), from the book's venv interpreter::

    python -m venv .vllmenv
    echo "$PWD/.venv/lib/python3.11/site-packages" > .vllmenv/lib/python3.11/site-packages/zz.pth
    .vllmenv/bin/pip install aiohttp pybase64 cachetools cbor2 msgspec cloudpickle uvloop \\
        py-cpuinfo llguidance xgrammar einops compressed-tensors==0.17.0 loguru fastapi \\
        openai openai-harmony partial-json-parser && .vllmenv/bin/pip uninstall -y triton
    PYTHONPATH=$PWD .vllmenv/bin/python bench/vllm_deploy_check.py --json --store

For every line of :data:`~cpbook.planner.deploy_examples.QUESTIONS` (each node's line of a
multi-node deployment) and of :data:`~cpbook.planner.deploy_examples.VIOLATIONS` (each broken
line and its fix),
:func:`vllm_config_check.run_line` (the one place that imports vLLM; see there for what stands
in for a GPU) gives vLLM's verdict: ``accepted``, the stage that raised, the exception's type,
its message's first line (vLLM's words, from its own code) and ``raised_at``, the
``vllm/...py:LINE`` of the innermost vLLM frame of its traceback (for pydantic's
``ValidationError``, of the validator's own exception).

For each question it then computes the **KV-cache capacity** of one GPU's line with and
without DCP the way vLLM's engine core does (``vllm/v1/engine/core.py``,
``_initialize_kv_caches``): one ``KVCacheSpec`` per attention layer as the model's layer
builds it (``FullAttentionSpec`` for GQA with the rank's KV heads, ``MLAAttentionSpec`` of the
576-wide latent for MLA, the config.s block size), ``get_global_kv_cache_groups``,
``get_kv_cache_configs`` with :data:`~cpbook.planner.deploy_examples.FREE_KV_BYTES_PER_GPU`
free on each GPU (what vLLM would measure after loading the weights; assumed), and
``get_kv_cache_capacity`` (``vllm/v1/core/kv_cache_utils.py``), the number behind the start-up
log line "GPU KV cache size: N tokens", and that line itself, as ``update_kv_cache_capacity``
logs it (captured from its logger); next to it the book's prediction for the same line
(:func:`~cpbook.planner.deploy_examples.book_kv_capacity_tokens`).

``--store`` writes ``cpbook/data/vllm_deploy_check.json``, read by
:func:`cpbook.planner.deploy_examples.vllm_verdicts` and checked without vLLM by
``tests/test_vllm_deploy_check.py``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from cpbook.data import hf_config_json, stored_path  # noqa: E402
from cpbook.planner import deploy_examples as de  # noqa: E402
from cpbook.planner.serve_flags import Launch, serve_command  # noqa: E402

#: the KV cache layout the workers report (``get_supported_kv_cache_layouts``): vLLM's default
#: token-major one, ``NHD``
KV_CACHE_LAYOUT = "LBNHC"


def raised_at(e: BaseException, root: str) -> str | None:
    """``vllm/...py:LINE`` of the innermost frame under ``root`` (vLLM's source folder) that
    raised ``e`` (for pydantic's ``ValidationError``, the validator's exception)."""
    for detail in getattr(e, "errors", lambda: [])():
        inner = detail.get("ctx", {}).get("error")
        if isinstance(inner, BaseException) and inner.__traceback__ is not None:
            e = inner
            break
    frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename.startswith(root)]
    if not frames:
        return None
    f = frames[-1]
    return f"{Path(f.filename).relative_to(root).as_posix()}:{f.lineno}"


def verdict(line: str, config_json: dict) -> dict:
    """vLLM's verdict on one line, JSON-ready."""
    from vllm_config_check import first_line, load, run_line

    load()
    root = str(Path(sys.modules["vllm"].__file__).parent.parent) + "/"
    _, stage, e = run_line(line, config_json)
    if e is None:
        return {"line": line, "accepted": True}
    message = str(e) if stage == "parse" else first_line(e)
    inner = [d.get("ctx", {}).get("error") for d in getattr(e, "errors", lambda: [])()]
    if inner and isinstance(inner[0], BaseException):
        message = first_line(inner[0])
    return {
        "line": line,
        "accepted": False,
        "stage": stage,
        "error": type(inner[0] if inner and inner[0] else e).__name__,
        "message": message,
        "raised_at": raised_at(e, root) if stage != "parse" else None,
    }


def kv_capacity_tokens(line: str, config_json: dict) -> tuple[int, int, tuple[str, str]]:
    """vLLM's "GPU KV cache size" in tokens for ``line`` with
    :data:`~cpbook.planner.deploy_examples.FREE_KV_BYTES_PER_GPU` free on each GPU, the
    block size (tokens per block on one GPU) and vLLM's start-up log line that reports it
    (:func:`_capacity_log_line`)."""
    import torch
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
    from vllm.v1.core.kv_cache_utils import (
        generate_scheduler_kv_cache_config,
        get_kv_cache_capacity,
    )
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec
    from vllm_config_check import run_line

    vllm_config, stage, e = run_line(line, config_json)
    if e is not None:
        raise RuntimeError(f"vLLM rejects {line}: {e}")
    model, par = vllm_config.model_config, vllm_config.parallel_config
    block = vllm_config.cache_config.block_size
    if model.use_mla:
        hf = model.hf_text_config
        spec = MLAAttentionSpec(
            block_size=block,
            num_kv_heads=1,
            head_size=hf.kv_lora_rank + hf.qk_rope_head_dim,
            dtype=torch.bfloat16,
            cache_dtype_str="auto",
        )
    else:
        spec = FullAttentionSpec(
            block_size=block,
            num_kv_heads=model.get_num_kv_heads(par),
            head_size=model.get_head_size(),
            dtype=torch.bfloat16,
        )
    specs = [{f"model.layers.{i}.self_attn.attn": spec for i in range(model.get_num_layers(par))}]
    resolve_kv_cache_layout(vllm_config, [[KV_CACHE_LAYOUT]], [spec])
    groups = get_global_kv_cache_groups(vllm_config, specs)
    configs = get_kv_cache_configs(vllm_config, specs, [de.FREE_KV_BYTES_PER_GPU], groups)
    scheduler_config = generate_scheduler_kv_cache_config(configs)
    tokens, _ = get_kv_cache_capacity(vllm_config, scheduler_config)
    return tokens, block, _capacity_log_line(vllm_config, scheduler_config)


class _Records(logging.Handler):
    """Each record's message and ``vllm/...py:LINE`` (relative to ``root``)."""

    def __init__(self, root: Path) -> None:
        super().__init__(logging.INFO)
        self.root, self.lines = root, []

    def emit(self, record: logging.LogRecord) -> None:
        at = f"{Path(record.pathname).relative_to(self.root).as_posix()}:{record.lineno}"
        self.lines.append((record.getMessage(), at))


def _capacity_log_line(vllm_config: object, kv_cache_config: object) -> tuple[str, str]:
    """The start-up log line vLLM's ``update_kv_cache_capacity`` writes for this config
    ("GPU KV cache size: N tokens, Maximum concurrency ..."), captured from its logger, and
    the ``vllm/...py:LINE`` that logs it."""
    from vllm.v1.core import kv_cache_utils

    log, records = kv_cache_utils.logger, _Records(Path(kv_cache_utils.__file__).parents[3])
    level = log.level
    log.setLevel(logging.INFO)
    log.addHandler(records)
    try:
        kv_cache_utils.update_kv_cache_capacity(vllm_config, kv_cache_config)
    finally:
        log.removeHandler(records)
        log.setLevel(level)
    (line,) = records.lines
    return line


def capacities(key: str) -> dict:
    """vLLM's and the book's KV-cache capacity of question ``key``'s winner, with and without
    DCP (one node's line; the capacity is per replica)."""
    q, p = de.QUESTIONS[key], de.answer(key)
    e, w = p.winner, p.workload
    out = {"kv_dtype": e.kv_dtype, "free_kv_bytes_per_gpu": de.FREE_KV_BYTES_PER_GPU}
    for name, d in (("dcp", e.deployment), ("no_dcp", de.without_dcp(e.deployment))):
        line = serve_command(
            p.model,
            d,
            e.kv_dtype,
            max_model_len=w.request_tokens,
            max_num_seqs=1,
            launch=Launch(q.gpus_per_node),
        )
        tokens, block, (log_line, log_at) = kv_capacity_tokens(line, hf_config_json(q.model))
        out[name] = {
            "line": line,
            "dcp": d.dcp,
            "block_size": block,
            "vllm_tokens": tokens,
            "vllm_log": log_line,
            "vllm_log_at": log_at,
            "book_tokens": de.book_kv_capacity_tokens(
                p.model, d, e.kv_dtype, de.FREE_KV_BYTES_PER_GPU
            ),
        }
    return out


def run() -> dict:
    """Every verdict and capacity, JSON-ready."""
    from vllm_config_check import vllm_version

    questions = {}
    for key, q in de.QUESTIONS.items():
        cfg = hf_config_json(q.model)
        questions[key] = {
            "model": q.model,
            "lines": [verdict(line, cfg) for line in de.serve_lines(key)],
            "kv_capacity": capacities(key),
        }
    violations = {
        key: {
            "model": v.model,
            "cpbook_rule": v.cpbook_rule,
            **verdict(v.line, v.hf_config()),
            "fix": verdict(v.fix, v.hf_config()),
        }
        for key, v in de.VIOLATIONS.items()
    }
    return {
        "name": "vllm_deploy_check",
        "vllm": vllm_version(),
        "questions": questions,
        "violations": violations,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="one JSON object (the only output)")
    ap.add_argument("--store", action="store_true", help="also write the package's stored run")
    a = ap.parse_args()
    out = run()
    text = json.dumps(out, indent=1) + "\n"
    print(text if a.json else json.dumps(out))
    if a.store:
        stored_path("vllm_deploy_check.json").write_text(text)


if __name__ == "__main__":
    main()
