"""The event loop behind :func:`cpbook.dynamic.simulator.simulate`: one run's state as a class
with one method per event (the model and its assumptions are in the simulator's docstring).

:class:`Simulation` fixes a run's plan at construction (each request's CP size, start size and
migration point, its prefill end from :func:`prefill_end_times`) and then advances the decode
pool from event to event: requests **arrive** from prefill, are **admitted** first-fit when
their KV fits, **decode** in global steps up to the next event, **migrate** at their migration
point and **complete**.  Between two events every GPU's attention time is linear in the step
index, so :meth:`Simulation.decode` prices the whole interval in one numpy expression.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from cpbook import costmodel as cm
from cpbook.core.errors import RuleError
from cpbook.dynamic.migration import migration_plan
from cpbook.dynamic.router import Router
from cpbook.dynamic.workload import SimWorkload

#: a :class:`cpbook.dynamic.simulator.Cluster` (the module above this one, not imported here)
ClusterLike = Any

__all__ = ["Simulation", "prefill_end_times"]

_NEVER = np.iinfo(np.int64).max // 2  # steps until a migration that never comes


def prefill_end_times(cluster: ClusterLike, w: SimWorkload, sizes: np.ndarray) -> np.ndarray:
    """Prefill end time of every request: FCFS on aligned groups of its size ``sizes``."""
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


class Simulation:
    """One :func:`simulate` run: the routed plan (fixed at construction) and the decode pool's
    state, advanced event by event (:meth:`run`): requests arrive from prefill
    (:meth:`arrive`), are admitted when memory allows (:meth:`admit_waiting`), decode in
    global steps up to the next event (:meth:`decode`), migrate (:meth:`migrate`) and
    complete (:meth:`complete`)."""

    def __init__(
        self, cluster: ClusterLike, w: SimWorkload, router: Router, expected_output: int | None
    ) -> None:
        self.w, self.router = w, router
        self.g_n, self.cap = cluster.decode_gpus, cluster.capacity_tokens()
        self.m, _ = cluster.spec
        self.layers, self.link = self.m.num_layers, cm.LINKS[cluster.link]
        sizes = self.sizes = router.route_many(w.total)
        start = self.start = (
            sizes
            if expected_output is None
            else np.minimum(sizes, router.route_many(w.prompt + expected_output))
        )
        thr = np.asarray([0.0] + router.thresholds)[[router.cp_sizes.index(n) for n in sizes]]
        self.mig_ctx = np.maximum(np.minimum(thr, start * self.cap), w.prompt + 1).astype(np.int64)
        self.migrates = (start < sizes) & (self.mig_ctx < w.total - 1)
        n_req = len(w.arrival)
        self.rejected = w.total > sizes * self.cap
        self.prefill_end = prefill_end_times(cluster, w, start)
        self.t_w = cluster.weights_step_s()
        self.terms = {n: cluster.attention_terms(n, router.tpa) for n in set(sizes.tolist()) | {1}}
        self.gamma = self.terms[1][2]
        order = np.argsort(self.prefill_end, kind="stable")
        self.order = order[~self.rejected[order]]
        # the pool's state
        self.free = np.full(self.g_n, float(self.cap))
        self.tok = np.zeros(self.g_n)  # KV tokens held per GPU (fractional under CP)
        self.grow = np.zeros(self.g_n)  # tokens added per step per GPU
        self.group_reqs: dict[tuple[int, int], int] = {}  # (n, group) -> requests decoding on it
        self.finish = np.full(n_req, np.nan)
        self.cur_n, self.cur_j = start.copy(), np.full(n_req, -1)
        self.dest_j = np.full(n_req, -1)
        self.act_id, self.act_rem, self.act_mig = (np.empty(0, np.int64) for _ in range(3))
        self.waiting: list[int] = []
        self.now, self.nxt, self.steps, self.decode_tokens, self.peak = 0.0, 0, 0, 0, 0.0
        self.moved_bytes, self.n_moved = 0, 0
        self.clock, self.produced = [0.0], [0]  # decode tokens produced by each event time

    # -- memory ----------------------------------------------------------------------------
    def _place(self, n: int, j: int, tokens: float, sign: int) -> None:
        sl = slice(j * n, (j + 1) * n)
        self.tok[sl] += sign * tokens / n
        self.grow[sl] += sign / n
        if n > 1:
            self.group_reqs[(n, j)] = self.group_reqs.get((n, j), 0) + sign

    def _hold(self, n: int, tokens: int) -> tuple[int, float] | None:
        need = float(-(-tokens // n))
        gfree = self.free.reshape(-1, n).min(axis=1)
        j = int(np.argmax(gfree))
        if gfree[j] < need:
            return None
        self.free[j * n : (j + 1) * n] -= need
        return j, need

    def _release(self, n: int, j: int, reserved: int, tokens: int) -> None:
        self.free[j * n : (j + 1) * n] += float(-(-reserved // n))
        self._place(n, j, float(tokens), -1)

    def admit(self, i: int) -> bool:
        """Reserve request ``i``'s KV (and its migration destination's); ``False`` if it does
        not fit now."""
        w, sizes, start = self.w, self.sizes, self.start
        first = int(self.mig_ctx[i]) if self.migrates[i] else int(w.total[i])
        dest = self._hold(int(sizes[i]), int(w.total[i])) if self.migrates[i] else None
        if self.migrates[i] and dest is None:
            return False
        got = self._hold(int(start[i]), first)
        if got is None:
            if dest is not None:
                n = int(sizes[i])
                self.free[dest[0] * n : (dest[0] + 1) * n] += dest[1]
            return False
        self.cur_j[i] = got[0]
        self.dest_j[i] = -1 if dest is None else dest[0]
        self._place(int(start[i]), got[0], float(w.prompt[i]), 1)
        return True

    # -- events ----------------------------------------------------------------------------
    def migrate(self, i: int) -> float:
        """Move request ``i`` to its destination group; the seconds every GPU waits."""
        ctx, n0, j0, n1, j1 = (
            int(self.mig_ctx[i]),
            int(self.start[i]),
            int(self.cur_j[i]),
            int(self.sizes[i]),
            int(self.dest_j[i]),
        )
        self._release(n0, j0, ctx, ctx)
        self._place(n1, j1, float(ctx), 1)
        self.cur_n[i], self.cur_j[i] = n1, j1
        plan = migration_plan(ctx, n0, n1)  # interleave 1 on both sides
        new_rank = {j1 * n1 + r: r for r in range(n1)}
        kept = sum(
            int(plan[r, new_rank[j0 * n0 + r]]) for r in range(n0) if j0 * n0 + r in new_rank
        )
        moved = (ctx - kept) * cm.kv_bytes_per_token(self.m)
        self.moved_bytes, self.n_moved = self.moved_bytes + moved, self.n_moved + 1
        return self.link.alpha_s + moved / self.link.bw_bytes_per_s

    def complete(self, i: int) -> None:
        """Request ``i`` finished now: free its KV (and an unused destination's)."""
        w, sizes, cur_n, cur_j, dest_j = self.w, self.sizes, self.cur_n, self.cur_j, self.dest_j
        self.finish[i] = self.now
        n1, tokens = int(sizes[i]), int(w.total[i] - 1)
        if dest_j[i] >= 0 and cur_n[i] != n1:  # never reached its migration point
            self.free[dest_j[i] * n1 : (dest_j[i] + 1) * n1] += float(-(-int(w.total[i]) // n1))
            self._release(int(cur_n[i]), int(cur_j[i]), int(self.mig_ctx[i]), tokens)
        else:
            self._release(int(cur_n[i]), int(cur_j[i]), int(w.total[i]), tokens)

    def decode(self, t_next: float) -> None:
        """Global decode steps up to the first event: the step ending after ``t_next`` (an
        arrival), a migration point or a completion; then that event's migrations and
        completions."""
        fixed = np.zeros(self.g_n)
        for (n, j), cnt in self.group_reqs.items():
            if cnt:
                a, b, _ = self.terms[n]
                fixed[j * n : (j + 1) * n] += a + b * cnt
        k_max = int(min(self.act_rem.min(), self.act_mig.min()))
        ks = np.arange(k_max)
        per_gpu = (
            self.gamma * (self.tok[:, None] + self.grow[:, None] * ks[None, :]) + fixed[:, None]
        )
        dt = self.t_w + self.layers * per_gpu.max(axis=0)
        ends = self.now + np.cumsum(dt)
        k = min(k_max, int(np.searchsorted(ends, t_next)) + 1)
        self.now = float(ends[k - 1])
        self.steps += k
        self.decode_tokens += k * len(self.act_id)
        self.tok += self.grow * k
        self.clock.append(self.now)
        self.produced.append(self.decode_tokens)
        self.act_rem, self.act_mig = self.act_rem - k, self.act_mig - k
        for i in self.act_id[self.act_mig == 0].tolist():
            self.now += self.migrate(i)
        self.act_mig = np.where(self.act_mig == 0, _NEVER, self.act_mig)
        done = self.act_rem == 0
        for i in self.act_id[done].tolist():
            self.complete(i)
        self.act_id, self.act_rem, self.act_mig = (
            self.act_id[~done],
            self.act_rem[~done],
            self.act_mig[~done],
        )

    def arrive(self) -> None:
        """Queue every request whose prefill has ended by now."""
        while self.nxt < len(self.order) and self.prefill_end[self.order[self.nxt]] <= self.now:
            self.waiting.append(int(self.order[self.nxt]))
            self.nxt += 1

    def admit_waiting(self) -> None:
        """Admit the waiting requests that fit, first-fit in arrival order."""
        w, still, new = self.w, [], []
        for i in self.waiting:
            (new if self.admit(i) else still).append(i)
        self.waiting = still
        if new:
            self.act_id = np.concatenate([self.act_id, np.array(new, np.int64)])
            self.act_rem = np.concatenate([self.act_rem, w.output[new] - 1])
            self.act_mig = np.concatenate(
                [
                    self.act_mig,
                    np.where(self.migrates[new], self.mig_ctx[new] - w.prompt[new], _NEVER),
                ]
            )
        self.peak = max(self.peak, 1.0 - float(self.free.min()) / self.cap)

    def run(self, policy: str) -> dict:
        """Advance from event to event until every admissible request has finished."""
        while self.nxt < len(self.order) or self.waiting or len(self.act_id):
            t_next = (
                self.prefill_end[self.order[self.nxt]] if self.nxt < len(self.order) else math.inf
            )
            if not len(self.act_id):
                self.now = max(self.now, t_next)
            else:
                self.decode(t_next)
            self.arrive()
            self.admit_waiting()
            if not len(self.act_id) and self.waiting and self.nxt == len(self.order):
                raise RuleError(
                    "decode-progress",
                    "an admissible request",
                    waiting=len(self.waiting),
                    capacity_tokens=self.cap,
                )
        w = self.w
        window = float(np.interp(w.arrival[-1], self.clock, self.produced)) / w.arrival[-1]
        out = _summary(
            w,
            policy,
            self.router,
            self.sizes,
            self.rejected,
            self.prefill_end - w.arrival,
            self.prefill_end,
            self.finish,
            self.steps,
            self.decode_tokens,
            self.peak,
            window,
        )
        return {**out, "migrations": self.n_moved, "migrated_bytes": int(self.moved_bytes)}


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
