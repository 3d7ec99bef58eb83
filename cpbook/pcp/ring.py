"""Ring attention over the PCP group: pass-KV and pass-Q, exact, point to point only.

The road vLLM did not take for PCP: as of v0.34.0 its PCP all-gathers K/V
(:mod:`cpbook.pcp.prefill`); a pass-KV loop over contiguous shards,
``vllm/v1/attention/ops/ring_attn.py``, was proposed in PR #39875 (closed, and absent from the
v0.34.0 wheel; read at commit 0cd2be2, where only its tests import it).  Meta's
context-parallel inference (Yang et al., arXiv 2411.01783) runs two exact rings over ``N``
ranks, each step's transfer in flight (``Group.sendrecv_async``) while the block already held
is computed:

* ``pass_kv`` — K/V blocks rotate, queries stay: at step ``s`` rank ``r`` attends its queries
  to the block of rank ``r − s`` and folds each result into its output by the LSE, in place.
* ``pass_q`` — queries rotate, K/V stay: rank ``r`` attends the visiting queries of rank
  ``r − s`` to its resident K/V and sends the partial output + LSE (one message, the LSE as an
  extra channel) straight back to that rank, which merges it one step later.  Meta returns
  them with one All2All after the ring; sent step by step they overlap the compute, and
  rows that saw none of a rank's keys are not sent at all.

Which rows each rank holds, the kernel calls of each block (masked blocks skipped) and the
bytes of each message are planned in :mod:`cpbook.pcp.ring_plan`.  Exact: float64 runs match
dense causal attention to rounding (<= 1e-10), for any batch, context and GQA ratio.
"""

from __future__ import annotations

import torch

from cpbook.core.attention import attention_with_lse, merge_attn_states_
from cpbook.core.comm import Group
from cpbook.core.config import ConfigError
from cpbook.pcp.ring_plan import Call, RingShards, check_mode

__all__ = ["ring_attention"]


