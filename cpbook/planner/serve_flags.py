"""A deployment as a ``vllm serve`` command line, and back.

Flag names are vLLM v0.33.0's (``EngineArgs.add_cli_args`` in ``vllm/engine/arg_utils.py``;
fields of ``vllm/config/parallel.py`` and ``vllm/config/cache.py``):
``--tensor-parallel-size`` (``-tp``), ``--decode-context-parallel-size`` (``-dcp``),
``--prefill-context-parallel-size`` (``-pcp``), ``--data-parallel-size`` (``-dp``),
``--enable-expert-parallel`` (``-ep``), ``--dcp-q-replicate`` / ``--no-dcp-q-replicate`` (MLA's
query replication, ``ParallelConfig.dcp_q_replicate``, a ``BooleanOptionalAction``),
``--dcp-comm-backend``, ``--cp-kv-cache-interleave-size``, ``--kv-cache-dtype``,
``--max-model-len``, ``--max-num-seqs`` and ``--gpu-memory-utilization``.
:func:`parse_serve_command` reads those flags (long or short) back into the deployment.
"""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Sequence

from cpbook.core.errors import RuleError
from cpbook.costmodel.memory import Deployment
from cpbook.costmodel.specs import ModelSpec

#: Hugging Face repositories of the built-in models (book/references.bib, ``hf_*``)
HF_REPOS = {
    "DeepSeek-V3": "deepseek-ai/DeepSeek-V3",
    "Kimi-K2": "moonshotai/Kimi-K2-Instruct",
    "Llama-3.1-8B": "meta-llama/Llama-3.1-8B",
    "Llama-3.1-70B": "meta-llama/Llama-3.1-70B",
    "Llama-3.1-405B": "meta-llama/Llama-3.1-405B",
    "Qwen2.5-7B-Instruct-1M": "Qwen/Qwen2.5-7B-Instruct-1M",
    "Qwen3-235B-A22B": "Qwen/Qwen3-235B-A22B",
}
#: vLLM's ``--kv-cache-dtype`` values read back as cpbook's KV dtypes
KV_FROM_VLLM = {
    "auto": "bf16",
    "bfloat16": "bf16",
    "float16": "bf16",
    "fp8": "fp8",
    "fp8_e4m3": "fp8",
    "fp8_ds_mla": "fp8",
}


def vllm_kv_cache_dtype(model: ModelSpec, kv_dtype: str) -> str:
    """vLLM's ``--kv-cache-dtype`` for cpbook's ``kv_dtype``: ``auto`` (the model's 16-bit
    dtype) or ``fp8``; for sparse MLA ``bfloat16`` or ``fp8_ds_mla``, since DeepSeek-V3.2's
    ``auto`` means FP8 (``CacheConfig.cache_dtype``'s docstring)."""
    if kv_dtype == "fp8":
        return "fp8_ds_mla" if model.sparse_mla else "fp8"
    return "bfloat16" if model.sparse_mla else "auto"


def serve_args(
    model: ModelSpec,
    deployment: Deployment,
    kv_dtype: str,
    *,
    max_model_len: int,
    max_num_seqs: int,
    gpu_memory_utilization: float | None = None,
    cp_kv_cache_interleave_size: int = 1,
) -> list[str]:
    """``vllm serve``'s arguments for ``deployment``: sizes above 1, the DCP options when DCP is on
    (``ag_rs``, the backend the cost model prices and PCP x DCP requires; query replication on
    or off explicitly, as some models default it on), the interleave size (1: token-level
    balance; a P/D decode instance sets it to its block size, chapter 2), and
    ``--gpu-memory-utilization`` only when the plan assumed other than vLLM's default."""
    args = ["--tensor-parallel-size", str(deployment.tp)]
    for flag, size in (
        ("--prefill-context-parallel-size", deployment.pcp),
        ("--decode-context-parallel-size", deployment.dcp),
        ("--data-parallel-size", deployment.dp),
    ):
        if size > 1:
            args += [flag, str(size)]
    if deployment.dcp > 1:
        args += ["--dcp-comm-backend", "ag_rs"]
        if model.use_mla and deployment.pcp == 1:
            args.append("--dcp-q-replicate" if deployment.tpa else "--no-dcp-q-replicate")
    if deployment.dcp > 1 or deployment.pcp > 1:
        args += ["--cp-kv-cache-interleave-size", str(cp_kv_cache_interleave_size)]
    if deployment.ep:
        args.append("--enable-expert-parallel")
    args += [
        "--kv-cache-dtype",
        vllm_kv_cache_dtype(model, kv_dtype),
        "--max-model-len",
        str(max_model_len),
        "--max-num-seqs",
        str(max_num_seqs),
    ]
    if gpu_memory_utilization is not None:  # None: vLLM v0.34's default, left unset
        args += ["--gpu-memory-utilization", f"{gpu_memory_utilization:g}"]
    return args


