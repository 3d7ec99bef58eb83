"""Calibration on this machine: fit α, β and throughputs to stored ``bench/`` runs (gloo, CPU),
then predict configurations the fit never saw (chapter 8).

A CPU run of one step costs, on the slowest rank,

    t = α·calls + β·bytes_sent + prefill_flops / F_prefill + decode_flops / F_decode
        + bytes_read / M

with the compute terms (FLOPs, bytes read) stretched by ``max(worst rank, all ranks / cores) /
worst rank`` when ranks share cores; a rank waiting in a collective leaves its core to others.
Every count comes from the mechanism modules' own formulas
(:func:`cpbook.pcp.prefill.pcp_comm_bytes`, :func:`cpbook.pcp.chunked_plan.chunked_comm_bytes`,
:func:`cpbook.dcp.tpa.tpa_comm_bytes`, :func:`cpbook.dcp.tpa.tpa_costs`); the five constants are
fitted by non-negative least squares on relative error.  No clock is read here: the times are the
stored runs in :mod:`cpbook.data`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from cpbook.core.comm import comm_bytes
from cpbook.core.config import ParallelConfig
from cpbook.core.heads import tpa_config
from cpbook.data import stored_rows, stored_text
from cpbook.dcp.comm_bytes import tpa_comm_bytes, tpa_costs
from cpbook.pcp.chunked_plan import chunked_comm_bytes
from cpbook.pcp.comm_bytes import pcp_comm_bytes

FEATURES = ("calls", "bytes_sent", "prefill_flops", "decode_flops", "bytes_read")
COMPUTE = ("prefill_flops", "decode_flops", "bytes_read")  # the terms that need a core


@dataclass(frozen=True)
class Point:
    """One measured configuration: ``bench`` name, its parameters, the slowest rank's
    seconds, the counted work of that rank (:data:`FEATURES`) and the core-sharing factor."""

    bench: str
    config: dict
    measured_s: float
    work: dict
    oversubscription: float = 1.0

    def scaled_work(self) -> list[float]:
        """The work in :data:`FEATURES` order, the compute terms stretched by
        ``oversubscription`` (ranks waiting in a collective leave their core to others)."""
        return [self.work[f] * (self.oversubscription if f in COMPUTE else 1.0) for f in FEATURES]

    @property
    def label(self) -> str:
        return self.bench + " " + " ".join(f"{k}={v}" for k, v in self.config.items())


@dataclass(frozen=True)
class CPUFit:
    """The fitted constants (seconds per call, per byte, FLOP/s, FLOP/s, bytes/s)."""

    alpha_s: float
    beta_s_per_byte: float
    prefill_flops_per_s: float
    decode_flops_per_s: float
    read_bytes_per_s: float

    def coefficients(self) -> list[float]:
        inv = [self.prefill_flops_per_s, self.decode_flops_per_s, self.read_bytes_per_s]
        return [self.alpha_s, self.beta_s_per_byte] + [1 / x if x else 0.0 for x in inv]

    def predict(self, point: Point) -> float:
        """Predicted seconds of ``point`` (its measured time is not used)."""
        c = self.coefficients()
        return sum(ci * x for ci, x in zip(c, point.scaled_work()))


def _work(**kw: float) -> dict:
    return {f: float(kw.get(f, 0.0)) for f in FEATURES}


def _calls(calls: Sequence[tuple[str, int]]) -> tuple[int, int]:
    return len(calls), comm_bytes(calls)


def pcp_points(rows: Sequence[dict], cores: int = 2) -> list[Point]:
    """``pcp_prefill.json`` rows: one-process SDPA, zigzag and contiguous PCP (MHA, fp32)."""

    out = []
    for r in rows:
        # the stored rows' key is "num_heads" (MHA: query heads = KV heads)
        s, n, h, d = r["seq_len"], r["world_size"], r["num_heads"], r["head_dim"]
        full = 4 * h * d * s * s / 2  # causal
        calls, sent = _calls(pcp_comm_bytes(s // n, h, d, n, elem_bytes=4))
        worst = {"zigzag": full / n, "contiguous": 4 * h * d * (s / n) * s * (2 * n - 1) / (2 * n)}
        out.append(
            Point(
                "pcp_prefill",
                {"ranks": n, "method": "single", "seq": s},
                r["single_ms"] / 1e3,
                _work(prefill_flops=full),
            )
        )
        for lay, f in worst.items():
            out.append(
                Point(
                    "pcp_prefill",
                    {"ranks": n, "method": lay, "seq": s},
                    r[f"cpbook_{lay}_ms"] / 1e3,
                    _work(calls=calls, bytes_sent=sent, prefill_flops=f),
                    max(1.0, full / cores / f),  # ranks share cores: max(worst, all / cores)
                )
            )
    return out


#: the deployment ``chunked_prefill.jsonl`` was measured on
_CHUNKED = ParallelConfig(
    tensor_parallel_size=1,
    prefill_context_parallel_size=2,
    decode_context_parallel_size=2,
    num_q_heads=8,
    num_kv_heads=1,
    head_dim=64,
    block_size=1,
    dcp_comm_backend="a2a",
)


def chunked_points(rows: Sequence[dict]) -> list[Point]:
    """``chunked_prefill.jsonl`` rows (2 ranks, pcp = dcp = 2, 8 Q heads, 1 KV head, d 64)."""

    out = []
    for r in rows:
        if r.get("name") != "chunked_prefill":
            continue
        c, t, st = r["context"], r["chunk"], r["strategy"]
        calls, sent = _calls(
            chunked_comm_bytes(st, [c], [t], _CHUNKED, workspace_size=16384, elem_bytes=4)
        )
        flops = 4 * 8 * 64 * t * (c + t / 2) / 2
        read = 2 * 64 * 4 * c if st == "allgather_kv" else 0  # the context gathered to a workspace
        out.append(
            Point(
                "chunked_prefill",
                {"ranks": 2, "strategy": st, "context": c, "chunk": t},
                r["ms"] / 1e3,
                _work(calls=calls, bytes_sent=sent, prefill_flops=flops, bytes_read=read),
            )
        )
    return out


def decode_points(rows: Sequence[dict]) -> list[Point]:
    """``decode_step.json`` rows: tp = ranks, 16 Q heads, 1 KV head, d 128, hidden 1024, fp32."""

    out = []
    for r in rows:
        if r.get("name") != "decode_step":
            continue
        n, c = r["ranks"], r["context"]
        for mode in ("no_cp", "dcp", "dcp_tpa"):
            dcp = 1 if mode == "no_cp" else n
            cfg = tpa_config(
                mode == "dcp_tpa",
                tensor_parallel_size=n,
                decode_context_parallel_size=dcp,
                num_q_heads=16,
                num_kv_heads=1,
                head_dim=128,
            )
            calls = [
                (op, b)
                for op, b in tpa_comm_bytes(cfg, 1, 128, 128, 1024, 4)
                if (n if op == "all_reduce" else dcp) > 1
            ]
            heads = cfg.q_heads_per_rank * dcp  # DCP gathers the group's query heads
            weights = tpa_costs(cfg, 1024, 1, 128, 4)["q_proj_weight_bytes"] * 2  # q and o
            read = 2 * 128 * 4 * c / dcp + weights
            ncalls, sent = _calls(calls)
            out.append(
                Point(
                    "decode_step",
                    {"ranks": n, "mode": mode, "context": c},
                    r[f"{mode}_ms"] / 1e3,
                    _work(
                        calls=ncalls,
                        bytes_sent=sent,
                        decode_flops=4 * heads * 128 * c / dcp,
                        bytes_read=read,
                    ),
                )
            )
    return out


def load_points(results: Path | None = None, cores: int = 2) -> list[Point]:
    """Every stored measurement: ``pcp_prefill.json``, ``chunked_prefill.jsonl``,
    ``decode_step.json``, from the package's copies (:mod:`cpbook.data`) or from the folder
    ``results`` holding files of those names."""

    def rows(name: str) -> list[dict]:
        return stored_rows(stored_text(name) if results is None else (results / name).read_text())

    return (
        decode_points(rows("decode_step.json"))
        + pcp_points(rows("pcp_prefill.json"), cores)
        + chunked_points(rows("chunked_prefill.jsonl"))
    )


def is_validation(point: Point) -> bool:
    """The held-out set: chunk 1024 of the chunked runs, decode at 4K and 64K, PCP on 4 ranks."""
    c, b = point.config, point.bench
    return (
        (b == "pcp_prefill" and c["ranks"] == 4)
        or (b == "chunked_prefill" and c["chunk"] == 1024)
        or (b == "decode_step" and c["context"] in (4096, 65536))
    )


def _nnls(a, y):
    """Least squares with non-negative coefficients (drop the most negative column, refit)."""
    import numpy as np

    keep = list(range(a.shape[1]))
    while True:
        sol = np.linalg.lstsq(a[:, keep], y, rcond=None)[0]
        if sol.min() >= 0 or len(keep) == 1:
            coef = np.zeros(a.shape[1])
            coef[keep] = np.clip(sol, 0, None)
            return coef
        keep.pop(int(sol.argmin()))


def fit(points: Sequence[Point]) -> CPUFit:
    """Non-negative least squares on relative error over ``points``, each ``bench`` weighing
    the same in total."""
    import numpy as np

    count = {b: sum(q.bench == b for q in points) for b in {q.bench for q in points}}
    w = np.array([count[p.bench] ** -0.5 for p in points])  # every bench weighs the same
    a = np.array([[x / p.measured_s for x in p.scaled_work()] for p in points])
    scale = np.where(a.max(axis=0) > 0, a.max(axis=0), 1.0)
    c = _nnls(a / scale * w[:, None], w) / scale
    inv = [1 / x if x > 0 else math.inf for x in c[2:]]
    return CPUFit(float(c[0]), float(c[1]), *map(float, inv))


def calibrate(
    points: Sequence[Point], held_out: Callable[[Point], bool] = is_validation
) -> tuple[CPUFit, list[dict]]:
    """Fit on the points ``held_out`` rejects; return the fit and, per held-out point,
    ``{"config", "predicted_ms", "measured_ms", "error"}`` (error = predicted / measured − 1)."""
    train = [p for p in points if not held_out(p)]
    model = fit(train)
    rows = []
    for p in points:
        if held_out(p):
            pred = model.predict(p)
            rows.append(
                {
                    "config": p.label,
                    "predicted_ms": round(float(pred) * 1e3, 2),
                    "measured_ms": round(p.measured_s * 1e3, 2),
                    "error": round(float(pred / p.measured_s - 1), 3),
                }
            )
    return model, rows