def _nbytes(*ts: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def _shaped(t: torch.Tensor, *shape: int) -> torch.Tensor:
    """A storage-free stand-in of ``shape`` in ``t``'s dtype (the group allocates the buffer)."""
    return t.new_empty(()).expand(*shape)


class _Tally:
    """Kernel calls, (query, key) pairs per head and the bytes of temporaries alive (peak)."""

    def __init__(self) -> None:
        self.kernel_calls = self.work = self.live = self.peak = 0

    def take(self, *ts: torch.Tensor) -> None:
        self.live += _nbytes(*ts)
        self.peak = max(self.peak, self.live)

    def drop(self, *ts: torch.Tensor) -> None:
        self.live -= _nbytes(*ts)

    def attend(
        self, q: torch.Tensor, kv: torch.Tensor, c: Call, scale: float | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        o, l = attention_with_lse(
            q,
            kv[0, :, c.k_lo : c.k_hi].transpose(0, 1),
            kv[1, :, c.k_lo : c.k_hi].transpose(0, 1),
            causal=c.causal,
            scale=scale,
        )
        self.kernel_calls, self.work = self.kernel_calls + 1, self.work + c.pairs
        self.peak = max(self.peak, self.live + _nbytes(o, l))
        return o, l


class _Out:
    """The rank's output ``[rows, Hq, Dv]`` and LSE ``[rows, Hq]`` (head-major storage)."""

    def __init__(self, q: torch.Tensor, dv: int) -> None:
        self.q, self.dv, self.out, self.lse = q, dv, None, None

    def _alloc(self) -> None:
        rows, hq = self.q.shape[:2]
        self.out = self.q.new_zeros(hq, rows, self.dv).transpose(0, 1)
        self.lse = torch.full((hq, rows), float("-inf"), dtype=self.q.dtype, device=self.q.device).T

    def write(self, lo: int, hi: int, o: torch.Tensor, l: torch.Tensor) -> None:
        if self.out is None and (lo, hi) == (0, self.q.shape[0]):
            self.out, self.lse = o, l  # one call covers every row: its result is the output
            return
        if self.out is None:
            self._alloc()
        self.out[lo:hi], self.lse[lo:hi] = o, l

    def merge(self, lo: int, hi: int, o: torch.Tensor, l: torch.Tensor) -> None:
        merge_attn_states_(self.out[lo:hi], self.lse[lo:hi], o, l)

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.out is None:
            self._alloc()
        return self.out, self.lse


def _check(q, k, v, k_ctx, v_ctx, shards: RingShards, group: Group, mode: str) -> None:
    check_mode(mode)
    if group.size != shards.pcp:
        raise ConfigError(
            "ring-group-matches-shards",
            "group size == pcp",
            group=group.name,
            group_size=group.size,
            pcp=shards.pcp,
        )
    ts = [t for t in (q, k, v, k_ctx, v_ctx) if t is not None]
    if any(t.dtype not in (torch.float32, torch.float64) or t.dtype != q.dtype for t in ts):
        raise ConfigError(
            "ring-dtype",
            "float32 or float64 inputs of one dtype",
            dtypes=[str(t.dtype) for t in ts],
        )
    rows = shards.metadata(group.rank).num_tokens
    if (
        any(t.dim() != 3 for t in ts)
        or not q.shape[0] == k.shape[0] == v.shape[0] == rows
        or k.shape[1:] != v.shape[1:]
        or q.shape[2] != k.shape[2]
        or q.shape[1] % k.shape[1]
    ):
        raise ConfigError(
            "ring-shapes",
            "q [num_tokens, Hq, D], k and v [num_tokens, Hkv, D], Hq % Hkv == 0",
            q=tuple(q.shape),
            k=tuple(k.shape),
            v=tuple(v.shape),
            num_tokens=rows,
        )
    need = shards.num_context(group.rank)
    got = [None if t is None else tuple(t.shape) for t in (k_ctx, v_ctx)]
    if (need or k_ctx is not None or v_ctx is not None) and got != [(need, *k.shape[1:])] * 2:
        raise ConfigError(
            "ring-context-rows",
            "k_ctx and v_ctx [num_context, Hkv, D] of this rank",
            k_ctx=got[0],
            v_ctx=got[1],
            num_context=need,
        )


def _pack_kv(k, v, k_ctx, v_ctx, shards: RingShards, rank: int) -> torch.Tensor:
    """This rank's K/V block ``[2, Hkv, rows, D]``: per request, context rows then new rows."""
    r = shards.rows[rank]
    kv = k.new_empty(2, k.shape[1], shards.kv_rows(rank), k.shape[2])
    for i, at in enumerate(r.kv_start):
        c, n, cs, qs = r.ctx[i], r.q_real[i], r.ctx_start[i], r.q_start[i]
        for j, (new, ctx) in enumerate(((k, k_ctx), (v, v_ctx))):
            if c:
                kv[j, :, at : at + c] = ctx[cs : cs + c].transpose(0, 1)
            kv[j, :, at + c : at + c + n] = new[qs : qs + n].transpose(0, 1)
    return kv


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    shards: RingShards,
    group: Group,
    mode: str = "pass_kv",
    k_ctx: torch.Tensor | None = None,
    v_ctx: torch.Tensor | None = None,
    scale: float | None = None,
    stats: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of this rank's new-token rows to every earlier token, by a ring.

    ``q, k, v``: this rank's rows (``shards.metadata(rank).num_tokens``; any strides, a
    head-major ``[H, T, D]`` storage avoids copies); ``k_ctx, v_ctx``: its context shard
    (see the module docstring).  Returns ``(out [num_tokens, Hq, D], lse [num_tokens, Hq])``,
    padding rows 0 and ``-inf``; exact.  Inputs are checked before any communication.  If
    ``stats`` is a dict it receives ``steps``, ``kernel_calls``, ``work`` ((query, key) pairs
    per query head) and ``peak_temp_bytes`` (largest total of the blocks, receive buffers and
    partial results this call holds at once; kernel workspaces excluded).

    More than eight parameters: the new rows' ``q, k, v`` and the context shard's ``k_ctx,
    v_ctx`` are the inputs of one attention call; ``shards``, ``group`` and ``mode`` say how the
    ring runs (as torch's ``context_parallel`` ring attention takes them).
    """
    _check(q, k, v, k_ctx, v_ctx, shards, group, mode)
    tally, acc = _Tally(), _Out(q, v.shape[2])
    kv = _pack_kv(k, v, k_ctx, v_ctx, shards, group.rank)
    tally.take(kv)
    (_pass_kv if mode == "pass_kv" else _pass_q)(q, kv, shards, group, acc, tally, scale)
    if stats is not None:
        stats.update(
            steps=group.size,
            kernel_calls=tally.kernel_calls,
            work=tally.work,
            peak_temp_bytes=tally.peak,
        )
    return acc.result()


def _pass_kv(q, kv, shards: RingShards, group: Group, acc: _Out, tally: _Tally, scale) -> None:
    n, r = group.size, group.rank
    cur, origin = kv, r
    for step in range(n):
        if step + 1 < n:  # the next block is in flight while this one is computed
            src = (origin - 1) % n
            like = _shaped(kv, 2, kv.shape[1], shards.kv_rows(src), kv.shape[3])
            nxt = group.sendrecv_async(cur, (r + 1) % n, (r - 1) % n, like=like)
            tally.take(like)
        for c in shards.plan(r, origin):
            o, l = tally.attend(q[c.q_lo : c.q_hi], cur, c, scale)
            (acc.write if c.causal else acc.merge)(c.q_lo, c.q_hi, o, l)
        if step + 1 < n:
            got = nxt.wait()
            tally.drop(cur)
            cur, origin = got, src


def _pass_q(q, kv, shards: RingShards, group: Group, acc: _Out, tally: _Tally, scale) -> None:
    n, r, hq, d, dv = group.size, group.rank, q.shape[1], q.shape[2], kv.shape[3]
    rows = shards.rows[r]
    qp = q.transpose(0, 1)
    if n > 1 and (shards.q_rows(r) != q.shape[0] or not qp.is_contiguous()):
        qp = torch.cat([qp[:, s : s + t] for s, t in zip(rows.q_start, rows.q_real)], dim=1)
        tally.take(qp)  # the real rows, head-major: the block that travels

    def post_q(block: torch.Tensor, origin: int):
        tally.take(_shaped(q, hq, shards.q_rows(origin), d))
        return group.sendrecv_async(
            block, (r + 1) % n, (r - 1) % n, like=_shaped(q, hq, shards.q_rows(origin), d)
        )

    pend = post_q(qp, (r - 1) % n) if n > 1 else None
    for c in shards.plan(r, r):
        o, l = tally.attend(q[c.q_lo : c.q_hi], kv, c, scale)
        (acc.write if c.causal else acc.merge)(c.q_lo, c.q_hi, o, l)
    sent, back = qp if qp.data_ptr() != q.data_ptr() else None, None
    for s in range(1, n):
        origin, home = (r - s) % n, (r + s) % n
        vis = pend.wait()  # also completes the forwarding of the previous block
        if sent is not None:
            tally.drop(sent)
        pend = post_q(vis, (origin - 1) % n) if s + 1 < n else None
        part = vis.new_empty(hq, shards.returned_rows(origin, r), dv + 1)
        tally.take(part)
        at = 0
        for c in shards.plan(origin, r):
            m = c.q_hi - c.q_lo
            o, l = tally.attend(vis[:, c.p_lo : c.p_lo + m].transpose(0, 1), kv, c, scale)
            part[:, at : at + m, :dv], part[:, at : at + m, dv] = o.transpose(0, 1), l.T
            at += m
        like = _shaped(part, hq, shards.returned_rows(r, home), dv + 1)
        ret = group.sendrecv_async(part, origin, home, like=like)
        tally.take(like)
        if back is not None:
            _merge_back(acc, *back, shards, r, tally)
        back, sent = (ret, home, part), vis
    if back is not None:
        _merge_back(acc, *back, shards, r, tally)


def _merge_back(acc: _Out, ret, home: int, part, shards: RingShards, r: int, tally) -> None:
    """Fold the partial results rank ``home`` computed for our queries into the output."""
    got, at, dv = ret.wait(), 0, part.shape[2] - 1
    for c in shards.plan(r, home):
        m = c.q_hi - c.q_lo
        acc.merge(
            c.q_lo, c.q_hi, got[:, at : at + m, :dv].transpose(0, 1), got[:, at : at + m, dv].T
        )
        at += m
    tally.drop(got, part)
