"""What ``serve`` serves besides generated prompts: ``--prompt TEXT`` and ``--input FILE|-``.

``--input`` reads JSON lines, one request each::

    {"prompt": "Explain context parallelism.", "max_new_tokens": 16, "id": "a"}
    {"prompt": [12, 7, 93], "max_new_tokens": 4}

``prompt`` is text (encoded with the model folder's tokenizer) or a list of token ids;
``max_new_tokens`` defaults to ``--max-new-tokens``; ``id`` (a string or an integer) defaults to
the line number.  :func:`read_requests` checks every line; a bad one is a
:class:`~cpbook.core.errors.RuleError` naming the source, the line number and the rule, which
``serve`` prints and skips (``--strict``: stops the run).  Blank lines are ignored.

:func:`load_tokenizer` is the folder's tokenizer: ``tokenizer_config.json`` present, through
transformers' ``AutoTokenizer`` (local files only, as vLLM loads it); else ``tokenizer.json``
through the ``tokenizers`` package; else none, and a text prompt is refused (rule
``serve-prompt-text``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Iterable

from cpbook.core.errors import RuleError

__all__ = ["FIELDS", "InputRequest", "TextCodec", "load_tokenizer", "read_requests"]

#: the fields a request line may carry
FIELDS = ("prompt", "max_new_tokens", "id")


@dataclass(frozen=True)
class InputRequest:
    """One request of ``--input`` (or ``--prompt``): its id, token ids and token budget."""

    request_id: str
    prompt: list[int]
    max_new_tokens: int


class TextCodec:
    """Text to token ids and back, whichever library the folder's tokenizer needs."""

    def __init__(self, tokenizer: Any, hf: bool) -> None:
        self.tokenizer, self.hf = tokenizer, hf

    def encode(self, text: str) -> list[int]:
        """The prompt's token ids (special tokens added as the tokenizer adds them)."""
        ids = self.tokenizer.encode(text)
        return list(ids if self.hf else ids.ids)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)


def load_tokenizer(folder: str) -> TextCodec | None:
    """The tokenizer of model folder ``folder`` (see the module docstring), or None."""
    if os.path.isfile(os.path.join(folder, "tokenizer_config.json")):
        try:
            from transformers import AutoTokenizer
        except ImportError:
            return None
        return TextCodec(AutoTokenizer.from_pretrained(folder, local_files_only=True), True)
    path = os.path.join(folder, "tokenizer.json")
    if not os.path.isfile(path):
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None
    return TextCodec(Tokenizer.from_file(path), False)


def _line(
    obj: Any, where: dict, vocab_size: int, max_new_tokens: int, tok: TextCodec | None
) -> tuple[str | None, list[int], int]:
    """One parsed line's ``(id or None, prompt ids, max_new_tokens)``; raises the rule it
    breaks, with ``where`` (source and line) first among the values."""
    if not isinstance(obj, dict):
        raise RuleError(
            "serve-input-json", "a JSON object per line", **where, got=type(obj).__name__
        )
    extra = sorted(set(obj) - set(FIELDS))
    if extra:
        raise RuleError("serve-input-fields", f"fields among {FIELDS}", **where, field=extra[0])
    prompt = obj.get("prompt")
    if isinstance(prompt, str) and prompt:
        if tok is None:
            raise RuleError(
                "serve-prompt-text",
                "a token-id prompt, or a model folder with a tokenizer (tokenizer_config.json "
                "or tokenizer.json)",
                **where,
            )
        prompt = tok.encode(prompt)
    ok = isinstance(prompt, list) and prompt
    if not ok or any(type(t) is not int or not 0 <= t < vocab_size for t in prompt):
        raise RuleError(
            "serve-input-prompt",
            "prompt: non-empty text or a list of token ids in [0, vocab_size)",
            **where,
            prompt=obj.get("prompt"),
            vocab_size=vocab_size,
        )
    n = obj.get("max_new_tokens", max_new_tokens)
    if type(n) is not int or n < 1:
        raise RuleError("serve-input-max-new-tokens", "a positive integer", **where, got=n)
    rid = obj.get("id")
    if rid is not None and (type(rid) not in (str, int) or rid == ""):
        raise RuleError("serve-input-id", "id: a string or an integer", **where, got=rid)
    return (None if rid is None else str(rid)), prompt, n


def read_requests(
    lines: Iterable[str],
    source: str,
    vocab_size: int,
    max_new_tokens: int,
    tokenizer: TextCodec | None = None,
) -> tuple[list[InputRequest], list[RuleError]]:
    """The valid requests of JSON ``lines`` (from ``source``, a file name or ``"-"``) and one
    :class:`RuleError` per bad line (its values start with ``source`` and ``line``, 1-based).
    Ids are unique: a repeated one is a bad line (rule ``serve-input-id``)."""
    good: list[InputRequest] = []
    bad: list[RuleError] = []
    seen: set[str] = set()
    for number, text in enumerate(lines, 1):
        if not text.strip():
            continue
        where = {"input": source, "line": number}
        try:
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                raise RuleError("serve-input-json", "a JSON object per line", **where, error=str(e))
            rid, prompt, n = _line(obj, where, vocab_size, max_new_tokens, tokenizer)
            rid = str(number) if rid is None else rid
            if rid in seen:
                raise RuleError("serve-input-id", "an id no earlier line used", **where, id=rid)
        except RuleError as e:
            bad.append(e)
            continue
        seen.add(rid)
        good.append(InputRequest(rid, prompt, n))
    return good, bad
