"""Fit the CPU cost model to this machine's stored benchmark runs and check it on held-out ones.

    python bench/calibrate.py --json      # reads the stored runs in cpbook/data, prints JSON lines

:mod:`cpbook.costmodel.calibration` turns every stored run of ``bench/decode_step.py``,
``bench/pcp_prefill.py`` and ``bench/chunked_prefill.py`` into counted work (collective calls,
bytes sent, FLOPs, bytes read: each from the mechanism's own formula) and a measured time,
fits α, β and three throughputs on the training runs, and predicts the held-out runs
(:func:`~cpbook.costmodel.calibration.is_validation`).  Prints::

    {"name": "costmodel_fit", "alpha_ms": ..., "beta_ns_per_byte": ..., ...}
    {"name": "costmodel_validation", "config": ..., "predicted_ms": ..., "measured_ms": ...,
     "error": ...}                                  # error = predicted / measured - 1

then ``{"name": "costmodel_summary", "validation": N, "within_20pct": K, "max_abs_error": E}``.
Re-run the three benchmarks first to calibrate a different machine; this script reads no clock.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from cpbook.costmodel.calibration import calibrate, is_validation, load_points


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print JSON lines (the default output)")
    p.add_argument(
        "--results",
        type=Path,
        default=None,
        help="folder of stored runs (default: the package copies in cpbook/data)",
    )
    p.add_argument("--cores", type=int, default=2, help="cores of the machine that ran them")
    a = p.parse_args(argv)
    points = load_points(a.results, a.cores)
    fit, rows = calibrate(points, is_validation)
    train = [q for q in points if not is_validation(q)]
    print(
        json.dumps(
            {
                "name": "costmodel_fit",
                "alpha_ms": round(fit.alpha_s * 1e3, 4),
                "beta_ns_per_byte": round(fit.beta_s_per_byte * 1e9, 3),
                "prefill_gflops": round(fit.prefill_flops_per_s / 1e9, 2),
                "decode_gflops": round(fit.decode_flops_per_s / 1e9, 2),
                "read_gb_per_s": round(fit.read_bytes_per_s / 1e9, 3),
                "train_points": len(train),
                "cores": a.cores,
                "machine_cores_now": os.cpu_count(),
            }
        )
    )
    for row in rows:
        print(json.dumps({"name": "costmodel_validation", **row}))
    errs = [abs(r["error"]) for r in rows]
    print(
        json.dumps(
            {
                "name": "costmodel_summary",
                "validation": len(rows),
                "within_20pct": sum(e <= 0.2 for e in errs),
                "max_abs_error": max(errs),
            }
        )
    )


if __name__ == "__main__":
    main()
