"""Figures of chapter 8: where one 1M-token request fits, TTFT and TPOT of whole deployments against
context, the CPU cost model's predictions against this machine's stored runs, and the GPU side
against AIConfigurator's stored predictions.

Every function draws numbers :mod:`cpbook.costmodel` computes (or stored ``bench/`` results the
chapter passes in) and returns the ``Figure``.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from matplotlib.ticker import FuncFormatter

from cpbook import costmodel as cm
from cpbook.viz.style import PALETTE, figure, plain_label, tokens_label

__all__ = ["capacity_boundary", "deployments_vs_context", "parity", "peer_parity"]

_PLAIN = FuncFormatter(plain_label)
_TOKENS = FuncFormatter(tokens_label)


def capacity_boundary(
    model: cm.ModelSpec, gpus: Sequence[str], utils: Sequence[float], target: int = 2**20
):
    """Longest single request (tokens) against ``gpu_memory_utilization``, one panel per GPU,
    one line per (KV dtype, DCP) on TP 8; the ``target`` line marks the claim."""
    fig, axes = figure(ncols=len(gpus), figsize=(7.2, 3.5), sharey=True)
    styles = {
        ("bf16", 1): (PALETTE[7], "o", "-"),
        ("fp8", 1): (PALETTE[1], "s", "-"),
        ("bf16", 8): (PALETTE[0], "^", "--"),
        ("fp8", 8): (PALETTE[2], "v", "--"),
    }
    for ax, g in zip(axes, gpus):
        for (kv, dcp), (c, mk, ls) in styles.items():
            ys = [
                cm.deployment_max_context(
                    model, cm.GPUS[g], cm.Deployment(tp=8, dcp=dcp), kv, gpu_memory_utilization=u
                )
                for u in utils
            ]
            ax.plot(utils, ys, color=c, marker=mk, ls=ls, label=f"{kv} KV, DCP {dcp}")
        ax.axhline(target, color=PALETTE[5], lw=1.5)
        ax.text(utils[0], target * 1.08, "1M tokens", color=PALETTE[5], fontsize=10)
        ax.set_yscale("log", base=2)
        ax.yaxis.set_major_formatter(_TOKENS)
        ax.set_title(f"{model.name}, 8 x {g}")
        ax.set_xlabel("gpu_memory_utilization")
    axes[0].set_ylabel("longest request (tokens)")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=4, fontsize=9)
    return fig


def deployments_vs_context(
    model: cm.ModelSpec,
    gpu: cm.GPUSpec,
    deployments: Sequence[cm.Deployment],
    contexts: Sequence[int],
    batch: int = 1,
):
    """TTFT (left) and TPOT at ``batch`` requests (right) against context, one line per
    deployment; deployments whose weights or KV do not fit are left out at that context."""
    fig, (a, b) = figure(ncols=2, figsize=(7.2, 3.2))
    for i, lay in enumerate(deployments):
        xs, t1, t2 = [], [], []
        for c in contexts:
            try:
                if cm.max_concurrency(model, gpu, lay, c) < max(1, batch // lay.dp):
                    continue
            except ValueError:
                continue
            xs.append(c)
            t1.append(cm.ttft(model, gpu, lay, c).total_s)
            t2.append(1e3 * cm.tpot(model, gpu, lay, c, batch).total_s)
        style = dict(color=PALETTE[i % len(PALETTE)], marker="os^vD<>"[i % 7], label=lay.label)
        a.plot(xs, t1, **style)
        b.plot(xs, t2, **style)
    for ax, lab in ((a, "TTFT (s)"), (b, f"TPOT at {batch} request(s) (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(_PLAIN)
        ax.yaxis.set_minor_formatter(_PLAIN if ax is b else FuncFormatter(lambda v, _p: ""))
        ax.xaxis.set_major_formatter(_TOKENS)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel(lab)
    a.legend(fontsize=9, loc="upper left")
    fig.suptitle(f"{model.name} on 8 x {gpu.name} (model)", fontsize=11)
    return fig


def parity(rows: Sequence[Mapping], train: Sequence[Mapping] = ()):
    """Predicted against measured milliseconds (log-log), held-out runs filled, training runs
    hollow; the band is +-20 %."""
    fig, ax = figure(figsize=(5.0, 4.2))
    kinds = {"decode_step": PALETTE[0], "chunked_prefill": PALETTE[2], "pcp_prefill": PALETTE[5]}
    for group, filled in ((train, False), (rows, True)):
        for k, c in kinds.items():
            pts = [
                (r["measured_ms"], r["predicted_ms"]) for r in group if r["config"].startswith(k)
            ]
            if pts:
                xs, ys = zip(*pts)
                ax.scatter(
                    xs,
                    ys,
                    s=28,
                    color=c if filled else "none",
                    edgecolors=c,
                    label=f"{k} ({'held out' if filled else 'fit'})",
                )
    lo, hi = 2.0, 8000.0
    ax.plot([lo, hi], [lo, hi], color="black", lw=1)
    ax.fill_between([lo, hi], [lo * 0.8, hi * 0.8], [lo * 1.2, hi * 1.2], color="#DDDDDD", zorder=0)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured (ms)")
    ax.set_ylabel("predicted (ms)")
    ax.legend(fontsize=8, loc="upper left")
    return fig


def peer_parity(rows: Sequence[Mapping]):
    """cpbook against AIConfigurator (``bench/vs_aiconfigurator.py``'s ``vs_aic`` rows, the
    fitting set, and ``vs_aic_held_out`` rows), TTFT (left, s) and TPOT (right, ms), log-log:
    fitted cases as blue circles, held-out ones as orange triangles, filled for H200 and hollow
    for H100; the band is +-15 %, the target on the median."""
    fig, axes = figure(ncols=2, figsize=(7.2, 3.6))
    sets = (("vs_aic", "fit", PALETTE[0], "o"), ("vs_aic_held_out", "held out", PALETTE[1], "^"))
    for ax, (key, scale, unit) in zip(axes, (("ttft", 1e-3, "s"), ("tpot", 1.0, "ms"))):
        for name, label, c, marker in sets:
            for gpu, filled in (("H200", True), ("H100", False)):
                pts = [
                    (r[f"aic_{key}_ms"] * scale, r[f"{key}_ms"] * scale)
                    for r in rows
                    if r["name"] == name and r["gpu"] == gpu
                ]
                if not pts:
                    continue
                xs, ys = zip(*pts)
                ax.scatter(
                    xs, ys, s=16, color=c if filled else "none", edgecolors=c,
                    marker=marker, label=f"{label} ({gpu})",
                )  # fmt: skip
        vals = [r[f"{k}_ms"] * scale for r in rows for k in (key, f"aic_{key}")]
        lo, hi = min(vals) / 1.3, max(vals) * 1.3
        ax.plot([lo, hi], [lo, hi], color="black", lw=1)
        ax.fill_between(
            [lo, hi], [lo * 0.85, hi * 0.85], [lo * 1.15, hi * 1.15], color="#DDDDDD", zorder=0
        )
        ax.set_xscale("log")
        ax.set_yscale("log")
        for axis in (ax.xaxis, ax.yaxis):
            axis.set_major_formatter(_PLAIN)
            axis.set_minor_formatter(FuncFormatter(lambda v, _p: ""))
        ax.set_xlabel(f"AIConfigurator {key.upper()} ({unit})")
        ax.set_ylabel(f"cpbook {key.upper()} ({unit})")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=4, fontsize=8)
    return fig
