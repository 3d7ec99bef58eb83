"""Speculative decoding for the mini engine: the config, two drafters and greedy acceptance.

* :class:`SpeculativeConfig` — vLLM's ``speculative_config`` in miniature: ``method``
  (``"ngram"`` or ``"draft"``), ``num_speculative_tokens`` (``k``), ``prompt_lookup_min`` /
  ``prompt_lookup_max`` (vLLM's defaults: both 5 when neither is given), for ``"draft"`` the
  draft ``model`` (``None``: the target's first layer with the target's final norm and LM
  head, an early-exit drafter) and ``draft_decode_context_parallel_size`` (1 or the target's
  DCP, default the target's; ``vllm/config/speculative.py`` v0.34.0).
* :class:`NgramProposer` — prompt lookup, no model: the longest suffix n-gram
  (``prompt_lookup_min ≤ n ≤ prompt_lookup_max``) that occurred earlier, at its *earliest*
  occurrence, and the up to ``k`` tokens that followed it (the rule of
  ``_find_longest_matched_ngram_and_propose_tokens``, ``vllm/v1/spec_decode/ngram_proposer.py``
  of v0.33.0's Model Runner V1; written here as a plain scan).  v0.34.0 has only Model Runner
  V2, whose ``NgramGPUSpeculator`` (``vllm/v1/worker/gpu/spec_decode/ngram/speculator.py``)
  takes the *rightmost* occurrence and pads short drafts with the last sampled token.
* :class:`DraftModelProposer` — ``k`` greedy steps of a small model per request over its own
  KV cache, at the target's TP: at draft DCP 1 every rank holds the request's whole draft KV
  (**replicated**), at the target's DCP its interleaved share (**sharded**; each draft forward
  is a DCP decode).  Its cache is rolled back to the tokens the target accepted.
* :func:`greedy_accept` — the greedy rule of vLLM's rejection sampler (``RejectionSampler``,
  ``vllm/v1/worker/gpu/spec_decode/rejection_sampler.py`` v0.34.0): accept the longest
  prefix of drafts that equals the target's argmax, then add the target's token after it (the
  bonus token).

Every rank builds the same drafter from the same arguments and proposes from the same token
history, so the drafts agree on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Sequence

import torch

from cpbook.core.config import ConfigError, ParallelConfig, check_vllm_spec_interleave
from cpbook.core.groups import ParallelGroups
from cpbook.core.heads import kv_heads_of, q_heads_of
from cpbook.dcp.verify import dcp_verify_attention, local_verify_attention
from cpbook.engine.models import TinyModel
from cpbook.kv.layout import DCPShard, local_seq_len, token_owner

__all__ = [
    "SPEC_METHODS",
    "SpeculativeConfig",
    "NgramProposer",
    "DraftModelProposer",
    "make_proposer",
    "check_draft_vocab",
    "first_layer_drafter",
    "greedy_accept",
    "check_vllm_spec_interleave",
]

SPEC_METHODS = ("ngram", "draft")


@dataclass(frozen=True)
class SpeculativeConfig:
    """What to speculate with; raises :class:`ConfigError` naming the rule on bad values."""

    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None
    draft_decode_context_parallel_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ConfigError("spec-method", f"method in {SPEC_METHODS}", method=self.method)
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ConfigError(
                "num-speculative-tokens", "num_speculative_tokens >= 1", num_speculative_tokens=k
            )
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        lo, hi = (5, 5) if lo is None and hi is None else (lo or hi, hi or lo)
        if lo < 1 or lo > hi:
            raise ConfigError(
                "prompt-lookup-range",
                "1 <= prompt_lookup_min <= prompt_lookup_max",
                prompt_lookup_min=lo,
                prompt_lookup_max=hi,
            )
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)
        d = self.draft_decode_context_parallel_size
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d < 1):
            raise ConfigError(
                "draft-dcp-positive",
                "draft_decode_context_parallel_size >= 1",
                draft_decode_context_parallel_size=d,
            )

    def draft_dcp(self, decode_context_parallel_size: int) -> int:
        """The draft model's DCP under a target of ``decode_context_parallel_size``: unset, the
        target's (vLLM's default for a separate draft model); set, 1 or the target's, else rule
        ``draft-dcp-one-or-target`` (``SpeculativeConfig._verify_and_get_draft_dcp``,
        ``vllm/config/speculative.py`` v0.34.0)."""
        d = self.draft_decode_context_parallel_size
        if d is None:
            return decode_context_parallel_size
        if d not in (1, decode_context_parallel_size):
            raise ConfigError(
                "draft-dcp-one-or-target",
                "draft_decode_context_parallel_size in (1, decode_context_parallel_size)",
                draft_decode_context_parallel_size=d,
                decode_context_parallel_size=decode_context_parallel_size,
            )
        return d

    @classmethod
    def of(cls, value: "SpeculativeConfig | dict | None") -> "SpeculativeConfig | None":
        """A config from a dict of vLLM's keys (or a config, or ``None``)."""
        return cls(**value) if isinstance(value, dict) else value


