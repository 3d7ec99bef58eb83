"""Three deployments a reader would run, and one broken line per rule a reader can break.

:data:`QUESTIONS` holds the questions ("this model, this context, these GPUs"); :func:`answer`
is the planner's :class:`~cpbook.planner.plan.Plan` for one and :func:`serve_lines` its
``vllm serve`` line(s), exactly as ``cpbook plan`` prints them (one per node):

``small-mla``
    DeepSeek-V2-Lite (MLA, 16 query heads, one 576-wide latent per token) on up to 4 H100s,
    one request of 128K + 1K tokens: the planner spends the four GPUs on TP 4 with DCP 4 and
    query replication, for the lowest latency (each GPU reads a quarter of the request's
    cached latents each decode step).
``gqa-node``
    Qwen3-235B-A22B (GQA, 4 KV heads) on one node of 8 H200s, 64 requests of 32K + 1K tokens
    (its native window, 40,960 positions), ranked by TTFT.  TP 8 has the shortest prefill but
    replicates each KV head on 8 / 4 = 2 GPUs and holds fewer than 64 such requests; DCP 2,
    the largest DCP vLLM admits there, undoes the replication and every request fits.  Ranked
    by throughput the planner would run attention in data-parallel replicas instead, with no
    CP.  (Llama-3.1-70B's 8 KV heads leave nothing to replicate at TP 8: no DCP on one node.)
``mla-two-nodes``
    DeepSeek-V3 on 16 H200s in two nodes of 8, 96 requests of 128K + 1K tokens: two TP 8
    replicas of 8 GPUs (DP 2) with DCP 8 and query replication, where without DCP the two
    replicas hold well under half the requests; the line carries
    ``--nnodes 2 --node-rank R --master-addr`` and node 1's ``--headless``.

:data:`VIOLATIONS` holds one broken line per rule, with the model's ``config.json`` (package
data, :func:`cpbook.data.hf_config_json`) and the cpbook rule that rejects it;
:func:`cpbook_rule` runs cpbook's own checks on a parsed line and names the rule.
``bench/vllm_deploy_check.py`` runs every line through vLLM v0.34.0's own code and stores its
verdicts, messages and KV-cache capacities (:func:`vllm_verdicts`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

from cpbook import data
from cpbook.core.config import ConfigError, ParallelConfig, check_vllm_spec_interleave
from cpbook.core.errors import RuleError
from cpbook.costmodel.memory import Deployment, deployment_kv_bytes_per_token
from cpbook.costmodel.specs import MODELS, ModelSpec
from cpbook.planner.hf_config import model_from_hf_config
from cpbook.planner.objective import AUTO
from cpbook.planner.plan import Plan, plan
from cpbook.planner.search_space import ServingWorkload
from cpbook.planner.serve_flags import (
    ALLOW_LONG_MAX_MODEL_LEN,
    HF_REPOS,
    parse_serve_command,
    serve_options,
)
from cpbook.planner.vllm_rules import (
    check_deployment,
    check_max_model_len,
    check_pcp_dcp_comm_backend,
)

__all__ = [
    "DeployQuestion",
    "FREE_KV_BYTES_PER_GPU",
    "QUESTIONS",
    "VIOLATIONS",
    "Violation",
    "answer",
    "book_kv_capacity_tokens",
    "cpbook_rule",
    "model_spec",
    "serve_lines",
    "vllm_verdicts",
    "without_dcp",
]

K = 1024
#: the KV-cache memory assumed free on each GPU once the weights are loaded, for the capacity
#: the book and vLLM's own functions compute (``bench/vllm_deploy_check.py``)
FREE_KV_BYTES_PER_GPU = 40 * 2**30


def model_spec(name: str, source: str = "builtin") -> ModelSpec:
    """cpbook's spec of model ``name``: the built-in one (``source="builtin"``, what
    ``cpbook plan --model`` uses) or read from its shipped ``config.json``
    (``source="hf_config"``, what ``cpbook plan --hf-config`` uses)."""
    if source == "builtin" and name in MODELS:
        return MODELS[name]
    return model_from_hf_config(data.hf_config_json(name), name=name)


@dataclass(frozen=True)
class DeployQuestion:
    """One reader's question: ``model`` (a key of :data:`cpbook.data.HF_CONFIGS`; its spec
    from ``source``, see :func:`model_spec`) on up to ``num_gpus`` ``gpu`` GPUs in nodes of
    ``gpus_per_node``, ``concurrency`` requests of ``prompt_tokens + output_tokens``, KV cache
    in ``kv_dtype``, ranked by ``objective``."""

    model: str
    source: str
    gpu: str
    num_gpus: int
    gpus_per_node: int
    prompt_tokens: int
    output_tokens: int
    concurrency: int
    kv_dtype: str = "bf16"
    objective: str = AUTO

    def spec(self) -> ModelSpec:
        return model_spec(self.model, self.source)

    def workload(self) -> ServingWorkload:
        return ServingWorkload(
            self.prompt_tokens,
            self.output_tokens,
            self.concurrency,
            kv_dtypes=(self.kv_dtype,),
            gpus_per_node=self.gpus_per_node,
        )

    def plan_command(self) -> str:
        """The ``cpbook plan`` line that asks the same question."""
        which = (
            f"--hf-config {self.model}/config.json --model {self.model}"
            if self.source == "hf_config"
            else f"--model {self.model}"
        )
        return (
            f"cpbook plan {which} --gpu {self.gpu} --gpus {self.num_gpus} "
            f"--gpus-per-node {self.gpus_per_node} --context {self.prompt_tokens // K}K "
            f"--output {self.output_tokens // K}K --concurrency {self.concurrency}"
            + ("" if self.objective == AUTO else f" --objective {self.objective}")
        )


QUESTIONS: dict[str, DeployQuestion] = {
    "small-mla": DeployQuestion("DeepSeek-V2-Lite", "hf_config", "H100", 4, 8, 128 * K, K, 1),
    "gqa-node": DeployQuestion(
        "Qwen3-235B-A22B", "builtin", "H200", 8, 8, 32 * K, K, 64, objective="ttft"
    ),
    "mla-two-nodes": DeployQuestion("DeepSeek-V3", "builtin", "H200", 16, 8, 128 * K, K, 96),
}


def answer(key: str) -> Plan:
    """The planner's answer to ``QUESTIONS[key]``."""
    q = QUESTIONS[key]
    return plan(q.spec(), q.gpu, q.num_gpus, q.workload(), objective=q.objective)


