"""A deployment as a ``vllm serve`` command line, and back.

Flag names are vLLM v0.34.0's (``EngineArgs.add_cli_args`` in ``vllm/engine/arg_utils.py``;
fields of ``vllm/config/parallel.py`` and ``vllm/config/cache.py``):
``--tensor-parallel-size`` (``-tp``), ``--decode-context-parallel-size`` (``-dcp``),
``--prefill-context-parallel-size`` (``-pcp``), ``--data-parallel-size`` (``-dp``),
``--enable-expert-parallel`` (``-ep``), ``--dcp-q-replicate`` / ``--no-dcp-q-replicate`` (MLA's
query replication, ``ParallelConfig.dcp_q_replicate``, a ``BooleanOptionalAction``),
``--dcp-comm-backend``, ``--cp-kv-cache-interleave-size``, ``--kv-cache-dtype``,
``--max-model-len``, ``--max-num-seqs`` and ``--gpu-memory-utilization``; for a deployment
wider than a node, vLLM's multiprocessing multi-node launch: the same line on every node with
``--nnodes N --node-rank R --master-addr ADDR`` (``ParallelConfig.nnodes`` / ``node_rank`` /
``master_addr``), ``--headless`` on the nodes other than 0 (``run_headless`` in
``vllm/entrypoints/cli/serve.py`` starts their workers); no Ray needed.  A
``--max-model-len`` beyond the model's ``max_position_embeddings`` is prefixed with
``VLLM_ALLOW_LONG_MAX_MODEL_LEN=1``, the variable vLLM asks for
(:func:`~cpbook.planner.vllm_rules.check_max_model_len`).
:func:`parse_serve_command` reads those flags (long or short) back into the deployment;
:func:`serve_options` reads every one of them, and two a reader adds by hand, ``--block-size``
(``CacheConfig.block_size``) and ``--speculative-config`` (a JSON ``SpeculativeConfig``).
"""

from __future__ import annotations

import argparse
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass

from cpbook.core.config import ConfigError
from cpbook.core.errors import RuleError
from cpbook.costmodel.memory import Deployment
from cpbook.costmodel.nodes import node_count
from cpbook.costmodel.specs import ModelSpec
from cpbook.planner.vllm_rules import check_max_model_len

