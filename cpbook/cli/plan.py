"""``python -m cpbook plan``: the deployment planner's ``vllm serve`` line, its top layouts and
why (:func:`cpbook.planner.plan.plan`), or JSON lines; sizes (``1M``) and durations
(``50ms``) parsed here."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from cpbook.core.errors import RuleError
from cpbook.costmodel.specs import GB, GPUS, get_model
from cpbook.planner.hf_config import model_from_hf_config
from cpbook.planner.plan import Plan, estimate_record, plan
from cpbook.planner.plan_advice import fmt_rate, fmt_s
from cpbook.planner.plan_space import AUTO, OBJECTIVES
from cpbook.planner.search_space import ServingWorkload
from cpbook.planner.vllm_rules import PLAN_KV_DTYPES

__all__ = ["add_parser", "command", "parse_seconds", "parse_tokens"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The ``plan`` sub-command's options."""
    q = sub.add_parser(
        "plan",
        help="the deployment planner: the best layout and its vllm serve flags",
        description="Search every deployment vLLM accepts for the model on at most --gpus "
        "GPUs, drop those that cannot hold --concurrency requests or miss a target, and rank "
        "the rest (cost-model estimates).  --objective auto (the default): lowest latency "
        "below the concurrency where decode throughput saturates, tokens/s per GPU above it.",
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
    q.add_argument("--objective", choices=(AUTO, *OBJECTIVES), default=AUTO)
    q.add_argument(
        "--kv-cache-dtype",
        action="append",
        choices=PLAN_KV_DTYPES,
        help="an allowed KV cache dtype (repeatable; default bf16)",
    )
    q.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="as vLLM's (default: vLLM v0.34's, 1.0 with its extensible KV cache)",
    )
    _add_nodes(q)
    q.add_argument("--top", type=int, default=8, help="rows of the table")
    q.add_argument("--json", action="store_true", help="JSON lines: layouts, then a summary")
    # ``--debug`` as cpbook.cli.options adds it; that module imports torch (the launcher)
    q.add_argument("--debug", action="store_true", help="show the full traceback on errors")


def _add_nodes(p: argparse.ArgumentParser) -> None:
    """``--gpus-per-node N`` (default: the GPU's node, 8 for HGX / DGX) and
    ``--inter-node-link NAME`` (a key of ``cpbook.costmodel.specs.LINKS``, default RDMA400): a
    collective group wider than a node is priced on that link, and its serve line carries
    vLLM's multi-node flags."""
    p.add_argument(
        "--gpus-per-node",
        type=int,
        default=None,
        help="GPUs per node on one NVLink domain (default: the GPU's, 8 for HGX)",
    )
    p.add_argument(
        "--inter-node-link",
        default="RDMA400",
        help="the link between nodes (a key of cpbook.costmodel.specs.LINKS)",
    )


class _Plain(str):
    """Text shown in a RuleError's values as is, without quotes."""

    def __repr__(self) -> str:
        return str(self)


_SUFFIX = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3}