def serve_lines(key: str) -> list[str]:
    """The winner's ``vllm serve`` line for ``QUESTIONS[key]``, one per node, node 0 first."""
    return answer(key).commands()


def without_dcp(deployment: Deployment) -> Deployment:
    """The same deployment with DCP 1 (and no query replication): the KV-capacity baseline."""
    return replace(deployment, dcp=1, tpa=False)


def book_kv_capacity_tokens(
    model: ModelSpec, deployment: Deployment, kv_dtype: str, kv_bytes_per_gpu: float
) -> int:
    """Tokens the book's memory model says one replica of ``deployment`` caches in
    ``kv_bytes_per_gpu`` bytes of KV memory on each GPU (each token's KV split by
    :func:`~cpbook.costmodel.memory.deployment_kv_bytes_per_token`)."""
    return int(kv_bytes_per_gpu // deployment_kv_bytes_per_token(model, deployment, kv_dtype))


@dataclass(frozen=True)
class Violation:
    """A ``vllm serve`` ``line`` for ``model`` (a key of :data:`cpbook.data.HF_CONFIGS`) that
    breaks one rule: ``broken`` says which in words, ``cpbook_rule`` names cpbook's rule, and
    ``fix`` is the nearest line that keeps it."""

    model: str
    line: str
    broken: str
    cpbook_rule: str
    fix: str

    def hf_config(self) -> dict:
        return data.hf_config_json(self.model)


def _violation(model: str, flags: str, broken: str, rule: str, fixed: str) -> Violation:
    serve = f"vllm serve {HF_REPOS[model]}"
    return Violation(model, f"{serve} {flags}", broken, rule, f"{serve} {fixed}")


_NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4})
_V2_LITE, _QWEN3, _LLAMA = "DeepSeek-V2-Lite", "Qwen3-235B-A22B", "Llama-3.1-70B"
_INTERLEAVE = "-tp 8 -dcp 2 --block-size 16 --cp-kv-cache-interleave-size"
_SPARSE_PCP_DCP = "-tp 4 -pcp 2 -dcp 2 --dcp-comm-backend {backend} --kv-cache-dtype fp8_ds_mla"

