"""Layer 7, named demos: every chapter's per-rank function, runnable inline, under torchrun
and from the CLI.

``python -m cpbook demo NAME --world-size N [--backend torchrun]`` runs one through
:func:`cpbook.core.launch.run`; ``torchrun --nproc-per-node N -m cpbook demo NAME`` runs it on the
processes torchrun started.  ``--param KEY=VALUE`` values are parsed and checked against the
function's signature (:func:`parse_params`) before any rank starts; a config object's fields
(``parallel_config=ParallelConfig(...)``) are set one by one under their vLLM names.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, Callable

from cpbook.core.errors import RuleError

__all__ = ["DEMOS", "get_demo", "demo_kwargs", "demo_params", "parse_params"]

#: name -> (chapter, "module:function")
DEMOS: dict[str, tuple[int, str]] = {
    "merge": (1, "cpbook.demos.ch01_merge:merge_rank"),
    "kvcache": (2, "cpbook.demos.ch02_kvcache:kvcache_rank"),
    "dcp-gqa": (3, "cpbook.demos.ch03_decode:gqa_decode_rank"),
    "dcp-mla": (3, "cpbook.demos.ch03_decode:mla_decode_rank"),
    "dcp-mla-ctx": (3, "cpbook.demos.ch03_decode:mla_context_rank"),
    "pcp": (4, "cpbook.demos.ch04_pcp:pcp_prefill_rank"),
    "chunked": (5, "cpbook.demos.ch05_chunked:chunked_prefill_rank"),
    "ring": (5, "cpbook.demos.ch05_chunked:ring_prefill_rank"),
    "tpa": (6, "cpbook.demos.ch06_tpa:tpa_rank"),
    "migrate": (7, "cpbook.demos.ch07_migration:migration_rank"),
    "engine": (9, "cpbook.engine.engine:serve_rank"),
    "spec-verify": (10, "cpbook.demos.ch10_spec:spec_verify_rank"),
    "draft-placement": (10, "cpbook.demos.ch10_spec:draft_placement_rank"),
}


def get_demo(name: str) -> Callable[..., Any]:
    """The per-rank function registered under ``name``."""
    if name not in DEMOS:
        raise RuleError("demo-name", f"one of {sorted(DEMOS)}", name=name)
    mod, fn = DEMOS[name][1].split(":")
    return getattr(importlib.import_module(mod), fn)


def _groups(fn: Callable[..., Any]) -> dict[str, Any]:
    """``name -> default`` of ``fn``'s keyword parameters whose default is a config object (a
    dataclass instance such as :class:`~cpbook.core.config.ParallelConfig`)."""
    return {
        p.name: p.default
        for p in inspect.signature(fn).parameters.values()
        if p.kind is p.KEYWORD_ONLY
        and dataclasses.is_dataclass(p.default)
        and not isinstance(p.default, type)
    }


def demo_params(fn: Callable[..., Any]) -> dict[str, tuple[Any, Any]]:
    """``name -> (type, default)`` of the flat keyword parameters of a per-rank function.

    A parameter whose default is a config object (``parallel_config=ParallelConfig(...)``)
    stands for its fields: the vLLM names (``tensor_parallel_size`` …) with the default's values,
    so the command line sets them one by one.
    """
    hints, groups, out = typing.get_type_hints(fn), _groups(fn), {}
    for p in inspect.signature(fn).parameters.values():
        if p.kind is not p.KEYWORD_ONLY:
            continue
        if p.name not in groups:
            out[p.name] = (hints.get(p.name, Any), p.default)
            continue
        cfg = groups[p.name]
        field_hints = typing.get_type_hints(type(cfg))
        for f in dataclasses.fields(cfg):
            if f.init and f.name not in out:  # a field two configs share is listed once
                out[f.name] = (field_hints.get(f.name, Any), getattr(cfg, f.name))
    return out


def demo_kwargs(fn: Callable[..., Any], flat: Mapping[str, Any]) -> dict[str, Any]:
    """``fn``'s keyword arguments from flat ones (:func:`demo_params`' names): the fields of a
    config object are collected into a copy of its default (validated as it is built), the rest
    pass through; a field two configs share sets both.  ``demo_kwargs(gqa_decode_rank,
    {"dcp_comm_backend": "a2a", "seq_lens": (9,)})`` gives ``{"parallel_config":
    replace(GQA_CONFIG, dcp_comm_backend="a2a"), "seq_lens": (9,)}``."""
    groups, out, used = _groups(fn), {}, set()
    for name, cfg in groups.items():
        names = {f.name for f in dataclasses.fields(cfg) if f.init}
        mine = {k: v for k, v in flat.items() if k in names}  # a shared field sets every config
        used |= set(mine)
        if name in flat:
            out[name] = flat[name]
        if mine:
            out[name] = dataclasses.replace(out.get(name, cfg), **mine)
    rest = {k: v for k, v in flat.items() if k not in used and k not in groups}
    return {**out, **rest}


def _optional(tp: Any) -> Any:
    """``X`` for ``X | None`` (``Optional[X]``), else ``None``."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return rest[0] if len(rest) == 1 else None
    return None


