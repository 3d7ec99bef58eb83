"""The deployment planner: which deployment, and which ``vllm serve`` flags, for a workload.

:func:`plan` prices every deployment vLLM accepts for the model on at most ``num_gpus``
GPUs (:mod:`cpbook.planner.plan_space`), drops those that cannot hold ``concurrency``
requests of the workload's length or miss a target, ranks the rest by the objective (by
default the workload's: latency below the concurrency where decode throughput saturates,
throughput per GPU above it), marks the Pareto set, and says why in one line per runner-up;
where nothing fits it says what would (:mod:`cpbook.planner.plan_advice`).  Every number is
the cost model's (modelled, with its parameters: the GPU-side terms of
:mod:`~cpbook.costmodel.gpu_terms`, HBM efficiency, link α–β), so the planner improves when
it does.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, replace

from cpbook.core.config import ConfigError
from cpbook.core.errors import RuleError
from cpbook.costmodel.memory import Deployment
from cpbook.costmodel.specs import GB, GPUSpec, ModelSpec, get_gpu, get_model
from cpbook.planner.objective import resolve_objective
from cpbook.planner.plan_advice import (
    WouldFit,
    fmt_rate,
    fmt_s,
    kv_warning,
    plural,
    why_lost,
    why_not_timed,
    would_fit,
)
from cpbook.planner.plan_space import (
    AUTO,
    Estimate,
    estimate,
    objective_value,
    pareto,
    rank_key,
    search,
)
from cpbook.planner.search_space import ServingWorkload
from cpbook.planner.serve_flags import Launch, node_commands
from cpbook.planner.vllm_rules import check_deployment, pool_gpus

RUNNERS_UP = 4


@dataclass(frozen=True)
class Plan:
    """What :func:`plan` found.  ``objective``: what it ranked by (``objective_reason``: why,
    when it chose it); ``ranked``: the deployments that serve the workload, best
    first (``winner`` is the first, ``None`` if there is none); ``dropped``: the others with
    their ``drop`` rule; ``rejected``: how many candidates each vLLM rule rejected;
    ``frontier``: the Pareto set of TTFT, TPOT and output tokens/s per GPU;
    ``frontier_ttft`` / ``frontier_tpot``: the Pareto frontiers of TTFT and of TPOT against
    output tokens/s per GPU; ``reasons``: the winner's case and one line per runner-up;
    ``would_fit``: what would serve the workload when nothing does; ``cp_note``: one line when
    no context-parallel deployment passes vLLM's rules for the model on these GPUs.

    More than eight parameters: a frozen record of one :func:`plan` answer, built by it only.
    """

    model: ModelSpec
    gpu: GPUSpec
    num_gpus: int
    workload: ServingWorkload
    objective: str
    ranked: tuple[Estimate, ...]
    dropped: tuple[Estimate, ...]
    rejected: dict[str, int]
    frontier_ttft: tuple[Estimate, ...]
    frontier_tpot: tuple[Estimate, ...]
    reasons: tuple[str, ...]
    would_fit: WouldFit | None
    objective_reason: str = ""
    frontier: tuple[Estimate, ...] = ()
    cp_note: str | None = None

    @property
    def winner(self) -> Estimate | None:
        return self.ranked[0] if self.ranked else None

    def command(self, e: Estimate | None = None) -> str:
        """The ``vllm serve`` line of ``e`` (default: the winner): its flags, the request length
        as ``--max-model-len``, each replica's share of the concurrency, rounded up, as
        ``--max-num-seqs`` (the busiest replica's batch the plan priced, never fewer), and
        ``--gpu-memory-utilization`` only when the workload sets one (else vLLM's default)."""
        return self.commands(e)[0]

    def commands(self, e: Estimate | None = None) -> list[str]:
        """:meth:`command` for every node ``e`` spans (one line on one node), node 0 first:
        the same line with ``--node-rank R`` (and ``--headless`` off node 0)."""
        e = e or self.winner
        if e is None:
            why = self.would_fit.lines[0] if self.would_fit else "no deployment serves it"
            raise RuleError("plan-fits", "a winning deployment", why=why)
        w = self.workload
        return node_commands(
            self.model,
            e.deployment,
            e.kv_dtype,
            max_model_len=w.request_tokens,
            max_num_seqs=math.ceil(w.concurrency / e.deployment.dp),
            gpu_memory_utilization=w.gpu_memory_utilization,
            launch=Launch(w.nodes(self.gpu).gpus_per_node),
        )


def _variant(model: ModelSpec, gpu: GPUSpec, e: Estimate, w: ServingWorkload, **sizes):
    """``e``'s deployment with ``sizes`` changed, priced with times, or ``None`` if vLLM
    rejects it."""
    deployment = replace(e.deployment, **sizes)
    try:
        check_deployment(model, deployment, e.kv_dtype, model_runner_v2=w.model_runner_v2)
    except ValueError:
        return None
    return estimate(model, gpu, deployment, e.kv_dtype, w)


#: the time each objective but throughput ranks by: its name and :class:`Estimate` attribute
_OBJECTIVE_TIMES = {
    "latency": ("latency", "latency_s"),
    "ttft": ("TTFT", "ttft_s"),
    "tpot": ("TPOT", "tpot_s"),
}


def headline(p: Plan) -> str:
    """The plan in a few words: what context parallelism the winner uses and the one number
    that decides it, or, when nothing fits, the rule and how many GPUs would."""
    w, best = p.workload, p.winner
    if best is None:
        f = p.would_fit
        if f is None:
            return "nothing fits"
        more = f"{f.num_gpus} GPUs would" if f.num_gpus else "no deployment would"
        return f"nothing fits [{f.rule}]: {more}"
    lay, parts = best.deployment, []
    if lay.dcp > 1:
        plain = _variant(p.model, p.gpu, best, w, dcp=1, tpa=False)
        if plain is not None and plain.capacity < w.concurrency:
            parts.append(f"DCP{lay.dcp}: without it {plain.capacity:,} of {w.concurrency:,} fit")
        elif plain is not None and p.objective != "throughput":
            name, attr = _OBJECTIVE_TIMES[p.objective]
            parts.append(
                f"DCP{lay.dcp}: {name} {fmt_s(getattr(best, attr))} vs "
                f"{fmt_s(getattr(plain, attr))} without it"
            )
        elif plain is not None and objective_value(plain, p.objective) == objective_value(
            best, p.objective
        ):
            parts.append(
                f"DCP{lay.dcp}: TPOT {fmt_s(best.tpot_s)} vs {fmt_s(plain.tpot_s)} without it"
            )
        elif plain is not None:
            parts.append(
                f"DCP{lay.dcp}: {fmt_rate(best.tokens_per_s_per_gpu, 2)} vs "
                f"{fmt_rate(plain.tokens_per_s_per_gpu, 2)} tok/s per GPU without it"
            )
    if lay.pcp > 1:
        gpus = lay.tp * lay.pcp
        parts.append(f"PCP{lay.pcp}: each prefill on {gpus} GPUs, TTFT {fmt_s(best.ttft_s)}")
    if not parts:
        spread = f"DP{lay.dp} replicas hold" if lay.dp > 1 else f"TP{lay.tp} holds"
        held = plural(best.capacity, "request")
        parts.append(f"no CP: {spread} {held} ({w.concurrency:,} in flight)")
    return "; ".join(parts)


def _winner_reasons(p: Plan) -> list[str]:
    """Why the winner: what it holds and its times, what CP buys over the same deployment without
    it, GPUs left idle, and the TTFT trade-off on the frontier."""
    model, gpu, w, best = p.model, p.gpu, p.workload, p.winner
    lay = best.deployment
    lines = [
        f"{best.label} on {best.num_gpus} of {p.num_gpus} x {gpu.name}: holds "
        f"{plural(best.capacity, 'request')} of {w.request_tokens:,} tokens "
        f"({w.concurrency:,} needed), weights "
        f"{best.weight_bytes / GB:.1f} GB and KV room {best.kv_budget_bytes / GB:.1f} GB per GPU, "
        f"TTFT {fmt_s(best.ttft_s)}, decode step {fmt_s(best.step_s)}, TPOT with prefill "
        f"interference {fmt_s(best.tpot_s)}, {fmt_rate(best.tokens_per_s_per_gpu)} output "
        f"tok/s per GPU (modelled)."
    ]
    warning = kv_warning(best)
    if warning:
        lines.append(warning)
    if lay.dcp > 1:
        plain = _variant(model, gpu, best, w, dcp=1, tpa=False)
        if plain is not None and plain.capacity < w.concurrency:
            lines.append(
                f"DCP{lay.dcp}: KV room; without it {plain.label} holds "
                f"{plural(plain.capacity, 'such request')}; DCP shards each request's KV over "
                f"{lay.dcp} GPUs."
            )
        elif plain is not None:
            lines.append(
                f"DCP{lay.dcp}: KV reads against collective cost; {plain.label} without it "
                f"takes a decode step of {fmt_s(plain.step_s)} (vs {fmt_s(best.step_s)}) and "
                f"reaches {fmt_rate(plain.tokens_per_s_per_gpu)} tok/s per GPU."
            )
    pool = pool_gpus(model, lay)
    if model.expert_params and pool > lay.tp:
        how = "each split by TP" if lay.moe_tp > 1 else "whole experts spread by EP"
        lines.append(
            f"Experts: every MoE layer runs on all {pool} GPUs of the pool, {how} over them "
            f"({lay.moe_label})."
        )
    if lay.pcp > 1:
        alone = _variant(model, gpu, best, w, pcp=1, dcp=1 if lay.dcp == lay.pcp else lay.dcp)
        if alone is not None and alone.prefill is None:
            lines.append(
                f"PCP{lay.pcp}: weights fit; without it {why_not_timed(alone)} (PCP spreads "
                f"the weights over {lay.tp * lay.pcp} GPUs per replica)."
            )
        elif alone is not None and alone.capacity < w.concurrency:
            lines.append(
                f"PCP{lay.pcp}: KV room; without it {alone.label} holds "
                f"{plural(alone.capacity, 'such request')}."
            )
        elif alone is not None:
            lines.append(
                f"PCP{lay.pcp}: prefill cost, TTFT {fmt_s(best.ttft_s)} against "
                f"{fmt_s(alone.ttft_s)} for {alone.label}."
            )
    if best.num_gpus < p.num_gpus:
        full = [e for e in p.ranked if e.num_gpus == p.num_gpus]
        tail = f"; the best on all {p.num_gpus}, {full[0].label}, " if full else "."
        if full:
            tail += f"reaches {fmt_rate(full[0].tokens_per_s_per_gpu)} tok/s per GPU."
        lines.append(
            f"Uses {best.num_gpus} of {p.num_gpus} GPUs: more replicas would split the same "
            f"{plural(w.concurrency, 'request')}{tail}"
        )
    fastest = p.frontier_ttft[0] if p.frontier_ttft else None
    if (
        p.objective not in ("ttft", "latency")
        and fastest is not None
        and fastest.ttft_s < best.ttft_s
    ):
        lines.append(
            f"Lowest TTFT: {fastest.label}, {fmt_s(fastest.ttft_s)} at "
            f"{fmt_rate(fastest.tokens_per_s_per_gpu)} tok/s per GPU (set a TTFT target or "
            f"objective='ttft' to prefer it)."
        )
    return lines


def _times(e: Estimate) -> str:
    return f", TTFT {fmt_s(e.ttft_s)}" if e.prefill else ""


def _dropped_summary(p: Plan) -> list[str]:
    counts = Counter(e.drop for e in p.dropped)
    if not counts:
        return []
    parts = []
    for rule, n in sorted(counts.items()):
        same = [e for e in p.dropped if e.drop == rule]
        if rule == "model-fits":
            e = min(same, key=lambda e: e.weight_bytes)
            parts.append(f"{n} by [{rule}] (e.g. {e.label}: weights {e.weight_bytes / GB:.0f} GB)")
        else:
            e = max(same, key=lambda e: (e.capacity, -e.ttft_s))
            parts.append(f"{n} by [{rule}] (e.g. {e.label}: holds {e.capacity:,}{_times(e)})")
    return ["Dropped: " + "; ".join(parts) + "."]


def cp_note(model: ModelSpec, num_gpus: int, rows: list[Estimate], kv_dtype: str) -> str | None:
    """One line when no deployment of ``rows`` (those vLLM's rules admit on ``num_gpus`` GPUs)
    uses DCP or PCP: why, by rule, for DCP (GQA: TP above the KV heads) and PCP; else ``None``."""
    if any(e.deployment.dcp > 1 or e.deployment.pcp > 1 for e in rows):
        return None
    why = []
    if not model.use_mla:
        why.append(
            f"DCP needs TP above its {model.num_kv_heads} KV heads, more than {num_gpus} GPUs "
            f"[gqa-dcp-needs-replicated-kv]"
        )
    try:
        check_deployment(model, Deployment(tp=1, pcp=2), kv_dtype)
    except ConfigError as e:
        why.append(f"PCP is refused [{e.rule}]")
    if not why:
        why.append(f"no CP deployment fits on {num_gpus} GPUs")
    return f"No context parallelism applies to {model.name} on {num_gpus} GPUs: {'; '.join(why)}."


def plan(
    model: str | ModelSpec,
    gpu: str | GPUSpec,
    num_gpus: int,
    workload: ServingWorkload,
    *,
    objective: str = AUTO,
    advise: bool = True,
) -> Plan:
    """The best deployment of ``model`` on at most ``num_gpus`` GPUs of ``gpu`` for
    ``workload`` by ``objective``: ``"auto"`` (the default: ``"latency"`` below the
    concurrency at which decode throughput saturates,
    :func:`~cpbook.planner.plan_space.saturation_concurrency`, ``"throughput"`` from it on),
    ``"latency"`` (TTFT plus the other output tokens at TPOT), ``"throughput"`` (steady-state
    output tokens/s per GPU, see :func:`~cpbook.planner.plan_space.estimate`), ``"ttft"`` or
    ``"tpot"``.

    Guarantees: every ranked deployment passes vLLM's rules (``ParallelConfig`` and
    :func:`~cpbook.planner.vllm_rules.check_deployment`), holds ``concurrency`` requests of
    ``prompt_tokens + output_tokens`` tokens and meets the targets; the ranking equals
    :func:`~cpbook.planner.plan_space.brute_force`'s; the best objective never worsens with
    more GPUs or looser targets.  Raises ``ValueError`` for an unknown model, GPU or objective
    or a bad GPU count.  ``advise=False`` leaves ``reasons`` and ``would_fit`` empty (for
    callers that need only the ranking: the property tests, sweeps).
    """
    model, gpu = get_model(model), get_gpu(gpu)
    objective, why = resolve_objective(model, workload, objective)
    key = rank_key(objective)
    cache: dict = {}  # estimate's, shared with the what-would-fit search
    rows, rejected = search(model, gpu, num_gpus, workload, cache=cache)
    ranked = tuple(sorted((e for e in rows if e.drop is None), key=key))
    dropped = tuple(e for e in rows if e.drop is not None)
    p = Plan(
        model,
        gpu,
        num_gpus,
        workload,
        objective,
        ranked,
        dropped,
        dict(rejected),
        tuple(pareto(list(ranked), "ttft_s")),
        tuple(pareto(list(ranked), "tpot_s")),
        (),
        None,
        why,
        tuple(pareto(list(ranked))),
        cp_note(model, num_gpus, rows, workload.kv_dtypes[0]),
    )
    if not advise:
        return p
    if not ranked:
        return replace(p, would_fit=would_fit(model, gpu, num_gpus, workload, objective, cache))
    reasons = _winner_reasons(p)
    seen = {ranked[0].label}
    for e in ranked[1:]:
        if len(seen) > RUNNERS_UP:
            break
        if e.label not in seen:
            seen.add(e.label)
            reasons.append(why_lost(e, ranked[0], workload, objective))
    return replace(p, reasons=tuple(reasons + _dropped_summary(p)))


def estimate_record(e: Estimate, rank: int | None = None) -> dict[str, object]:
    """One deployment as a JSON-ready row (sizes, memory in GB, times in seconds)."""
    lay: Deployment = e.deployment
    return {
        "name": "deployment",
        "rank": rank,
        "label": e.label,
        "tp": lay.tp,
        "dcp": lay.dcp,
        "pcp": lay.pcp,
        "dp": lay.dp,
        "ep": lay.ep,
        "dcp_q_replicate": lay.tpa,
        "kv_cache_dtype": e.kv_dtype,
        "gpus": lay.num_gpus,
        "weights_gb_per_gpu": round(e.weight_bytes / GB, 3),
        "kv_room_gb_per_gpu": round(e.kv_budget_bytes / GB, 3),
        "kv_gb_per_request_per_gpu": round(e.kv_bytes_per_request / GB, 4),
        "holds": e.capacity,
        "ttft_s": round(e.ttft_s, 4) if e.prefill else None,
        "decode_step_s": round(e.step_s, 6) if e.decode else None,
        "tpot_s": round(e.tpot_s, 6) if e.decode else None,
        "latency_s": round(e.latency_s, 4) if e.decode else None,
        "kv_headroom": round(e.kv_headroom, 4),
        "tokens_per_s_per_gpu": round(e.tokens_per_s_per_gpu, 3),
        "decode_tokens_per_s_per_gpu": round(e.decode_tokens_per_s_per_gpu, 3),
        "drop": e.drop,
    }