VIOLATIONS: dict[str, Violation] = {
    "dcp-not-dividing-tp": _violation(
        _V2_LITE, "-tp 4 -dcp 3", "DCP does not divide TP", "tp-divisible-by-dcp", "-tp 4 -dcp 4"
    ),
    "gqa-dcp-without-replicas": _violation(
        _LLAMA,
        "-tp 8 -dcp 2",
        "GQA DCP with no KV head replicated (TP = KV heads)",
        "gqa-dcp-needs-replicated-kv",
        "-tp 8",
    ),
    "gqa-dcp-beyond-replicas": _violation(
        _QWEN3,
        "-tp 8 -dcp 4",
        "GQA DCP larger than the KV head's copies (TP / KV heads = 2)",
        "gqa-dcp-within-replicas",
        "-tp 8 -dcp 2",
    ),
    "pcp-gqa": _violation(_QWEN3, "-tp 4 -pcp 2", "PCP on a GQA model", "pcp-mla-only", "-tp 8"),
    "pcp-dcp-dense-mla": _violation(
        "DeepSeek-V3",
        "-tp 4 -pcp 2 -dcp 2",
        "PCP x DCP on dense MLA",
        "pcp-dcp-sparse-mla-only",
        "-tp 4 -pcp 2",
    ),
    "pcp-dcp-a2a": _violation(
        "DeepSeek-V3.2",
        _SPARSE_PCP_DCP.format(backend="a2a"),
        "PCP x DCP with the a2a backend",
        "pcp-dcp-needs-ag-rs",
        _SPARSE_PCP_DCP.format(backend="ag_rs"),
    ),
    "interleave-above-block": _violation(
        _QWEN3,
        f"{_INTERLEAVE} 32",
        "interleave size above the block size",
        "interleave-le-block-size",
        f"{_INTERLEAVE} 16",
    ),
    "interleave-not-dividing-block": _violation(
        _QWEN3,
        f"{_INTERLEAVE} 12",
        "interleave size not dividing the block size",
        "block-size-divisible-by-interleave",
        f"{_INTERLEAVE} 8",
    ),
    "spec-decode-interleave": _violation(
        _QWEN3,
        f"-tp 8 -dcp 2 --cp-kv-cache-interleave-size 16 --speculative-config '{_NGRAM}'",
        "speculative decoding with interleave size > 1",
        "spec-cp-interleave-one",
        f"-tp 8 -dcp 2 --speculative-config '{_NGRAM}'",
    ),
    "max-model-len-past-positions": _violation(
        _QWEN3,
        "-tp 8 --max-model-len 131072",
        "--max-model-len past the model's positions, without VLLM_ALLOW_LONG_MAX_MODEL_LEN=1",
        "max-model-len-within-positions",
        "-tp 8 --max-model-len 40960",
    ),
}

_REPO_MODELS = {repo: name for name, repo in HF_REPOS.items()}


def cpbook_rule(line_or_violation: str | Violation) -> str | None:
    """The cpbook rule that rejects a ``vllm serve`` line (``None`` if cpbook accepts it):
    the line parsed (:func:`~cpbook.planner.serve_flags.serve_options`), then, in order,
    ``--max-model-len`` against the model's positions unless the environment allows it, the
    replica's :class:`~cpbook.core.config.ParallelConfig` (with the interleave, block size and
    DCP backend of the line), :func:`~cpbook.planner.vllm_rules.check_pcp_dcp_comm_backend`,
    the model-level rules of :func:`~cpbook.planner.vllm_rules.check_deployment`, and with
    ``--speculative-config`` :func:`~cpbook.core.config.check_vllm_spec_interleave` (sparse
    MLA's backend allows any interleave).  The model: the violation's, or the line's repo's."""
    if isinstance(line_or_violation, Violation):
        line, name = line_or_violation.line, line_or_violation.model
    else:
        line, name = line_or_violation, None
    try:
        env, a = serve_options(line)
        deployment, kv_dtype = parse_serve_command(line)
    except RuleError as e:  # serve-command
        return e.rule
    model = model_spec(name or _REPO_MODELS.get(a.model, a.model))
    try:
        if a.max_model_len and env.get(ALLOW_LONG_MAX_MODEL_LEN) != "1":
            check_max_model_len(model, a.max_model_len)
        layout = {"block_size": a.block_size} if a.block_size else {}
        cfg = ParallelConfig.for_model(
            model,
            tensor_parallel_size=deployment.tp,
            decode_context_parallel_size=deployment.dcp,
            prefill_context_parallel_size=deployment.pcp,
            cp_kv_cache_interleave_size=a.cp_kv_cache_interleave_size,
            dcp_comm_backend=a.dcp_comm_backend or "ag_rs",
            **layout,
        )
        check_pcp_dcp_comm_backend(cfg)
        check_deployment(model, deployment, kv_dtype)
        if a.speculative_config:
            check_vllm_spec_interleave(cfg, backend_supports_interleave=model.sparse_mla)
    except ConfigError as e:
        return e.rule
    return None


def vllm_verdicts() -> dict:
    """The stored run of ``bench/vllm_deploy_check.py``: vLLM's version, its verdict on each
    line of :data:`QUESTIONS` and :data:`VIOLATIONS` (``accepted``, its message and the
    ``file:line`` that raised it) and the KV-cache capacities (package data)."""
    return json.loads(data.stored_text("vllm_deploy_check.json"))
