"""What the sub-commands share: the options that place ranks (``--backend``, ``--dist-backend``,
``--device``), ``--timeout`` and ``--debug``, and the torchrun worker's start and end."""

from __future__ import annotations

import argparse
import os

from cpbook.core.comm import DEFAULT_TIMEOUT_S
from cpbook.core.context import RankContext
from cpbook.core.launch import pick_backend, worker_context

__all__ = [
    "add_debug",
    "add_placement",
    "add_timeout",
    "end_worker",
    "start_worker",
    "under_torchrun",
]


def add_placement(p: argparse.ArgumentParser, dist_help: str | None = None) -> None:
    """``--backend inline|torchrun``, ``--dist-backend gloo|nccl`` and ``--device``."""
    p.add_argument("--backend", choices=["inline", "torchrun"], default="inline")
    p.add_argument("--dist-backend", choices=["gloo", "nccl"], default=None, help=dist_help)
    p.add_argument("--device", default="cpu", help="simulated ranks' device (cuda:0: one GPU)")


def add_timeout(p: argparse.ArgumentParser) -> None:
    """``--timeout SECONDS`` per collective."""
    p.add_argument(
        "--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds per collective"
    )


def add_debug(p: argparse.ArgumentParser) -> None:
    """``--debug``: errors raise with their traceback instead of one line."""
    p.add_argument("--debug", action="store_true", help="show the full traceback on errors")


def under_torchrun() -> bool:
    """True in a process torchrun started (its environment names a rank and a world)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def start_worker(a: argparse.Namespace, world: int) -> RankContext:
    """This torchrun worker's context: ``--dist-backend``, or NCCL when every local rank of
    ``world`` has a GPU (gloo otherwise), with ``--timeout``."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return worker_context(a.dist_backend or pick_backend(world, local), a.timeout)


def end_worker() -> None:
    """Tear down the process group :func:`start_worker` opened."""
    import torch.distributed as dist

    dist.destroy_process_group()
