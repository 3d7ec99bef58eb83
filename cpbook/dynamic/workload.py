"""The simulator's workload: a seeded stream of requests with Poisson arrivals and a
long-tailed mix of prompt lengths (chapter 7), the input of
:func:`cpbook.dynamic.simulator.simulate`."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["SimWorkload", "WorkloadMix", "make_workload"]


@dataclass(frozen=True)
class SimWorkload:
    """``n`` requests: arrival times (s), prompt and output lengths (tokens), arrival order."""

    arrival: np.ndarray
    prompt: np.ndarray
    output: np.ndarray

    @property
    def total(self) -> np.ndarray:
        return self.prompt + self.output


@dataclass(frozen=True)
class WorkloadMix:
    """The length distributions of :func:`make_workload`: prompts a mixture of two log-normals
    (medians ``short_median`` and, for a ``long_fraction`` of requests, ``long_median``; shape
    ``sigma``) clipped to ``[16, max_prompt]``; outputs log-normal around ``output_median``
    clipped to ``[2, max_output]``."""

    long_fraction: float = 0.1
    short_median: int = 2_000
    long_median: int = 48_000
    sigma: float = 0.8
    max_prompt: int = 512_000
    output_median: int = 400
    max_output: int = 4_096


def make_workload(
    num_requests: int = 10_000,
    rate: float = 4.0,
    *,
    mix: WorkloadMix | None = None,
    seed: int = 0,
) -> SimWorkload:
    """Poisson arrivals at ``rate`` req/s, lengths drawn from ``mix`` (default
    :class:`WorkloadMix`), seeded."""
    m = WorkloadMix() if mix is None else mix
    rng = np.random.default_rng(seed)
    arrival = np.cumsum(rng.exponential(1.0 / rate, num_requests))
    is_long = rng.random(num_requests) < m.long_fraction
    median = np.where(is_long, m.long_median, m.short_median)
    prompt = np.clip(median * np.exp(m.sigma * rng.standard_normal(num_requests)), 16, m.max_prompt)
    output = np.clip(
        m.output_median * np.exp(0.7 * rng.standard_normal(num_requests)), 2, m.max_output
    )
    return SimWorkload(arrival, prompt.astype(np.int64), output.astype(np.int64))
