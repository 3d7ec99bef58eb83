"""A MoE layer's token exchange when its experts span more GPUs than one replica's TP group.

vLLM v0.34.0 runs every routed-expert layer over the whole pool of ``dp x pcp x tp`` GPUs,
whatever the attention layout (``FusedMoEParallelConfig.make``,
``vllm/model_executor/layers/fused_moe/config.py``):

* without ``--enable-expert-parallel`` each expert's weights are split by TP over the whole
  pool, ``flatten_tp_across_dp_and_pcp``: ``tp_size = dp * pcp * tp``
  (:attr:`~cpbook.costmodel.memory.Deployment.moe_tp`).  Every GPU then needs every token of
  the pool: before the experts the runner all-gathers the hidden states over DP
  (``dispatch_router_logits`` of the default ``all2all_backend="allgather_reducescatter"``,
  ``AgRsAll2AllManager``, ``vllm/distributed/device_communicators/all2all.py``; its
  ``_get_comm_group`` is the DP group) and then over PCP (``pcp_group.all_gather``,
  ``_maybe_dispatch`` in ``vllm/model_executor/layers/fused_moe/runner/moe_runner.py``), and
  after them it reduce-scatters back (``combine``, ``get_pcp_group().reduce_scatter``); the
  TP all-reduce that follows is the replica's own.  :func:`moe_gather_calls` lists those
  collectives.
* with ``--enable-expert-parallel`` the experts are spread whole over the pool and tokens
  travel by the EP dispatch and combine (``use_all2all_kernels``: only when ``dp > 1``,
  ``pcp > 1`` or sequence-parallel MoE; TP alone runs the local experts on every token and
  reuses TP's all-reduce).  With ``tp > 1`` and ``dp > 1`` v0.34.0 makes the MoE input
  sequence parallel (``ParallelConfig.use_sequence_parallel_moe``, ``vllm/config/parallel.py``;
  ``DeepseekV2DecoderLayer.forward`` reduce-scatters the attention output over TP,
  ``vllm/model_executor/models/deepseek_v2.py``), so each TP rank dispatches ``1 / tp`` of the
  tokens: :func:`ep_dispatch_rows`.

Pure arithmetic, no torch; the byte counts follow :func:`~cpbook.costmodel.decode.collective_time`'s
convention (what one rank sends: ``(N - 1) * chunk`` for a ring all-gather or reduce-scatter).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from cpbook.costmodel.decode import collective_time
from cpbook.costmodel.memory import Deployment
from cpbook.costmodel.specs import LinkSpec

__all__ = ["ep_dispatch_rows", "moe_gather_calls", "moe_gather_s"]


def moe_gather_calls(
    deployment: Deployment, rows: float, row_bytes: float
) -> list[tuple[str, str, int, float]]:
    """The collectives one MoE layer adds without EP, as ``(op, group kind, group size, bytes
    one rank sends)``: each GPU holds ``rows`` token rows of ``row_bytes`` bytes; an all-gather
    over DP, then over PCP (of the DP-gathered rows), and the reduce-scatters that undo them.
    Empty with EP, or when the pool is one replica's TP group (``dp = pcp = 1``)."""
    d = deployment
    if d.ep:
        return []
    calls = []
    if d.dp > 1:
        dp_bytes = (d.dp - 1) * rows * row_bytes
        calls += [("all_gather", "dp", d.dp, dp_bytes), ("reduce_scatter", "dp", d.dp, dp_bytes)]
    if d.pcp > 1:
        pcp_bytes = (d.pcp - 1) * d.dp * rows * row_bytes
        calls += [
            ("all_gather", "pcp", d.pcp, pcp_bytes),
            ("reduce_scatter", "pcp", d.pcp, pcp_bytes),
        ]
    return calls


def moe_gather_s(
    deployment: Deployment,
    rows: float,
    row_bytes: float,
    link_of_group: Callable[[str], LinkSpec],
) -> float:
    """Seconds of :func:`moe_gather_calls` for one MoE layer, each collective α–β on the link
    ``link_of_group(kind)`` returns for its group kind."""
    return sum(
        collective_time(op, nbytes, n, link_of_group(kind))
        for op, kind, n, nbytes in moe_gather_calls(deployment, rows, row_bytes)
    )


def ep_dispatch_rows(deployment: Deployment, rows: float) -> float:
    """Token rows one GPU sends through EP's dispatch (and receives back in the combine) per MoE
    layer, when each GPU of a replica's TP group holds ``rows``: 0 without EP or when vLLM runs
    no all-to-all (EP over TP alone: ``dp = pcp = 1``); ``rows / tp`` under sequence-parallel
    MoE (``tp > 1`` and ``dp > 1``); else ``rows``."""
    d = deployment
    if not d.ep or (d.dp == 1 and d.pcp == 1):
        return 0.0
    if d.tp > 1 and d.dp > 1:
        return math.ceil(rows / d.tp)  # vLLM pads the tokens to a multiple of TP
    return rows
