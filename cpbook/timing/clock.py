"""The clock: when and where numbers were taken, a GPU-aware stopwatch, and the barrier-aligned
rounds every timing helper runs its methods in.  The package's only reads of a clock are here
(``time.perf_counter`` for wall time, ``time.process_time`` / ``time.thread_time`` for CPU time).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

import torch

from cpbook.core.context import RankContext
from cpbook.core.errors import RuleError

__all__ = [
    "CLOCKS",
    "WALL_CLOCK",
    "Stopwatch",
    "device_name",
    "machine_record",
    "stopwatch",
    "synchronize",
    "timed_rounds",
]


def device_name(device: torch.device | str = "cpu") -> str:
    """What ran the tensors: ``"cpu"``, or ``"cuda:0 (NVIDIA H200)"``."""
    device = torch.device(device)
    if device.type != "cuda":
        return device.type
    return f"{device} ({torch.cuda.get_device_name(device)})"


def machine_record(device: torch.device | str = "cpu", dist_backend: str = "none") -> dict:
    """When and where numbers were taken: UTC date and minute, CPU model and count, 1-minute
    load average, the device the tensors lived on (:func:`device_name`) and the dist backend
    between ranks (``"gloo"``, ``"nccl"``, ``"inline"`` for simulated ranks, ``"none"``).
    Every ``bench/`` script prints it first, so stored results carry it."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "machine": f"{os.cpu_count()} x {cpu}",
        "cores": os.cpu_count(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "device": device_name(device),
        "dist_backend": dist_backend,
    }


def synchronize(device: torch.device | str) -> None:
    """Wait for every kernel queued on ``device`` (a no-op on the CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


CLOCKS: Mapping[str, Callable[[], float]] = {
    "wall": time.perf_counter,
    "process": time.process_time,
    "thread": time.thread_time,
}
"""The clocks by name: wall time, CPU time of the whole process (every thread), CPU time of the
calling thread."""

WALL_CLOCK: Mapping[str, Callable[[], float]] = {"": CLOCKS["wall"]}
"""The wall clock alone, as :func:`timed_rounds`' ``clocks`` (no ``_cpu`` / ``_thread`` keys)."""


def timed_rounds(
    ctx: RankContext,
    methods: Mapping[str, Callable[[], Any]],
    repeats: int,
    clocks: Mapping[str, Callable[[], float]] | None = None,
) -> tuple[dict[str, float], dict[str, Any]]:
    """Run every method ``repeats + 1`` times in turns, each run from a world barrier.

    Returns ``({method + clock_suffix: median seconds over the last repeats}, {method: last
    return value})``.  Default clocks: ``""`` wall (``perf_counter``), ``"_cpu"`` process CPU
    time (every thread of the rank) and ``"_thread"`` CPU time of the calling thread.  On a GPU
    each run is bracketed by :func:`synchronize`, so the wall clock includes the kernels.
    """
    clocks = clocks or {"": CLOCKS["wall"], "_cpu": CLOCKS["process"], "_thread": CLOCKS["thread"]}
    runs: dict[str, list[float]] = {m + c: [] for m in methods for c in clocks}
    last: dict[str, Any] = {}
    for _ in range(repeats + 1):
        for name, fn in methods.items():
            synchronize(ctx.device)  # nothing queued before counts ...
            ctx.world.barrier()
            start = {c: clock() for c, clock in clocks.items()}
            last[name] = fn()
            synchronize(ctx.device)  # ... and the method's own kernels do
            for c, clock in clocks.items():
                runs[name + c].append(clock() - start[c])
    return {key: statistics.median(t[1:]) for key, t in runs.items()}, last


@dataclass
class Stopwatch:
    """What :func:`stopwatch` measured: ``seconds`` of wall time (0.0 until its block ends)."""

    seconds: float = 0.0

    @property
    def ms(self) -> float:
        """The same in milliseconds."""
        return 1e3 * self.seconds


@contextlib.contextmanager
def stopwatch(device: torch.device | str | None = None, clock: str = "wall") -> Iterator[Stopwatch]:
    """Time the ``with`` block: ``with stopwatch(device) as t: ...`` then ``t.seconds``.

    ``clock`` is one of :data:`CLOCKS` (``"wall"``, ``"process"``, ``"thread"``).  On a GPU
    ``device`` the block starts after, and ends with, :func:`synchronize`, so its kernels count,
    not their launch; ``None`` or the CPU reads the clock only.  The seconds are set when the
    block ends, also when it raises."""
    if clock not in CLOCKS:
        raise RuleError("clock-name", f"clock in {tuple(CLOCKS)}", clock=clock)
    read, watch = CLOCKS[clock], Stopwatch()
    if device is not None:
        synchronize(device)
    start = read()
    try:
        yield watch
    finally:
        if device is not None:
            synchronize(device)
        watch.seconds = read() - start