def parse_tokens(flag: str, text: str) -> int:
    """``"1M"`` → 1048576, ``"128K"`` → 131072, ``"4096"`` → 4096; RuleError otherwise."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?)\s*", text)
    tokens = float(m.group(1)) * _SUFFIX[m.group(2).lower()] if m else None
    if tokens is None or tokens != int(tokens):
        raise RuleError("token-count", f"{flag} N[K|M] (whole tokens)", text=text)
    return int(tokens)


def parse_seconds(flag: str, text: str | None) -> float | None:
    """``"10s"`` → 10.0, ``"50ms"`` → 0.05, ``"2"`` → 2.0 (seconds); RuleError otherwise."""
    if text is None:
        return None
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)\s*(s|ms)?\s*", text)
    if not m:
        raise RuleError("duration", f"{flag} N[s|ms]", text=text)
    return float(m.group(1)) * (1e-3 if m.group(2) == "ms" else 1.0)


def _config_file(path: str) -> str:
    """The ``config.json`` that ``--hf-config PATH`` names (the file, or the one in a folder)."""
    p = Path(path)
    return str(p / "config.json" if p.is_dir() else p)


def _plan_model(a: argparse.Namespace):
    if a.hf_config:
        try:
            return model_from_hf_config(a.hf_config, name=a.model)
        except json.JSONDecodeError as e:
            raise RuleError(
                "hf-config-json",
                "--hf-config a JSON config.json (or its folder)",
                file=_Plain(_config_file(a.hf_config)),
                error=_Plain(e.msg),
            ) from e
    if not a.model:
        raise RuleError(
            "plan-model", "--model NAME or --hf-config PATH", model=None, hf_config=None
        )
    return get_model(a.model)


def _workload(a: argparse.Namespace) -> ServingWorkload:
    memory = {}
    if a.gpu_memory_utilization is not None:
        memory["gpu_memory_utilization"] = a.gpu_memory_utilization
    return ServingWorkload(
        parse_tokens("--context", a.context),
        parse_tokens("--output", a.output),
        a.concurrency,
        parse_seconds("--ttft", a.ttft),
        parse_seconds("--tpot", a.tpot),
        tuple(dict.fromkeys(a.kv_cache_dtype or ["bf16"])),
        gpus_per_node=a.gpus_per_node,
        inter_node_link=a.inter_node_link,
        **memory,
    )


#: the table's legend: what its two TPOT columns and its mark mean
LEGEND = (
    "step: one decode step alone (chapter 6's TPOT); TPOT+pf: TPOT with the prefill chunks of "
    "other requests each step carries (continuous batching); * on the Pareto set of TTFT, "
    "TPOT+pf and tok/s/GPU"
)
#: the legend's line for a MoE model's ``experts`` column
MOE_LEGEND = (
    "experts: a MoE layer runs on all the deployment's GPUs, each expert split by TP over them "
    "(vLLM's -dp without --enable-expert-parallel) or whole experts spread by EP"
)


def _plan_table(p: Plan, top: int) -> list[str]:
    w = p.workload
    front = {id(e) for e in p.frontier}
    lines = [
        "",
        f"{p.model.name} on up to {p.num_gpus} x {p.gpu.name}: {w.concurrency:,} "
        f"request{'s' if w.concurrency != 1 else ''} of "
        f"{w.prompt_tokens:,} + {w.output_tokens:,} tokens (modelled: cpbook.costmodel)",
        f"{p.objective_reason[:1].upper()}{p.objective_reason[1:]}.",
    ]
    if p.cp_note:
        lines.append(p.cp_note)
    moe = bool(p.model.expert_params)
    lines += [
        f"{'#':>3}  {'deployment':24s} {'GPUs':>4} {'experts ' if moe else ''}{'weights':>8} "
        f"{'KV room':>8} {'holds':>6} {'TTFT':>9} {'step':>9} {'TPOT+pf':>9} {'tok/s/GPU':>10}",
    ]
    for i, e in enumerate(p.ranked[:top], 1):
        mark = "*" if id(e) in front else " "
        experts = f"{e.deployment.moe_label.removeprefix('experts '):>7} " if moe else ""
        lines.append(
            f"{i:>3}{mark} {e.label:24s} {e.num_gpus:>4} {experts}{e.weight_bytes / GB:>5.1f} GB "
            f"{e.kv_budget_bytes / GB:>5.1f} GB {e.capacity:>6,} {fmt_s(e.ttft_s):>9} "
            f"{fmt_s(e.step_s):>9} {fmt_s(e.tpot_s):>9} {fmt_rate(e.tokens_per_s_per_gpu, 4):>10}"
        )
    legend = [LEGEND] + ([MOE_LEGEND] if moe else [])
    return lines + legend + ["", "Why:"] + [f"  - {r}" for r in p.reasons]


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
        "objective_reason": p.objective_reason,
        "cp_note": p.cp_note,
        "pareto": [e.label for e in p.frontier],
        "winner": best.label if best else None,
        "command": p.command() if best else None,
        "commands": p.commands() if best else None,
        "serving": len(p.ranked),
        "dropped": len(p.dropped),
        "rejected": p.rejected,
        "frontier_ttft": [e.label for e in p.frontier_ttft],
        "frontier_tpot": [e.label for e in p.frontier_tpot],
        "reasons": list(p.reasons),
        "would_fit": list(p.would_fit.lines) if p.would_fit else None,
    }


def command(a: argparse.Namespace, p: argparse.ArgumentParser | None = None) -> int:
    """Plan and print the command and table (or JSON lines); 0 when a deployment serves the
    workload, a RuleError naming the rule that dropped the closest one otherwise."""
    res = plan(_plan_model(a), a.gpu, a.gpus, _workload(a), objective=a.objective)
    if a.json:
        for i, e in enumerate(res.ranked, 1):
            print(json.dumps(estimate_record(e, i)))
        for e in res.dropped:
            print(json.dumps(estimate_record(e)))
        print(json.dumps(_plan_summary(res)))
    if res.winner is None:
        f = res.would_fit
        advice = _Plain(" ".join(f.lines + ((res.cp_note,) if res.cp_note else ())))
        raise RuleError(f.rule, "a deployment that serves the workload", serving=0, advice=advice)
    if not a.json:
        print("\n".join(res.commands() + _plan_table(res, a.top)))
    return 0
