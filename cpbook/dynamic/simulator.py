"""A deterministic discrete-event simulation of a mixed-length workload under four policies:
static DP, static CP = N, dynamic CP and dynamic CP + TPA (chapter 7).

The system modelled (every assumption is a parameter of :class:`Cluster` or stated here):

* **Prefill/decode disaggregated.**  A prefill pool of ``prefill_gpus`` GPUs runs each prompt
  on the CP size the policy gives it (PCP: the work split evenly over ``n`` GPUs of an aligned
  group), first come first served, each GPU busy until its work ends.  Prefill seconds of a
  ``P``-token prompt on ``n`` GPUs: ``(2·active_params·P + attention(P)) / (n·flops·mfu)``,
  attention from :func:`cpbook.costmodel.prefill_flops`.  The first token leaves with the
  prefill: TTFT = prefill end − arrival (the KV transfer to the decode pool is not modelled).
* **Decode pool: DP attention + expert parallelism** on ``decode_gpus`` GPUs.  Every layer's
  expert all-to-all synchronises all GPUs (vLLM RFC #29295), so the pool advances in global
  steps and one step lasts ``t_weights + layers · max_g attention_g``: ``t_weights`` streams a
  GPU's weights (:func:`cpbook.costmodel.deployment_weight_bytes`), ``attention_g`` reads the KV
  tokens GPU ``g`` holds and pays the collectives of each CP group with requests on it
  (:func:`cpbook.dynamic.router.cp_line`: α per call, β per request, TPA's extra ``q_proj``).
* **Memory.**  A request reserves ``P + O`` KV tokens when admitted to decode (no preemption):
  on one GPU (CP = 1) or ``ceil((P + O)/n)`` on each GPU of its group.  Requests wait in one
  queue, admitted first-fit in arrival order whenever memory frees; a request larger than its
  CP size's whole capacity is rejected.  CP groups are aligned blocks of ``n`` GPUs; a request
  goes to the GPU or group with the most free KV.
* The policy sees the true total length ``P + O`` (an oracle for the output length).

The event loop jumps from event to event (a prefill ends, a request finishes): between two
events every GPU's attention time is linear in the step index, so the step times of the whole
interval come from one numpy expression.  Same seed, same result, to the bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from cpbook import costmodel as cm
from cpbook.dynamic.migration import migration_plan
from cpbook.dynamic.router import Router, cp_line
from cpbook.dynamic.workload import SimWorkload, make_workload

__all__ = [
    "Cluster",
    "POLICIES",
    "policy_router",
    "simulate",
    "sweep",
]

POLICIES = ("static_dp", "static_cp", "dynamic_cp", "dynamic_cp_tpa")


_NEVER = np.iinfo(np.int64).max // 2  # steps until a migration that never comes


@dataclass(frozen=True)
class Cluster:
    """Hardware, model and the cost-model constants of the simulation (module docstring)."""

    model: str = "DeepSeek-V3"
    gpu: str = "H200"
    decode_gpus: int = 8
    prefill_gpus: int = 32
    cp_sizes: tuple[int, ...] = (1, 2, 4, 8)
    static_cp: int = 8
    mfu: float = 0.5
    router_num_reqs: int = 1
    link: str = "NVLink4"

    @property
    def spec(self) -> tuple[cm.ModelSpec, cm.GPUSpec]:
        return cm.MODELS[self.model], cm.GPUS[self.gpu]

    def capacity_tokens(self) -> int:
        """KV tokens one decode GPU holds (DP attention + EP over the decode pool)."""
        m, g = self.spec
        layout = cm.Deployment(dp=self.decode_gpus, tp=1, ep=True)
        return math.floor(
            cm.deployment_kv_budget(m, g, layout) / cm.deployment_kv_bytes_per_token(m, layout)
        )

    def weights_step_s(self) -> float:
        """Seconds one decode step spends streaming a GPU's weights."""
        m, g = self.spec
        layout = cm.Deployment(dp=self.decode_gpus, tp=1, ep=True)
        return cm.deployment_weight_bytes(m, layout) / (
            g.hbm_bw_bytes_per_s * cm.DEFAULT_HBM_EFFICIENCY
        )

    def attention_terms(self, n: int, tpa: bool) -> tuple[float, float, float]:
        """Per layer: ``(alpha, beta, gamma)`` — seconds per step of a CP group of ``n`` with
        requests on it, per request on it, per KV token a GPU holds."""
        m, g = self.spec
        link = cm.LINKS[self.link]
        a1, s1 = cp_line(m, g, n, tpa=tpa, num_reqs=1, link=link)
        a2, _ = cp_line(m, g, n, tpa=tpa, num_reqs=2, link=link)
        return a1 - (a2 - a1), a2 - a1, s1 * n

    def prefill_s(self, prompt: np.ndarray, n: np.ndarray) -> np.ndarray:
        """Seconds to prefill each prompt on ``n`` GPUs (ideal split)."""
        m, g = self.spec
        p = prompt.astype(np.float64)
        flops = 2.0 * m.params_per_token * p + cm.prefill_flops(m, 1)[1] * p**2
        return flops / (n * g.bf16_flops * self.mfu)


