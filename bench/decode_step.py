"""One decode step's attention block without CP, with DCP, and with DCP + TPA, over context.

    python bench/decode_step.py --json       # gloo, 1 thread per rank, float32
    python bench/decode_step.py --store      # the same, and refresh cpbook/data/decode_step.json
    python bench/decode_step.py --json --dist-backend nccl   # on GPUs, one per rank (not stored)

For world size 2 (and 4 when the machine has at least 4 cores) one torchrun launch times, per
context length, one request's attention block (``q_proj`` → attention → ``o_proj`` with its
all-reduce; 16 query heads, one KV head, head_dim 128, hidden 1024) three ways, interleaved
run after run from a common barrier (:func:`cpbook.timing.decode_step_timing`): ``no_cp``
(TP = N: every rank reads the whole KV), ``dcp`` (DCP = N: 1/N of the KV, query all-gather and
LSE combine) and ``dcp_tpa`` (TPA: no query all-gather).  A method's time is the slowest rank's
median.  Prints per context::

    {"name": "decode_step", "ranks": N, "context": C, "no_cp_ms": ..., "dcp_ms": ...,
     "dcp_tpa_ms": ...}

after a ``{"name": "decode_step_run", "date_utc": ..., "machine": ...}`` line (when and where),
then ``{"name": "decode_break_even", "ranks": N, "dcp_tokens": ..., "dcp_tpa_tokens": ...}``:
the context length where DCP starts to beat no CP, interpolated on log(context) between the
last grid point where it loses and the first where it wins from there on (the grid's first
point if it wins everywhere).  Targets: ``dcp_tpa_ms <= dcp_ms`` at every context,
``dcp_tpa_tokens <= dcp_tokens``, and at 256K ``dcp_ms <= 0.6 * no_cp_ms`` on 2 ranks.

``--store`` also writes the printed lines, as they are (JSON lines), over the package data the
package reads, ``cpbook/data/decode_step.json`` (:mod:`cpbook.data`: chapter 6's break-even
behind :meth:`cpbook.dynamic.router.Router.measured`, and the calibration's decode points).  It
writes once the whole run has finished, and refuses when a break-even is missing (DCP never won
on the grid), since ``Router.measured`` needs one.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import cpbook.data
from cpbook.core.launch import run
from cpbook.timing import decode_step_timing, machine_record

CONTEXTS = (1024, 4096, 16384, 65536, 262144)
STORE = cpbook.data.stored_path("decode_step.json")  # the package's copy


def break_even(contexts, slow, fast) -> float | None:
    """Context where ``fast`` starts to beat ``slow`` for good (log-linear interpolation of the
    time difference); ``None`` if it never does on the grid."""
    diff = [f - s for s, f in zip(slow, fast)]
    if diff[-1] >= 0:
        return None
    i = max([j for j, d in enumerate(diff) if d >= 0], default=-1)
    if i < 0:
        return float(contexts[0])
    x0, x1 = math.log(contexts[i]), math.log(contexts[i + 1])
    t = diff[i] / (diff[i] - diff[i + 1])
    return round(math.exp(x0 + t * (x1 - x0)))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print JSON lines (the default output)")
    p.add_argument("--repeats", type=int, default=21)
    p.add_argument("--contexts", type=int, nargs="+", default=list(CONTEXTS))
    p.add_argument("--store", action="store_true", help=f"also write the output to {STORE}")
    p.add_argument(
        "--dist-backend",
        choices=("gloo", "nccl"),
        default="gloo",
        help="gloo: CPU tensors (the stored runs); nccl: one GPU per rank",
    )
    a = p.parse_args(argv)
    if a.store and a.dist_backend != "gloo":
        p.error("--store keeps the CPU (gloo) runs the package reads; not with --dist-backend nccl")
    worlds = (2, 4) if (os.cpu_count() or 1) >= 4 else (2,)
    lines: list[str] = []

    def emit(record: dict) -> None:
        lines.append(json.dumps(record))
        print(lines[-1], flush=True)

    dev = "cuda:0" if a.dist_backend == "nccl" else "cpu"  # rank r runs on cuda:r
    emit({"name": "decode_step_run", **machine_record(dev, a.dist_backend)})
    for n in worlds:
        res = run(
            decode_step_timing,
            n,
            "torchrun",
            dict(contexts=tuple(a.contexts), repeats=a.repeats),
            dist_backend=a.dist_backend,
            report=False,
        )
        ms = {
            c: {m: 1e3 * max(r[c][m] for r in res) for m in ("no_cp", "dcp", "dcp_tpa")}
            for c in a.contexts
        }
        for c in a.contexts:
            err = max(r[c][f"{m}_err"] for r in res for m in ("dcp", "dcp_tpa"))
            emit(
                {
                    "name": "decode_step",
                    "ranks": n,
                    "context": c,
                    **{f"{m}_ms": round(v, 3) for m, v in ms[c].items()},
                    "max_abs_diff": float(f"{err:.1e}"),
                }
            )
        col = {m: [ms[c][m] for c in a.contexts] for m in ("no_cp", "dcp", "dcp_tpa")}
        emit(
            {
                "name": "decode_break_even",
                "ranks": n,
                "dcp_tokens": break_even(a.contexts, col["no_cp"], col["dcp"]),
                "dcp_tpa_tokens": break_even(a.contexts, col["no_cp"], col["dcp_tpa"]),
            }
        )
    if a.store:
        store(lines)


def store(lines: list[str], path: Path = STORE) -> None:
    """Write ``lines`` (the run's JSON lines) to ``path``, the package's ``decode_step.json``,
    unless a break-even is missing (``Router.measured`` reads the first one)."""
    for line in lines:
        row = json.loads(line)
        missing = None in (row.get("dcp_tokens", 0), row.get("dcp_tpa_tokens", 0))
        if row["name"] == "decode_break_even" and missing:
            sys.exit(f"not storing: no break-even on ranks={row['ranks']} ({path} left as it was)")
    path.write_text("".join(line + "\n" for line in lines))
    print(f"stored {len(lines)} lines in {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