#: vLLM's short aliases of the parallel sizes (``EngineArgs.add_cli_args``)
SHORT_FLAGS = {
    "--tensor-parallel-size": "-tp",
    "--prefill-context-parallel-size": "-pcp",
    "--decode-context-parallel-size": "-dcp",
    "--data-parallel-size": "-dp",
    "--enable-expert-parallel": "-ep",
}


def deployment_flags(model: ModelSpec, deployment: Deployment, kv_dtype: str) -> str:
    """The deployment alone in vLLM's short forms, e.g. ``-tp 8 -dcp 8 --dcp-q-replicate``: the
    parallel sizes, query replication when on, and the KV dtype when it is FP8 (no memory
    settings; :func:`parse_serve_command` reads it back)."""
    args = serve_args(
        model, deployment, kv_dtype, max_model_len=1, max_num_seqs=1, gpu_memory_utilization=1.0
    )
    keep, i = [], 0
    while i < len(args):
        flag = args[i]
        value = args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("-") else None
        i += 1 if value is None else 2
        if flag in SHORT_FLAGS:
            keep += [SHORT_FLAGS[flag]] + ([value] if value else [])
        elif flag == "--dcp-q-replicate" or (flag == "--kv-cache-dtype" and kv_dtype == "fp8"):
            keep += [flag] + ([value] if value else [])
    return " ".join(keep)


def serve_command(model: ModelSpec, deployment: Deployment, kv_dtype: str, **kwargs) -> str:
    """The shell line ``vllm serve REPO ARGS`` (``kwargs``: those of :func:`serve_args`)."""
    repo = HF_REPOS.get(model.name, model.name)
    return shlex.join(["vllm", "serve", repo, *serve_args(model, deployment, kv_dtype, **kwargs)])


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="vllm serve", add_help=False, allow_abbrev=False, exit_on_error=False
    )
    p.add_argument("model")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--decode-context-parallel-size", "-dcp", type=int, default=1)
    p.add_argument("--prefill-context-parallel-size", "-pcp", type=int, default=1)
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1)
    p.add_argument("--enable-expert-parallel", "-ep", action=argparse.BooleanOptionalAction)
    p.add_argument("--dcp-q-replicate", action=argparse.BooleanOptionalAction)
    p.add_argument("--dcp-comm-backend", choices=["ag_rs", "a2a"])
    p.add_argument("--cp-kv-cache-interleave-size", type=int, default=1)
    p.add_argument("--kv-cache-dtype", choices=sorted(KV_FROM_VLLM), default="auto")
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--gpu-memory-utilization", type=float)
    return p


def parse_serve_command(command: str | Sequence[str]) -> tuple[Deployment, str]:
    """``(deployment, kv_dtype)`` of a ``vllm serve`` line written with the flags above (the
    ``vllm serve`` prefix optional); ValueError naming any other argument."""
    argv = shlex.split(command) if isinstance(command, str) else list(command)
    if argv[:2] == ["vllm", "serve"]:
        argv = argv[2:]
    try:
        a, rest = _parser().parse_known_args(argv)
    except (SystemExit, argparse.ArgumentError) as e:  # argparse's error paths
        raise RuleError("serve-command", "vllm serve MODEL [FLAGS]", argv=argv) from e
    if rest:
        raise RuleError("serve-command", "only the planner's flags", rest=rest)
    deployment = Deployment(
        tp=a.tensor_parallel_size,
        dcp=a.decode_context_parallel_size,
        pcp=a.prefill_context_parallel_size,
        dp=a.data_parallel_size,
        ep=bool(a.enable_expert_parallel),
        tpa=bool(a.dcp_q_replicate),
    )
    return deployment, KV_FROM_VLLM[a.kv_cache_dtype]
