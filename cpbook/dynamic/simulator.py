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
from cpbook.core.errors import RuleError
from cpbook.dynamic.events import Simulation
from cpbook.dynamic.router import Router, cp_line
from cpbook.dynamic.workload import SimWorkload, WorkloadMix, make_workload

__all__ = [
    "Cluster",
    "POLICIES",
    "STATIC_DP",
    "STATIC_CP",
    "DYNAMIC_CP",
    "DYNAMIC_CP_TPA",
    "policy_router",
    "simulate",
    "sweep",
]

#: the policies, the one place they are spelled: static DP, static CP = ``Cluster.static_cp``,
#: dynamic CP and dynamic CP whose CP groups use TPA (``tpa=True`` of
#: :meth:`~cpbook.dynamic.router.Router.modelled`)
POLICIES = ("static_dp", "static_cp", "dynamic_cp", "dynamic_cp_tpa")
STATIC_DP, STATIC_CP, DYNAMIC_CP, DYNAMIC_CP_TPA = POLICIES


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
    if policy == STATIC_DP:
        return Router([], [1])
    if policy == STATIC_CP:
        return Router([0], [1, cluster.static_cp], model=m, pool_size=cluster.decode_gpus)
    if policy in (DYNAMIC_CP, DYNAMIC_CP_TPA):
        return Router.modelled(
            m,
            g,
            cluster.cp_sizes,
            tpa=policy == DYNAMIC_CP_TPA,
            num_reqs=cluster.router_num_reqs,
            link=cm.LINKS[cluster.link],
            pool_size=cluster.decode_gpus,
            capacity_tokens=cap,
        )
    raise RuleError("policy", f"policy in {POLICIES}", policy=policy)


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
    return Simulation(cluster, w, router, expected_output).run(policy)


def sweep(
    cluster: Cluster,
    rates: Sequence[float],
    num_requests: int = 2_000,
    policies: Sequence[str] = POLICIES,
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
    mix: WorkloadMix | None = None,
) -> list[dict]:
    """:func:`simulate` every policy at every arrival rate (one seeded workload of ``mix`` per
    rate); ``progress(done, total)`` is called after each run (a progress bar hooks in there)."""
    out, total = [], len(rates) * len(policies)
    for rate in rates:
        w = make_workload(num_requests, rate, mix=mix, seed=seed)
        for policy in policies:
            r = simulate(cluster, w, policy)
            out.append(
                {"rate": rate, **{k: v for k, v in r.items() if not isinstance(v, np.ndarray)}}
            )
            if progress is not None:
                progress(len(out), total)
    return out
