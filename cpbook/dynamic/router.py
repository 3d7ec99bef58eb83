"""Dynamic CP, the planning half: route each request to data parallelism (CP = 1) or to a CP
group of a chosen size by its length (chapter 7).

A :class:`Router` holds increasing length thresholds ``t_1 < t_2 < ...`` and CP sizes
``1 = n_0 < n_1 < ...``: a request whose expected total length (prompt + expected output)
``T`` satisfies ``t_j <= T < t_{j+1}`` runs on ``n_j`` replicas (``t_0 = 0``).  A request that
does not fit in the KV memory of that many replicas is sent to the smallest size where it fits.

Where the thresholds come from:

* :meth:`Router.measured` — chapter 6's measured break-even length on 2 gloo ranks
  (``decode_step.json`` in :mod:`cpbook.data`): the length above which DCP (or DCP + TPA) decoded
  one step faster than one rank.
* :meth:`Router.modelled` — the cost model (:func:`cpbook.costmodel.decode_layer_time`) for a
  model and GPU: for every length, the CP size whose decode-attention step is shortest (the
  lower envelope of one line per size).  A CP group of ``N`` replicas of ``replica_tp`` GPUs
  is modelled as vLLM's layout TP = ``N·replica_tp``, DCP = ``N`` (with TPA: attention TP =
  ``replica_tp``), so its valid sizes are the ones vLLM's rules accept.

The migration of a running request into a bigger group is :mod:`cpbook.dynamic.migration`; the
workload simulator is :mod:`cpbook.dynamic.simulator`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from cpbook import costmodel as cm
from cpbook.core.config import ConfigError, RuleError
from cpbook.data import stored_rows, stored_text

__all__ = ["Route", "Router", "cp_line", "valid_cp_size"]


@dataclass(frozen=True)
class Route:
    """Where one request goes and why: ``cp_size`` replicas, ``reason`` in words."""

    cp_size: int
    reason: str


def valid_cp_size(model: cm.ModelSpec, n: int, replica_tp: int = 1, tpa: bool = False) -> None:
    """Raise :class:`~cpbook.core.config.ConfigError` (vLLM's rule name) unless ``n`` replicas
    of ``replica_tp`` GPUs can form a DCP group for ``model``: the layout TP = ``n·replica_tp``,
    DCP = ``n``."""
    if n > 1:
        cm.Deployment(tp=n * replica_tp, dcp=n, tpa=tpa).config(model)


def cp_line(
    model: cm.ModelSpec,
    gpu: cm.GPUSpec,
    n: int,
    *,
    replica_tp: int = 1,
    tpa: bool = False,
    num_reqs: int = 1,
    link: cm.LinkSpec | None = None,
) -> tuple[float, float]:
    """One layer's decode attention on a CP group of ``n`` replicas as ``(a, s)``: seconds
    ``a + s·L`` for ``num_reqs`` requests of ``L`` tokens (``n = 1``: one replica, no CP)."""
    mode = "no_cp" if n == 1 else ("dcp_tpa" if tpa else "dcp")
    tp, dcp = (replica_tp, 1) if n == 1 else (n * replica_tp, n)
    kw = dict(tp=tp, dcp=dcp, num_reqs=num_reqs)
    if link is not None:
        kw["knobs"] = cm.CostKnobs(link=link)
    big = float(2**20)
    a = cm.decode_layer_time(model, gpu, 0, mode, **kw).total_s
    return a, (cm.decode_layer_time(model, gpu, big, mode, **kw).total_s - a) / big


class Router:
    """Length thresholds -> CP size (module docstring).

    ``thresholds``: ``k`` strictly increasing lengths ``> 0``; ``cp_sizes``: ``k + 1`` strictly
    increasing sizes starting at 1.  With ``model``, every size must be a valid DCP group for it
    (:func:`valid_cp_size`); with ``pool_size``, every size must divide the pool.  With
    ``capacity_tokens`` (KV tokens one replica holds), a request is moved up to the smallest
    size whose ``n·capacity_tokens`` holds it.  Violations raise ``ConfigError`` naming the rule.
    """

    def __init__(
        self,
        thresholds: Sequence[float],
        cp_sizes: Sequence[int],
        *,
        model: cm.ModelSpec | None = None,
        replica_tp: int = 1,
        tpa: bool = False,
        pool_size: int | None = None,
        capacity_tokens: float | None = None,
    ) -> None:
        t, n = [float(x) for x in thresholds], [int(x) for x in cp_sizes]
        if len(n) != len(t) + 1:
            raise ConfigError(
                "one-size-per-range",
                "len(cp_sizes) == len(thresholds) + 1",
                thresholds=t,
                cp_sizes=n,
            )
        if any(x < 0 or math.isnan(x) for x in t) or any(b <= a for a, b in zip(t, t[1:])):
            raise ConfigError(
                "thresholds-increasing", "thresholds >= 0 and strictly increasing", thresholds=t
            )
        if n[0] != 1 or any(b <= a for a, b in zip(n, n[1:])):
            raise ConfigError(
                "cp-sizes-increasing", "cp_sizes strictly increasing from 1", cp_sizes=n
            )
        if pool_size is not None and any(pool_size % x for x in n):
            raise ConfigError(
                "cp-size-divides-pool",
                "every cp size to divide pool_size",
                cp_sizes=n,
                pool_size=pool_size,
            )
        if model is not None:
            for x in n:
                valid_cp_size(model, x, replica_tp, tpa)
        self.thresholds, self.cp_sizes = t, n
        self.capacity_tokens = capacity_tokens
        self.tpa = tpa

    def __repr__(self) -> str:
        return f"Router(thresholds={[round(x) for x in self.thresholds]}, cp_sizes={self.cp_sizes})"

    def route_many(self, totals: np.ndarray) -> np.ndarray:
        """CP size for each expected total length (int64 array, same shape)."""
        totals = np.asarray(totals, dtype=np.float64)
        idx = np.searchsorted(np.asarray(self.thresholds), totals, side="right")
        sizes = np.asarray(self.cp_sizes, dtype=np.int64)[idx]
        if self.capacity_tokens is not None:
            for j, n in enumerate(self.cp_sizes):
                too_big = totals > n * self.capacity_tokens
                if j + 1 < len(self.cp_sizes):
                    sizes = np.where(too_big & (sizes <= n), self.cp_sizes[j + 1], sizes)
        return sizes

    def route(self, prompt_len: int, expected_output: int = 0) -> Route:
        """The :class:`Route` of one request, with the rule that chose it."""
        total = prompt_len + expected_output
        n = int(self.route_many(np.array([total]))[0])
        j = self.cp_sizes.index(n)
        by_length = int(np.searchsorted(np.asarray(self.thresholds), total, side="right"))
        if j > by_length:
            why = f"{total:,} tokens do not fit {self.cp_sizes[j - 1]} replica(s): memory"
        elif j == 0:
            why = f"{total:,} < {self.thresholds[0]:,.0f}: DP" if self.thresholds else "DP"
        else:
            why = f"{total:,} >= {self.thresholds[j - 1]:,.0f}: CP={n}"
        return Route(n, why)

    # -- defaults -------------------------------------------------------------------------
    @classmethod
    def measured(cls, tpa: bool = False, path: Path | str | None = None) -> "Router":
        """DP below chapter 6's measured break-even length, CP = 2 above it.  Read from the
        package's stored run (:mod:`cpbook.data`), or from ``path``, a ``decode_step.json``."""
        text = stored_text("decode_step.json") if path is None else Path(path).read_text()
        for row in stored_rows(text):
            if row.get("name") == "decode_break_even":
                key = "dcp_tpa_tokens" if tpa else "dcp_tokens"
                return cls([row[key]], [1, row["ranks"]], tpa=tpa)
        raise RuleError("measured-break-even", "a decode_break_even row", path=path)

    @classmethod
    def modelled(
        cls,
        model: cm.ModelSpec,
        gpu: cm.GPUSpec,
        cp_sizes: Sequence[int] = (1, 2, 4, 8),
        *,
        replica_tp: int = 1,
        tpa: bool = False,
        num_reqs: int = 1,
        link: cm.LinkSpec | None = None,
        **kwargs,
    ) -> "Router":
        """Thresholds where the modelled decode-attention step of a bigger CP size becomes the
        shortest (lower envelope of :func:`cp_line` over ``cp_sizes``); sizes that are never
        the shortest are dropped.  ``kwargs`` go to :class:`Router`."""
        for n in cp_sizes:
            valid_cp_size(model, n, replica_tp, tpa)
        lines = {
            n: cp_line(model, gpu, n, replica_tp=replica_tp, tpa=tpa, num_reqs=num_reqs, link=link)
            for n in cp_sizes
        }
        sizes, thresholds, at = [1], [], 0.0
        while True:
            a0, s0 = lines[sizes[-1]]
            best = None
            for n in cp_sizes:
                a, s = lines[n]
                if n > sizes[-1] and s < s0:
                    x = max((a - a0) / (s0 - s), at)
                    if best is None or x < best[0] or (x == best[0] and s < lines[best[1]][1]):
                        best = (x, n)
            if best is None:
                break
            at = best[0]
            if thresholds and at <= thresholds[-1]:
                sizes[-1] = best[1]  # the previous size never wins: replace it
            else:
                thresholds.append(at)
                sizes.append(best[1])
        return cls(thresholds, sizes, model=model, replica_tp=replica_tp, tpa=tpa, **kwargs)