#: Hugging Face repositories of the built-in models and of the configs in ``cpbook/data/
#: hf_configs`` (book/references.bib, ``hf_*``)
HF_REPOS = {
    "DeepSeek-V2-Lite": "deepseek-ai/DeepSeek-V2-Lite",
    "DeepSeek-V3": "deepseek-ai/DeepSeek-V3",
    "DeepSeek-V3.2": "deepseek-ai/DeepSeek-V3.2",
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


#: the head node's address in a printed multi-node line, for the reader to replace
HEAD_NODE_ADDR = "HEAD_NODE_IP"
#: the environment variable vLLM asks for to start beyond ``max_position_embeddings``
ALLOW_LONG_MAX_MODEL_LEN = "VLLM_ALLOW_LONG_MAX_MODEL_LEN"


@dataclass(frozen=True)
class Launch:
    """Where one ``vllm serve`` line runs: nodes of ``gpus_per_node`` GPUs (``None``: one node,
    however many GPUs), this line's ``node_rank`` and the head node's ``master_addr``."""

    gpus_per_node: int | None = None
    node_rank: int = 0
    master_addr: str = HEAD_NODE_ADDR

    def nnodes(self, deployment: Deployment) -> int:
        """The ``--nnodes`` of ``deployment`` (:func:`~cpbook.costmodel.nodes.node_count`)."""
        if self.gpus_per_node is None:
            return 1
        return node_count(deployment.num_gpus, self.gpus_per_node)


def serve_args(
    model: ModelSpec,
    deployment: Deployment,
    kv_dtype: str,
    *,
    max_model_len: int,
    max_num_seqs: int,
    gpu_memory_utilization: float | None = None,
    cp_kv_cache_interleave_size: int | None = None,
    launch: Launch = Launch(),
) -> list[str]:
    """``vllm serve``'s arguments for ``deployment``: sizes above 1, the DCP options when DCP is on
    (``ag_rs``, the backend the cost model prices and PCP x DCP requires; query replication on
    or off explicitly, as some models default it on), the interleave size only when given
    (omitted, vLLM v0.34 uses 1, token-level balance, and picks the block size itself for a
    NIXL P/D decode instance, ``VllmConfig.adjust_dcp_kv_cache_interleave_size``; an explicit
    value turns that choice off), ``--gpu-memory-utilization`` only when the plan assumed
    other than vLLM's default and, when ``launch`` puts it on several nodes,
    ``--nnodes --node-rank --master-addr`` (and ``--headless`` off the head node)."""
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
    if cp_kv_cache_interleave_size is not None and (deployment.dcp > 1 or deployment.pcp > 1):
        args += ["--cp-kv-cache-interleave-size", str(cp_kv_cache_interleave_size)]
    if deployment.ep:
        args.append("--enable-expert-parallel")
    nnodes = launch.nnodes(deployment)
    if nnodes > 1:
        args += ["--nnodes", str(nnodes), "--node-rank", str(launch.node_rank)]
        args += ["--master-addr", launch.master_addr]
        args += ["--headless"] if launch.node_rank else []
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
    args = serve_args(model, deployment, kv_dtype, max_model_len=1, max_num_seqs=1)
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


def long_context_env(model: ModelSpec, max_model_len: int) -> list[str]:
    """``["VLLM_ALLOW_LONG_MAX_MODEL_LEN=1"]`` when ``max_model_len`` exceeds the model's
    ``max_position_embeddings`` (rule ``max-model-len-within-positions``), else ``[]``."""
    try:
        check_max_model_len(model, max_model_len)
    except ConfigError:
        return [f"{ALLOW_LONG_MAX_MODEL_LEN}=1"]
    return []


def max_model_len_note(model: ModelSpec, max_model_len: int) -> str | None:
    """One sentence for a line that needs ``VLLM_ALLOW_LONG_MAX_MODEL_LEN=1``: what vLLM checks
    and what makes the answers right beyond the trained positions; ``None`` when not needed."""
    if not long_context_env(model, max_model_len):
        return None
    return (
        f"--max-model-len {max_model_len:,} exceeds {model.name}'s max_position_embeddings "
        f"({model.max_position_embeddings:,}): vLLM starts only with "
        f"{ALLOW_LONG_MAX_MODEL_LEN}=1, and positions past it need a RoPE scaling that covers "
        "them (e.g. YaRN through --hf-overrides) for the answers to be right."
    )


def serve_command(model: ModelSpec, deployment: Deployment, kv_dtype: str, **kwargs) -> str:
    """The shell line ``[VLLM_ALLOW_LONG_MAX_MODEL_LEN=1] vllm serve REPO ARGS`` (``kwargs``:
    those of :func:`serve_args`; the variable when ``max_model_len`` needs it)."""
    repo = HF_REPOS.get(model.name, model.name)
    env = long_context_env(model, kwargs["max_model_len"])
    args = serve_args(model, deployment, kv_dtype, **kwargs)
    return shlex.join([*env, "vllm", "serve", repo, *args])


def node_commands(model: ModelSpec, deployment: Deployment, kv_dtype: str, **kwargs) -> list[str]:
    """:func:`serve_command` for every node of ``kwargs["launch"]`` (one line on one node),
    node 0 first."""
    launch = kwargs.pop("launch", Launch())
    return [
        serve_command(model, deployment, kv_dtype, launch=Launch(launch.gpus_per_node, r), **kwargs)
        for r in range(launch.nnodes(deployment))
    ]


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
    p.add_argument("--nnodes", "-n", type=int, default=1)
    p.add_argument("--node-rank", "-r", type=int, default=0)
    p.add_argument("--master-addr")
    p.add_argument("--master-port", type=int)
    p.add_argument("--headless", action="store_true")
    p.add_argument("--kv-cache-dtype", choices=sorted(KV_FROM_VLLM), default="auto")
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--gpu-memory-utilization", type=float)
    p.add_argument("--block-size", type=int)
    p.add_argument("--speculative-config")
    return p


def serve_options(command: str | Sequence[str]) -> tuple[dict[str, str], argparse.Namespace]:
    """``(environment, flags)`` of a ``vllm serve`` line written with the flags above (the
    ``vllm serve`` prefix optional): the ``NAME=VALUE`` assignments before it, and every flag
    under vLLM's field name (``a.cp_kv_cache_interleave_size``, ``a.block_size``, ...);
    rule ``serve-command`` for any other argument."""
    argv = shlex.split(command) if isinstance(command, str) else list(command)
    env = {}
    while argv and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", argv[0]):
        name, value = argv.pop(0).split("=", 1)
        env[name] = value
    if argv[:2] == ["vllm", "serve"]:
        argv = argv[2:]
    try:
        a, rest = _parser().parse_known_args(argv)
    except (SystemExit, argparse.ArgumentError) as e:  # argparse's error paths
        raise RuleError("serve-command", "vllm serve MODEL [FLAGS]", argv=argv) from e
    if rest:
        raise RuleError("serve-command", "only the planner's flags", rest=rest)
    return env, a


def parse_serve_command(command: str | Sequence[str]) -> tuple[Deployment, str]:
    """``(deployment, kv_dtype)`` of a ``vllm serve`` line written with the flags above (the
    ``vllm serve`` prefix and ``NAME=VALUE`` environment assignments before it optional);
    ValueError naming any other argument (:func:`serve_options`)."""
    _, a = serve_options(command)
    deployment = Deployment(
        tp=a.tensor_parallel_size,
        dcp=a.decode_context_parallel_size,
        pcp=a.prefill_context_parallel_size,
        dp=a.data_parallel_size,
        ep=bool(a.enable_expert_parallel),
        tpa=bool(a.dcp_q_replicate),
    )
    return deployment, KV_FROM_VLLM[a.kv_cache_dtype]
