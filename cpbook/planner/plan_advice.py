"""The planner's words: why a runner-up lost, and what would serve a workload nothing serves.

:func:`why_lost` splits the cost of an output token (GPU-seconds per token, the inverse of the
steady-state rate) into its prefill and decode parts and names the larger difference.
:func:`would_fit` answers "nothing fits" with numbers: the fewest GPUs that serve the workload,
FP8 KV, the longest prompt and the most requests that fit on these GPUs, and the loosest TTFT /
TPOT target that any deployment holding the requests meets.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from cpbook.core.config import ConfigError
from cpbook.costmodel.memory import Deployment, deployment_max_context
from cpbook.costmodel.specs import GB, GPUSpec, ModelSpec
from cpbook.planner.plan_space import (
    DROP_RULES,
    Cache,
    Estimate,
    estimate,
    gpu_seconds_per_token,
    objective_value,
    rank_key,
    search,
)
from cpbook.planner.search_space import ServingWorkload
from cpbook.planner.vllm_rules import check_deployment

#: the largest replica (TP x PCP GPUs) and deployment :func:`would_fit` sizes
MAX_REPLICA_GPUS = 64
MAX_GPUS = 1 << 14


def plural(n: int, noun: str) -> str:
    """``"1 request"``, ``"16 requests"``: ``n`` with thousands separators and ``noun``."""
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def fmt_rate(x: float, digits: int = 3) -> str:
    """``x`` to ``digits`` significant figures without an exponent: ``"0.147"``, ``"838"``,
    ``"2,640"`` (``format(2637, ".3g")`` would print ``"2.64e+03"``)."""
    v = float(f"{x:.{digits}g}")
    return f"{v:,.0f}" if abs(v) >= 10 ** (digits - 1) else f"{v:.{digits}g}"


def fmt_s(seconds: float) -> str:
    """``"16.4 s"``, ``"18.2 ms"``; ``"not timed"`` for a time not computed (callers say why
    in words where they can: :func:`why_not_timed`)."""
    if seconds == float("inf"):
        return "not timed"
    return f"{seconds:.3g} s" if seconds >= 1 else f"{seconds * 1e3:.3g} ms"


#: below this share of free KV room the winner's line warns (a longer prompt or a burst of
#: requests would be preempted)
KV_HEADROOM_WARNING = 0.10


def why_not_timed(e: Estimate) -> str:
    """Why ``e`` has no times, in words: the weights leave no KV room, or not one request of the
    workload fits in it."""
    if e.drop == "model-fits" or not e.kv_budget_bytes:
        return (
            f"{e.label} does not fit: its weights, {e.weight_bytes / GB:.1f} GB per GPU, leave "
            f"no KV room"
        )
    return (
        f"{e.label} holds no request: {e.kv_budget_bytes / GB:.1f} GB of KV room per GPU "
        f"against {e.kv_bytes_per_request / GB:.1f} GB for one"
    )


def kv_warning(e: Estimate) -> str | None:
    """A line when ``e``'s requests leave less than :data:`KV_HEADROOM_WARNING` of its KV room
    free, else ``None``."""
    if e.kv_headroom >= KV_HEADROOM_WARNING:
        return None
    per = math.ceil(e.batch / e.deployment.dp)
    return (
        f"KV headroom {e.kv_headroom:.1%}: {plural(per, 'request')} per replica use "
        f"{per * e.kv_bytes_per_request / GB:.1f} of {e.kv_budget_bytes / GB:.1f} GB of KV room "
        f"per GPU; longer requests or a burst above {plural(e.capacity, 'request')} are "
        f"preempted."
    )


def _tie(e: Estimate, best: Estimate, objective: str) -> str:
    """Why ``e`` ranks below ``best`` when their objectives round alike: the first tie-break
    of :func:`~cpbook.planner.plan_space.rank_key` that differs."""
    order = {
        "throughput": ("ttft", "tpot", "rate"),
        "ttft": ("rate", "tpot", "ttft"),
        "latency": ("rate", "ttft", "tpot"),
    }
    shown = {
        "ttft": lambda x: f"TTFT {fmt_s(x.ttft_s)}",
        "tpot": lambda x: f"TPOT {fmt_s(x.tpot_s)}",
        "rate": lambda x: f"{fmt_rate(x.tokens_per_s_per_gpu, 4)} tok/s per GPU",
    }
    for name in order.get(objective, ("rate", "ttft", "tpot")):
        if shown[name](e) != shown[name](best):
            return f"{shown[name](e)} vs {shown[name](best)}"
    return "the same numbers; listed by size (fewer GPUs, smaller TP, no EP first)"


def why_lost(e: Estimate, best: Estimate, w: ServingWorkload, objective: str) -> str:
    """One line: ``e``'s objective against ``best``'s and the term that makes the gap (or,
    when they round alike at the planner's resolution, the tie-break that decides)."""
    if objective_value(e, objective) == objective_value(best, objective):
        return f"{e.label}: ties at 2 significant figures; {_tie(e, best, objective)}."
    if objective == "ttft":
        return f"{e.label}: TTFT {fmt_s(e.ttft_s)} vs {fmt_s(best.ttft_s)} ({_replica(e)})."
    if objective == "latency":
        head = f"{e.label}: latency {fmt_s(e.latency_s)} vs {fmt_s(best.latency_s)}"
        prefill, decode = (
            e.ttft_s - best.ttft_s,
            e.latency_s - e.ttft_s - (best.latency_s - best.ttft_s),
        )
        if prefill >= decode:
            return (
                f"{head}: prefill cost, TTFT {fmt_s(e.ttft_s)} vs {fmt_s(best.ttft_s)} "
                f"({_prefill_term(e, best)})."
            )
        return (
            f"{head}: decode cost, TPOT {fmt_s(e.tpot_s)} vs {fmt_s(best.tpot_s)} "
            f"({_step(e, best)})."
        )
    if objective == "tpot":
        return f"{e.label}: TPOT {fmt_s(e.tpot_s)} vs {fmt_s(best.tpot_s)} ({_step(e, best)})."
    gap = 1 - e.tokens_per_s_per_gpu / best.tokens_per_s_per_gpu
    head = f"{e.label}: {fmt_rate(e.tokens_per_s_per_gpu)} tok/s per GPU ({gap:.1%} less)"
    (pe, de), (pb, db) = (gpu_seconds_per_token(x, w.output_tokens) for x in (e, best))
    if pe - pb >= de - db:
        return (
            f"{head}: prefill costs {pe * 1e3:.3g} vs {pb * 1e3:.3g} GPU-ms per output token "
            f"(TTFT {fmt_s(e.ttft_s)}, {_replica(e)})."
        )
    if e.step_s <= best.step_s:  # as fast a step, on more GPUs per request
        why = (
            f"a step of {fmt_s(e.step_s)} on {plural(e.num_gpus, 'GPU')} for "
            f"{plural(e.batch, 'request')} vs {fmt_s(best.step_s)} on {best.num_gpus} for "
            f"{best.batch:,}"
        )
    else:
        why = f"decode step {fmt_s(e.step_s)}, {_step(e, best)}"
    return f"{head}: decode costs {de * 1e3:.3g} vs {db * 1e3:.3g} GPU-ms per output token ({why})."


def _prefill_term(e: Estimate, best: Estimate) -> str:
    """The prefill term (compute, TP or CP collectives, EP all-to-all) that grew most over
    ``best``'s, or the GPUs each prefill runs on."""
    a, b = e.prefill, best.prefill
    terms = {
        "compute": a.compute_s - b.compute_s,
        "TP collectives": a.tp_comm_s - b.tp_comm_s,
        "CP collectives": a.cp_comm_s - b.cp_comm_s,
        "EP all-to-all": a.ep_comm_s - b.ep_comm_s,
    }
    name, d = max(terms.items(), key=lambda kv: kv[1])
    if d <= 0:
        return _replica(e)
    return f"{name} +{fmt_s(d)}, {_replica(e)}"


def _replica(e: Estimate) -> str:
    n = e.deployment.tp * e.deployment.pcp
    return f"{plural(n, 'GPU')} per replica"


def _step(e: Estimate, best: Estimate) -> str:
    """The decode-step term (bytes read, compute, collectives) that grew most over ``best``'s."""
    a, b = e.decode, best.decode
    terms = {
        "HBM reads": a.memory_s - b.memory_s,
        "compute": a.compute_s - b.compute_s,
        "collective cost": a.comm_s - b.comm_s,
        "prefill chunks": a.prefill_s - b.prefill_s,
    }
    name, d = max(terms.items(), key=lambda kv: kv[1])
    if d <= 0:
        return f"batch {e.batch:,} on {e.num_gpus} GPUs"
    return f"{name} +{fmt_s(d)} per step"


@dataclass(frozen=True)
class WouldFit:
    """What would serve a workload that no deployment of ``num_gpus`` serves.  ``rule``: the
    last drop rule every deployment failed (:data:`~cpbook.planner.plan_space.DROP_RULES`);
    ``num_gpus``: the fewest GPUs that would (``None`` beyond :data:`MAX_GPUS`), with
    ``gpus_deployment``; ``fp8_kv``: the best deployment once FP8 KV is allowed (``None`` if it is
    already or it does not help); ``prompt_tokens`` / ``concurrency``: the longest prompt and
    the most requests that fit on these GPUs (``None``: not even one); ``ttft_target_s`` /
    ``tpot_target_s``: the loosest target a deployment holding the requests meets.

    More than eight parameters: a frozen record of the advice, built by :func:`would_fit` only.
    """

    rule: str
    num_gpus: int | None
    gpus_deployment: Estimate | None
    fp8_kv: Estimate | None
    prompt_tokens: int | None
    concurrency: int | None
    ttft_target_s: float | None
    tpot_target_s: float | None
    lines: tuple[str, ...]


def _best(
    model: ModelSpec, gpu: GPUSpec, n: int, w: ServingWorkload, objective: str, cache: Cache
) -> Estimate | None:
    rows, _ = search(model, gpu, n, w, cache=cache)
    ok = [e for e in rows if e.drop is None]
    return min(ok, key=rank_key(objective)) if ok else None


def _largest(lo: int, hi: int, ok: Callable[[int], bool], guess: int | None) -> int | None:
    """The largest ``x`` in ``[lo, hi]`` with ``ok(x)`` (``ok`` true up to a point), or None.
    ``guess``, an upper bound from memory alone, is tried first: if it passes and ``guess + 1``
    does not, it is the answer; else bisection below it."""
    if guess is not None:
        guess = min(guess, hi)
        if guess < lo:
            return None
        if ok(guess):
            if guess == hi or not ok(guess + 1):
                return guess
            lo = guess + 1
        else:
            hi = guess - 1
    if hi < lo or not ok(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
    return lo


def _fewest_gpus(
    model: ModelSpec, gpu: GPUSpec, w: ServingWorkload, objective: str, cache: Cache
) -> Estimate | None:
    """The deployment with the fewest GPUs that serves ``w`` (ties: the best by
    ``objective``): for every replica shape (TP x PCP <= :data:`MAX_REPLICA_GPUS`; PCP > 1 only
    where it can matter, with a TTFT target or sparse MLA), the least DP that serves it, by
    doubling then bisection (capacity grows and TPOT falls with DP; TTFT does not depend on
    it)."""
    best: Estimate | None = None
    key = rank_key(objective)
    eps = (False, True) if model.expert_params else (False,)
    pcps = MAX_REPLICA_GPUS if (w.ttft_target_s is not None or model.sparse_mla) else 1
    for tp, pcp in itertools.product(range(1, MAX_REPLICA_GPUS + 1), range(1, pcps + 1)):
        if tp * pcp > MAX_REPLICA_GPUS:
            continue
        dcps = [d for d in range(1, tp + 1) if tp % d == 0] if pcp == 1 else {1, pcp, tp * pcp}
        for dcp, ep, kv in itertools.product(sorted(dcps), eps, w.kv_dtypes):
            for tpa in (False, True) if model.use_mla and dcp > 1 else (False,):
                low = 2 if ep and tp * pcp == 1 else 1
                base = Deployment(tp=tp, dcp=dcp, pcp=pcp, dp=low, ep=ep, tpa=tpa)
                try:
                    check_deployment(model, base, kv, model_runner_v2=w.model_runner_v2)
                except ConfigError:
                    continue
                limit = (best.num_gpus if best else MAX_GPUS) // (tp * pcp)

                def serves(dp: int) -> Estimate:
                    deployment = replace(base, dp=dp)
                    return estimate(model, gpu, deployment, kv, w, time_dropped=False, cache=cache)

                lo, hi = low, low
                e = serves(hi) if hi <= limit else None
                while e is not None and e.drop not in (None, "ttft-target") and hi < limit:
                    lo, hi = hi + 1, min(2 * hi, limit)
                    e = serves(hi)
                if e is None or e.drop is not None:
                    continue
                while lo < hi:  # the least DP in [lo, hi] that serves w
                    mid = (lo + hi) // 2
                    lo, hi = (lo, mid) if serves(mid).drop is None else (mid + 1, hi)
                found = serves(hi)
                if best is None or (found.num_gpus, key(found)) < (best.num_gpus, key(best)):
                    best = found
    return best


def would_fit(
    model: ModelSpec,
    gpu: GPUSpec,
    num_gpus: int,
    w: ServingWorkload,
    objective: str,
    cache: Cache | None = None,
) -> WouldFit:
    """:class:`WouldFit` for a workload no deployment of ``num_gpus`` GPUs serves; ``cache``:
    the search's (:func:`~cpbook.planner.plan_space.estimate`'s, per model and GPU) to reuse."""
    cache = {} if cache is None else cache
    rows, _ = search(model, gpu, num_gpus, w, time_dropped=True, cache=cache)
    reached = max((DROP_RULES.index(e.drop) for e in rows), default=0)
    rule = DROP_RULES[reached]
    lines = [
        f"No deployment of at most {num_gpus} x {gpu.name} serves "
        f"{plural(w.concurrency, 'request')} of {w.request_tokens:,} tokens{_targets(w)}: "
        f"every one fails [{rule}]."
    ]
    more = _fewest_gpus(model, gpu, w, objective, cache)
    if more is not None:
        lines.append(
            f"{more.num_gpus} GPUs would: {more.label} holds "
            f"{plural(more.capacity, 'request')}, TTFT {fmt_s(more.ttft_s)}, "
            f"TPOT {fmt_s(more.tpot_s)}."
        )
    fp8 = None
    if "fp8" not in w.kv_dtypes:
        more_kv = replace(w, kv_dtypes=w.kv_dtypes + ("fp8",))
        fp8 = _best(model, gpu, num_gpus, more_kv, objective, cache)
        if fp8 is not None:
            lines.append(
                f"FP8 KV (--kv-cache-dtype fp8) would on {num_gpus} GPUs: {fp8.label} holds "
                f"{plural(fp8.capacity, 'request')}."
            )

    def fits(**change) -> bool:
        return _best(model, gpu, num_gpus, replace(w, **change), objective, cache) is not None

    roomy = [e for e in rows if e.drop != "model-fits"]
    longest = [
        deployment_max_context(model, gpu, e.deployment, e.kv_dtype, **_memory(w))
        // math.ceil(w.concurrency / e.deployment.dp)
        for e in roomy
    ]
    guess = max(longest, default=0) - w.output_tokens
    prompt = _largest(1, w.prompt_tokens - 1, lambda p: fits(prompt_tokens=p), guess)
    if prompt is not None:
        lines.append(
            f"A prompt of at most {prompt:,} tokens would ({w.output_tokens:,} output tokens)."
        )
    on_time = [e.capacity for e in roomy if e.prefill is not None and _meets_ttft(e, w)]
    conc = _largest(1, w.concurrency - 1, lambda c: fits(concurrency=c), max(on_time, default=0))
    if conc is not None:
        lines.append(f"At most {plural(conc, 'request')} in flight would fit.")
    held = [e for e in rows if e.capacity >= w.concurrency and e.decode is not None]
    ttft_t = tpot_t = None
    if w.ttft_target_s is not None:
        meet = [e for e in held if w.tpot_target_s is None or e.tpot_s <= w.tpot_target_s]
        if meet:
            ttft_t = min(e.ttft_s for e in meet)
            lines.append(f"A TTFT target of {fmt_s(ttft_t)} would.")
    if w.tpot_target_s is not None:
        meet = [e for e in held if w.ttft_target_s is None or e.ttft_s <= w.ttft_target_s]
        if meet:
            tpot_t = min(e.tpot_s for e in meet)
            lines.append(f"A TPOT target of {fmt_s(tpot_t)} would.")
    return WouldFit(
        rule,
        more.num_gpus if more else None,
        more,
        fp8,
        prompt,
        conc,
        ttft_t,
        tpot_t,
        tuple(lines),
    )


def _memory(w: ServingWorkload) -> dict[str, float]:
    return {"gpu_memory_utilization": w.memory_utilization}


def _meets_ttft(e: Estimate, w: ServingWorkload) -> bool:
    return w.ttft_target_s is None or e.ttft_s <= w.ttft_target_s


def _targets(w: ServingWorkload) -> str:
    parts = [f"TTFT <= {fmt_s(w.ttft_target_s)}"] if w.ttft_target_s is not None else []
    parts += [f"TPOT <= {fmt_s(w.tpot_target_s)}"] if w.tpot_target_s is not None else []
    return f" with {' and '.join(parts)}" if parts else ""
