"""Speculative decoding in the decode cost model: what ``k`` drafts do to DCP's break-even.

One verification step of ``B`` requests with ``k`` drafts each, on one GPU, per layer
(chapter 6's :func:`~cpbook.costmodel.decode.decode_layer_time` terms, called, not re-derived):

* the KV read is that of an ordinary decode step — decode is memory-bound and the ``k + 1``
  rows of a request read its KV once (``kv_read_s`` of ``B`` requests);
* the collectives are those of ``B·(k + 1)`` query rows (:func:`cpbook.dcp.verify.verify_comm_bytes`
  has the bytes): the query all-gather and the combine grow with ``k + 1``, their count and
  latency ``α`` do not.

The step emits ``m`` tokens per request on average (the mean accepted tokens, bonus included),
so per output token the time is ``step / m``.  With the KV slope ``s`` (no CP) and ``s / N``
(DCP over ``N``), and ``c_N(k)`` DCP's per-step collective time, the break-even context against
a **non-speculative** no-CP decode is::

    L*(k, m) = (c_N(k) / m − c_1) / (s − s / (N·m))

``c_1`` is the no-CP step's own collectives (0 for one layer's attention on TP alone).  With
``m = 1`` this is chapter 6's break-even; a larger ``m`` divides the collective term by about
``m`` (while ``c_N(k)`` grows only by the bytes of ``k`` more rows).  Against an *equally
speculative* no-CP decode both sides divide by ``m`` and ``L* = (c_N(k) − c_1)/(s − s/N)``:
speculation then moves the break-even up, by the extra bytes, not down.
:func:`expected_accepted_tokens` gives ``m`` for an i.i.d. per-draft acceptance rate ``a``:
``m = (1 − a^{k+1}) / (1 − a)``.  Every result here is modelled.
"""

from __future__ import annotations

import math

from cpbook.core.errors import RuleError
from cpbook.costmodel.decode import decode_layer_time
from cpbook.costmodel.specs import GPUSpec, ModelSpec

__all__ = [
    "expected_accepted_tokens",
    "spec_step_time",
    "per_token_time",
    "spec_break_even",
]


def expected_accepted_tokens(acceptance_rate: float, num_speculative_tokens: int) -> float:
    """Mean tokens a greedy step emits when each draft is accepted with probability ``a``
    independently, given its predecessors were: ``Σ_{j=0..k} a^j``."""
    a, k = acceptance_rate, num_speculative_tokens
    if not 0.0 <= a <= 1.0 or k < 0:
        raise RuleError(
            "acceptance-rate",
            "0 <= acceptance_rate <= 1 and num_speculative_tokens >= 0",
            acceptance_rate=a,
            num_speculative_tokens=k,
        )
    return float(k + 1) if a == 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)


def spec_step_time(
    model: ModelSpec,
    gpu: GPUSpec,
    context_tokens: float,
    mode: str,
    num_speculative_tokens: int = 0,
    *,
    num_reqs: int = 1,
    **kwargs,
) -> float:
    """Seconds of one layer's decode attention in a verification step: the KV read of
    ``num_reqs`` requests plus the collectives of ``num_reqs·(k + 1)`` rows (``mode``:
    ``no_cp`` or ``dcp``; ``kwargs`` to :func:`decode_layer_time`)."""
    if mode not in ("no_cp", "dcp"):
        raise RuleError("spec-mode", "mode in ('no_cp', 'dcp')", mode=mode)
    one = decode_layer_time(model, gpu, context_tokens, mode, num_reqs=num_reqs, **kwargs)
    rows = num_reqs * (num_speculative_tokens + 1)
    wide = decode_layer_time(model, gpu, context_tokens, mode, num_reqs=rows, **kwargs)
    return one.kv_read_s + wide.comm_s + one.q_proj_extra_s + one.w_uk_t_extra_s


def per_token_time(
    model: ModelSpec,
    gpu: GPUSpec,
    context_tokens: float,
    mode: str,
    num_speculative_tokens: int = 0,
    mean_accepted_tokens: float = 1.0,
    **kwargs,
) -> float:
    """:func:`spec_step_time` divided by the tokens each step emits (``m >= 1``)."""
    if mean_accepted_tokens < 1.0 or mean_accepted_tokens > num_speculative_tokens + 1:
        raise RuleError(
            "mean-accepted-tokens",
            "1 <= mean_accepted_tokens <= k + 1",
            mean_accepted_tokens=mean_accepted_tokens,
            k=num_speculative_tokens,
        )
    step = spec_step_time(model, gpu, context_tokens, mode, num_speculative_tokens, **kwargs)
    return step / mean_accepted_tokens


def spec_break_even(
    model: ModelSpec,
    gpu: GPUSpec,
    num_speculative_tokens: int,
    mean_accepted_tokens: float,
    baseline_speculates: bool = False,
    **kwargs,
) -> float:
    """Context above which DCP with ``k`` drafts beats no-CP per output token (the module's
    ``L*``); the no-CP side speculates too if ``baseline_speculates``.  ``0.0`` if DCP never
    loses, ``inf`` if it never wins; every term is linear in the context, so the crossing is
    solved exactly."""
    k, m = num_speculative_tokens, mean_accepted_tokens
    kb, mb = (k, m) if baseline_speculates else (0, 1.0)

    def gap(c: float) -> float:
        d = per_token_time(model, gpu, c, "dcp", k, m, **kwargs)
        return d - per_token_time(model, gpu, c, "no_cp", kb, mb, **kwargs)

    big = float(2**20)
    g0, g1 = gap(0.0), gap(big)
    if g0 <= 0:
        return 0.0
    if g1 >= g0:
        return math.inf
    return g0 * big / (g0 - g1)
