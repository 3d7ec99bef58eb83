"""DCP's byte formulas without torch: what one rank sends per layer and decode step.

:func:`decode_comm_bytes` is the table of :mod:`cpbook.dcp.decode` (the query all-gather and
the combine), :func:`tpa_comm_bytes` and :func:`tpa_costs` those of :mod:`cpbook.dcp.tpa`.
They sit here, apart from the torch algorithms they count, so that the cost model and the
planner (which price them) import no torch; the algorithm modules re-export them and their
tests check them against the traced bytes.
"""

from __future__ import annotations

from cpbook.core.config import ParallelConfig, check_comm_backend
from cpbook.core.errors import RuleError
from cpbook.core.heads import uses_tpa

__all__ = [
    "V_UP_PROJ_FIRST_MIN_TOKENS",
    "check_v_up_proj_combine",
    "config_decode_comm_bytes",
    "decode_comm_bytes",
    "tpa_comm_bytes",
    "tpa_costs",
]

#: vLLM v0.34.0's ``_V_UP_PROJ_FIRST_MIN_TOKENS`` (``vllm/v1/attention/ops/dcp.py``): below
#: this many tokens "reading every head's W_UV costs more than the smaller All-to-All saves
#: (measured on MI355X, DCP8)", so the combine merges the latent outputs first
V_UP_PROJ_FIRST_MIN_TOKENS = 8


def check_v_up_proj_combine(dcp_comm_backend: str, prefill_context_parallel_size: int = 1) -> None:
    """Rule ``v-up-proj-combine-a2a``: MLA's up-projected combine runs only with the ``a2a``
    backend and no PCP (vLLM v0.34.0's ``MLADCPManager._init_combine``)."""
    if dcp_comm_backend != "a2a" or prefill_context_parallel_size > 1:
        raise RuleError(
            "v-up-proj-combine-a2a",
            "dcp_comm_backend == 'a2a' and no PCP (vLLM v0.34.0's MLADCPManager)",
            dcp_comm_backend=dcp_comm_backend,
            prefill_context_parallel_size=prefill_context_parallel_size,
        )


def decode_comm_bytes(
    num_reqs: int,
    heads_per_rank: int,
    q_dim: int,
    out_dim: int,
    dcp: int,
    dcp_comm_backend: str = "ag_rs",
    elem_bytes: int = 8,
    lse_bytes: int | None = None,
) -> list[tuple[str, int]]:
    """:mod:`cpbook.dcp.decode`'s formulas: ``[(op, bytes sent per rank), ...]`` in call order.

    ``lse_bytes`` (default ``elem_bytes``, as this module's runs send it) is ``l``."""
    check_comm_backend(dcp_comm_backend)
    b, h, n, e = num_reqs, heads_per_rank, dcp, elem_bytes
    lb = e if lse_bytes is None else lse_bytes
    calls = [("all_gather", b * h * q_dim * e * (n - 1))]
    if dcp_comm_backend == "ag_rs":
        return calls + [
            ("all_gather", b * n * h * lb * (n - 1)),
            ("reduce_scatter", b * h * out_dim * e * (n - 1)),
        ]
    return calls + [("all_to_all", b * h * (out_dim * e + lb) * (n - 1))]


def config_decode_comm_bytes(
    num_reqs: int,
    config: ParallelConfig,
    q_dim: int,
    out_dim: int,
    elem_bytes: int = 8,
    lse_bytes: int | None = None,
) -> list[tuple[str, int]]:
    """:func:`decode_comm_bytes` for one rank of ``config``: its query heads per rank, DCP size
    and combine backend."""
    return decode_comm_bytes(
        num_reqs,
        config.q_heads_per_rank,
        q_dim,
        out_dim,
        config.dcp,
        config.dcp_comm_backend,
        elem_bytes,
        lse_bytes,
    )


def tpa_comm_bytes(
    config: ParallelConfig,
    num_reqs: int,
    q_dim: int,
    out_dim: int,
    hidden_size: int,
    elem_bytes: int = 8,
    lse_bytes: int | None = None,
) -> list[tuple[str, int]]:
    """:mod:`cpbook.dcp.tpa`'s table for one rank of ``config``: ``[(op, bytes sent per rank),
    ...]`` in call order.

    With TPA (:func:`~cpbook.core.heads.uses_tpa`) it is the standard list without its first
    entry, the query all-gather.  ``lse_bytes``: bytes per LSE value (default ``elem_bytes``;
    vLLM's are fp32, 4), see :func:`cpbook.dcp.decode.decode_comm_bytes`.
    """
    calls = config_decode_comm_bytes(num_reqs, config, q_dim, out_dim, elem_bytes, lse_bytes)
    b, tp = num_reqs * hidden_size * elem_bytes, config.tp
    return (calls[1:] if uses_tpa(config) else calls) + [("all_reduce", 2 * b * (tp - 1) // tp)]


def tpa_costs(
    config: ParallelConfig,
    hidden_size: int,
    num_reqs: int,
    q_dim: int,
    elem_bytes: int = 2,
    w_uk_t_head_bytes: int = 0,
) -> dict[str, int]:
    """Per rank and layer: ``q_proj`` FLOPs and weight bytes, and the extra that ``tpa`` pays
    (``dcp − 1`` more head shards of the same size).

    ``q_dim`` is the per-head output width of ``q_proj`` (``D``, or ``Dn + R`` for MLA).  For MLA
    pass ``w_uk_t_head_bytes``, one head's absorbed ``W_UK_T`` (``qk_nope_head_dim ×
    kv_lora_rank`` values in the activation dtype): vLLM's ``dcp_q_replicate`` all-gathers it at
    load into ``W_UK_T_dcp_qrep`` (the group's ``N·h`` heads, kept beside the rank's own
    ``W_UK_T``) and reads that at every decode step, so TPA also holds and reads ``dcp − 1`` more
    head shards of it (``extra_w_uk_t_bytes``).  The absorption's extra FLOPs are not counted.
    """
    h, n = config.q_heads_per_rank, config.dcp
    flops = 2 * num_reqs * hidden_size * h * q_dim
    weights = hidden_size * h * q_dim * elem_bytes
    w_uk_t = h * w_uk_t_head_bytes
    tpa = uses_tpa(config)
    return {
        "q_proj_flops": flops * (n if tpa else 1),
        "q_proj_weight_bytes": weights * (n if tpa else 1),
        "extra_flops": flops * (n - 1) if tpa else 0,
        "extra_weight_bytes": weights * (n - 1) if tpa else 0,
        "w_uk_t_bytes": w_uk_t * (n if tpa else 1),
        "extra_w_uk_t_bytes": w_uk_t * (n - 1) if tpa else 0,
    }
