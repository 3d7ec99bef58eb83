"""Speculative decoding for the mini engine: the config, two drafters and greedy acceptance.

* :class:`SpeculativeConfig` — vLLM's ``speculative_config`` in miniature: ``method``
  (``"ngram"`` or ``"draft"``), ``num_speculative_tokens`` (``k``), ``prompt_lookup_min`` /
  ``prompt_lookup_max`` (vLLM's defaults: both 5 when neither is given,
  ``vllm/config/speculative.py`` v0.33.0), and for ``"draft"`` the draft ``model`` (``None``:
  the target's first layer with the target's final norm and LM head, an early-exit drafter).
* :class:`NgramProposer` — prompt lookup, no model: the longest suffix n-gram
  (``prompt_lookup_min ≤ n ≤ prompt_lookup_max``) that occurred earlier, at its *earliest*
  occurrence, and the up to ``k`` tokens that followed it (the rule of vLLM's
  ``_find_longest_matched_ngram_and_propose_tokens``, ``vllm/v1/spec_decode/ngram_proposer.py``
  v0.33.0; written here as a plain scan).
* :class:`DraftModelProposer` — ``k`` greedy steps of a small model over its own contiguous
  KV cache per request, *replicated*: every rank holds the whole draft KV and computes the same
  drafts with no communication.  Its cache is rolled back to the tokens the target accepted.
* :func:`greedy_accept` — the greedy rule of vLLM's rejection sampler
  (``vllm/v1/sample/rejection_sampler.py``): accept the longest prefix of drafts that equals
  the target's argmax, then add the target's token after it (the bonus token).

Every rank builds the same drafter from the same arguments and proposes from the same token
history, so the drafts agree without a collective.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import torch

from cpbook.core.config import ConfigError
from cpbook.engine.models import TinyModel, reference_forward

__all__ = [
    "SPEC_METHODS",
    "SpeculativeConfig",
    "NgramProposer",
    "DraftModelProposer",
    "make_proposer",
    "check_draft_vocab",
    "first_layer_drafter",
    "greedy_accept",
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
    """``k`` greedy steps of ``draft`` per request over its own contiguous (replicated) KV."""

    def __init__(self, draft: TinyModel, target_vocab_size: int) -> None:
        check_draft_vocab(draft.config.vocab_size, target_vocab_size)
        self.draft = draft
        self.cache: dict[str, tuple[list[int], list[list[torch.Tensor]]]] = {}

    def _fresh(self) -> list[list[torch.Tensor]]:
        return [[] for _ in range(self.draft.config.num_hidden_layers)]

    def rollback(self, request_id: str, num_tokens: int) -> None:
        """Keep only the first ``num_tokens`` rows of the request's draft KV."""
        if request_id not in self.cache:
            return
        toks, cache = self.cache[request_id]
        self.cache[request_id] = (
            toks[:num_tokens],
            [[x[:num_tokens] for x in layer] for layer in cache],
        )

    def release(self, request_id: str) -> None:
        self.cache.pop(request_id, None)

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
        held, cache = self.cache[request_id]
        logits = reference_forward(self.draft, tokens[common:], common, cache)[-1]
        out = [int(logits.argmax())]
        while len(out) < k:
            logits = reference_forward(self.draft, out[-1:], len(tokens) + len(out) - 1, cache)
            out.append(int(logits[-1].argmax()))
        self.cache[request_id] = (tokens + out[:-1], cache)
        return out


def make_proposer(
    config: SpeculativeConfig, target: TinyModel, draft: TinyModel | None = None
) -> NgramProposer | DraftModelProposer:
    """The drafter of ``config``: n-gram, or a draft model (``draft``, else the target's first
    layer, :func:`first_layer_drafter`)."""
    if config.method == "ngram":
        return NgramProposer(config)
    return DraftModelProposer(draft or first_layer_drafter(target), target.config.vocab_size)


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
    a = 0
    while a < len(drafts) and drafts[a] == targets[a]:
        a += 1
    return list(targets[: a + 1])
