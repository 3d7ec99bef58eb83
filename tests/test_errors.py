"""One error type: every ``[rule]`` error of the package is a :class:`RuleError` carrying
``.rule``; none is a bare ``ValueError(f"[…")``."""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import pytest

import cpbook
from cpbook.core.config import ConfigError, ParallelConfig
from cpbook.core.errors import RuleError
from cpbook.kv.manager import AllocationError

PKG = Path(cpbook.__file__).resolve().parent


def test_no_bare_rule_error_in_the_package():
    pattern = re.compile(r"""(ValueError|RuntimeError|TypeError)\(\s*f?["']\[""")
    found = [
        f"{p.relative_to(PKG)}:{i}: {line.strip()}"
        for p in sorted(PKG.rglob("*.py"))
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not found, "raise these through RuleError:\n" + "\n".join(found)


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
