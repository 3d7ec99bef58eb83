"""Live migration of a running request's paged KV from CP = N to CP = M (chapter 7).

Dynamic CP starts a request on one data-parallel replica (CP = 1) and, when it grows long,
moves it into a CP group of ``M`` replicas without recomputing anything: every cached token
goes to the rank that owns it in the new DCP-interleaved layout (:mod:`cpbook.kv.layout`), is
written through that rank's slot mapping into blocks the new group's
:class:`~cpbook.kv.manager.KVCacheManager` allocated, and decoding continues with the DCP
decode step (:func:`cpbook.dcp.decode.dcp_decode_attention`).

A token at position ``p`` lives on old rank ``(p // I_old) % N`` and belongs on new rank
``(p // I_new) % M``.  ``count[r, t]`` (:func:`migration_plan`) is the number of the first
``L`` positions with old owner ``r`` and new owner ``t``; a token whose old and new owner are
the same rank is rewritten locally and never sent.  Ranks ``0..max(N, M)-1`` take part; the
old group is ranks ``0..N-1``, the new one ``0..M-1``.  Bytes on the wire, ``e`` bytes per
element, ``Hkv`` KV heads of ``D`` (:func:`migration_bytes`)::

    bytes_moved = sum_{r != t} count[r, t] * 2 * Hkv * D * e
                = (L - local_seq_len(L, M, 0, I_new)) * 2 * Hkv * D * e      for N = 1

Growing CP = N to CP = M (and shrinking) falls out of the same plan; CP = 1 -> M is ``N = 1``.
Transfers are point-to-point sends of K then V for every ordered pair ``(r, t)`` with
``count[r, t] > 0``, taken in one global order (source, then destination), so blocking sends
and receives cannot deadlock.  Positions are never sent: both sides compute them.
"""

from __future__ import annotations

import torch

from cpbook.core.comm import Group
from cpbook.kv.layout import check_layout, local_positions
from cpbook.kv.paged import PagedKVCache

__all__ = ["migration_plan", "migration_bytes", "migration_comm_bytes", "migrate_kv"]


def migration_plan(
    seq_len: int, old_size: int, new_size: int, old_interleave: int = 1, new_interleave: int = 1
) -> torch.Tensor:
    """``count[r, t]``: tokens of the first ``seq_len`` that old rank ``r`` sends new rank ``t``.

    int64 ``[old_size, new_size]``; the sum is ``seq_len``, the diagonal stays where it is.
    """
    check_layout(old_size, old_interleave)
    check_layout(new_size, new_interleave)
    p = torch.arange(seq_len)
    src = torch.div(p, old_interleave, rounding_mode="floor") % old_size
    dst = torch.div(p, new_interleave, rounding_mode="floor") % new_size
    return torch.bincount(src * new_size + dst, minlength=old_size * new_size).view(
        old_size, new_size
    )


def migration_bytes(
    seq_len: int,
    old_size: int,
    new_size: int,
    old_interleave: int,
    new_interleave: int,
    num_kv_heads: int,
    head_dim: int,
    elem_bytes: int = 8,
) -> int:
    """The module docstring's formula: bytes all ranks send together (K and V)."""
    count = migration_plan(seq_len, old_size, new_size, old_interleave, new_interleave)
    return sum(n for _, _, n in _pairs(count)) * 2 * num_kv_heads * head_dim * elem_bytes


def _pairs(count: torch.Tensor) -> list[tuple[int, int, int]]:
    """``(src, dst, tokens)`` for every transfer, in the one global order every rank follows."""
    n_old, n_new = count.shape
    return [
        (r, t, int(count[r, t]))
        for r in range(n_old)
        for t in range(n_new)
        if r != t and int(count[r, t]) > 0
    ]


def migration_comm_bytes(rank: int, count: torch.Tensor, token_bytes: int) -> list[tuple[str, int]]:
    """Rank ``rank``'s traced calls of :func:`migrate_kv` under the plan ``count``
    (:func:`migration_plan`), ``[(op, bytes_sent)]`` in order: two ``send`` (K, V) per transfer
    it sources, ``token_bytes`` (one token's K, ``num_kv_heads * head_dim * elem_bytes``) per
    token each, and two ``recv`` (0 bytes sent) per one it gets."""
    out: list[tuple[str, int]] = []
    for src, dst, n in _pairs(count):
        if rank == src:
            out += [("send", n * token_bytes)] * 2
        elif rank == dst:
            out += [("recv", 0)] * 2
    return out


def migrate_kv(
    group: Group,
    seq_len: int,
    old: tuple[PagedKVCache, torch.Tensor] | None,
    new: tuple[PagedKVCache, torch.Tensor] | None,
    old_size: int,
    new_size: int,
    old_interleave: int,
    new_interleave: int,
) -> int:
    """Move one request's first ``seq_len`` cached tokens from the old layout to the new one.

    ``group`` spans ranks ``0..max(old_size, new_size)-1``; ``old = (cache, block_table)`` on
    ranks below ``old_size`` (else ``None``), ``new`` likewise below ``new_size``, with the new
    group's block table (the same ids on every new rank).  Every token is copied bit for bit.
    Returns the number of tokens this rank wrote into its new cache.
    """
    r = group.rank
    count = migration_plan(seq_len, old_size, new_size, old_interleave, new_interleave)
    got_k, got_v, got_p = [], [], []
    if old is not None:
        k_old, v_old, _ = old[0].read(old[1], seq_len)
        pos = local_positions(seq_len, old_size, r, old_interleave)  # on the host
        owner = torch.div(pos, new_interleave, rounding_mode="floor") % new_size

        def rows_for(t: int) -> torch.Tensor:
            """This rank's rows whose new owner is ``t``, as indices on the cache's device."""
            return (owner == t).nonzero().flatten().to(k_old.device)

        if new is not None:
            keep = rows_for(r)
            got_k.append(k_old.index_select(0, keep))
            got_v.append(v_old.index_select(0, keep))
            got_p.append(pos[owner == r])
    for src, dst, n in _pairs(count):
        if r == src:
            rows = rows_for(dst)
            group.send(k_old.index_select(0, rows), dst)
            group.send(v_old.index_select(0, rows), dst)
        elif r == dst:
            kc, vc = new[0].key_cache, new[0].value_cache
            got_k.append(group.recv(kc.new_empty(n, *kc.shape[2:]), src))
            got_v.append(group.recv(vc.new_empty(n, *vc.shape[2:]), src))
            theirs = local_positions(seq_len, old_size, src, old_interleave)
            got_p.append(
                theirs[torch.div(theirs, new_interleave, rounding_mode="floor") % new_size == r]
            )
    if new is None:
        return 0
    cache, table = new
    if not got_p:
        return 0
    pos = torch.cat(got_p)
    return cache.write(torch.cat(got_k), torch.cat(got_v), cache.slot_mapping(pos, table))