class NgramProposer:
    """Prompt-lookup drafts from a request's own tokens (prompt and output)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, request_id: str, tokens: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the earliest earlier occurrence of the longest
        suffix n-gram of ``tokens``; ``[]`` when no n-gram of ``min_n..max_n`` recurs."""
        t, total = list(tokens), len(tokens)
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            suffix = t[total - n :]
            for i in range(total - n):
                if t[i : i + n] == suffix:
                    return t[i + n : i + n + k]
        return []

    def rollback(self, request_id: str, num_tokens: int) -> None:
        """Nothing to undo: the n-gram drafter keeps no state."""

    def release(self, request_id: str) -> None:
        """Nothing held per request."""


def first_layer_drafter(target: TinyModel) -> TinyModel:
    """An early-exit draft: the target's embedding and first decoder layer, then the target's
    final norm and LM head (so the vocabularies agree by construction)."""
    cfg = replace(target.config, name=f"{target.config.name}-layer0", num_hidden_layers=1)
    return replace(target, config=cfg, layers=target.layers[:1], mla=target.mla[:1])


def check_draft_vocab(draft_vocab_size: int, target_vocab_size: int) -> None:
    """Greedy acceptance compares token ids, so the draft must share the target's vocabulary
    (vLLM requires the same; rule ``draft-vocab-matches``)."""
    if draft_vocab_size != target_vocab_size:
        raise ConfigError(
            "draft-vocab-matches",
            "the draft model's vocab_size == the target's",
            draft_vocab_size=draft_vocab_size,
            target_vocab_size=target_vocab_size,
        )


