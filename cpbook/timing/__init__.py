"""Layer 10, the one place that measures time: helpers the benchmarks in ``bench/`` run on every
rank.

Algorithm modules never read a clock, and no test or notebook asserts on what these return: a
busy machine must not fail a check.  Each helper times its methods from a common barrier, in
turns (run after run, every method once per round), so drifts of a shared machine hit all of
them alike, and reports medians after one warm-up round.  Inputs live on ``ctx.device``; on a
GPU every timed call is bracketed by ``torch.cuda.synchronize`` (kernels run asynchronously, so
an unsynchronised clock would time the launch, not the work), and the CPU clocks (``_cpu``,
``_thread``) then measure only the host's share.

:mod:`.clock` reads the clocks (:func:`~.clock.timed_rounds`, :func:`~.clock.stopwatch` for a
bench's own loops, :func:`~.clock.machine_record`); :mod:`.prefill` and :mod:`.decode` time the
mechanisms of chapters 4–5 and 3, 6, 9–10.
"""

from cpbook.timing.clock import (
    CLOCKS,
    WALL_CLOCK,
    Stopwatch,
    device_name,
    machine_record,
    stopwatch,
    synchronize,
    timed_rounds,
)
from cpbook.timing.decode import decode_step_timing, serve_timing, spec_decode_timing
from cpbook.timing.prefill import (
    chunked_prefill_timing,
    collective_timing,
    pcp_prefill_timing,
    ring_prefill_timing,
    sdpa_ring_kernel,
)

__all__ = [
    "CLOCKS",
    "WALL_CLOCK",
    "Stopwatch",
    "chunked_prefill_timing",
    "collective_timing",
    "decode_step_timing",
    "device_name",
    "machine_record",
    "pcp_prefill_timing",
    "ring_prefill_timing",
    "sdpa_ring_kernel",
    "serve_timing",
    "spec_decode_timing",
    "stopwatch",
    "synchronize",
    "timed_rounds",
]