def policy_router(cluster: Cluster, policy: str) -> Router:
    """The :class:`~cpbook.dynamic.router.Router` of ``policy`` on ``cluster``."""
    m, g = cluster.spec
    cap = cluster.capacity_tokens()
    if policy == "static_dp":
        return Router([], [1])
    if policy == "static_cp":
        return Router([0], [1, cluster.static_cp], model=m, pool_size=cluster.decode_gpus)
    if policy in ("dynamic_cp", "dynamic_cp_tpa"):
        return Router.modelled(
            m,
            g,
            cluster.cp_sizes,
            tpa=policy == "dynamic_cp_tpa",
            num_reqs=cluster.router_num_reqs,
            link=cm.LINKS[cluster.link],
            pool_size=cluster.decode_gpus,
            capacity_tokens=cap,
        )
    raise ValueError(f"[policy] requires policy in {POLICIES}; got {policy!r}")


def _prefill(cluster: Cluster, w: SimWorkload, sizes: np.ndarray) -> np.ndarray:
    """Prefill end time of every request: FCFS on aligned groups of its size."""
    free_at = np.zeros(cluster.prefill_gpus)
    dur = cluster.prefill_s(w.prompt, sizes)
    end = np.empty(len(w.arrival))
    for i in range(len(w.arrival)):
        n = int(sizes[i])
        groups = free_at.reshape(-1, n).max(axis=1)
        j = int(np.argmin(groups))
        end[i] = max(w.arrival[i], groups[j]) + dur[i]
        free_at[j * n : (j + 1) * n] = end[i]
    return end


