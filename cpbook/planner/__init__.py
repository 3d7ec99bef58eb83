"""cpbook's deployment planner, on top of the cost model: which deployment, and which
``vllm serve`` flags, for a workload.

Modules: :mod:`.hf_config` (a :class:`~cpbook.costmodel.specs.ModelSpec` from a ``config.json``,
through :mod:`cpbook.core.hf_config`), :mod:`.vllm_rules` (what vLLM serves),
:mod:`.serve_flags` (the ``vllm serve`` line and its parser), :mod:`.search_space` (the
workload and every deployment vLLM serves), :mod:`.objective` (what a plan ranks by, the
default by workload), :mod:`.plan_space` (one deployment's numbers, the ranking, the Pareto
set), :mod:`.plan_advice` (the reasons, and what would fit), :mod:`.plan` (:func:`plan`), and
:mod:`.decision_path` (the article's three questions, kept as a check on the planner) and
:mod:`.deploy_examples` (three deployments a reader would run, and one broken ``vllm serve``
line per rule, with vLLM's stored verdicts).  The
planner and the cost model import no torch.  Its public names are re-exported here
(``from cpbook import planner; planner.plan(...)``).
"""

from cpbook.planner.decision_path import PathAnswer, PathCheck, decision_path, path_vs_plan
from cpbook.planner.hf_config import SUPPORTED_MODEL_TYPES, model_from_hf_config
from cpbook.planner.objective import AUTO, resolve_objective, saturation_concurrency
from cpbook.planner.plan import Plan, estimate_record, headline, plan
from cpbook.planner.plan_advice import MAX_REPLICA_GPUS, WouldFit
from cpbook.planner.plan_space import (
    OBJECTIVES,
    Estimate,
    brute_force,
    estimate,
    objective_value,
    pareto,
)
from cpbook.planner.search_space import ServingWorkload, deployments
from cpbook.planner.serve_flags import (
    HF_REPOS,
    deployment_flags,
    parse_serve_command,
    serve_command,
)
from cpbook.planner.vllm_rules import PLAN_KV_DTYPES, check_deployment, rule_probes

__all__ = [
    "AUTO",
    "Estimate",
    "HF_REPOS",
    "MAX_REPLICA_GPUS",
    "OBJECTIVES",
    "PLAN_KV_DTYPES",
    "PathAnswer",
    "PathCheck",
    "Plan",
    "SUPPORTED_MODEL_TYPES",
    "ServingWorkload",
    "WouldFit",
    "brute_force",
    "check_deployment",
    "decision_path",
    "deployment_flags",
    "deployments",
    "estimate",
    "estimate_record",
    "headline",
    "model_from_hf_config",
    "objective_value",
    "pareto",
    "parse_serve_command",
    "path_vs_plan",
    "plan",
    "resolve_objective",
    "rule_probes",
    "saturation_concurrency",
    "serve_command",
]