class DraftModelProposer:
    """``k`` greedy steps of ``draft`` per request, at the target's TP and a draft DCP of 1 or
    the target's (``parallel_config``'s sizes with the draft's heads; ``groups`` the target's).

    Each rank keeps, per request and draft layer, the draft KV rows it owns in position order:
    all of them at draft DCP 1 (the **replicated** cache of vLLM's ``dcp_sharded=False`` path),
    ``local_seq_len(L)`` at the target's DCP (**sharded**, the target's interleaved layout).
    A draft forward is the model runner's decode step: this rank's query heads and MLP
    columns, the TP all-reduces, and at DCP > 1 :func:`~cpbook.dcp.verify.dcp_verify_attention`
    over the DCP group (DCP 1: the local causal attention, no DCP collective).  Every rank of a
    TP group gets the same all-reduced rows and every group the same inputs, so the drafts
    agree on every rank.  ``rows_per_call`` logs each forward's rows, ``comm`` the
    ``(op, bytes sent)`` of every collective the drafting made on this rank (what
    :func:`~cpbook.dcp.draft_placement.draft_step_comm_bytes` prices), ``peak_rows`` the most
    draft KV rows per layer this rank held at once."""

    def __init__(
        self,
        draft: TinyModel,
        target_vocab_size: int,
        parallel_config: ParallelConfig | None = None,
        groups: ParallelGroups | None = None,
        draft_dcp: int = 1,
    ) -> None:
        check_draft_vocab(draft.config.vocab_size, target_vocab_size)
        sizes = {} if parallel_config is None else _sizes(parallel_config, draft_dcp)
        self.config = ParallelConfig.for_model(draft.config, **sizes)
        self.draft, self.groups = draft, groups
        tp_rank = groups.coords.tp_rank if groups is not None else 0
        dcp_rank = groups.coords.dcp_rank if groups is not None and draft_dcp > 1 else 0
        self.shard = DCPShard(draft_dcp, dcp_rank, self.config.interleave)
        self.placement = "sharded" if draft_dcp > 1 else "replicated"
        self.heads = q_heads_of(self.config, tp_rank)
        self.kv_heads = kv_heads_of(self.config, tp_rank)
        self.cols = draft.mlp_shard(tp_rank, self.config.tp)
        self.cache: dict[str, tuple[list[int], list[list[torch.Tensor]]]] = {}
        self.rows_per_call: list[int] = []
        self.comm: list[tuple[str, int]] = []
        self.peak_rows = 0

    def _fresh(self) -> list[list[torch.Tensor]]:
        return [[] for _ in range(self.draft.config.num_hidden_layers)]

    def rows_held(self, request_id: str) -> int:
        """Draft KV rows (per layer) this rank holds for the request."""
        layers = self.cache.get(request_id, ([], [[]]))[1]
        return int(layers[0][0].shape[0]) if layers and layers[0] else 0

    def rollback(self, request_id: str, num_tokens: int) -> None:
        """Keep only the request's first ``num_tokens`` positions of draft KV (this rank's
        ``local_seq_len(num_tokens)`` rows of them)."""
        if request_id not in self.cache:
            return
        toks, cache = self.cache[request_id]
        s = self.shard
        n = local_seq_len(num_tokens, s.dcp, s.dcp_rank, s.interleave)
        self.cache[request_id] = (toks[:num_tokens], [[x[:n] for x in lay] for lay in cache])

    def release(self, request_id: str) -> None:
        self.cache.pop(request_id, None)

    def _tp_sum(self, t: torch.Tensor) -> torch.Tensor:
        tp = self.groups.tp if self.groups is not None else None
        return tp.all_reduce(t) if tp is not None and tp.size > 1 else t

    def _forward(self, request_id: str, token_ids: list[int], start: int) -> torch.Tensor:
        """Logits of the last of ``token_ids`` (positions ``start, …``), their draft KV
        appended on the ranks that own their positions."""
        model, s, cache = self.draft, self.shard, self.cache[request_id][1]
        dev = model.device
        pos = torch.arange(start, start + len(token_ids), device=dev)
        mine = token_owner(pos.cpu(), s.dcp, s.interleave).to(dev) == s.dcp_rank
        x = model.embed[torch.tensor(token_ids, dtype=torch.long, device=dev)]
        self.rows_per_call.append(len(token_ids))
        for layer in range(model.config.num_hidden_layers):
            q, k, v = model.qkv(layer, model.attn_input(layer, x), pos, self.heads, self.kv_heads)
            new = [k[mine]] if v is None else [k[mine], v[mine]]
            cache[layer] = (
                new if not cache[layer] else [torch.cat([a, b]) for a, b in zip(cache[layer], new)]
            )
            kk = cache[layer][0]
            vv = kk[..., : model.config.kv_lora_rank] if v is None else cache[layer][1]
            scale = model.attn_scale(layer)
            if s.dcp == 1:
                a = local_verify_attention(q, [kk], [vv], [start], [len(token_ids)], s, scale)[0]
            else:
                if kk.shape[1] > 1:  # gathered heads come in DCP blocks: tile the KV heads
                    kk, vv = kk.repeat(1, s.dcp, 1), vv.repeat(1, s.dcp, 1)
                a = dcp_verify_attention(
                    q, [kk], [vv], [start], [len(token_ids)], self.groups.dcp, s.interleave,
                    self.config.dcp_comm_backend, scale,
                )  # fmt: skip
            x = x + self._tp_sum(model.o_proj(layer, a, self.heads))
            x = x + self._tp_sum(model.mlp(layer, x, self.cols))
        self.peak_rows = max(self.peak_rows, sum(self.rows_held(r) for r in self.cache))
        return model.logits(x[-1:])[0]

    def propose(self, request_id: str, tokens: Sequence[int], k: int) -> list[int]:
        """Catch the draft KV up on ``tokens`` (rolled back to the longest common prefix of what
        it holds), then ``k`` greedy draft tokens; the draft KV then holds ``tokens`` + all but
        the last draft."""
        tokens = list(tokens)
        held, cache = self.cache.get(request_id, ([], self._fresh()))
        common = 0
        while common < min(len(held), len(tokens) - 1) and held[common] == tokens[common]:
            common += 1
        self.cache[request_id] = (held, cache)
        self.rollback(request_id, common)
        trace = self.groups.world.trace if self.groups is not None else []
        first = len(trace)
        out = [int(self._forward(request_id, tokens[common:], common).argmax())]
        while len(out) < k:
            logits = self._forward(request_id, out[-1:], len(tokens) + len(out) - 1)
            out.append(int(logits.argmax()))
        self.cache[request_id] = (tokens + out[:-1], self.cache[request_id][1])
        self.comm.extend((r.op, r.bytes_sent) for r in trace[first:])
        return out


