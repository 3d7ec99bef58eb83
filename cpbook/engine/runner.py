"""The mini engine's model runner: one rank's share of a tiny model and its paged KV cache.

One :meth:`ModelRunner.execute` call runs one engine step (a
:class:`~cpbook.engine.scheduler.SchedulerOutput`) on this rank of a TP × PCP × DCP grid, the same
code inline and under torchrun (vLLM's ``GPUModelRunner.execute_model``):

* **TP**: this rank's query heads (``q_heads_of``), KV heads (``kv_heads_of``; MLA:
  the one latent) and MLP columns; the partial attention-output and MLP projections are summed
  by an all-reduce over the TP group.
* **Step metadata** (:class:`StepMetadata`, vLLM's per-step attention metadata): built once
  per step on the host by :meth:`ModelRunner.prepare` — token ids, positions, the batched
  rows' :class:`~cpbook.engine.attention.AttentionMetadata` (slot mapping, padded key slots,
  mask), PCP's prefill partition, slots and context slots — copied to the device once and
  reused by every layer.  The layer loop has no per-request Python and reads nothing back.
* **Decode rows** (``1 + k`` per request: the last sampled token and ``k`` speculative drafts,
  ``k = 0`` without speculation; every PCP rank holds all of them): one
  :func:`cpbook.engine.attention.batched_attention` call per layer for the whole batch — the
  new K/V written through the DCP slot mapping and appended to the batch's kept keys
  (:class:`~cpbook.engine.attention.BatchKV`, copied afresh when the batch's requests change),
  each row attending the local keys at positions up to its own (causal by global position),
  AllGather Q and the ``ag_rs`` or ``a2a`` LSE combine under DCP.  MLA runs the same call on
  its absorbed latent queries against the cached latents.  :meth:`ModelRunner.rollback`
  invalidates the slots of rejected draft rows.
  Without PCP (and with the ``"auto"`` strategy) the prefill chunks join the same call: a
  chunk's rows are rows after a cached context, causal by global position like drafts.
* **Prefill rows under PCP** (or a forced strategy): split zigzag over the PCP group
  (:mod:`cpbook.pcp.zigzag`), attended by :func:`cpbook.pcp.chunked.chunked_prefill_attention`
  (context from the paged cache, AllGather-Q or AllGather-KV picked by the selector), then the new
  K/V is all-gathered over PCP and written through the slot mapping.
* **Sampling**: greedy, on every decode row and on the last row of every prefill chunk that
  reaches its request's last token;
  rank 0's tokens are shared with every rank (one all-gather, a guard against drift; vLLM
  all-gathers no sampled tokens: every worker samples the same logits and one output rank
  replies, ``_get_output_rank`` in ``vllm/v1/executor/multiproc_executor.py``), and read to
  the host once per step for the scheduler.
* **Devices**: weights, caches and every step's tensors live on the model's device
  (``ctx.device`` of the :class:`~cpbook.engine.engine.Engine`); the step's token ids,
  positions and slot mappings are built on the host and copied once.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from cpbook.core.config import ParallelConfig
from cpbook.core.groups import ParallelGroups
from cpbook.core.heads import kv_heads_of, q_heads_of
from cpbook.engine.attention import (
    AttentionMetadata,
    BatchKV,
    batch_slot_mapping,
    batched_attention,
    build_attention_metadata,
    padded_block_tables,
)
from cpbook.engine.config import RunnerConfig
from cpbook.engine.models import TinyModel
from cpbook.engine.scheduler import ChunkKind, ScheduledChunk, SchedulerOutput
from cpbook.kv.context import ContextShard
from cpbook.kv.layout import PAD_SLOT_ID, DCPShard
from cpbook.kv.paged import PagedKVCache
from cpbook.pcp.chunked import chunked_prefill_attention
from cpbook.pcp.chunked_plan import ChunkedPrefillConfig
from cpbook.pcp.prefill import pcp_restore, pcp_shard
from cpbook.pcp.zigzag import PCPMetadata, zigzag_partition

__all__ = ["ModelRunner", "PrefillMetadata", "StepMetadata"]


@dataclass(frozen=True)
class PrefillMetadata:
    """The step's prefill chunks on this rank: the PCP partition (``pcp``), the chunks'
    ``context_lens`` (tokens cached before each), the device slots their new K/V goes to
    (``write_rows`` of the restored rows; ``None``: all), the device slots of every chunk's
    cached context (``context_slots``, split by ``context_sizes``); host ``slot_mapping`` and
    ``read_slots`` for the step's checks."""

    pcp: PCPMetadata
    context_lens: tuple[int, ...]
    slot_mapping: torch.Tensor
    read_slots: torch.Tensor
    write_rows: torch.Tensor | None
    write_slots: torch.Tensor
    context_slots: torch.Tensor
    context_sizes: tuple[int, ...]