def _type_name(tp: Any) -> str:
    if _optional(tp) is not None:
        return f"{_type_name(_optional(tp))} | None"
    origin = typing.get_origin(tp)
    if origin is None:
        return getattr(tp, "__name__", str(tp))
    args = ", ".join(_type_name(a) for a in typing.get_args(tp) if a is not Ellipsis)
    return f"{getattr(origin, '__name__', str(origin))}[{args}]"


def _convert(name: str, text: str, tp: Any) -> Any:
    """``text`` as a value of type ``tp`` (int, float, bool, str or a sequence of ints)."""

    def bad(why: str) -> RuleError:
        return RuleError(f"param-{name}", why, **{name: text})

    if _optional(tp) is not None:
        return None if text == "None" else _convert(name, text, _optional(tp))
    if tp is str:
        return text
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        raise bad(f"a {_type_name(tp)} literal") from None
    if tp is bool:
        if not isinstance(value, bool):
            raise bad("True or False")
        return value
    if tp is int or tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float) if tp is float else int):
            raise bad(f"a {tp.__name__}")
        if name != "seed" and value < 0:
            raise bad("a value >= 0")
        return tp(value)
    if typing.get_origin(tp) in (Sequence, tuple, list):
        items = value if isinstance(value, (tuple, list)) else None
        if items is None or any(isinstance(x, bool) or not isinstance(x, int) for x in items):
            raise bad("a sequence of integers, e.g. 8,16 or (8, 16)")
        if any(x < 0 for x in items):
            raise bad("integers >= 0")
        return tuple(items)
    return value


def parse_params(fn: Callable[..., Any], pairs: Sequence[str]) -> dict[str, Any]:
    """Parse ``KEY=VALUE`` strings into ``fn``'s keyword arguments, checked against its signature.

    Raises :class:`~cpbook.core.errors.RuleError` naming the parameter for an unknown name, a
    missing ``=`` or a value of the wrong type or range, and the config's rule for an invalid
    config object.  Sequences may be written ``8,16`` or ``(8, 16)``.  Config fields are
    collected into their config object (:func:`demo_kwargs`).
    """
    params, out = demo_params(fn), {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep:
            raise RuleError("param-syntax", "KEY=VALUE", param=pair)
        if key not in params:
            raise RuleError("param-name", f"one of {sorted(params)}", name=key)
        out[key] = _convert(key, text, params[key][0])
    return demo_kwargs(fn, out)


def describe(name: str) -> str:
    """The parameter list of demo ``name``, one line each (for ``demo NAME --help``)."""
    fn = get_demo(name)
    chapter, path = DEMOS[name]
    doc = (fn.__doc__ or "").strip().splitlines()[0]
    lines = [f"{name} (chapter {chapter}, {path}): {doc}", "", "parameters (--param KEY=VALUE):"]
    for key, (tp, default) in demo_params(fn).items():
        lines.append(f"  {key:32s} {_type_name(tp):14s} default {default!r}")
    return "\n".join(lines)
