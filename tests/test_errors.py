"""One error type: every ``[rule]`` error of the package is a :class:`RuleError` carrying
``.rule``; none is a bare ``ValueError(f"[…")``."""

from __future__ import annotations

import ast
import pickle
from pathlib import Path

import pytest

import cpbook
from cpbook.core.config import ConfigError, ParallelConfig
from cpbook.core.errors import RuleError
from cpbook.kv.manager import AllocationError

PKG = Path(cpbook.__file__).resolve().parent


BUILTIN_ERRORS = {"ValueError", "RuntimeError", "TypeError", "KeyError", "AssertionError"}


def _starts_with_rule(arg: ast.expr) -> bool:
    """A message that opens with ``[`` (a rule name), plain or f-string, on any number of lines."""
    if isinstance(arg, ast.JoinedStr) and arg.values:
        arg = arg.values[0]
    return isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value[:1] == "["


def bare_rule_errors(path: Path) -> list[int]:
    """Lines where a built-in error is built with a ``[rule]`` message instead of RuleError."""
    return [
        node.lineno
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in BUILTIN_ERRORS
        and node.args
        and _starts_with_rule(node.args[0])
    ]


def test_no_bare_rule_error_in_the_package():
    found = [
        f"{p.relative_to(PKG)}:{line}"
        for p in sorted(PKG.rglob("*.py"))
        for line in bare_rule_errors(p)
    ]
    assert not found, "raise these through RuleError:\n" + "\n".join(found)


def test_the_check_sees_multi_line_messages(tmp_path):
    src = tmp_path / "m.py"
    src.write_text('raise ValueError(\n    f"[x] requires {1}"\n)\nraise RuleError("x", "y")\n')
    assert bare_rule_errors(src) == [1]


def test_subclasses_carry_the_rule():
    assert issubclass(ConfigError, RuleError) and issubclass(AllocationError, RuleError)
    assert issubclass(RuleError, ValueError) and issubclass(AllocationError, RuntimeError)
    with pytest.raises(RuleError) as e:
        ParallelConfig(tensor_parallel_size=4, decode_context_parallel_size=3)
    assert e.value.rule == "tp-divisible-by-dcp"
    assert str(e.value).startswith("[tp-divisible-by-dcp] requires ")


def test_rule_error_survives_pickling():
    err = AllocationError("blocks-available", "2 free block ids", free=1)
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is AllocationError and back.rule == err.rule and str(back) == str(err)
