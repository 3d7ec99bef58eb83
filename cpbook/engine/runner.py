"""The mini engine's model runner: one rank's share of a tiny model and its paged KV cache.

One :meth:`ModelRunner.execute` call runs one engine step (a
:class:`~cpbook.engine.scheduler.SchedulerOutput`) on this rank of a TP × PCP × DCP grid, the same
code inline and under torchrun (vLLM's ``GPUModelRunner.execute_model``):

* **TP**: this rank's query heads (``q_heads_of``), KV heads (``kv_heads_of``; MLA:
  the one latent) and MLP columns; the partial attention-output and MLP projections are summed
  by an all-reduce over the TP group.
* **Decode rows** (``1 + k`` per request: the last sampled token and ``k`` speculative drafts,
  ``k = 0`` without speculation; every PCP rank holds all of them): the new K/V is written
  through the DCP slot mapping, then :func:`cpbook.dcp.verify.dcp_verify_attention` over the DCP
  group — each row attends the local keys at positions up to its own (causal by global
  position), then AllGather Q, attention over the local shard, ``ag_rs`` or ``a2a`` combine.
  MLA runs the same function on its absorbed latent queries against the cached latents.
  :meth:`ModelRunner.rollback` invalidates the slots of rejected draft rows on this rank.
* **Prefill rows** (whole or chunked prompts): split zigzag over the PCP group
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

import torch

from cpbook.core.config import ParallelConfig
from cpbook.core.groups import ParallelGroups
from cpbook.core.heads import kv_heads_of, q_heads_of
from cpbook.dcp.verify import dcp_verify_attention, local_verify_attention
from cpbook.engine.config import RunnerConfig
from cpbook.engine.models import TinyModel
from cpbook.engine.scheduler import ScheduledChunk, SchedulerOutput
from cpbook.kv.context import ContextShard
from cpbook.kv.layout import DCPShard
from cpbook.kv.paged import PagedKVCache
from cpbook.pcp.chunked import chunked_prefill_attention
from cpbook.pcp.chunked_plan import ChunkedPrefillConfig
from cpbook.pcp.prefill import pcp_restore, pcp_shard
from cpbook.pcp.zigzag import PCPMetadata, zigzag_partition

__all__ = ["ModelRunner"]


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
        self.caches = [
            PagedKVCache(
                num_blocks,
                config.block_size,
                nkv,
                mc.kv_cache_dim,
                0 if mc.use_mla else None,
                shard=DCPShard(config.dcp, c.dcp_rank, config.interleave),
                dtype=model.embed.dtype,
                device=model.device,
            )
            for _ in range(mc.num_hidden_layers)
        ]
        self.strategies: Counter[str] = Counter()

    # -- helpers ------------------------------------------------------------------------------
    def _tp_sum(self, t: torch.Tensor) -> torch.Tensor:
        return self.groups.tp.all_reduce(t) if self.groups.tp.size > 1 else t

    def _restore(self, t: torch.Tensor, meta: PCPMetadata) -> torch.Tensor:
        """Every prefill row of the step in sequence order (all-gather over PCP if > 1)."""
        if self.groups.pcp.size == 1:
            return t.index_select(0, meta.restore_index.to(t.device))
        return pcp_restore(t, meta, self.groups.pcp)

    def _value_view(self, k: torch.Tensor, v: torch.Tensor | None) -> torch.Tensor:
        return k[..., : self.model.config.kv_lora_rank] if v is None else v

    # -- attention ----------------------------------------------------------------------------
    def _decode(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor | None,
        chunks: list[ScheduledChunk],
    ) -> torch.Tensor:
        cache, cfg = self.caches[layer], self.config
        slots = torch.cat([cache.slot_mapping(self._positions(c), c.block_table) for c in chunks])
        cache.write(k, v, slots)
        ks, vs = [], []
        for c in chunks:
            kk, vv, _ = cache.read(c.block_table, c.start + c.num_tokens)
            ks.append(kk)
            vs.append(self._value_view(kk, vv))
        grp, scale = self.groups.dcp, self.model.attn_scale(layer)
        starts, rows = [c.start for c in chunks], [c.num_tokens for c in chunks]
        if grp.size == 1:
            return local_verify_attention(q, ks, vs, starts, rows, DCPShard(), scale)[0]
        if ks[0].shape[1] > 1:  # gathered heads come in DCP blocks: tile the KV heads to match
            ks = [x.repeat(1, grp.size, 1) for x in ks]
            vs = [x.repeat(1, grp.size, 1) for x in vs]
        return dcp_verify_attention(
            q, ks, vs, starts, rows, grp, cfg.interleave, cfg.dcp_comm_backend, scale
        )

    @staticmethod
    def _positions(c: ScheduledChunk) -> torch.Tensor:
        return torch.arange(c.start, c.start + c.num_tokens)

    def rollback(self, block_table: tuple[int, ...], start: int, end: int) -> int:
        """Invalidate this rank's slots of positions ``[start, end)`` (rejected draft rows) in
        every layer's cache; returns how many it dropped (per layer; 0 if it owns none)."""
        pos = torch.arange(start, end)
        dropped = {c.invalidate(c.slot_mapping(pos, block_table)) for c in self.caches}
        return dropped.pop()  # the same slots in every layer

    def _prefill(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor | None,
        chunks: list[ScheduledChunk],
        meta: PCPMetadata,
    ) -> torch.Tensor:
        cache, cfg = self.caches[layer], self.config
        keys, values = [], []
        for c in chunks:
            kk, vv, _ = cache.read(c.block_table, c.start)
            keys.append(kk)
            values.append(vv)
        mla = self.model.config.use_mla
        context = ContextShard(
            tuple(c.start for c in chunks),
            tuple(keys),
            None if mla else tuple(values),
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
            meta,
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
        new = self._restore(k if v is None else torch.cat([k, v], dim=-1), meta)  # one gather
        new_k, new_v = (new, None) if v is None else (new[..., :d], new[..., d:])
        slots = torch.cat(
            [
                cache.slot_mapping(torch.arange(c.start, c.start + c.num_tokens), c.block_table)
                for c in chunks
            ]
        )
        cache.write(new_k, new_v, slots)
        return out

    # -- one step -----------------------------------------------------------------------------
    def execute(self, out: SchedulerOutput) -> tuple[dict[str, list[int]], dict[str, torch.Tensor]]:
        """Run the step; returns, for every sampling chunk, its greedy tokens (one per decode
        row; one for a prefill chunk) and their logits rows ``[n, vocab]``."""
        model, groups = self.model, self.groups
        dec = [c for c in out.chunks if c.kind == "decode"]
        pre = [c for c in out.chunks if c.kind != "decode"]
        nd = sum(c.num_tokens for c in dec)
        ids = [torch.tensor([t for c in dec for t in c.token_ids], dtype=torch.long)]
        pos = [torch.cat([self._positions(c) for c in dec]) if dec else torch.zeros(0).long()]
        meta = None
        if pre:
            meta = zigzag_partition([c.num_tokens for c in pre], self.config.pcp).metadata(
                groups.coords.pcp_rank
            )
            flat = torch.tensor([t for c in pre for t in c.token_ids], dtype=torch.long)
            ids.append(pcp_shard(flat, meta))
            starts = torch.tensor([c.start for c in pre], dtype=torch.long)
            pos.append(meta.positions + starts[meta.request_ids])
        dev = model.device  # the step's metadata is built on the host, then copied once
        ids_t, pos_t = torch.cat(ids).to(dev), torch.cat(pos).to(dev)
        x = model.embed[ids_t]
        for layer in range(model.config.num_hidden_layers):
            h = model.attn_input(layer, x)
            q, k, v = model.qkv(layer, h, pos_t, self.heads, self.kv_heads)
            parts = []
            if dec:
                parts.append(
                    self._decode(layer, q[:nd], k[:nd], None if v is None else v[:nd], dec)
                )
            if pre:
                parts.append(
                    self._prefill(layer, q[nd:], k[nd:], None if v is None else v[nd:], pre, meta)
                )
            attn = torch.cat(parts)
            x = x + self._tp_sum(model.o_proj(layer, attn, self.heads))
            x = x + self._tp_sum(model.mlp(layer, x, self.cols))
        names, counts, rows = [c.request_id for c in dec], [c.num_tokens for c in dec], [x[:nd]]
        if pre and any(c.sample for c in pre):
            seq = self._restore(x[nd:], meta)
            keep = [j for j, c in enumerate(pre) if c.sample]
            names += [pre[j].request_id for j in keep]
            counts += [1] * len(keep)
            ends = torch.tensor([meta.cu_seq_lens[j + 1] - 1 for j in keep], device=dev)
            rows.append(seq.index_select(0, ends))
        logits = model.logits(torch.cat(rows))
        tokens = logits.argmax(dim=-1)
        if groups.world.size > 1:  # everyone continues with rank 0's tokens
            tokens = groups.world.all_gather(tokens[None], dim=0)[0]
        # the step's one host read: the scheduler needs the sampled tokens
        flat, per_tok, per_row, at = tokens.tolist(), {}, {}, 0
        for name, n in zip(names, counts):
            per_tok[name], per_row[name] = flat[at : at + n], logits[at : at + n]
            at += n
        return per_tok, per_row
