"""The ``Group`` interface every algorithm calls, with two interchangeable backends.

* :class:`SimGroup` — in-process simulated ranks, one Python thread per rank (notebooks, fast
  tests).  One rendezvous per collective on a condition variable, with a timeout.
* :class:`TorchGroup` — ``torch.distributed`` process groups (gloo on CPU, NCCL on GPUs), as
  started by ``torchrun``.

Both give bit-identical results for data movement, and every call appends the same
:class:`CommRecord` to the rank's :class:`Trace`.  Bytes are counted per rank as the data that
must leave it (``bytes_sent``) and arrive at it (``bytes_recv``), counting each peer's piece
once: the minimum any algorithm moves (ring algorithms achieve it).  For a group of ``N`` ranks
and a local tensor of ``b`` bytes:

============== ======================== ========================
op             bytes_sent               bytes_recv
============== ======================== ========================
all_gather     ``b·(N−1)``              ``b·(N−1)``
reduce_scatter ``b·(N−1)/N``            ``b·(N−1)/N``
all_reduce     ``2·b·(N−1)/N``          ``2·b·(N−1)/N``
all_to_all     ``b·(N−1)/N``            ``b·(N−1)/N``
send / recv    ``b`` / 0                0 / ``b``
============== ======================== ========================

Every blocking call times out (``timeout`` seconds, default 60) and raises
:class:`CommTimeout`; nothing hangs.  The process groups under it time out later
(:func:`process_group_timeout_s`), so cpbook's error, naming the rank, comes first.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Sequence

import torch

from cpbook.core.errors import RuleError

__all__ = [
    "CommRecord",
    "Trace",
    "CommTimeout",
    "CommAborted",
    "Group",
    "Pending",
    "DEFAULT_TIMEOUT_S",
    "process_group_timeout_s",
    "comm_bytes",
]

DEFAULT_TIMEOUT_S = 60.0


def process_group_timeout_s(timeout: float) -> float:
    """The ``torch.distributed`` process groups' own timeout for cpbook's ``timeout``: twice
    it plus a minute, so that a stuck collective always ends in cpbook's :class:`CommTimeout`
    (which names the group and the rank) before NCCL's watchdog kills the process."""
    return 2 * timeout + 60


def comm_bytes(comm, op: str | None = None) -> int:
    """Total bytes of a rank's ``comm`` list of ``(op, bytes_sent)`` pairs (what every demo
    returns), or of one ``op`` only."""
    return sum(b for o, b in comm if op is None or o == op)


class CommTimeout(RuntimeError):
    """A collective or point-to-point call did not complete within the timeout.  ``where``
    (torch backend) names it: ``op``, ``group``, ``ranks`` (global), ``call`` (the group's
    ``calls`` count at it, 1-based) and ``timeout`` — what a fault report compares between
    ranks."""

    where: dict | None = None


class CommAborted(RuntimeError):
    """A simulated collective was abandoned because another rank failed."""


@dataclass(frozen=True)
class CommRecord:
    """One communication call as seen by one rank."""

    op: str
    group: str
    group_size: int
    bytes_sent: int
    bytes_recv: int
    shape: tuple[int, ...]
    dtype: str


class Trace(list):
    """The list of :class:`CommRecord` one rank produced, with small summaries."""

    def bytes_sent(self, op: str | None = None, group: str | None = None) -> int:
        return sum(r.bytes_sent for r in self._select(op, group))

    def bytes_recv(self, op: str | None = None, group: str | None = None) -> int:
        return sum(r.bytes_recv for r in self._select(op, group))

    def count(self, op: str | None = None, group: str | None = None) -> int:
        return len(self._select(op, group))

    def _select(self, op: str | None, group: str | None) -> list[CommRecord]:
        return [
            r for r in self if (op is None or r.op == op) and (group is None or r.group == group)
        ]

    def summary(self) -> dict[tuple[str, str], tuple[int, int, int]]:
        """``(op, group) -> (calls, bytes_sent, bytes_recv)``, in first-call order."""
        out: dict[tuple[str, str], tuple[int, int, int]] = {}
        for r in self:
            c, s, v = out.get((r.op, r.group), (0, 0, 0))
            out[(r.op, r.group)] = (c + 1, s + r.bytes_sent, v + r.bytes_recv)
        return out


