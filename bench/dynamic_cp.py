"""Dynamic CP in simulation: four policies on the chapter's default mixed workload.

    python bench/dynamic_cp.py --json            # the default workload, 10,000 requests
    python bench/dynamic_cp.py --json --sweep    # also the load sweep of chapter 7's frontier

Runs :func:`cpbook.dynamic.simulator.simulate` (DeepSeek-V3 on a decode pool of 8 H200 with DP
attention + EP, 32 prefill GPUs; every assumption in the module's docstring) for ``static_dp``,
``static_cp`` (CP = 8), ``dynamic_cp`` and ``dynamic_cp_tpa``, and prints after a
``{"name": "dynamic_cp_run", "date_utc": ..., ...}`` line one line per policy::

    {"name": "dynamic_cp", "policy": ..., "throughput_tok_s": ..., "ttft_p99_ms": ...,
     "tpot_p99_ms": ..., "rejected": ..., ...}

then ``{"name": "dynamic_cp_sim", "wall_s": ..., "requests": ...}`` (``wall_s``: the slowest
policy's simulation).  ``--sweep`` adds ``{"name": "dynamic_cp_sweep", "rate": ...}`` lines
(2,000 requests per point) with a progress bar on stderr.  Targets: one policy's simulation of
10,000 requests in <= 30 s; ``rejected == 0`` for both dynamic policies.
"""

from __future__ import annotations

import argparse
import json
import sys

from cpbook.dynamic.simulator import POLICIES, Cluster, simulate, sweep
from cpbook.dynamic.workload import make_workload
from cpbook.timing import machine_record, stopwatch

RATES = (1.0, 2.0, 4.0, 6.0, 8.0)
KEYS = (
    "policy",
    "router",
    "requests",
    "completed",
    "rejected",
    "cp_requests",
    "throughput_tok_s",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "tpot_p50_ms",
    "tpot_p99_ms",
    "kv_peak_fraction",
)


def _bar(done: int, total: int) -> None:
    width = 30
    fill = width * done // total
    print(f"\r[{'#' * fill}{'.' * (width - fill)}] {done}/{total}", end="", file=sys.stderr)
    if done == total:
        print(file=sys.stderr)


def _round(row: dict) -> dict:
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print JSON lines (the default output)")
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--rate", type=float, default=4.0)
    p.add_argument("--sweep", action="store_true", help="also the load sweep (frontier)")
    a = p.parse_args(argv)
    print(json.dumps({"name": "dynamic_cp_run", **machine_record()}), flush=True)
    cluster, w = Cluster(), make_workload(a.requests, a.rate)
    walls = []
    for policy in POLICIES:
        with stopwatch() as t:
            r = simulate(cluster, w, policy)
        walls.append(t.seconds)
        print(json.dumps({"name": "dynamic_cp", **_round({k: r[k] for k in KEYS})}), flush=True)
    print(
        json.dumps(
            {
                "name": "dynamic_cp_sim",
                "wall_s": round(max(walls), 2),
                "wall_all_s": round(sum(walls), 2),
                "requests": a.requests,
            }
        ),
        flush=True,
    )
    if a.sweep:
        for row in sweep(cluster, RATES, 2_000, progress=_bar):
            print(json.dumps({"name": "dynamic_cp_sweep", **_round(row)}), flush=True)


if __name__ == "__main__":
    main()
