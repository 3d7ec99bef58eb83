"""Several nodes under torchrun: the node options and how a failure reaches every node.

:class:`Nodes` is the multi-node form of :func:`cpbook.core.launch.run`: each node calls ``run``
with its own ``node_rank`` and the same ``nnodes`` and ``rdzv_endpoint``, and torchrun's c10d
rendezvous joins them into one world.  The rendezvous itself orders the nodes (torchrun reads
``--node-rank`` only for its static rendezvous), so a node learns its global ranks from its
results (``RankResults.ranks``), never from ``node_rank``.

A node sees only its own ranks' processes, so a failure travels through the job's store (the
``MASTER_ADDR:MASTER_PORT`` key-value store every worker already shares):

* a rank whose own code raises writes its traceback under :data:`ROOT_KEY` (first one wins);
* a rank that dies without a word (killed, crashed) is seen by its node's ``run`` (its process
  is gone and it left neither a result nor an error file), which writes the same key;
* a rank whose collective failed because a peer went away waits a little for that key and
  reports the root cause instead of its own broken-pipe error; when no rank publishes one (a
  rank stopped answering), the peers name the rank they waited for
  (:func:`cpbook.core.faults.blame`).

So every node's ``run`` raises naming the rank that failed first, on whichever node it ran.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from cpbook.core.comm import CommAborted, CommTimeout
from cpbook.core.errors import RuleError

__all__ = ["Nodes", "ROOT_KEY", "job_store", "root_cause", "report_root", "dead_rank"]

ROOT_KEY = "cpbook/root_cause"


@dataclass(frozen=True)
class Nodes:
    """This node of an ``nnodes``-node torchrun job rendezvousing (c10d) at ``rdzv_endpoint``
    (``HOST:PORT``, the same on every node; ``HOST`` is one of the nodes)."""

    nnodes: int
    node_rank: int
    rdzv_endpoint: str

    def __post_init__(self) -> None:
        if not (isinstance(self.nnodes, int) and self.nnodes >= 1):
            raise RuleError("nnodes", "a positive integer nnodes", nnodes=self.nnodes)
        if not (isinstance(self.node_rank, int) and 0 <= self.node_rank < self.nnodes):
            raise RuleError("node-rank", "0 <= node_rank < nnodes", node_rank=self.node_rank)
        host, _, port = self.rdzv_endpoint.rpartition(":")
        if not host or not port.isdigit():
            raise RuleError("rdzv-endpoint", "HOST:PORT", rdzv_endpoint=self.rdzv_endpoint)

    def torchrun_args(self, nproc_per_node: int) -> list[str]:
        """The torchrun flags for this node (what the README's command line spells out)."""
        return [
            f"--nnodes={self.nnodes}",
            f"--node-rank={self.node_rank}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={self.rdzv_endpoint}",
            f"--nproc-per-node={nproc_per_node}",
        ]


def job_store(timeout: float, addr: str | None = None, port: str | None = None):
    """A client of the job's key-value store (torchrun's ``MASTER_ADDR:MASTER_PORT``)."""
    import torch.distributed as dist

    return dist.TCPStore(
        addr or os.environ["MASTER_ADDR"],
        int(port or os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=datetime.timedelta(seconds=timeout),
    )


def is_consequence(e: BaseException) -> bool:
    """A collective that failed because some other rank went away, not this rank's own fault."""
    import torch.distributed as dist

    return isinstance(e, (CommTimeout, CommAborted, dist.DistError))


def report_root(rank: int, text: str, addr: str | None = None, port: str | None = None) -> None:
    """Record ``text`` as the job's root cause unless another rank's came first."""
    try:
        job_store(5.0, addr, port).compare_set(ROOT_KEY, "", f"{rank}\n{text}")
    except Exception:  # noqa: BLE001 - the store may be gone with its node; report locally
        pass


def root_cause(wait_s: float) -> tuple[int, str] | None:
    """The job's root cause ``(rank, text)``, waiting up to ``wait_s`` for a node to report it."""
    deadline = time.monotonic() + wait_s
    try:
        store = job_store(5.0)
        while True:
            if store.check([ROOT_KEY]):
                rank, _, text = store.get(ROOT_KEY).decode().partition("\n")
                return int(rank), text
            if time.monotonic() > deadline:
                return None
            time.sleep(0.1)
    except Exception:  # noqa: BLE001 - no store, no root cause: the rank reports its own
        return None


def write_pid(tmp: str, rank: int) -> None:
    """Leave this worker's pid and the job's store address for its node's ``run``."""
    line = f"{os.getpid()} {os.environ['MASTER_ADDR']} {os.environ['MASTER_PORT']}"
    Path(tmp, f"pid_rank{rank}.txt").write_text(line)


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return stat.rpartition(")")[2].split()[0] != "Z"


def dead_rank(tmp: str, node_rank: int) -> tuple[int, str] | None:
    """A rank of this node whose process ended without a result or an error file (killed or
    crashed); records it as the job's root cause in the store and returns ``(rank, text)``."""
    for p in sorted(Path(tmp).glob("pid_rank*.txt")):
        rank = int(p.stem.removeprefix("pid_rank"))
        done = [Path(tmp, f"{k}_rank{rank}.{e}") for k, e in (("result", "pt"), ("error", "txt"))]
        if any(d.exists() for d in done) or Path(tmp, f"term_rank{rank}").exists():
            continue
        pid, addr, port = p.read_text().split()
        if _alive(int(pid)):
            continue
        text = (
            f"process {pid} (node_rank {node_rank}, host {socket.gethostname()}) ended without a "
            "result or a Python error: killed by a signal or crashed (torchrun's report on that "
            "node names the exit code)"
        )
        report_root(rank, text, addr, port)
        return rank, text
    return None
