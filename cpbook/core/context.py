"""What a per-rank function receives: :class:`RankContext` (its rank, the world group, a
collective way to make sub-groups, and the rank's :class:`~cpbook.core.comm.Trace`).

The same per-rank function runs on simulated ranks (:class:`~cpbook.core.backends.SimGroup`)
and under ``torchrun`` (:class:`~cpbook.core.backends.TorchGroup`); only the context differs."""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Sequence

import torch

from cpbook.core.backends import SimGroup, SimWorld, TorchGroup, new_process_group
from cpbook.core.comm import DEFAULT_TIMEOUT_S, Group, Trace, process_group_timeout_s
from cpbook.core.errors import RuleError

__all__ = ["RankContext"]


# ------------------------------------------------------------------------------------------
# What a per-rank function receives
# ------------------------------------------------------------------------------------------
@dataclass
class RankContext:
    """Everything a per-rank function needs: its rank, the world group, a way to make groups.

    ``new_group(group_ranks, name)`` is collective: every rank passes the same list of rank
    lists (e.g. all DCP groups) and gets back the :class:`Group` that contains it.
    """

    rank: int
    world_size: int
    backend: str  # "inline", "gloo" or "nccl"
    device: torch.device
    timeout: float = DEFAULT_TIMEOUT_S
    trace: Trace = field(default_factory=Trace)
    sim: SimWorld | None = None
    _cache: dict = field(default_factory=dict, repr=False)

    @contextmanager
    def traced(self) -> Iterator[list[tuple[str, int]]]:
        """``with ctx.traced() as comm:`` — on leaving the block, ``comm`` holds
        ``(op, bytes_sent)`` of every call this rank made inside it, in call order: the traced
        side of a mechanism's ``*_comm_bytes`` formula."""
        first, calls = len(self.trace), []
        try:
            yield calls
        finally:
            calls.extend((r.op, r.bytes_sent) for r in self.trace[first:])

    @property
    def world(self) -> Group:
        return self.new_group([list(range(self.world_size))], "world")

    def new_group(self, group_ranks: Sequence[Sequence[int]], name: str) -> Group:
        lists = [tuple(int(r) for r in g) for g in group_ranks]
        flat = sorted(r for g in lists for r in g)
        if flat != list(range(self.world_size)):
            raise RuleError(
                "group-partition",
                f"the groups of {name!r} to partition ranks 0..{self.world_size - 1} exactly once",
                groups=[list(g) for g in lists],
            )
        key = (name, tuple(lists))
        if key not in self._cache:
            mine = next(g for g in lists if self.rank in g)
            if self.sim is not None:
                self._cache[key] = SimGroup(self.sim, name, mine, self.rank, self.trace)
            else:
                import torch.distributed as dist

                td = datetime.timedelta(seconds=process_group_timeout_s(self.timeout))
                made = None
                for g in lists:  # every rank creates every group, in the same order
                    pg = (
                        (dist.group.WORLD, None)
                        if list(g) == list(range(self.world_size))
                        else new_process_group(g, td)
                    )
                    if g == mine:
                        made = pg
                self._cache[key] = TorchGroup(
                    made[0], name, mine, self.rank, self.trace, self.timeout, made[1]
                )
        return self._cache[key]
