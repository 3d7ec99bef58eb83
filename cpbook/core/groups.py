"""The rank grid: world = PCP × TP (TP innermost), and the TP, PCP and DCP groups as rank lists.

vLLM builds every group from one tensor of global ranks (``initialize_model_parallel`` in
``vllm/distributed/parallel_state.py``); we keep only the PCP and TP axes (no DP, PP):

* TP groups are the rows: ranks ``[p*tp, ..., p*tp + tp - 1]`` for each PCP slice ``p``.
* PCP groups are the columns: one TP rank across all PCP slices (stride ``tp``).
* DCP groups depend on the vLLM release (``order``, one of :data:`GROUP_ORDERS`; the default
  :data:`ANCHOR_ORDER` is the release the book anchors to, v0.34.0):

  - ``"v0.14"`` (v0.11 and v0.14): ``all_ranks.reshape(-1, dcp)``, contiguous chunks of each
    TP group, ``dcp_rank = tp_rank % dcp``.  TP=8, DCP=4 → ``[0,1,2,3], [4,5,6,7]``.
  - ``"v0.33"`` (v0.33.0, inline in ``initialize_model_parallel``): when ``dcp > 1``, transpose
    (PCP, TP) to (TP, PCP), then ``reshape(-1, dcp)``; when ``dcp == 1``, no transpose, so the
    one-rank groups are listed in rank order (TP=2, PCP=2 → ``[[0],[1],[2],[3]]``, vLLM's
    ``tests/distributed/test_context_parallel_group_layout.py``).  Identical to v0.14 for
    PCP = 1; for PCP > 1 a DCP group spans PCP first: TP=2, PCP=2, DCP=2 → ``[[0,2],[1,3]]``
    (= the PCP groups), DCP=4 → ``[[0,2,1,3]]``.
  - ``"v0.34"`` (v0.34.0): the same groups, each listed in sorted rank order
    (``[sorted(x.tolist()) ...]``): torch.distributed orders a group's members by sorted
    global rank, so an unsorted list made ``rank_in_group`` disagree with the order of a
    collective's output.  Only a DCP group that spans both TP > 1 and PCP > 1 changes:
    TP=2, PCP=2, DCP=4 → ``[[0,1,2,3]]``, so there ``dcp_rank`` is the global rank.

``"current"`` is accepted as another name for :data:`ANCHOR_ORDER`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cpbook.core.comm import Group
from cpbook.core.config import ConfigError, ParallelConfig, check_positive
from cpbook.core.context import RankContext
from cpbook.core.errors import RuleError

__all__ = [
    "ANCHOR_ORDER",
    "GROUP_ORDERS",
    "RankCoords",
    "RankGrid",
    "ParallelGroups",
    "make_groups",
    "check_grid_world",
    "pcp_of_world",
]


GROUP_ORDERS = ("v0.14", "v0.33", "v0.34")
ANCHOR_ORDER = "v0.34"  # the group order of the release the book anchors to (v0.34.0)


@dataclass(frozen=True)
class RankCoords:
    """Where one global rank sits: its PCP slice, its TP rank and its rank in its DCP group."""

    rank: int
    pcp_rank: int
    tp_rank: int
    dcp_rank: int


@dataclass(frozen=True)
class RankGrid:
    """Rank lists of every group of a (tp, pcp, dcp) grid in a vLLM release's group ``order``
    (one of :data:`GROUP_ORDERS`, or ``"current"`` = :data:`ANCHOR_ORDER`); no communication."""

    tensor_parallel_size: int
    prefill_context_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    order: str = ANCHOR_ORDER

    @classmethod
    def from_config(cls, config: ParallelConfig, order: str = ANCHOR_ORDER) -> "RankGrid":
        return cls(config.tp, config.pcp, config.dcp, order)

    def __post_init__(self) -> None:
        tp, pcp, dcp = (
            self.tensor_parallel_size,
            self.prefill_context_parallel_size,
            self.decode_context_parallel_size,
        )
        check_positive(
            tensor_parallel_size=tp,
            prefill_context_parallel_size=pcp,
            decode_context_parallel_size=dcp,
        )
        if self.order == "current":
            object.__setattr__(self, "order", ANCHOR_ORDER)
        if self.order not in GROUP_ORDERS:
            raise ConfigError("group-order", f"order in {GROUP_ORDERS}", order=self.order)
        if (tp * pcp) % dcp:
            raise ConfigError(
                "grid-dcp-divides-world",
                "(tp * pcp) % dcp == 0",
                tensor_parallel_size=tp,
                prefill_context_parallel_size=pcp,
                decode_context_parallel_size=dcp,
            )
        if self.order == "v0.14" and tp % dcp:
            raise ConfigError(
                "tp-divisible-by-dcp",
                "tp % dcp == 0 (v0.14 keeps DCP inside TP)",
                tensor_parallel_size=tp,
                decode_context_parallel_size=dcp,
            )

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.prefill_context_parallel_size

    def _grid(self) -> torch.Tensor:
        return torch.arange(self.world_size).reshape(
            self.prefill_context_parallel_size, self.tensor_parallel_size
        )

    def tp_groups(self) -> list[list[int]]:
        return self._grid().tolist()

    def pcp_groups(self) -> list[list[int]]:
        return self._grid().T.tolist()

    def dcp_groups(self) -> list[list[int]]:
        """The DCP groups, each listed in the order ``self.order`` gives (see the module)."""
        g = self._grid()
        if self.order != "v0.14" and self.decode_context_parallel_size > 1:
            g = g.T  # vLLM transposes only for DCP > 1
        groups = g.reshape(-1, self.decode_context_parallel_size).tolist()
        return [sorted(x) for x in groups] if self.order == "v0.34" else groups

    def groups(self, kind: str) -> list[list[int]]:
        """``kind`` in {"tp", "pcp", "dcp", "world"}."""
        if kind == "world":
            return [list(range(self.world_size))]
        table = {"tp": self.tp_groups, "pcp": self.pcp_groups, "dcp": self.dcp_groups}
        if kind not in table:
            raise RuleError("group-kind", "kind in ('tp', 'pcp', 'dcp', 'world')", kind=kind)
        return table[kind]()

    def group_of(self, kind: str, rank: int) -> list[int]:
        """The rank list of the ``kind`` group that contains global ``rank``."""
        if not 0 <= rank < self.world_size:
            raise RuleError("rank-in-world", f"0 <= rank < {self.world_size}", rank=rank)
        return next(g for g in self.groups(kind) if rank in g)

    def coords(self, rank: int) -> RankCoords:
        """``rank``'s PCP slice, TP rank and DCP rank (its index in its DCP group's list)."""
        tp = self.tensor_parallel_size
        dcp_group = self.group_of("dcp", rank)
        return RankCoords(rank, rank // tp, rank % tp, dcp_group.index(rank))


@dataclass
class ParallelGroups:
    """This rank's communicators for one grid: ``tp``, ``pcp``, ``dcp`` and ``world``."""

    grid: RankGrid
    coords: RankCoords
    world: "Group"
    tp: "Group"
    pcp: "Group"
    dcp: "Group"


