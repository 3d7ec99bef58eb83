"""The article's three-question decision path, kept as a check on the planner (chapter 8).

The article (§7) decides in turn: (1) does one request exceed what a GPU holds? Yes → DCP;
(2) with that, is TTFT still too high at moderate concurrency? Yes → add PCP; (3) short
(< 32K) and very concurrent? → pure DP, no context parallelism.  :func:`decision_path` asks
the three questions literally, on the smallest TP whose weights fit, with the cost model's
memory and TTFT and only the sizes ``ParallelConfig`` admits: it knows neither the requested
concurrency nor the rules vLLM v0.34 adds for a model.  It is not the algorithm
(:func:`~cpbook.planner.plan.plan` is); :func:`path_vs_plan` sets its answer beside the
planner's and, where they differ, says why from the planner's own verdict on the path's
deployment: a rule vLLM applies, a drop rule it fails, or the cost it loses on.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from cpbook.core.config import ConfigError
from cpbook.costmodel.latency import ttft
from cpbook.costmodel.memory import Deployment, deployment_max_context
from cpbook.costmodel.specs import GPUSpec, ModelSpec, get_gpu, get_model
from cpbook.planner.plan import Plan, plan
from cpbook.planner.plan_advice import fmt_s, plural, why_lost
from cpbook.planner.plan_space import estimate
from cpbook.planner.search_space import ServingWorkload, check_num_gpus
from cpbook.planner.vllm_rules import check_deployment

#: the article's "short" requests, and the requests per GPU this module calls "very concurrent"
SHORT_CONTEXT_TOKENS = 32 * 1024
CROWDED_PER_GPU = 16


@dataclass(frozen=True)
class PathAnswer:
    """The deployment the decision path ends on (DP over the GPUs TP x PCP leaves), and the
    answer to each question in words."""

    deployment: Deployment
    steps: tuple[str, ...]


def _room(model: ModelSpec, gpu: GPUSpec, deployment: Deployment, w: ServingWorkload) -> int | None:
    """The longest request one replica of ``deployment`` holds; ``None`` if ``ParallelConfig``
    rejects the sizes or the weights do not fit."""
    try:
        deployment.config(model)
        mem = {"gpu_memory_utilization": w.memory_utilization}
        return deployment_max_context(model, gpu, deployment, w.kv_dtypes[0], **mem)
    except ValueError:
        return None


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def decision_path(
    model: str | ModelSpec, gpu: str | GPUSpec, num_gpus: int, w: ServingWorkload
) -> PathAnswer:
    """The three questions for ``w`` on ``num_gpus`` GPUs, with the first KV dtype of ``w``.

    (1) If one request of ``w.request_tokens`` tokens does not fit the smallest TP, the
    smallest DCP (on any TP whose weights fit) with which it does; (2) if TTFT exceeds the
    target and fewer than :data:`CROWDED_PER_GPU` requests per GPU are in flight, the smallest
    PCP that meets it (else the largest there is room for), with the smallest DCP
    ``ParallelConfig`` admits beside it that holds the request; (3) otherwise DP replicas.
    Raises ``ConfigError`` (``model-fits``, ``request-fits``) when no TP holds the weights or
    no DCP holds the request."""
    model, gpu = get_model(model), get_gpu(gpu)
    check_num_gpus(num_gpus)
    tokens, target = w.request_tokens, w.ttft_target_s
    rooms = {t: _room(model, gpu, Deployment(tp=t), w) for t in _divisors(num_gpus)}
    tps = [t for t, room in rooms.items() if room is not None]
    if not tps:
        raise ConfigError("model-fits", "the weights to fit at some TP", num_gpus=num_gpus)
    lay = Deployment(tp=tps[0])
    steps = [f"TP{lay.tp}: the smallest TP whose weights fit on one {gpu.name}."]
    if rooms[lay.tp] < tokens:
        fits = [
            Deployment(tp=t, dcp=d)
            for t in tps
            for d in _divisors(t)[1:]
            if (_room(model, gpu, Deployment(tp=t, dcp=d), w) or 0) >= tokens
        ]
        if not fits:
            raise ConfigError(
                "request-fits", "one request to fit with DCP", tokens=tokens, num_gpus=num_gpus
            )
        lay = min(fits, key=lambda x: (x.dcp, x.tp))
        steps.append(
            f"1. One request ({tokens:,} tokens) does not fit TP{tps[0]} "
            f"({rooms[tps[0]]:,} tokens): DCP{lay.dcp} on TP{lay.tp}."
        )
    else:
        steps.append(f"1. One request ({tokens:,} tokens) fits TP{lay.tp}: no DCP.")
    crowded = w.concurrency >= CROWDED_PER_GPU * num_gpus
    first = ttft(model, gpu, lay, w.prompt_tokens).total_s
    if target is not None and first > target and not crowded:
        step = f"2. TTFT {fmt_s(first)} exceeds the {fmt_s(target)} target: add PCP"
        options, pcps = [], _divisors(num_gpus // lay.tp)[1:]
        for p in pcps:
            for d in sorted({1, p, lay.tp * p}):
                if (_room(model, gpu, replace(lay, pcp=p, dcp=d), w) or 0) >= tokens:
                    options.append(replace(lay, pcp=p, dcp=d))
                    break
        on_time = [o for o in options if ttft(model, gpu, o, w.prompt_tokens).total_s <= target]
        if on_time or options:
            lay = (on_time or options)[0 if on_time else -1]
            t = ttft(model, gpu, lay, w.prompt_tokens).total_s
            steps.append(f"{step}; PCP{lay.pcp} predicts {fmt_s(t)}.")
        elif not pcps:
            steps.append(f"{step}, but TP{lay.tp} already uses the {num_gpus} GPUs.")
        else:
            steps.append(f"{step}, but no PCP size holds the request on {num_gpus} GPUs.")
    elif lay.dcp == 1 and w.prompt_tokens < SHORT_CONTEXT_TOKENS and crowded:
        dp = num_gpus // lay.tp
        short = f"3. Short prompts (< {SHORT_CONTEXT_TOKENS // 1024}K), {w.concurrency:,} in flight"
        if lay.tp == 1:
            steps.append(f"{short}: pure DP (DP{dp}), no context parallelism.")
        else:
            steps.append(
                f"{short}: pure DP, but the weights need TP{lay.tp}, so DP{dp} x TP{lay.tp}; "
                f"no context parallelism."
            )
    else:
        steps.append(
            "2./3. Neither a TTFT problem nor short, crowded traffic: keep the deployment."
        )
    dp = num_gpus // (lay.tp * lay.pcp)
    return PathAnswer(replace(lay, dp=dp), tuple(steps))


@dataclass(frozen=True)
class PathCheck:
    """The decision path beside the planner on one question: ``path`` (``None`` if it finds no
    deployment), ``plan``, whether both end on the same deployment (or both on none), and
    ``reason``: why they do not, in one line (empty when they agree)."""

    path: PathAnswer | None
    plan: Plan
    agree: bool
    reason: str

    @property
    def same_cp(self) -> bool | None:
        """Whether both turn DCP and PCP on or off alike (``None``: one of them has no
        deployment)."""
        if self.path is None or self.plan.winner is None:
            return None
        a, b = self.path.deployment, self.plan.winner.deployment
        return (a.dcp > 1, a.pcp > 1) == (b.dcp > 1, b.pcp > 1)


def path_vs_plan(
    model: str | ModelSpec,
    gpu: str | GPUSpec,
    num_gpus: int,
    w: ServingWorkload,
    objective: str = "throughput",
) -> PathCheck:
    """:func:`decision_path` against :func:`~cpbook.planner.plan.plan` on the same question.
    The reason is the planner's verdict on the path's deployment: the vLLM v0.34 rule that rejects
    it, the drop rule it fails (capacity, a target), or, when it serves the workload, its rank
    and :func:`~cpbook.planner.plan_advice.why_lost`'s line."""
    p = plan(model, gpu, num_gpus, w, objective=objective)
    try:
        path = decision_path(p.model, p.gpu, num_gpus, w)
    except ConfigError as e:
        return PathCheck(None, p, p.winner is None, "" if p.winner is None else str(e))
    lay, kv, best = path.deployment, w.kv_dtypes[0], p.winner
    if best is not None and (best.deployment, best.kv_dtype) == (lay, kv):
        return PathCheck(path, p, True, "")
    try:
        check_deployment(p.model, lay, kv, model_runner_v2=w.model_runner_v2)
    except ConfigError as e:
        return PathCheck(path, p, False, f"vLLM v0.34 does not run {lay.label}: [{e.rule}].")
    e = estimate(p.model, p.gpu, lay, kv, w)
    if e.drop == "holds-concurrency":
        why = f"{e.label} holds {e.capacity:,} of {plural(w.concurrency, 'request')}."
    elif e.drop == "ttft-target":
        why = f"{e.label}'s TTFT {fmt_s(e.ttft_s)} misses the {fmt_s(w.ttft_target_s)} target."
    elif e.drop is not None:
        why = f"{e.label} fails [{e.drop}]."
    else:
        rank = 1 + next(
            i for i, x in enumerate(p.ranked) if (x.deployment, x.kv_dtype) == (lay, kv)
        )
        why = f"{why_lost(e, best, w, objective)} Ranked {rank} of {len(p.ranked)}."
    return PathCheck(path, p, False, why)
