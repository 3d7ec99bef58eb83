"""The one error type every rule of the package raises.

A rule is a named condition (``"tp-divisible-by-dcp"``, ``"request-fits-cache"`` …).  Breaking
one raises :class:`RuleError` (a ``ValueError``) whose ``rule`` a caller can test and whose
message reads ``[rule] requires <condition>; got name=value, …`` — one line, the rule and the
values that broke it.  :class:`~cpbook.core.config.ConfigError` (a bad layout) and
:class:`~cpbook.kv.manager.AllocationError` (a cache out of block ids) are its subclasses.
"""

from __future__ import annotations

__all__ = ["RuleError"]


class RuleError(ValueError):
    """A named rule is violated.  ``rule`` names it, ``condition`` says what it requires and
    ``values`` holds the values that violate it (shown in the message as ``name=repr``)."""

    def __init__(self, rule: str, condition: str, **values: object) -> None:
        self.rule, self.condition, self.values = rule, condition, values
        shown = ", ".join(f"{k}={v!r}" for k, v in values.items())
        super().__init__(f"[{rule}] requires {condition}; got {shown}")

    def __reduce__(self):
        # a rank's error crosses a process boundary (torchrun) intact, rule and values included
        return (_rebuild, (type(self), self.rule, self.condition, self.values))


def _rebuild(cls: type, rule: str, condition: str, values: dict) -> RuleError:
    return cls(rule, condition, **values)