def check_grid_world(grid_world_size: int, world_size: int) -> None:
    """Rule ``grid-matches-world``: the rank grid fills the launched world,
    ``tp * pcp == world_size``."""
    if grid_world_size != world_size:
        raise ConfigError(
            "grid-matches-world",
            "tp * pcp == world_size",
            grid_world_size=grid_world_size,
            world_size=world_size,
        )


def pcp_of_world(world_size: int, tensor_parallel_size: int) -> int:
    """The PCP size a world of ``world_size`` processes gives at ``tensor_parallel_size``:
    ``world_size // tp``; rule ``world-divisible-by-tp``."""
    if world_size % tensor_parallel_size:
        raise ConfigError(
            "world-divisible-by-tp",
            "world_size % tensor_parallel_size == 0",
            world_size=world_size,
            tensor_parallel_size=tensor_parallel_size,
        )
    return world_size // tensor_parallel_size


def make_groups(
    ctx: "RankContext", grid: RankGrid | ParallelConfig, order: str = ANCHOR_ORDER
) -> ParallelGroups:
    """Create every group of ``grid`` on all ranks (collective: every rank must call it)."""
    if isinstance(grid, ParallelConfig):
        grid = RankGrid.from_config(grid, order)
    check_grid_world(grid.world_size, ctx.world_size)
    made = {kind: ctx.new_group(grid.groups(kind), kind) for kind in ("tp", "pcp", "dcp")}
    return ParallelGroups(
        grid, grid.coords(ctx.rank), ctx.world, made["tp"], made["pcp"], made["dcp"]
    )
