"""Layer 2, the stored measurements the package reads, shipped inside it as package data.

Three CPU runs of this book's benches (2-core machine, gloo): ``decode_step.json``
(``bench/decode_step.py``, chapter 6's break-even, behind
:meth:`cpbook.dynamic.router.Router.measured`), ``pcp_prefill.json`` (``bench/pcp_prefill.py``,
chapter 4) and ``chunked_prefill.jsonl`` (``bench/chunked_prefill.py``, chapter 5);
:mod:`cpbook.costmodel.calibration` fits on all three.  ``vllm_deploy_check.json``: vLLM
v0.34.0's own verdicts on chapter 11's ``vllm serve`` lines (``bench/vllm_deploy_check.py``).
``hf_configs/``: the ``config.json`` of each model the book hands to vLLM's config classes, as
its Hugging Face repository publishes it (the fields those classes read), :data:`HF_CONFIGS`.
They are read with :mod:`importlib.resources`, so an installed wheel works outside the checkout.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from cpbook.core.errors import RuleError

__all__ = ["HF_CONFIGS", "STORED", "hf_config_json", "stored_path", "stored_text", "stored_rows"]

STORED = (
    "decode_step.json",
    "pcp_prefill.json",
    "chunked_prefill.jsonl",
    "vllm_deploy_check.json",
)

_HF = resources.files(__name__).joinpath("hf_configs")
#: model name -> its ``config.json`` shipped in ``hf_configs/`` (e.g. ``"DeepSeek-V2-Lite"``)
HF_CONFIGS: dict[str, Path] = {
    f.name.removesuffix(".json"): Path(str(f))
    for f in sorted(_HF.iterdir(), key=lambda f: f.name)
    if f.name.endswith(".json")
}


def stored_path(name: str) -> Path:
    """The file of stored run ``name`` (one of :data:`STORED`) in this installation: what
    :func:`stored_text` reads and a bench's ``--store`` rewrites (in a checkout)."""
    if name not in STORED:
        raise RuleError("stored-run", f"name in {STORED}", name=name)
    return Path(__file__).resolve().parent / name


def stored_text(name: str) -> str:
    """The text of stored run ``name`` (one of :data:`STORED`), read as package data."""
    stored_path(name)  # the name check
    return resources.files(__name__).joinpath(name).read_text()


def stored_rows(text: str) -> list[dict]:
    """The rows of a stored run's text: a JSON list, or one JSON object per line."""
    text = text.strip()
    if text.startswith("["):
        return json.loads(text)
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def hf_config_json(name: str) -> dict:
    """The ``config.json`` of model ``name`` (a key of :data:`HF_CONFIGS`) as a dict."""
    if name not in HF_CONFIGS:
        raise RuleError("hf-config-name", f"name in {sorted(HF_CONFIGS)}", name=name)
    return json.loads(HF_CONFIGS[name].read_text())
