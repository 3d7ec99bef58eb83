"""TPA: shard the query projection at TP/DCP granularity so DCP decode needs no query all-gather.

One attention block per rank, ``x [B, hidden] → q_proj → attention under TP × DCP → o_proj``,
for one decode token per request, without TPA or with it (``tpa``, the config's
:func:`~cpbook.core.heads.uses_tpa`):

* ``standard`` (vLLM's DCP): ``q_proj`` is column-sharded over TP, so TP rank ``r`` computes its
  ``h = Hq / tp`` query heads; the DCP group then **all-gathers the query heads**
  (``[B, h, D] → [B, N·h, D]``, a gather on a non-leading dimension: one more copy, vLLM's
  transpose) so that every rank can attend its KV shard with all ``N·h`` heads of its group.
* ``tpa``: ``q_proj`` is sharded over ``tp / dcp`` attention ranks, so every rank of a DCP group
  computes the same ``N·h`` heads itself; **no query all-gather**.  It costs ``N``× the
  ``q_proj`` FLOPs and weights per rank.  For GQA this is vLLM's
  ``--tensor-parallel-size-attention`` (PR #36287, successor #42674, both open in Nov 2026),
  which also lets a DCP group hold several KV heads; for MLA it is ``dcp_q_replicate``
  (``--dcp-q-replicate``, PRs #45964 and #50382, merged), whose absorbed ``W_UK_T`` is gathered
  at load time into ``W_UK_T_dcp_qrep``: ``N``× those weights too, read at every decode step.

After attention both modes are identical: the combine (``ag_rs``: all-gather the LSE,
reduce-scatter the outputs; or ``a2a``) leaves every rank its own ``h`` heads, ``o_proj`` is
row-sharded over TP and ends in an all-reduce.  Both are exact against one device.

Bytes one rank sends per layer and step (``B`` requests, ``e`` bytes per element, ``Dq`` the
query width — ``D`` for GQA, ``C + R`` for absorbed MLA — and ``Do`` the combined width):

=====================  ============================  ==========
collective             bytes                         mode
=====================  ============================  ==========
AllGather Q            ``B·h·Dq·e·(N−1)``            no TPA
ag_rs: AllGather LSE   ``B·N·h·l·(N−1)``             both
ag_rs: ReduceScatter   ``B·h·Do·e·(N−1)``            both
o_proj AllReduce       ``2·B·hidden·e·(TP−1)/TP``    both
=====================  ============================  ==========
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from cpbook.core.config import ParallelConfig
from cpbook.core.groups import ParallelGroups
from cpbook.core.heads import q_heads_of, q_proj_heads, uses_tpa
from cpbook.dcp.comm_bytes import tpa_comm_bytes, tpa_costs
from cpbook.dcp.decode import dcp_combine, dcp_decode_attention, local_attention
from cpbook.dcp.mla import MLAWeights, mla_decode_attention

__all__ = ["TPABlock", "attention_block", "tpa_comm_bytes", "tpa_costs"]


@dataclass(frozen=True)
class TPABlock:
    """Weights of one attention block: ``w_q [hidden, Hq·Dq]``, ``w_o [Hq·Dv, hidden]``, and for
    MLA the up-projections (``mla``); ``Dq = D`` (GQA) or ``Dn + R`` (MLA's MHA form)."""

    w_q: torch.Tensor
    w_o: torch.Tensor
    num_q_heads: int
    mla: MLAWeights | None = None

    def to(
        self, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> "TPABlock":
        """The same block on ``device`` and in ``dtype`` (``None``: unchanged)."""
        return TPABlock(
            self.w_q.to(device, dtype),
            self.w_o.to(device, dtype),
            self.num_q_heads,
            None if self.mla is None else self.mla.to(device, dtype),
        )

    @property
    def q_dim(self) -> int:
        return self.w_q.shape[1] // self.num_q_heads

    def q(self, x: torch.Tensor, heads: slice) -> torch.Tensor:
        """``q_proj`` for ``heads``: ``x [B, hidden] → [B, len(heads), Dq]`` (column shard)."""
        d = self.q_dim
        return (x @ self.w_q[:, heads.start * d : heads.stop * d]).view(x.shape[0], -1, d)

    def o(self, out: torch.Tensor, heads: slice) -> torch.Tensor:
        """This rank's ``o_proj`` partial sum: ``out [B, len(heads), Dv] → [B, hidden]`` (row
        shard); the TP all-reduce completes it."""
        dv = out.shape[-1]
        return out.reshape(out.shape[0], -1) @ self.w_o[heads.start * dv : heads.stop * dv]


def attention_block(
    x: torch.Tensor,
    block: TPABlock,
    ks: Sequence[torch.Tensor],
    vs: Sequence[torch.Tensor | None],
    config: ParallelConfig,
    groups: ParallelGroups,
    shapes: dict[str, Any] | None = None,
) -> torch.Tensor:
    """One decode step of the block on this rank; returns the full ``[B, hidden]`` output.

    ``ks[i]``/``vs[i]``: this rank's DCP shard of request ``i`` for the KV heads of
    :func:`attention_kv_heads` (MLA: latent rows, ``vs[i] is None``).  The mode is the config's
    (:func:`tpa_config`).  Exact to the dtype's rounding.
    """
    tp_rank, backend = groups.coords.tp_rank, config.dcp_comm_backend
    mine, computed = q_heads_of(config, tp_rank), q_proj_heads(config, tp_rank)
    q = block.q(x, computed)
    if shapes is not None:
        shapes["q_proj"] = tuple(q.shape)
    if block.mla is None and not uses_tpa(config):
        out = dcp_decode_attention(q, ks, vs, groups.dcp, backend, shapes=shapes)
    elif block.mla is None:
        o, lse = local_attention(q, ks, vs)
        out = dcp_combine(o, lse.to(o.dtype), groups.dcp, backend)
    else:
        mla, dn = block.mla, block.mla.W_UK.shape[2]
        q_nope, q_pe = q[..., :dn], q[..., dn:]
        if not uses_tpa(config):
            out = mla_decode_attention(q_nope, q_pe, ks, mla, mine, groups.dcp, backend, shapes)
        else:  # dcp_q_replicate: absorb with the group's W_UK, attend, combine, local W_UV
            ql = mla.absorb_q(q_nope, q_pe, computed)
            c = mla.kv_lora_rank
            o, lse = local_attention(
                ql, [k[:, None] for k in ks], [k[:, None, :c] for k in ks], mla.scale
            )
            out = mla.v_up_proj(dcp_combine(o, lse.to(o.dtype), groups.dcp, backend), mine)
    y = groups.tp.all_reduce(block.o(out, mine))
    if shapes is not None:
        shapes.update(attn_out=tuple(out.shape), o_proj=tuple(y.shape))
    return y
