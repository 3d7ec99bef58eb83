"""Chapter 7 explorer: route at the modelled break-even, at 32K or at 4K, under a light or a
heavy load, and read the simulated latencies of dynamic CP + TPA beside static DP."""

from __future__ import annotations

from typing import Sequence

from cpbook.dynamic.router import Router
from cpbook.dynamic.simulator import DYNAMIC_CP_TPA, Cluster, simulate
from cpbook.dynamic.workload import make_workload
from cpbook.viz.style import tokens_label
from cpbook.widgets.explorer import Control, Explorer, pre

__all__ = ["routing_explorer"]


def routing_explorer(
    cluster: Cluster | None = None,
    rates: Sequence[float] = (1.0, 4.0),
    thresholds: Sequence[int | None] = (None, 32_768, 4_096),
    num_requests: int = 400,
    seed: int = 0,
    **value,
) -> Explorer:
    """Threshold (``None``: the modelled one) × arrival rate: every state simulated up front
    (:func:`cpbook.dynamic.simulator.simulate`, ``num_requests`` requests, HTML only)."""
    cluster = cluster or Cluster()
    cap = cluster.capacity_tokens()
    loads = {rate: make_workload(num_requests, rate, seed=seed) for rate in rates}
    base = {rate: simulate(cluster, w, "static_dp") for rate, w in loads.items()}

    def render(threshold: int | None, rate: float) -> str:
        router = (
            None
            if threshold is None
            else Router([threshold], [1, 8], tpa=True, capacity_tokens=cap)
        )
        dyn = simulate(cluster, loads[rate], DYNAMIC_CP_TPA, router)
        where = "the modelled break-even" if threshold is None else tokens_label(threshold)
        lines = [
            f"DCP + TPA routed at {where}, {rate:g} req/s, {num_requests:,} requests",
            "                on CP  TPOT p50  TPOT p99  TTFT p99  rejected",
        ]
        for name, r in (("dynamic + TPA", dyn), ("static DP", base[rate])):
            lines.append(
                f"{name:14s} {r['cp_requests']:6d} {r['tpot_p50_ms']:9.1f}"
                f" {r['tpot_p99_ms']:9.1f} {r['ttft_p99_ms'] / 1e3:7.1f} s"
                f" {r['rejected']:9d}"
            )
        return pre("\n".join(lines))

    names = ["modelled" if t is None else tokens_label(t) for t in thresholds]
    return Explorer(
        render,
        {
            "threshold": Control(list(thresholds), names=names, kind="select"),
            "rate": Control(list(rates), names=[f"{r:g} req/s" for r in rates], label="load"),
        },
        value=value,
    )
