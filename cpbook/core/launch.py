"""Run one per-rank function on N ranks: inline (simulated, one thread per rank) or under torchrun.

``run(fn, world_size, backend="inline" | "torchrun", fn_kwargs={...})`` calls
``fn(ctx, **fn_kwargs)`` on
every rank, where ``ctx`` is a :class:`cpbook.core.context.RankContext`, and returns the per-rank
return values in rank order.  The *same* ``fn`` runs on both backends; that is the book's
central promise.

torchrun backend: ``python -m torch.distributed.run --standalone --nproc-per-node N`` in a
subprocess (``OMP_NUM_THREADS`` set, ``PYTHONPATH`` passed through plus the current folder).
Workers import ``fn`` by its module path, so ``fn`` must live in an importable module, not in a
notebook.  NCCL is used when at least ``world_size`` CUDA GPUs are visible, gloo otherwise.
Results travel back through files (``torch.save``); each rank's stdout is captured and printed
by the parent in rank order, so the report is deterministic.  When a rank fails, torchrun
stops the job and :func:`run` raises one ``RuntimeError`` naming the guilty rank and the cause
on its first line (:mod:`cpbook.core.faults`): the exception a rank raised (its traceback
follows), the signal that killed it, or, when a rank stops answering, the call its peers
waited in for it.

Several nodes: ``run(fn, world_size, "torchrun", nodes=Nodes(nnodes, node_rank, "HOST:PORT"))``
on every node runs ``world_size // nnodes`` processes there under torchrun's c10d rendezvous;
each node's call returns its own ranks' results (``RankResults.ranks`` are their global ranks),
and a rank failing on any node fails every node's call naming that rank
(:mod:`cpbook.core.nodes`).
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import io
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from cpbook.core.backends import SimWorld
from cpbook.core.comm import (
    DEFAULT_TIMEOUT_S,
    CommAborted,
    CommTimeout,
    Trace,
    process_group_timeout_s,
)
from cpbook.core.context import RankContext
from cpbook.core.errors import RuleError
from cpbook.core.faults import error_text, raise_failure, summary
from cpbook.core.nodes import Nodes, dead_rank, write_pid

__all__ = ["run", "RankResults", "Nodes", "pick_backend", "format_report"]


class RankResults(list):
    """Per-rank return values (a list, rank order) plus each rank's trace and stdout; ``ranks``
    are their global ranks (``0 .. n-1`` on one node, this node's ranks with :class:`Nodes`)."""

    def __init__(
        self,
        values: Sequence[Any],
        traces: Sequence[Trace],
        stdout: Sequence[str],
        backend: str,
        dist_backend: str,
        ranks: Sequence[int] | None = None,
    ) -> None:
        super().__init__(values)
        self.traces, self.stdout = list(traces), list(stdout)
        self.backend, self.dist_backend = backend, dist_backend
        self.ranks = list(range(len(self)) if ranks is None else ranks)

    def report(self) -> str:
        return format_report(self.backend, self.dist_backend, self.stdout, self.traces, self.ranks)


def format_report(
    backend: str,
    dist_backend: str,
    stdout: Sequence[str],
    traces: Sequence[Trace],
    ranks: Sequence[int] | None = None,
) -> str:
    """Deterministic text: each rank's printed lines, then its traffic per (op, group)."""
    ranks = list(range(len(traces)) if ranks is None else ranks)
    head = f"{backend}: {len(traces)} ranks" + (
        f", {dist_backend}" if backend == "torchrun" else ""
    )
    lines = [head]
    for r, out in zip(ranks, stdout):
        lines += [f"[rank {r}] {line}" for line in out.splitlines()]
    for r, tr in zip(ranks, traces):
        parts = [
            f"{op}[{g}] x{c}: sent {s:,} B, recv {v:,} B"
            for (op, g), (c, s, v) in tr.summary().items()
        ]
        lines.append(f"rank {r} comm: " + ("; ".join(parts) if parts else "none"))
    return "\n".join(lines)


def pick_backend(world_size: int, nproc_per_node: int | None = None) -> str:
    """``"nccl"`` when at least ``nproc_per_node`` (default ``world_size``) GPUs are visible."""
    need = nproc_per_node or world_size
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= need else "gloo"


def run(
    fn: Callable[..., Any],
    world_size: int,
    backend: str = "inline",
    fn_kwargs: Mapping[str, Any] | None = None,
    *,
    timeout: float = DEFAULT_TIMEOUT_S,
    dist_backend: str | None = None,
    threads: int = 1,
    torchrun_args: Sequence[str] = (),
    nodes: Nodes | None = None,
    job_timeout: float = 900.0,
    report: bool = True,
    device: str | torch.device = "cpu",
) -> RankResults:
    """Run ``fn(ctx, **fn_kwargs)`` on ``world_size`` ranks and return the per-rank results.

    ``fn_kwargs`` are the per-rank function's own arguments, kept apart from the launcher's
    options, so a per-rank function may take a parameter called ``timeout`` or ``threads``.
    ``timeout`` bounds every collective; ``job_timeout`` bounds a whole torchrun job; ``threads``
    is each torchrun worker's ``OMP_NUM_THREADS``.  Extra ``torchrun_args`` (``--nnodes=2``,
    ``--rdzv-endpoint=host:port``, ``--node-rank=0`` ...) replace ``--standalone`` when they
    configure a rendezvous (``world_size`` is then per node).  ``nodes`` is the tested
    multi-node form: :class:`Nodes` ``(nnodes, node_rank, rdzv_endpoint)``, ``world_size`` the
    whole world's, ``world_size // nnodes`` processes on this node, and the results of this
    node's ranks only (``.ranks`` their global ranks).  With ``report=True`` the deterministic
    report is printed.
    ``device`` is the simulated ranks' device (``"cuda:0"``: every thread on one GPU); under
    torchrun each rank uses ``cuda:LOCAL_RANK`` with NCCL and the CPU with gloo.

    More than eight parameters: the launcher's own options (timeouts, threads, torchrun flags,
    device, report) are keyword-only and kept apart from ``fn_kwargs``, so notebooks and the CLI
    call ``run(fn, world_size, backend, fn_kwargs)`` and name only the option they change.
    """
    kwargs = dict(fn_kwargs or {})
    if not isinstance(world_size, int) or world_size < 1:
        raise RuleError("world-size", "a positive integer world_size", world_size=world_size)
    if backend == "inline":
        res = _run_inline(fn, world_size, timeout, kwargs, torch.device(device))
    elif backend == "torchrun":
        if torch.device(device).type != "cpu":
            raise RuleError(
                "launch-device",
                "device='cpu' under torchrun (each rank's device follows its dist backend)",
                device=device,
            )
        per_node = world_size // nodes.nnodes if nodes else world_size
        if nodes and per_node * nodes.nnodes != world_size:
            raise RuleError(
                "nodes-world", "world_size a multiple of nnodes", world_size=world_size, nodes=nodes
            )
        res = _run_torchrun(
            fn,
            world_size,
            timeout,
            dist_backend or pick_backend(world_size, per_node),
            threads,
            list(torchrun_args),
            job_timeout,
            kwargs,
            nodes,
        )
    else:
        raise RuleError("launch-backend", "backend in ('inline', 'torchrun')", backend=backend)
    if report:
        print(res.report())
    return res


# ------------------------------------------------------------------------------------------
# inline: one thread per simulated rank
# ------------------------------------------------------------------------------------------
class _PerThreadStdout(io.TextIOBase):
    """Routes ``print`` from rank threads into per-rank buffers; other threads pass through."""

    def __init__(self, fallback) -> None:
        self.fallback, self.local = fallback, threading.local()

    def write(self, s: str) -> int:
        buf = getattr(self.local, "buf", None)
        return (buf or self.fallback).write(s)

    def flush(self) -> None:
        self.fallback.flush()


def _run_inline(
    fn, world_size: int, timeout: float, kwargs: dict, device: torch.device
) -> RankResults:
    sim = SimWorld(world_size, timeout)
    ctxs = [
        RankContext(r, world_size, "inline", device, timeout, sim=sim) for r in range(world_size)
    ]
    values: list[Any] = [None] * world_size
    bufs = [io.StringIO() for _ in range(world_size)]
    errors: list[tuple[float, int, BaseException, str]] = []
    proxy = _PerThreadStdout(sys.stdout)

    def body(r: int) -> None:
        proxy.local.buf = bufs[r]
        try:
            values[r] = fn(ctxs[r], **kwargs)
        except BaseException as e:  # noqa: BLE001 - reported to the caller below
            errors.append((time.monotonic(), r, e, traceback.format_exc()))
            sim.abort()

    threads = [
        threading.Thread(target=body, args=(r,), name=f"cpbook-rank{r}", daemon=True)
        for r in range(world_size)
    ]
    old = sys.stdout
    sys.stdout = proxy
    try:
        for t in threads:
            t.start()
        silent = _join(threads, errors, time.monotonic() + 4 * timeout + 60, min(timeout, 5.0))
    finally:
        sys.stdout = old
    if silent and not errors:
        sim.abort()
        raise RuntimeError(
            f"inline run of {fn.__name__} did not finish within {4 * timeout + 60:g} s"
        )
    if silent and all(isinstance(e[2], (CommTimeout, CommAborted)) for e in errors):
        sim.abort()  # every failure was a wait: the ranks still running are the ones waited for
        waited = sorted(set(range(world_size)) - set(silent))
        _, _, e, tb = min(errors, key=lambda e: (isinstance(e[2], CommAborted), e[0]))
        raise RuntimeError(
            f"rank {silent[0]} of {world_size} failed in {fn.__name__}: stopped answering: "
            f"ranks {waited} timed out or gave up waiting (timeout {timeout:g} s) while "
            f"rank(s) {silent} never returned\n{tb}"
        ) from e
    if errors:
        errors.sort(key=lambda e: (isinstance(e[2], CommAborted), e[0]))
        _, r, e, tb = errors[0]
        raise RuntimeError(
            f"rank {r} of {world_size} failed in {fn.__name__}: {summary(e)}\n{tb}"
        ) from e
    return RankResults(
        values, [c.trace for c in ctxs], [b.getvalue() for b in bufs], "inline", "threads"
    )


def _join(threads: list, errors: list, deadline: float, grace: float) -> list[int]:
    """Wait for the rank threads until they end, ``grace`` seconds after the first error (the
    others' collectives fail at once, or time out, when a rank raises or stops answering), or
    at ``deadline``; returns the ranks still running."""
    first = None
    while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
        if errors and first is None:
            first = time.monotonic()
        if first is not None and time.monotonic() > first + grace:
            break
        next(t for t in threads if t.is_alive()).join(0.05)
    return [r for r, t in enumerate(threads) if t.is_alive()]


# ------------------------------------------------------------------------------------------
# torchrun: real processes
# ------------------------------------------------------------------------------------------
def _fn_path(fn) -> str:
    mod, qual = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not mod or mod == "__main__" or "<locals>" in qual:
        raise RuleError(
            "importable-fn",
            "fn importable by module path (torchrun workers import it): define it in a module "
            "(e.g. cpbook) instead of a notebook cell",
            fn=getattr(fn, "__name__", fn),
            module=mod,
            qualname=qual,
        )
    return f"{mod}:{qual}"


def _run_torchrun(
    fn, world_size, timeout, dist_backend, threads, extra, job_timeout, kwargs, nodes=None
) -> RankResults:
    rendezvous = nodes is not None or any(
        a.split("=")[0]
        in ("--nnodes", "--rdzv-endpoint", "--rdzv_endpoint", "--master-addr", "--master_addr")
        for a in extra
    )
    with tempfile.TemporaryDirectory(prefix="cpbook-run-") as tmp:
        torch.save(
            {
                "fn": _fn_path(fn),
                "kwargs": kwargs,
                "timeout": timeout,
                "dist_backend": dist_backend,
                "nodes": nodes is not None,
            },
            Path(tmp, "payload.pt"),
        )
        where = (
            nodes.torchrun_args(world_size // nodes.nnodes)
            if nodes
            else [*([] if rendezvous else ["--standalone"]), f"--nproc-per-node={world_size}"]
        )
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            *where,
            *extra,
            "-m",
            "cpbook.core.launch",
            tmp,
        ]
        env = dict(
            os.environ,
            OMP_NUM_THREADS=str(threads),
            PYTHONPATH=os.pathsep.join(
                p for p in [os.getcwd(), os.environ.get("PYTHONPATH", "")] if p
            ),
        )
        out_path, err_path = Path(tmp, "torchrun.out"), Path(tmp, "torchrun.err")
        with open(out_path, "w") as fo, open(err_path, "w") as fe:
            proc = subprocess.Popen(
                cmd, stdout=fo, stderr=fe, text=True, env=env, start_new_session=True
            )
        dead, deadline = None, time.monotonic() + job_timeout
        while proc.poll() is None:
            if time.monotonic() > deadline:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                raise RuntimeError(
                    f"torchrun job for {fn.__name__} exceeded {job_timeout:g} s; stderr tail:\n"
                    f"{err_path.read_text()[-3000:]}"
                )
            if nodes and dead is None:
                dead = dead_rank(tmp, nodes.node_rank)
            time.sleep(0.05)
        out, err = out_path.read_text(), err_path.read_text()
        if nodes and dead is None:
            dead = dead_rank(tmp, nodes.node_rank)
        raise_failure(fn.__name__, world_size, tmp, err, dead)
        files = {
            int(p.stem.removeprefix("result_rank")): p for p in Path(tmp).glob("result_rank*.pt")
        }
        if proc.returncode != 0 or not files:
            raise RuntimeError(
                f"torchrun exited with code {proc.returncode} and no rank reported an "
                f"error; stderr tail:\n{err[-3000:]}\nstdout tail:\n{out[-2000:]}"
            )
        if nodes:  # this node's ranks only
            ranks = sorted(files)
            got = [torch.load(files[r], weights_only=False) for r in ranks]
        else:  # raw torchrun_args: ranks on other nodes leave their results there: None here
            empty = {"value": None, "trace": Trace(), "stdout": ""}
            ranks = list(range(max(files) + 1 if rendezvous else world_size))
            got = [torch.load(files[r], weights_only=False) if r in files else empty for r in ranks]
    return RankResults(
        [g["value"] for g in got],
        [g["trace"] for g in got],
        [g["stdout"] for g in got],
        "torchrun",
        dist_backend,
        ranks,
    )


def _to_cpu(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if isinstance(x, (list, tuple)) and type(x) in (list, tuple):
        return type(x)(_to_cpu(v) for v in x)
    if isinstance(x, dict):
        return {k: _to_cpu(v) for k, v in x.items()}
    return x


def worker_context(dist_backend: str, timeout: float) -> RankContext:
    """Initialise ``torch.distributed`` from torchrun's environment; build this rank's context."""
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cpu")
    if dist_backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    dist.init_process_group(
        dist_backend,
        timeout=datetime.timedelta(seconds=process_group_timeout_s(timeout)),
        **({"device_id": device} if dist_backend == "nccl" else {}),
    )
    return RankContext(rank, world, dist_backend, device, timeout)


def worker_run(fn, kwargs: dict, ctx: RankContext) -> dict:
    """Run ``fn`` on this rank with stdout captured; returns ``{"value", "trace", "stdout"}``."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        value = fn(ctx, **kwargs)
    return {"value": _to_cpu(value), "trace": ctx.trace, "stdout": buf.getvalue()}


def gather_results(mine: dict, ctx: RankContext) -> list[dict] | None:
    """Collect every rank's :func:`worker_run` result on rank 0 (one extra collective)."""
    import torch.distributed as dist

    gathered = [None] * ctx.world_size if ctx.rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    return gathered


def _worker_main(tmp: str) -> None:
    """A torchrun worker: run the payload's function, leave a result or an error file."""
    payload = torch.load(Path(tmp, "payload.pt"), weights_only=False)
    mod, qual = payload["fn"].split(":")
    fn = importlib.import_module(mod)
    for part in qual.split("."):
        fn = getattr(fn, part)
    rank = int(os.environ["RANK"])
    write_pid(tmp, rank)  # a rank that dies without a word is found by its pid (core/faults.py)
    signal.signal(signal.SIGTERM, lambda *_: _terminated(tmp, rank))
    try:
        ctx = worker_context(payload["dist_backend"], payload["timeout"])
        mine = worker_run(fn, payload["kwargs"], ctx)
    except BaseException as e:  # noqa: BLE001 - the parent raises it with this traceback
        tb = traceback.format_exc()
        try:
            text = error_text(rank, e, tb, payload["timeout"])
        except Exception:  # noqa: BLE001 - the report itself failed: this rank's own error
            text = f"{rank} raised\n{summary(e)}\n{tb}"
        Path(tmp, f"error_rank{rank}.tmp").write_text(text)
        os.replace(Path(tmp, f"error_rank{rank}.tmp"), Path(tmp, f"error_rank{rank}.txt"))
        sys.stdout.flush()
        os._exit(1)
    torch.save(mine, Path(tmp, f"rank{rank}.tmp"))
    os.replace(Path(tmp, f"rank{rank}.tmp"), Path(tmp, f"result_rank{rank}.pt"))
    import torch.distributed as dist

    dist.destroy_process_group()


def _terminated(tmp: str, rank: int) -> None:
    """torchrun stops the other workers (SIGTERM) when one fails: not a root cause."""
    Path(tmp, f"term_rank{rank}").touch()
    os._exit(143)


if __name__ == "__main__":
    _worker_main(sys.argv[1])
