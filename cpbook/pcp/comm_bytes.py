"""PCP prefill's byte formulas without torch (those of :mod:`cpbook.pcp.prefill`), here so
that the cost model, which prices them, imports no torch; :mod:`cpbook.pcp.prefill`
re-exports them and its tests check them against the traced bytes."""

from __future__ import annotations

__all__ = ["pcp_comm_bytes", "pcp_restore_bytes"]


def pcp_comm_bytes(
    tokens_per_rank: int,
    num_kv_heads: int,
    head_dim: int,
    pcp: int,
    v_head_dim: int | None = None,
    elem_bytes: int = 8,
) -> list[tuple[str, int]]:
    """Bytes one rank sends per layer: the all-gathers of its K rows, then of its V rows.

    ``tokens_per_rank`` rows (padding included: every rank sends the same shape) of
    ``num_kv_heads`` heads: ``T·Hkv·D·e·(K−1)`` for K and ``T·Hkv·Dv·e·(K−1)`` for V.  Nothing
    else moves per layer; the output restore is once per forward (:func:`pcp_restore_bytes`).
    """
    dv = head_dim if v_head_dim is None else v_head_dim
    t, h, k = tokens_per_rank, num_kv_heads, pcp
    return [
        ("all_gather", t * h * head_dim * elem_bytes * (k - 1)),
        ("all_gather", t * h * dv * elem_bytes * (k - 1)),
    ]


def pcp_restore_bytes(tokens_per_rank: int, row_bytes: int, pcp: int) -> list[tuple[str, int]]:
    """Bytes one rank sends for :func:`pcp_restore`, once per forward (not per layer): one
    all-gather of its ``tokens_per_rank`` rows of ``row_bytes`` each (vLLM restores the hidden
    states, ``hidden_size·e`` bytes a row, before sampling)."""
    return [("all_gather", tokens_per_rank * row_bytes * (pcp - 1))]