@dataclass(frozen=True)
class StepMetadata:
    """Everything a step's layers need, built once (vLLM's ``CommonAttentionMetadata`` plus the
    model inputs): ``input_ids``/``positions`` (device; the batched backend's rows first —
    decode chunks, then without PCP the prefill chunks — then this PCP rank's prefill rows),
    ``num_batched_rows``, ``attention`` (the batched rows' metadata) and ``prefill`` (PCP's;
    ``None`` when the step has none), and the sampling plan: ``sample_ids``/``sample_counts``
    (rows per sampling request), ``sample_rows`` (device rows of the batched rows that yield
    a token; ``None``: all) and ``prefill_sample_rows`` (rows of the restored PCP prefill)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    num_batched_rows: int
    attention: AttentionMetadata | None
    prefill: PrefillMetadata | None
    sample_ids: tuple[str, ...]
    sample_counts: tuple[int, ...]
    sample_rows: torch.Tensor | None
    prefill_sample_rows: torch.Tensor | None

    def summary(self) -> dict:
        """A compact host view of the step (what chapter 9 prints)."""
        d, p = self.attention, self.prefill
        out: dict = {"input_ids": self.input_ids.cpu().tolist()}
        out["positions"] = self.positions.cpu().tolist()
        if d is not None:
            out["attention"] = {
                "query_start_loc": d.query_start_loc.tolist(),
                "seq_lens": d.seq_lens.tolist(),
                "slot_mapping": d.slot_mapping.tolist(),
                "max_keys": d.max_keys,
            }
        if p is not None:
            out["prefill"] = {
                "query_lens": p.pcp.query_lens,
                "context_lens": list(p.context_lens),
                "slot_mapping": p.slot_mapping.tolist(),
            }
        return out


class ModelRunner:
    """This rank's heads, MLP columns and per-layer :class:`~cpbook.kv.paged.PagedKVCache`
    (``num_blocks`` physical blocks of ``block_size`` slots, DCP layout of ``config``); the
    chunked-prefill ``strategy``, ``workspace_size`` and link (``alpha``, ``beta``; ``None``:
    the CPU fit) from ``runner_config``."""

    def __init__(
        self,
        model: TinyModel,
        config: ParallelConfig,
        groups: ParallelGroups,
        num_blocks: int,
        runner_config: RunnerConfig | None = None,
    ) -> None:
        mc, c = model.config, groups.coords
        run = RunnerConfig() if runner_config is None else runner_config
        self.model, self.config, self.groups = model, config, groups
        self.strategy, self.workspace_size = run.strategy, run.workspace_size
        self.alpha, self.beta = run.alpha, run.beta
        self.heads = q_heads_of(config, c.tp_rank)
        self.kv_heads = kv_heads_of(config, c.tp_rank)
        self.cols = model.mlp_shard(c.tp_rank, config.tp)
        nkv = self.kv_heads.stop - self.kv_heads.start
        self.shard = DCPShard(config.dcp, c.dcp_rank, config.interleave)
        # without PCP (and with the automatic strategy) prefill chunks join the batched call
        self.batched_prefill = config.pcp == 1 and run.strategy == "auto"
        self.caches = [
            PagedKVCache(
                num_blocks,
                config.block_size,
                nkv,
                mc.kv_cache_dim,
                0 if mc.use_mla else None,
                shard=self.shard,
                dtype=model.embed.dtype,
                device=model.device,
            )
            for _ in range(mc.num_hidden_layers)
        ]
        for c in self.caches[1:]:  # every layer stores the same slots: one bookkeeping
            c.written = self.caches[0].written
        self.kv = BatchKV(mc.num_hidden_layers)  # the batch's keys, kept across steps
        self.strategies: Counter[str] = Counter()
        self.last_metadata: StepMetadata | None = None

    # -- helpers ------------------------------------------------------------------------------
    def _tp_sum(self, t: torch.Tensor) -> torch.Tensor:
        return self.groups.tp.all_reduce(t) if self.groups.tp.size > 1 else t

    def _restore(self, t: torch.Tensor, meta: PCPMetadata) -> torch.Tensor:
        """Every prefill row of the step in sequence order (all-gather over PCP if > 1)."""
        if self.groups.pcp.size == 1:
            return t.index_select(0, meta.restore_index.to(t.device))
        return pcp_restore(t, meta, self.groups.pcp)

    def rollback(self, block_table: tuple[int, ...], start: int, end: int) -> int:
        """Invalidate this rank's slots of positions ``[start, end)`` (rejected draft rows) in
        every layer's cache; returns how many it dropped (per layer; 0 if it owns none)."""
        c = self.caches[0]  # the layers share one record of written slots
        return c.invalidate(c.slot_mapping(torch.arange(start, end), block_table))

    # -- the step's metadata, once ------------------------------------------------------------
    def _prefill_metadata(self, pre: list[ScheduledChunk], dev: torch.device) -> PrefillMetadata:
        cache = self.caches[0]
        pcp = zigzag_partition([c.num_tokens for c in pre], self.config.pcp).metadata(
            self.groups.coords.pcp_rank
        )
        counts = torch.tensor([c.num_tokens for c in pre], dtype=torch.long)
        req = torch.repeat_interleave(torch.arange(len(pre)), counts)
        first = torch.cumsum(counts, 0) - counts
        starts = torch.tensor([c.start for c in pre], dtype=torch.long)
        positions = starts[req] + torch.arange(int(counts.sum())) - first[req]
        tables = padded_block_tables([c.block_table for c in pre])
        slots = batch_slot_mapping(positions, req, tables, self.config.block_size, self.shard)
        ctx = [cache.local_slots(c.block_table, c.start) for c in pre]
        read = torch.cat(ctx) if ctx else torch.zeros(0, dtype=torch.long)
        mine = slots != PAD_SLOT_ID
        return PrefillMetadata(
            pcp,
            tuple(c.start for c in pre),
            slots,
            read,
            None if bool(mine.all()) else mine.nonzero().flatten().to(dev),
            slots[mine].to(dev),
            read.to(dev),
            tuple(x.numel() for x in ctx),
        )

    def prepare(self, out: SchedulerOutput) -> StepMetadata:
        """The step's :class:`StepMetadata`, built on the host and copied once; checks (once
        for every layer) that each slot read holds a token and each slot written lies in the
        cache.  Decode chunks, and without PCP every prefill chunk too, go to the batched
        backend; PCP's prefill chunks to the PCP path."""
        model, dev = self.model, self.model.device
        dec = [c for c in out.chunks if c.kind is ChunkKind.DECODE]
        pre = [c for c in out.chunks if c.kind is not ChunkKind.DECODE]
        batch, pre = (dec + pre, []) if self.batched_prefill else (dec, pre)
        ids = [t for c in batch for t in c.token_ids]
        if out.preempted:  # a preempted request's keys are recomputed: copy afresh
            self.kv.forget()
        attn = prefill = None
        pos, names, counts, rows = [], [], [], []
        if batch:
            attn = build_attention_metadata(
                [c.start for c in batch],
                [c.num_tokens for c in batch],
                [c.block_table for c in batch],
                self.config.block_size,
                self.shard,
                model.embed.dtype,
                dev,
                [c.request_id for c in batch],
                self.kv,
            )
            pos.append(attn.positions)
            qsl = attn.query_start_loc.tolist()
            for j, c in enumerate(batch):
                if c.kind is ChunkKind.DECODE or c.sample:
                    n = c.num_tokens if c.kind is ChunkKind.DECODE else 1
                    names.append(c.request_id)
                    counts.append(n)
                    rows.extend(range(qsl[j + 1] - n, qsl[j + 1]))
        else:  # keys written outside the batched call: copy afresh
            self.kv.forget()
        sample_rows = None
        keep = [j for j, c in enumerate(pre) if c.sample]
        if pre:
            prefill = self._prefill_metadata(pre, dev)
            flat = torch.tensor([t for c in pre for t in c.token_ids], dtype=torch.long)
            ids_pre = pcp_shard(flat, prefill.pcp)
            starts = torch.tensor([c.start for c in pre], dtype=torch.long)
            pos.append(prefill.pcp.positions + starts[prefill.pcp.request_ids])
            cu = prefill.pcp.cu_seq_lens
            if keep:
                sample_rows = torch.tensor([cu[j + 1] - 1 for j in keep], device=dev)
        written = [] if attn is None else [attn.new_slots]
        if prefill is not None:
            written.append(prefill.slot_mapping[prefill.slot_mapping != PAD_SLOT_ID])
        # a fill of only the new rows copies them, not the cache: nothing read to check
        reads = [] if attn is None or attn.fill_new else [attn.read_slots]
        if prefill is not None:
            reads.append(prefill.read_slots)
        self._check(reads, written)
        ids_t = torch.tensor(ids, dtype=torch.long)
        if pre:
            ids_t = torch.cat([ids_t, ids_pre])
        pos_t = torch.cat(pos) if pos else torch.zeros(0, dtype=torch.long)
        return StepMetadata(
            ids_t.to(dev),
            pos_t.to(dev),
            len(ids),
            attn,
            prefill,
            tuple(names) + tuple(pre[j].request_id for j in keep),
            tuple(counts) + (1,) * len(keep),
            None if len(rows) == len(ids) else torch.tensor(rows, dtype=torch.long, device=dev),
            sample_rows,
        )

    def _check(self, read: list[torch.Tensor], written: list[torch.Tensor]) -> None:
        """Mark the step's ``written`` slots (host) in the layers' shared bookkeeping, then
        check that every slot it ``read``s holds a token (a decode row reads its own new key)."""
        for slots in written:
            self.caches[0].mark_written(slots)
        for slots in read:
            self.caches[0].check_written(slots)

    # -- attention ----------------------------------------------------------------------------
    def _prefill(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor | None,
        meta: PrefillMetadata,
    ) -> torch.Tensor:
        cache, cfg, mla = self.caches[layer], self.config, self.model.config.use_mla
        keys, values = cache.gather(meta.context_slots)
        context = ContextShard(
            meta.context_lens,
            keys.split(meta.context_sizes),
            None if mla else values.split(meta.context_sizes),
            cfg.dcp,
            self.groups.coords.dcp_rank,
            cfg.interleave,
            self.model.config.kv_lora_rank if mla else None,
        )
        stats: dict = {}
        out, _ = chunked_prefill_attention(
            q,
            k,
            v,
            context,
            meta.pcp,
            self.groups,
            ChunkedPrefillConfig(
                strategy=self.strategy,
                workspace_size=self.workspace_size,
                dcp_comm_backend=cfg.dcp_comm_backend,
                alpha=self.alpha,
                beta=self.beta,
                scale=self.model.attn_scale(layer),
            ),
            stats,
        )
        self.strategies[stats["strategy"]] += 1
        d = k.shape[-1]
        new = self._restore(k if v is None else torch.cat([k, v], dim=-1), meta.pcp)  # one gather
        new_k, new_v = (new, None) if v is None else (new[..., :d], new[..., d:])
        cache.store(new_k, new_v, meta.write_slots, meta.write_rows)
        return out

    # -- one step -----------------------------------------------------------------------------
    @torch.inference_mode()  # as vLLM's model runner: no autograd bookkeeping on any tensor
    def execute(self, out: SchedulerOutput) -> tuple[dict[str, list[int]], dict[str, torch.Tensor]]:
        """Run the step; returns, for every sampling chunk, its greedy tokens (one per decode
        row; one for a prefill chunk) and their logits rows ``[n, vocab]``."""
        model, groups, cfg = self.model, self.groups, self.config
        meta = self.last_metadata = self.prepare(out)
        if self.batched_prefill and any(c.kind is not ChunkKind.DECODE for c in out.chunks):
            # prefill rows in the batched call: their "strategy", once per layer
            self.strategies["batched"] += model.config.num_hidden_layers
        nd, dec, pre = meta.num_batched_rows, meta.attention, meta.prefill
        mla_dim = model.config.kv_lora_rank if model.config.use_mla else None
        x = model.embed[meta.input_ids]
        for layer in range(model.config.num_hidden_layers):
            h = model.attn_input(layer, x)
            q, k, v = model.qkv(layer, h, meta.positions, self.heads, self.kv_heads)
            parts = []
            if pre is not None:  # the batched rows first, then this PCP rank's prefill rows
                qp, kp, vp = q[nd:], k[nd:], None if v is None else v[nd:]
                q, k, v = q[:nd], k[:nd], None if v is None else v[:nd]
            if dec is not None:
                parts.append(
                    batched_attention(
                        q,
                        k,
                        v,
                        self.caches[layer],
                        dec,
                        model.attn_scale(layer),
                        groups.dcp,
                        cfg.dcp_comm_backend,
                        mla_dim,
                        self.kv,
                        layer,
                    )
                )
            if pre is not None:
                parts.append(self._prefill(layer, qp, kp, vp, pre))
            attn = parts[0] if len(parts) == 1 else torch.cat(parts)
            x = x + self._tp_sum(model.o_proj(layer, attn, self.heads))
            x = x + self._tp_sum(model.mlp(layer, x, self.cols))
        rows = [x[:nd] if meta.sample_rows is None else x.index_select(0, meta.sample_rows)]
        if meta.prefill_sample_rows is not None:
            rows.append(self._restore(x[nd:], pre.pcp).index_select(0, meta.prefill_sample_rows))
        logits = model.logits(rows[0] if len(rows) == 1 else torch.cat(rows))
        tokens = logits.argmax(dim=-1)
        if groups.world.size > 1:  # everyone continues with rank 0's tokens
            tokens = groups.world.all_gather(tokens[None], dim=0)[0]
        # the step's one host read: the scheduler needs the sampled tokens
        flat, per_tok, at = tokens.tolist(), {}, 0
        for name, n in zip(meta.sample_ids, meta.sample_counts):
            per_tok[name] = flat[at : at + n]
            at += n
        return per_tok, dict(zip(meta.sample_ids, logits.split(meta.sample_counts)))
