"""The two interchangeable backends of the :class:`~cpbook.core.comm.Group` interface.

* :class:`SimGroup` (with its :class:`SimWorld`) — simulated ranks, one Python thread per rank,
  one rendezvous per collective (:class:`_Rendezvous`) with a timeout (notebooks, fast tests);
* :class:`TorchGroup` — a ``torch.distributed`` process group (gloo on CPU, NCCL on GPUs), as
  started by ``torchrun``.

Both move bit-identical data and append the same :class:`~cpbook.core.comm.CommRecord` to the
rank's trace; every blocking call raises :class:`~cpbook.core.comm.CommTimeout` past its timeout."""

from __future__ import annotations

import datetime
import inspect
import queue
import threading
from typing import Sequence

import torch

from cpbook.core.comm import DEFAULT_TIMEOUT_S, CommAborted, CommTimeout, Group, Pending, Trace
from cpbook.core.errors import RuleError

__all__ = ["SimGroup", "SimWorld", "TorchGroup", "new_process_group", "new_group_keeps_order"]


# ------------------------------------------------------------------------------------------
# Simulated ranks: one thread per rank
# ------------------------------------------------------------------------------------------
class _Rendezvous:
    """Where the ``n`` ranks of one simulated communicator meet: each collective writes its
    value in the round's slots, waits once for every rank and reads them all.  Rounds
    alternate between two sets of slots, so one wait per collective is enough: a rank writes
    round ``g + 2``'s slots only after every rank has reached round ``g + 1``, that is after
    each has read round ``g``.  A timeout or :meth:`abort` breaks it for every rank
    (``threading.BrokenBarrierError``, as a broken ``threading.Barrier``)."""

    def __init__(self, n: int) -> None:
        self.n, self.arrived, self.round, self.broken = n, 0, 0, False
        self.cond = threading.Condition()
        self.slots: tuple[list[object], list[object]] = ([None] * n, [None] * n)

    def exchange(self, rank: int, value: object, timeout: float) -> list:
        """Every rank's ``value`` of this round, in rank order."""
        with self.cond:
            g = self.round
            slots = self.slots[g % 2]
            slots[rank] = value
            self.arrived += 1
            if self.broken:
                raise threading.BrokenBarrierError
            if self.arrived == self.n:
                self.arrived, self.round = 0, g + 1
                self.cond.notify_all()
            elif not self.cond.wait_for(lambda: self.round != g or self.broken, timeout):
                self.broken = True  # timed out: nobody else may wait on it
                self.cond.notify_all()
                raise threading.BrokenBarrierError
            elif self.round == g:  # woken by abort
                raise threading.BrokenBarrierError
            return list(slots)

    def abort(self) -> None:
        with self.cond:
            self.broken = True
            self.cond.notify_all()


