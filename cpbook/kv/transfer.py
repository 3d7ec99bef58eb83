"""P/D disaggregation: which whole blocks a DCP decode group must receive from a prefill
node (:func:`transfer_plan`, :class:`TransferPlan`), and the bytes one rank sends to rebuild a
request from its DCP shards (:func:`kvcache_comm_bytes`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from cpbook.core.config import check_positive
from cpbook.kv.layout import block_fill, local_seq_len

__all__ = ["TransferPlan", "transfer_plan", "kvcache_comm_bytes"]


# ------------------------------------------------------------------------------------------
# P/D disaggregation: which blocks a decode node must receive
# ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TransferPlan:
    """Whole-block KV transfer of one request from a prefill node to a DCP decode group.

    ``fill[r, b]`` = tokens rank ``r`` holds in virtual block ``b``.  A rank sends every physical
    block holding at least one of its tokens, whole; empty blocks are not sent.
    """

    seq_len: int
    block_size: int
    dcp: int
    interleave: int
    bytes_per_token: int
    fill: torch.Tensor

    @property
    def blocks_sent(self) -> list[list[int]]:
        """Per rank, the request's virtual-block indices whose physical block it sends."""
        return [torch.nonzero(row).flatten().tolist() for row in self.fill]

    @property
    def fill_ratios(self) -> list[list[float]]:
        """Per rank, the fill ratio (tokens / block_size) of each block it sends."""
        return [
            [int(row[b]) / self.block_size for b in blocks]
            for row, blocks in zip(self.fill, self.blocks_sent)
        ]

    @property
    def rank_bytes(self) -> list[int]:
        return [len(b) * self.block_size * self.bytes_per_token for b in self.blocks_sent]

    @property
    def bytes_sent(self) -> int:
        return sum(self.rank_bytes)

    @property
    def useful_bytes(self) -> int:
        return self.seq_len * self.bytes_per_token

    @property
    def no_dcp_bytes(self) -> int:
        """Whole blocks a DCP-less decode node would receive: ``ceil(L / B)`` blocks."""
        return -(-self.seq_len // self.block_size) * self.block_size * self.bytes_per_token

    @property
    def amplification(self) -> float:
        """``bytes_sent / no_dcp_bytes`` (1 = no overhead from DCP)."""
        return self.bytes_sent / self.no_dcp_bytes if self.seq_len else 1.0

    @property
    def waste(self) -> float:
        """Fraction of the bytes sent that are empty slots: ``1 - useful / sent``."""
        return 1 - self.useful_bytes / self.bytes_sent if self.seq_len else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "seq_len": self.seq_len,
            "block_size": self.block_size,
            "dcp": self.dcp,
            "interleave": self.interleave,
            "blocks_sent": sum(map(len, self.blocks_sent)),
            "bytes_sent": self.bytes_sent,
            "useful_bytes": self.useful_bytes,
            "amplification": round(self.amplification, 6),
            "waste": round(self.waste, 6),
        }


def transfer_plan(
    seq_len: int, block_size: int, dcp: int, interleave: int, bytes_per_token: int = 1
) -> TransferPlan:
    """The :class:`TransferPlan` of a request of ``seq_len`` tokens (bytes in units of
    ``bytes_per_token``)."""
    check_positive(bytes_per_token=bytes_per_token)
    return TransferPlan(
        seq_len,
        block_size,
        dcp,
        interleave,
        bytes_per_token,
        block_fill(seq_len, block_size, dcp, interleave),
    )


def kvcache_comm_bytes(
    seq_len: int,
    dcp: int,
    interleave: int,
    num_kv_heads: int,
    head_dim: int,
    elem_bytes: int = 8,
) -> list[tuple[str, int]]:
    """Bytes one rank sends to rebuild the request from its shards, in call order.

    Three uneven all-gathers (K, V, positions), each a size exchange (one int64) and the rows
    padded to the largest shard, ``ceil``-stripe rank 0's ``local_seq_len``:
    ``[("all_gather", 8·(N−1)), ("all_gather", rows·H·D·e·(N−1))] × 2`` then positions at 8 B.
    """
    n = dcp
    rows = local_seq_len(seq_len, n, 0, interleave)  # rank 0 holds the most tokens
    kv = [
        ("all_gather", 8 * (n - 1)),
        ("all_gather", rows * num_kv_heads * head_dim * elem_bytes * (n - 1)),
    ]
    return kv + kv + [("all_gather", 8 * (n - 1)), ("all_gather", rows * 8 * (n - 1))]