def simulate(
    cluster: Cluster,
    w: SimWorkload,
    policy: str,
    router: Router | None = None,
    expected_output: int | None = None,
) -> dict:
    """Run ``policy`` on workload ``w`` (with ``router`` instead of the policy's own, if given;
    CP groups pay TPA's costs when ``router.tpa``); returns per-request times and metrics.

    With ``expected_output``, a request starts on the size the router gives its prompt plus
    ``expected_output`` tokens and, if its true length routes it higher, **migrates** when its
    context reaches that size's threshold (or its first GPU's capacity): every GPU waits while
    the tokens that change owner cross one link (``alpha + bytes / bandwidth``, the bytes of
    :func:`cpbook.dynamic.migration.migration_plan`).  The destination's KV is reserved at
    admission.
    """
    router = policy_router(cluster, policy) if router is None else router
    tpa = router.tpa
    g_n, cap = cluster.decode_gpus, cluster.capacity_tokens()
    m, _ = cluster.spec
    layers, link = m.num_layers, cm.LINKS[cluster.link]
    sizes = router.route_many(w.total)
    start = (
        sizes
        if expected_output is None
        else np.minimum(sizes, router.route_many(w.prompt + expected_output))
    )
    thr = np.asarray([0.0] + router.thresholds)[[router.cp_sizes.index(n) for n in sizes]]
    mig_ctx = np.maximum(np.minimum(thr, start * cap), w.prompt + 1).astype(np.int64)
    migrates = (start < sizes) & (mig_ctx < w.total - 1)
    n_req = len(w.arrival)
    rejected = w.total > sizes * cap
    prefill_end = _prefill(cluster, w, start)
    ttft = prefill_end - w.arrival
    t_w = cluster.weights_step_s()
    terms = {n: cluster.attention_terms(n, tpa) for n in set(sizes.tolist()) | {1}}
    gamma = terms[1][2]

    order = np.argsort(prefill_end, kind="stable")
    order = order[~rejected[order]]
    free = np.full(g_n, float(cap))
    tok = np.zeros(g_n)  # KV tokens held per GPU (fractional under CP)
    grow = np.zeros(g_n)  # tokens added per step per GPU
    group_reqs: dict[tuple[int, int], int] = {}  # (n, group) -> requests decoding on it
    finish = np.full(n_req, np.nan)
    cur_n, cur_j, dest_j = start.copy(), np.full(n_req, -1), np.full(n_req, -1)
    act_id, act_rem, act_mig = (np.empty(0, np.int64) for _ in range(3))
    waiting: list[int] = []
    now, nxt, steps, decode_tokens, peak = 0.0, 0, 0, 0, 0.0
    moved_bytes, n_moved = 0, 0
    clock, produced = [0.0], [0]  # decode tokens produced by each event time

    def place(i: int, n: int, j: int, tokens: float, sign: int) -> None:
        sl = slice(j * n, (j + 1) * n)
        tok[sl] += sign * tokens / n
        grow[sl] += sign / n
        if n > 1:
            group_reqs[(n, j)] = group_reqs.get((n, j), 0) + sign

    def hold(n: int, tokens: int) -> tuple[int, float] | None:
        need = float(-(-tokens // n))
        gfree = free.reshape(-1, n).min(axis=1)
        j = int(np.argmax(gfree))
        if gfree[j] < need:
            return None
        free[j * n : (j + 1) * n] -= need
        return j, need

    def admit(i: int) -> bool:
        first = int(mig_ctx[i]) if migrates[i] else int(w.total[i])
        dest = hold(int(sizes[i]), int(w.total[i])) if migrates[i] else None
        if migrates[i] and dest is None:
            return False
        got = hold(int(start[i]), first)
        if got is None:
            if dest is not None:
                n = int(sizes[i])
                free[dest[0] * n : (dest[0] + 1) * n] += dest[1]
            return False
        cur_j[i] = got[0]
        dest_j[i] = -1 if dest is None else dest[0]
        place(i, int(start[i]), got[0], float(w.prompt[i]), 1)
        return True

    def release(i: int, n: int, j: int, reserved: int, tokens: int) -> None:
        free[j * n : (j + 1) * n] += float(-(-reserved // n))
        place(i, n, j, float(tokens), -1)

    def migrate(i: int) -> float:
        nonlocal moved_bytes, n_moved
        ctx, n0, j0, n1, j1 = (
            int(mig_ctx[i]),
            int(start[i]),
            int(cur_j[i]),
            int(sizes[i]),
            int(dest_j[i]),
        )
        release(i, n0, j0, ctx, ctx)
        place(i, n1, j1, float(ctx), 1)
        cur_n[i], cur_j[i] = n1, j1
        plan = migration_plan(ctx, n0, n1)  # interleave 1 on both sides
        new_rank = {j1 * n1 + r: r for r in range(n1)}
        kept = sum(
            int(plan[r, new_rank[j0 * n0 + r]]) for r in range(n0) if j0 * n0 + r in new_rank
        )
        moved = (ctx - kept) * cm.kv_bytes_per_token(m)
        moved_bytes, n_moved = moved_bytes + moved, n_moved + 1
        return link.alpha_s + moved / link.bw_bytes_per_s

    def finish_request(i: int) -> None:
        n1, tokens = int(sizes[i]), int(w.total[i] - 1)
        if dest_j[i] >= 0 and cur_n[i] != n1:  # never reached its migration point
            free[dest_j[i] * n1 : (dest_j[i] + 1) * n1] += float(-(-int(w.total[i]) // n1))
            release(i, int(cur_n[i]), int(cur_j[i]), int(mig_ctx[i]), tokens)
        else:
            release(i, int(cur_n[i]), int(cur_j[i]), int(w.total[i]), tokens)

    while nxt < len(order) or waiting or len(act_id):
        t_next = prefill_end[order[nxt]] if nxt < len(order) else math.inf
        if not len(act_id):
            now = max(now, t_next)
        else:
            fixed = np.zeros(g_n)
            for (n, j), cnt in group_reqs.items():
                if cnt:
                    a, b, _ = terms[n]
                    fixed[j * n : (j + 1) * n] += a + b * cnt
            k_max = int(min(act_rem.min(), act_mig.min()))
            ks = np.arange(k_max)
            per_gpu = gamma * (tok[:, None] + grow[:, None] * ks[None, :]) + fixed[:, None]
            dt = t_w + layers * per_gpu.max(axis=0)
            ends = now + np.cumsum(dt)
            k = min(k_max, int(np.searchsorted(ends, t_next)) + 1)
            now = float(ends[k - 1])
            steps += k
            decode_tokens += k * len(act_id)
            tok += grow * k
            clock.append(now)
            produced.append(decode_tokens)
            act_rem, act_mig = act_rem - k, act_mig - k
            for i in act_id[act_mig == 0].tolist():
                now += migrate(i)
            act_mig = np.where(act_mig == 0, _NEVER, act_mig)
            done = act_rem == 0
            for i in act_id[done].tolist():
                finish[i] = now
                finish_request(i)
            act_id, act_rem, act_mig = act_id[~done], act_rem[~done], act_mig[~done]
        while nxt < len(order) and prefill_end[order[nxt]] <= now:
            waiting.append(int(order[nxt]))
            nxt += 1
        still, new = [], []
        for i in waiting:
            (new if admit(i) else still).append(i)
        waiting = still
        if new:
            act_id = np.concatenate([act_id, np.array(new, np.int64)])
            act_rem = np.concatenate([act_rem, w.output[new] - 1])
            act_mig = np.concatenate(
                [act_mig, np.where(migrates[new], mig_ctx[new] - w.prompt[new], _NEVER)]
            )
        peak = max(peak, 1.0 - float(free.min()) / cap)
        if not len(act_id) and waiting and nxt == len(order):
            raise RuntimeError("[decode-progress] requires an admissible request; none fits")
    window = float(np.interp(w.arrival[-1], clock, produced)) / w.arrival[-1]
    out = _summary(
        w,
        policy,
        router,
        sizes,
        rejected,
        ttft,
        prefill_end,
        finish,
        steps,
        decode_tokens,
        peak,
        window,
    )
    return {**out, "migrations": n_moved, "migrated_bytes": int(moved_bytes)}


def _summary(
    w, policy, router, sizes, rejected, ttft, prefill_end, finish, steps, tokens, peak, window
):
    """The metrics; ``throughput_tok_s``: decode tokens per second while requests arrive."""
    ok = ~rejected
    tpot = np.where(w.output > 1, (finish - prefill_end) / np.maximum(w.output - 1, 1), 0.0)
    pct = lambda x, q: float(np.percentile(x[ok], q) * 1e3) if ok.any() else float("nan")  # noqa: E731
    return {
        "policy": policy,
        "router": repr(router),
        "requests": int(len(w.arrival)),
        "completed": int(np.isfinite(finish).sum()),
        "rejected": int(rejected.sum()),
        "cp_requests": int((sizes[ok] > 1).sum()),
        "output_tokens": int(w.output[np.isfinite(finish)].sum()),
        "decode_tokens": int(tokens),
        "decode_steps": int(steps),
        "throughput_tok_s": window,
        "ttft_p50_ms": pct(ttft, 50),
        "ttft_p99_ms": pct(ttft, 99),
        "tpot_p50_ms": pct(tpot, 50),
        "tpot_p99_ms": pct(tpot, 99),
        "kv_peak_fraction": peak,
        "sizes": sizes,
        "ttft_s": ttft,
        "tpot_s": tpot,
        "finish_s": finish,
    }


def sweep(
    cluster: Cluster,
    rates: Sequence[float],
    num_requests: int = 2_000,
    policies: Sequence[str] = POLICIES,
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
    **workload,
) -> list[dict]:
    """:func:`simulate` every policy at every arrival rate (one seeded workload per rate);
    ``progress(done, total)`` is called after each run (a progress bar hooks in there)."""
    out, total = [], len(rates) * len(policies)
    for rate in rates:
        w = make_workload(num_requests, rate, seed=seed, **workload)
        for policy in policies:
            r = simulate(cluster, w, policy)
            out.append(
                {"rate": rate, **{k: v for k, v in r.items() if not isinstance(v, np.ndarray)}}
            )
            if progress is not None:
                progress(len(out), total)
    return out