class Pending:
    """The result of a started collective: :meth:`wait` finishes it and returns the result."""

    def __init__(self, value: object, finish=None, then=None) -> None:
        self._value, self._finish, self._then = value, finish, then

    def then(self, fn) -> "Pending":
        """A pending result that applies ``fn`` to this one's tensor once it has arrived."""
        first = self._then
        return Pending(self._value, self._finish, fn if first is None else lambda x: fn(first(x)))

    def wait(self):
        if self._finish is not None:
            self._finish()
            self._finish = None
        return self._value if self._then is None else self._then(self._value)


class Group(ABC):
    """A communicator over ``ranks`` (global ranks, in group order); ``rank`` is the local index.

    Public methods validate arguments, record a :class:`CommRecord`, and delegate to the
    backend's ``_``-prefixed primitive.  All tensors go in and come out on this rank's device.
    """

    def __init__(
        self, name: str, ranks: Sequence[int], global_rank: int, trace: Trace, timeout: float
    ) -> None:
        self.name, self.ranks, self.trace, self.timeout = name, tuple(ranks), trace, timeout
        self.rank, self.size = self.ranks.index(global_rank), len(self.ranks)
        self.calls = 0  # communication calls this rank entered on this group (a fault names it)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, ranks={list(self.ranks)}, rank={self.rank})"

    def _record(self, op: str, t: torch.Tensor, sent: int, recv: int) -> None:
        self.calls += 1
        self.trace.append(
            CommRecord(
                op,
                self.name,
                self.size,
                int(sent),
                int(recv),
                tuple(t.shape),
                str(t.dtype).replace("torch.", ""),
            )
        )

    def _divisible(self, op: str, t: torch.Tensor, dim: int) -> None:
        if t.shape[dim] % self.size:
            raise RuleError(
                f"{op}-divisible",
                f"tensor.shape[{dim}] % group size == 0",
                shape=tuple(t.shape),
                group=self.name,
                size=self.size,
            )

    # -- collectives ------------------------------------------------------------------------
    def all_gather(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Concatenate every rank's ``t`` (equal shapes) along ``dim``, in group-rank order."""
        return self.all_gather_async(t, dim).wait()

    def all_gather_async(self, t: torch.Tensor, dim: int = 0, parts: bool = False) -> "Pending":
        """Start :meth:`all_gather`; ``.wait()`` returns its result.  Work done between the two
        overlaps the transfer (torch backend); simulated ranks complete it at the call.

        With ``parts=True`` the result is the list of every rank's tensor instead of their
        concatenation, and this rank's entry is ``t`` itself: no copy of the local part.
        """
        b = t.numel() * t.element_size()
        self._record("all_gather", t, b * (self.size - 1), b * (self.size - 1))
        if self.size == 1:
            return Pending([t] if parts else t.clone())
        got = self._all_gather_start(t.contiguous())
        return got if parts else got.then(lambda xs: torch.cat(xs, dim=dim))

    def all_gather_v(self, t: torch.Tensor, dim: int = 0) -> tuple[torch.Tensor, list[int]]:
        """All-gather tensors whose sizes differ along ``dim``: sizes first, then padded data.

        Returns the concatenation (padding dropped) and every rank's size.  Two traced calls.
        """
        n = torch.tensor([t.shape[dim]], dtype=torch.int64, device=t.device)
        sizes = self.all_gather(n).tolist()  # one host read: the sizes set the padding
        pad = max(sizes) - t.shape[dim]
        if pad:
            shape = list(t.shape)
            shape[dim] = pad
            t = torch.cat([t, t.new_zeros(shape)], dim=dim)
        parts = (
            self.all_gather(t, dim).split(max(sizes), dim=dim) if max(sizes) else [t] * self.size
        )
        return torch.cat([p.narrow(dim, 0, s) for p, s in zip(parts, sizes)], dim=dim), sizes

    def reduce_scatter(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Sum ``t`` over ranks and keep this rank's ``1/size`` slice along ``dim``."""
        self._divisible("reduce_scatter", t, dim)
        b = t.numel() * t.element_size() // self.size
        self._record("reduce_scatter", t, b * (self.size - 1), b * (self.size - 1))
        if self.size == 1:
            return t.clone()
        return self._reduce_scatter(t.movedim(dim, 0).contiguous()).movedim(0, dim)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over ranks (returns a new tensor)."""
        b = t.numel() * t.element_size()
        moved = 2 * b * (self.size - 1) // self.size
        self._record("all_reduce", t, moved, moved)
        return self._all_reduce(t.contiguous()) if self.size > 1 else t.clone()

    def all_to_all(
        self, t: torch.Tensor, scatter_dim: int = 0, gather_dim: int = 0
    ) -> torch.Tensor:
        """Split ``t`` into ``size`` chunks along ``scatter_dim``, send chunk ``j`` to rank ``j``,
        and concatenate the chunks received (rank order) along ``gather_dim``."""
        self._divisible("all_to_all", t, scatter_dim)
        b = t.numel() * t.element_size() // self.size
        self._record("all_to_all", t, b * (self.size - 1), b * (self.size - 1))
        if self.size == 1:
            return t.clone()
        got = self._all_to_all(t.movedim(scatter_dim, 0).contiguous())  # [size * chunk, ...]
        chunks = [c.movedim(0, scatter_dim) for c in got.chunk(self.size, dim=0)]
        return torch.cat(chunks, dim=gather_dim)

    def barrier(self) -> None:
        self._record("barrier", torch.empty(0), 0, 0)
        if self.size > 1:
            self._barrier()

    # -- point to point (every rank posts its send and its receive before waiting on either) --
    def send(self, t: torch.Tensor, dst: int) -> None:
        self._record("send", t, t.numel() * t.element_size(), 0)
        self._sendrecv(t.contiguous(), dst, None, None)

    def recv(self, like: torch.Tensor, src: int) -> torch.Tensor:
        """Receive a tensor shaped and typed like ``like`` from group rank ``src``."""
        self._record("recv", like, 0, like.numel() * like.element_size())
        return self._sendrecv(None, None, torch.empty_like(like), src)

    def sendrecv(
        self, t: torch.Tensor, dst: int, src: int, like: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Send ``t`` to ``dst`` while receiving one tensor (shaped like ``like`` or ``t``) from
        ``src``."""
        buf = torch.empty_like(t if like is None else like)
        self._record("sendrecv", t, t.numel() * t.element_size(), buf.numel() * buf.element_size())
        return self._sendrecv(t.contiguous(), dst, buf, src)

    def sendrecv_async(
        self, t: torch.Tensor, dst: int, src: int, like: torch.Tensor | None = None
    ) -> "Pending":
        """Start :meth:`sendrecv`; ``.wait()`` returns the received tensor.  Traced exactly like
        :meth:`sendrecv`.  Work done before the wait overlaps the transfer (torch backend);
        simulated ranks complete it at the call.  Several exchanges may be in flight at once if
        every rank starts them in the same order: messages between two ranks arrive in the
        order they were sent."""
        buf = torch.empty_like(t if like is None else like)
        self._record("sendrecv", t, t.numel() * t.element_size(), buf.numel() * buf.element_size())
        return self._sendrecv_start(t.contiguous(), dst, buf, src)

    # -- backend primitives -------------------------------------------------------------------
    @abstractmethod
    def _all_gather_start(self, t: torch.Tensor) -> "Pending":
        """Gather ``t`` from every rank: a list in group-rank order, this rank's entry ``t``."""

    @abstractmethod
    def _reduce_scatter(self, t: torch.Tensor) -> torch.Tensor: ...
    @abstractmethod
    def _all_reduce(self, t: torch.Tensor) -> torch.Tensor: ...
    @abstractmethod
    def _all_to_all(self, t: torch.Tensor) -> torch.Tensor: ...
    @abstractmethod
    def _barrier(self) -> None: ...
    @abstractmethod
    def _sendrecv(
        self, t: torch.Tensor | None, dst: int | None, buf: torch.Tensor | None, src: int | None
    ) -> torch.Tensor | None: ...
    @abstractmethod
    def _sendrecv_start(
        self, t: torch.Tensor | None, dst: int | None, buf: torch.Tensor | None, src: int | None
    ) -> "Pending":
        """Post the send of ``t`` and the receive into ``buf`` (either may be ``None``); the
        pending result is ``buf``."""
