"""Does cpbook run on a GPU?  One call checks it on one GPU, or dry-runs the same on the CPU.

    python -m cpbook.tools.gpu_smoke                 # cuda:0, NCCL at world 1 (≤ 5 min, H200)
    python -m cpbook.tools.gpu_smoke --device cpu    # the dry run CI does: gloo, no GPU
    bash bench/gpu_smoke.sh                          # the GPU run, stored in bench/results/

Prints JSON lines, then exits 1 if any check failed:

* ``gpu_smoke_env`` — torch, CUDA and NCCL versions, the device, and which of the torch APIs
  cpbook needs this torch has (``all_gather_single`` or an older name, ``new_group`` with
  ``sort_ranks``, the fused SDPA kernels);
* ``gpu_smoke_attention`` — :func:`~cpbook.core.attention.attention_with_lse` on the device in
  float32 and float64 against dense float64 attention on the CPU: GQA, causal chunks after a
  prefix and before their keys, empty shards, no queries, MLA's absorbed (576/512) and MHA
  (192/128) widths;
* ``gpu_smoke_demo`` — every demo and an engine grid on simulated ranks on the device, with
  its error and ``gpu_bytes``, the peak GPU memory it allocated (0 means it ran on the host;
  ``null`` on the CPU);
* ``gpu_smoke_dist`` — real ``torch.distributed`` at world 1 (NCCL on a GPU, gloo on the CPU):
  each :class:`~cpbook.core.backends.TorchGroup` primitive (a one-rank group skips them in the
  :class:`~cpbook.core.comm.Group` calls, so they are called directly), ``python -m cpbook demo
  merge --backend torchrun`` and ``torchrun -m cpbook serve``;
* ``gpu_smoke_summary`` — checks run and failed.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
from typing import Any, Callable

import torch

from cpbook.core.attention import attention_with_lse, dense_attention
from cpbook.core.backends import _dist_call, new_group_keeps_order
from cpbook.core.context import RankContext
from cpbook.core.launch import run
from cpbook.demos import demo_kwargs, get_demo
from cpbook.demos.ch09_engine import grid_runs, run_world, serve_grid_rank
from cpbook.engine.engine import make_prompts
from cpbook.engine.models import TinyModel, reference_generate

#: (demo, world size, parameters): every registered demo, defaults, and a few variants
DEMOS = [
    ("merge", 4, {}),
    ("merge", 4, {"num_keys": 3, "dtype": "float32"}),
    ("kvcache", 4, {}),
    ("dcp-gqa", 6, {}),
    ("dcp-gqa", 6, {"dcp_comm_backend": "a2a", "dtype": "float32"}),
    ("dcp-mla", 4, {}),
    ("dcp-mla-ctx", 4, {}),
    ("pcp", 4, {}),
    ("chunked", 2, {}),
    ("chunked", 4, {"strategy": "allgather_kv", "tensor_parallel_size": 2}),
    ("ring", 3, {}),
    ("ring", 3, {"mode": "pass_q", "dtype": "float32"}),
    ("tpa", 4, {}),
    (
        "tpa",
        4,
        {
            "use_mla": True,
            "num_kv_heads": 1,
            "tensor_parallel_size_attention": None,
            "dcp_q_replicate": True,
        },
    ),
    ("migrate", 4, {}),
    ("engine", 1, {"model": "tiny-mla"}),
    ("spec-verify", 4, {}),
    ("spec-verify", 4, {"use_mla": True, "dcp_comm_backend": "a2a"}),
    ("draft-placement", 2, {}),
]
#: (tq, tk, q heads, kv heads, q/k width, v width, causal, q_offset)
ATTENTION = [
    (7, 33, 8, 2, 64, 64, False, 0),
    (1, 0, 8, 2, 64, 64, False, 0),
    (0, 5, 8, 2, 64, 64, False, 0),
    (16, 40, 8, 8, 64, 64, True, 24),
    (5, 9, 4, 4, 64, 64, True, -3),
    (3, 20, 16, 1, 576, 512, False, 0),
    (8, 8, 16, 16, 192, 128, True, 0),
]
TOL = {torch.float64: 1e-10, torch.float32: 1e-4}
ENGINE_WORK = dict(num_requests=3, max_new_tokens=3)


def emit(row: dict[str, Any], failed: list[str]) -> None:
    if not row.get("ok", True):
        failed.append(f"{row['name']}:{row.get('case', '')}")
    print(json.dumps(row), flush=True)


def env_row(device: torch.device) -> dict[str, Any]:
    import torch.distributed as dist

    def has(*names: str) -> str | None:
        try:
            return _dist_call(*names).__name__
        except RuntimeError:
            return None

    cuda = torch.cuda.is_available()
    apis = {
        "all_gather": has("all_gather_single", "all_gather_into_tensor", "_all_gather_base"),
        "reduce_scatter": has(
            "reduce_scatter_single", "reduce_scatter_tensor", "_reduce_scatter_base"
        ),
        "new_group_sort_ranks": new_group_keeps_order(),
        "batch_isend_irecv": hasattr(dist, "batch_isend_irecv"),
        "sdpa_efficient": hasattr(torch.ops.aten, "_scaled_dot_product_efficient_attention"),
        "sdpa_flash_for_cpu": hasattr(
            torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"
        ),
    }
    usable = device.type == "cpu" or (cuda and torch.cuda.device_count() > (device.index or 0))
    return {
        "name": "gpu_smoke_env",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if dist.is_nccl_available() else None,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "device": str(device),
        "apis": apis,
        "ok": bool(usable and apis["all_gather"] and apis["reduce_scatter"]),
    }


def attention_rows(device: torch.device) -> list[dict[str, Any]]:
    rows = []
    for i, (tq, tk, hq, hk, d, dv, causal, off) in enumerate(ATTENTION):
        gen = torch.Generator().manual_seed(i)
        q, k = (
            torch.randn(n, h, d, generator=gen, dtype=torch.float64)
            for n, h in ((tq, hq), (tk, hk))
        )
        v = torch.randn(tk, hk, dv, generator=gen, dtype=torch.float64)
        ref, ref_lse = dense_attention(q, k, v, causal=causal, q_offset=off)
        for dt in (torch.float32, torch.float64):
            out, lse = attention_with_lse(*(t.to(device, dt) for t in (q, k, v)), causal, off)
            out, lse = out.cpu().double(), lse.cpu().double()
            empty = torch.isneginf(ref_lse)
            same_empty = torch.equal(torch.isneginf(lse), empty)
            err = max(
                [(out - ref).abs().max().item() if out.numel() else 0.0]
                + [(lse - ref_lse)[~empty].abs().max().item() if (~empty).any() else 0.0]
            )
            rows.append(
                {
                    "name": "gpu_smoke_attention",
                    "case": f"tq{tq} tk{tk} h{hq}/{hk} d{d}/{dv} causal={causal} off={off}",
                    "dtype": str(dt).removeprefix("torch."),
                    "max_abs_err": float(f"{err:.2e}"),
                    "ok": same_empty and err <= TOL[dt],
                }
            )
    return rows


def _measured(device: torch.device, fn: Callable[[], Any]) -> tuple[Any, int | None]:
    """``fn()`` and the peak GPU memory it allocated (``None`` on the CPU)."""
    if device.type != "cuda":
        return fn(), None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    out = fn()
    torch.cuda.synchronize(device)
    return out, torch.cuda.max_memory_allocated(device) - base


def demo_rows(device: torch.device) -> list[dict[str, Any]]:
    rows = []
    for name, world, params in DEMOS:
        res, used = _measured(
            device,
            lambda: run(
                get_demo(name),
                world,
                fn_kwargs=demo_kwargs(get_demo(name), params),
                report=False,
                device=device,
            ),
        )
        if name == "engine":
            want = _references(params.get("model", "tiny-gqa"), num_requests=6, max_new_tokens=8)
            err, ok = None, all(r["tokens"] == want for r in res)
        else:
            err = max(r["max_abs_err"] for r in res)
            ok = err <= TOL[getattr(torch, params.get("dtype", "float64"))]
        rows.append(_demo_row(name, world, params, err, used, ok))
    for world in (2, 4):
        runs = [r for r in grid_runs(max_world=4, workload=ENGINE_WORK) if run_world(r) == world]
        res, used = _measured(
            device,
            lambda: run(
                serve_grid_rank, world, fn_kwargs={"runs": runs}, report=False, device=device
            ),
        )
        ok = all(
            rank[j]["tokens"] == _references(r["model"], **ENGINE_WORK)
            for rank in res
            for j, r in enumerate(runs)
        )
        rows.append(_demo_row("engine-grid", world, {"configs": len(runs)}, None, used, ok))
    return rows


def _demo_row(name, world, params, err, used, ok) -> dict[str, Any]:
    return {
        "name": "gpu_smoke_demo",
        "case": name,
        "world_size": world,
        "params": params,
        "max_abs_err": None if err is None else float(f"{err:.2e}"),
        "gpu_bytes": used,
        "ok": bool(ok and (used is None or used > 0)),
    }


_REFS: dict[tuple, list[list[int]]] = {}


def _references(model: str, num_requests: int, max_new_tokens: int) -> list[list[int]]:
    """Greedy tokens of :func:`make_prompts` on the CPU, float64 (cached)."""
    key = (model, num_requests, max_new_tokens)
    if key not in _REFS:
        m = TinyModel.from_name(model)
        prompts = make_prompts(num_requests, 0, m.config.vocab_size)
        _REFS[key] = [reference_generate(m, p, max_new_tokens) for p in prompts]
    return _REFS[key]


def primitives_rank(ctx: RankContext) -> dict[str, Any]:
    """Every :class:`~cpbook.core.backends.TorchGroup` primitive on a one-rank world, called
    directly (a one-rank :class:`~cpbook.core.comm.Group` call skips them)."""
    g = ctx.world
    t = torch.arange(6.0, device=ctx.device).reshape(2, 3)
    got = {
        "all_gather": g._all_gather_start(t).wait()[0],
        "all_gather_0dim": g._all_gather_start(t[1, 2]).wait()[0],
        "reduce_scatter": g._reduce_scatter(t),
        "all_reduce": g._all_reduce(t),
        "all_to_all": g._all_to_all(t),
    }
    if ctx.backend != "gloo":  # gloo cannot send to itself; NCCL can
        got["sendrecv"] = g._sendrecv(t, 0, torch.empty_like(t), 0)
    g._barrier()
    want = {"all_gather_0dim": t[1, 2]}
    return {
        "primitives": {k: bool(torch.equal(v, want.get(k, t))) for k, v in got.items()},
        "on_device": all(v.device == ctx.device for v in got.values()),
        "device": str(ctx.device),
    }


def dist_rows(device: torch.device) -> list[dict[str, Any]]:
    backend = "nccl" if device.type == "cuda" else "gloo"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # by module path, also when this file runs as __main__: torchrun workers import it
    fn = importlib.import_module(__spec__.name if __spec__ else __name__).primitives_rank
    res = run(fn, 1, "torchrun", dist_backend=backend, job_timeout=300, report=False)
    prim = res[0]
    rows = [
        {
            "name": "gpu_smoke_dist",
            "case": "TorchGroup primitives",
            "dist_backend": backend,
            **prim,
            "ok": all(prim["primitives"].values()) and prim["on_device"],
        }
    ]
    cli = [sys.executable, "-m", "cpbook", "demo", "merge", "--world-size", "1"]
    out = subprocess.run(
        [*cli, "--backend", "torchrun", "--dist-backend", backend],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    head = f"torchrun: 1 ranks, {backend}"
    rows.append(
        {
            "name": "gpu_smoke_dist",
            "case": "demo merge --backend torchrun",
            "dist_backend": backend,
            "returncode": out.returncode,
            "ok": out.returncode == 0
            and out.stdout.startswith(head)
            and "merged == dense: True" in out.stdout,
        }
    )
    serve = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1"]
    work = ["--requests", "3", "--max-new-tokens", "3", "--json"]
    out = subprocess.run(
        [*serve, "-m", "cpbook", "serve", "--model", "tiny-mla", "--dist-backend", backend, *work],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    got = [json.loads(x)["tokens"] for x in out.stdout.splitlines() if '"request"' in x]
    rows.append(
        {
            "name": "gpu_smoke_dist",
            "case": "torchrun -m cpbook serve",
            "dist_backend": backend,
            "returncode": out.returncode,
            "ok": out.returncode == 0 and got == _references("tiny-mla", **ENGINE_WORK),
        }
    )
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda:0", help="cuda:0 (default), or cpu for a dry run")
    a = p.parse_args(argv)
    device, failed = torch.device(a.device), []
    torch.set_num_threads(1)
    env = env_row(device)
    emit(env, failed)
    checks = 1
    for section in (attention_rows, demo_rows, dist_rows) if env["ok"] else ():
        try:
            rows = section(device)
        except Exception as e:  # noqa: BLE001 - reported as a failed check; the others still run
            rows = [
                {
                    "name": "gpu_smoke_error",
                    "case": section.__name__,
                    "error": repr(e)[-3000:],
                    "ok": False,
                }
            ]
        for row in rows:
            emit(row, failed)
        checks += len(rows)
    summary = {"name": "gpu_smoke_summary", "device": str(device), "checks": checks}
    print(json.dumps({**summary, "failed": failed, "ok": not failed}), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