def _sizes(config: ParallelConfig, draft_dcp: int) -> dict[str, Any]:
    """The target's deployment with the draft's DCP (what vLLM's draft runs at)."""
    keep = ("tensor_parallel_size", "prefill_context_parallel_size", "block_size")
    return dict(
        {f: getattr(config, f) for f in keep},
        decode_context_parallel_size=draft_dcp,
        cp_kv_cache_interleave_size=config.interleave,
        dcp_comm_backend=config.dcp_comm_backend,
    )


def make_proposer(
    config: SpeculativeConfig,
    target: TinyModel,
    draft: TinyModel | None = None,
    parallel_config: ParallelConfig | None = None,
    groups: ParallelGroups | None = None,
) -> NgramProposer | DraftModelProposer:
    """The drafter of ``config``: n-gram, or a draft model (``draft``, else the target's first
    layer, :func:`first_layer_drafter`) at the target's ``parallel_config`` (``None``: one
    rank) with :meth:`SpeculativeConfig.draft_dcp`'s DCP, on the target's ``groups``."""
    if config.method == "ngram":
        return NgramProposer(config)
    dcp = 1 if parallel_config is None else config.draft_dcp(parallel_config.dcp)
    return DraftModelProposer(
        draft or first_layer_drafter(target), target.config.vocab_size, parallel_config, groups, dcp
    )


def greedy_accept(drafts: Sequence[int], targets: Sequence[int]) -> list[int]:
    """The tokens a greedy speculative step emits: the longest prefix of ``drafts`` equal to
    ``targets`` (the target's argmax at each row), then the target's next token.

    ``len(targets) == len(drafts) + 1``; returns between 1 and ``len(drafts) + 1`` tokens, each
    the target's own greedy choice — so the output equals non-speculative greedy decoding."""
    if len(targets) != len(drafts) + 1:
        raise ConfigError(
            "targets-per-draft",
            "len(targets) == len(drafts) + 1",
            drafts=len(drafts),
            targets=len(targets),
        )
    if not drafts:  # no speculation: the target's token
        return [targets[0]]
    a = 0
    while a < len(drafts) and drafts[a] == targets[a]:
        a += 1
    return list(targets[: a + 1])