class SimWorld:
    """Shared state of ``world_size`` simulated ranks (threads): rendezvous points and mailboxes."""

    def __init__(self, world_size: int, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        self.world_size, self.timeout = world_size, timeout
        self._lock = threading.Lock()
        self._rdv: dict[tuple, _Rendezvous] = {}
        self._mail: dict[tuple, queue.Queue] = {}
        self.aborted = threading.Event()

    def rendezvous(self, key: tuple) -> _Rendezvous:
        """The rendezvous of one communicator, keyed by ``(name, ranks)`` like a real group."""
        with self._lock:
            return self._rdv.setdefault(key, _Rendezvous(len(key[1])))

    def mailbox(self, key: tuple, src: int, dst: int) -> queue.Queue:
        with self._lock:
            return self._mail.setdefault((key, src, dst), queue.Queue())

    def abort(self) -> None:
        """Wake every waiting rank with :class:`CommAborted` (called when one rank fails)."""
        self.aborted.set()
        with self._lock:
            for r in self._rdv.values():
                r.abort()


class SimGroup(Group):
    """A group of simulated ranks; data is exchanged by reference through the shared world."""

    def __init__(
        self, world: SimWorld, name: str, ranks: Sequence[int], global_rank: int, trace: Trace
    ) -> None:
        super().__init__(name, ranks, global_rank, trace, world.timeout)
        self.world = world
        self._key = (name, self.ranks)
        self._rdv = world.rendezvous(self._key)

    def _exchange(self, what: str, value: object) -> list:
        """Every rank's ``value``, in group-rank order (one rendezvous)."""
        try:
            return self._rdv.exchange(self.rank, value, self.timeout)
        except threading.BrokenBarrierError:
            if self.world.aborted.is_set():
                raise CommAborted(
                    f"{what} on group {self.name!r} {list(self.ranks)} abandoned: "
                    "another rank failed"
                ) from None
            self.world.abort()
            raise CommTimeout(
                f"{what} on group {self.name!r} {list(self.ranks)} timed out after "
                f"{self.timeout:g} s at group rank {self.rank}: a peer never called it"
            ) from None

    def _all_gather_start(self, t):
        got = self._exchange("all_gather", t)
        return Pending([t if r == self.rank else x.clone() for r, x in enumerate(got)])

    def _reduce_scatter(self, t):
        parts = [x.chunk(self.size, dim=0)[self.rank] for x in self._exchange("reduce_scatter", t)]
        return torch.stack(parts).sum(dim=0)

    def _all_reduce(self, t):
        return torch.stack(self._exchange("all_reduce", t)).sum(dim=0)

    def _all_to_all(self, t):
        return torch.cat(
            [x.chunk(self.size, dim=0)[self.rank] for x in self._exchange("all_to_all", t)]
        )

    def _barrier(self):
        self._exchange("barrier", None)

    def _sendrecv(self, t, dst, buf, src):
        if t is not None:
            self.world.mailbox(self._key, self.rank, dst).put(t.clone())
        if buf is None:
            return None
        box = self.world.mailbox(self._key, src, self.rank)
        waited = 0.0
        while True:
            try:
                got = box.get(timeout=0.05)
                break
            except queue.Empty:
                waited += 0.05
                if self.world.aborted.is_set():
                    raise CommAborted(
                        f"recv on group {self.name!r} abandoned: another rank failed"
                    ) from None
                if waited >= self.timeout:
                    raise CommTimeout(
                        f"recv from group rank {src} on group {self.name!r} timed out "
                        f"after {self.timeout:g} s"
                    ) from None
        if got.shape != buf.shape or got.dtype != buf.dtype:
            raise RuleError(
                "recv-shape",
                "the sent tensor to match the receive buffer",
                got=(tuple(got.shape), got.dtype),
                expected=(tuple(buf.shape), buf.dtype),
            )
        return buf.copy_(got)

    def _sendrecv_start(self, t, dst, buf, src):
        return Pending(self._sendrecv(t, dst, buf, src))


# ------------------------------------------------------------------------------------------
# torch.distributed: gloo (CPU) or NCCL (GPU)
# ------------------------------------------------------------------------------------------
def _dist_call(*names: str):
    """The first of ``names`` this torch's ``torch.distributed`` has: torch 2.13 calls the
    single-tensor collectives ``all_gather_single`` / ``reduce_scatter_single``, torch 2.1–2.12
    ``all_gather_into_tensor`` / ``reduce_scatter_tensor``, older ones ``_all_gather_base`` /
    ``_reduce_scatter_base``; GPU images often carry another torch than the pin."""
    import torch.distributed as dist

    for n in names:
        if hasattr(dist, n):
            return getattr(dist, n)
    raise RuntimeError(f"torch.distributed {torch.__version__} has none of {names}")


def new_group_keeps_order() -> bool:
    """Whether ``dist.new_group`` takes ``sort_ranks=False`` (older torch sorts a group's ranks)."""
    import torch.distributed as dist

    return "sort_ranks" in inspect.signature(dist.new_group).parameters


def new_process_group(ranks: Sequence[int], timeout: datetime.timedelta):
    """A process group over ``ranks`` and its ``order``: the process-group rank of each group
    rank (``None`` when they agree).  Collective: every rank calls it for every group, in one
    order.  Where ``sort_ranks=False`` is missing the group is made sorted and
    :class:`TorchGroup` reorders what goes in and out by ``order``."""
    import torch.distributed as dist

    ranks = [int(r) for r in ranks]
    if new_group_keeps_order():
        return dist.new_group(ranks, timeout=timeout, sort_ranks=False), None
    pg = dist.new_group(sorted(ranks), timeout=timeout)
    order = [sorted(ranks).index(r) for r in ranks]
    return pg, None if order == list(range(len(ranks))) else order


class TorchGroup(Group):
    """A ``torch.distributed`` process group; every call is async and waited with a timeout.

    ``order[i]`` is the process-group rank of group rank ``i`` when the two differ (a sorted
    group on an older torch, :func:`new_process_group`); point-to-point calls name peers by
    global rank, which every torch version accepts.
    """

    #: dist backends whose all-gather goes point to point: gloo's allgather moves the same
    #: bytes about 3x slower than pairwise isend/irecv on one host (measured: 36 vs 12 ms for
    #: 16.8 MB between 2 ranks).
    P2P_ALL_GATHER: tuple[str, ...] = ("gloo",)

    def __init__(
        self,
        pg,
        name: str,
        ranks: Sequence[int],
        global_rank: int,
        trace: Trace,
        timeout: float,
        order: Sequence[int] | None = None,
    ) -> None:
        super().__init__(name, ranks, global_rank, trace, timeout)
        self.pg, self.order = pg, None if order is None else list(order)

    def _wait(self, work, what: str) -> None:
        try:
            work.wait(timeout=datetime.timedelta(seconds=self.timeout))
        except RuntimeError as e:
            err = CommTimeout(
                f"{what} on group {self.name!r} {list(self.ranks)} failed or timed out "
                f"(timeout {self.timeout:g} s) at global rank {self.ranks[self.rank]}: {e}"
            )
            err.where = dict(
                op=what,
                group=self.name,
                ranks=list(self.ranks),
                call=self.calls,
                timeout=self.timeout,
            )
            raise err from e

    def _to_pg_order(self, t: torch.Tensor) -> torch.Tensor:
        """``t``'s ``size`` chunks (dim 0, chunk ``i`` for group rank ``i``) in process-group
        order."""
        if self.order is None:
            return t
        chunks = t.chunk(self.size)
        return torch.cat([chunks[self.order.index(j)] for j in range(self.size)])

    def _all_gather_start(self, t):
        import torch.distributed as dist

        if dist.get_backend(self.pg) not in self.P2P_ALL_GATHER:
            flat = t.reshape(-1)  # 1-D: 0-dim tensors too, and one layout every backend takes
            out = flat.new_empty(self.size * flat.numel())
            gather = _dist_call("all_gather_single", "all_gather_into_tensor", "_all_gather_base")
            work = gather(out, flat, group=self.pg, async_op=True)
            rows = out.view(self.size, flat.numel())
            pg_rank = self.order or range(self.size)
            parts = [
                t if i == self.rank else rows[pg_rank[i]].view(t.shape) for i in range(self.size)
            ]
            return Pending(parts, lambda: self._wait(work, "all_gather"))
        parts = [t if peer == self.rank else torch.empty_like(t) for peer in range(self.size)]
        works = [
            w
            for peer in range(self.size)
            if peer != self.rank
            for w in (
                dist.isend(t, dst=self.ranks[peer], group=self.pg),
                dist.irecv(parts[peer], src=self.ranks[peer], group=self.pg),
            )
        ]

        def finish() -> None:
            for w in works:
                self._wait(w, "all_gather")

        return Pending(parts, finish)

    def _reduce_scatter(self, t):
        out = torch.empty_like(t.chunk(self.size, dim=0)[0])
        scatter = _dist_call(
            "reduce_scatter_single", "reduce_scatter_tensor", "_reduce_scatter_base"
        )
        self._wait(
            scatter(out, self._to_pg_order(t), group=self.pg, async_op=True), "reduce_scatter"
        )
        return out

    def _all_reduce(self, t):
        import torch.distributed as dist

        t = t.clone()
        self._wait(dist.all_reduce(t, group=self.pg, async_op=True), "all_reduce")
        return t

    def _all_to_all(self, t):
        import torch.distributed as dist

        out = torch.empty_like(t)
        work = dist.all_to_all_single(out, self._to_pg_order(t), group=self.pg, async_op=True)
        self._wait(work, "all_to_all")
        if self.order is None:
            return out
        chunks = out.chunk(self.size)  # chunk j came from process-group rank j
        return torch.cat([chunks[self.order[i]] for i in range(self.size)])

    def _barrier(self):
        import torch.distributed as dist

        self._wait(dist.barrier(group=self.pg, async_op=True), "barrier")

    def _sendrecv(self, t, dst, buf, src):
        return self._sendrecv_start(t, dst, buf, src).wait()

    def _sendrecv_start(self, t, dst, buf, src):
        import torch.distributed as dist

        # Every rank posts its send first, then its receive, and waits on neither until both
        # are posted.  Posting never blocks: gloo hands both to its transport, which moves
        # them in the background, so each receive is posted whatever the ranks' order around
        # a ring, and no rank waits on a peer that is itself waiting.  NCCL needs the two
        # posted as one group to be safe (a two-rank exchange otherwise serialises them).
        to = None if t is None else self.ranks[dst]  # peers by global rank
        frm = None if buf is None else self.ranks[src]
        if dist.get_backend(self.pg) == "gloo":
            works = ([] if t is None else [dist.isend(t, dst=to, group=self.pg)]) + (
                [] if buf is None else [dist.irecv(buf, src=frm, group=self.pg)]
            )
        else:
            pairs = ((dist.isend, t, to), (dist.irecv, buf, frm))
            ops = [dist.P2POp(op, x, peer, group=self.pg) for op, x, peer in pairs if x is not None]
            works = dist.batch_isend_irecv(ops)

        def finish() -> None:
            for w in works:
                self._wait(w, "sendrecv")

        return Pending(buf, finish)
