"""The parameter rule: no public function or method of the package takes more than eight named
parameters, unless its docstring says why.

Public: a name without a leading ``_`` in a module whose dotted path has no ``_``-prefixed
component (``cpbook.__main__`` and ``cpbook.demos._x`` are private; a package's
``__init__.py`` is the package), at module level or in a public class (nested public classes
included); a public class's own ``__init__`` counts.  Named parameters: positional-only,
positional and keyword-only, without a method's ``self`` / ``cls``; ``*args`` and ``**kwargs``
are not counted.  A dataclass's generated ``__init__`` is not in the source and is not checked:
the config objects are how a signature stays short.  The stated reason is a docstring line that
starts ``More than eight parameters:`` and goes on to say why.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator

import cpbook

PKG = Path(cpbook.__file__).resolve().parent
LIMIT = 8
REASON = "More than eight parameters:"

Function = ast.FunctionDef | ast.AsyncFunctionDef


def public_modules() -> Iterator[tuple[str, Path]]:
    """``(dotted module, path)`` for every module whose dotted path has no ``_`` component."""
    for path in sorted(PKG.rglob("*.py")):
        parts = path.relative_to(PKG.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if not any(p.startswith("_") for p in parts):
            yield ".".join(parts), path


def named_parameters(fn: Function, method: bool) -> int:
    """Positional-only, positional and keyword-only parameters; a method's leading ``self`` or
    ``cls`` (not a staticmethod's first parameter) is not counted."""
    args = fn.args
    positional = [*args.posonlyargs, *args.args]
    static = any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in fn.decorator_list)
    if method and not static and positional and positional[0].arg in ("self", "cls"):
        positional = positional[1:]
    return len(positional) + len(args.kwonlyargs)


def public_functions(body: list[ast.stmt], prefix: str = "") -> Iterator[tuple[str, Function]]:
    """``(qualified name, node)`` of the public functions and methods in ``body``: module-level
    functions, and the methods (``__init__`` included) of public classes, recursively."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            method = bool(prefix)
            if not node.name.startswith("_") or (method and node.name == "__init__"):
                yield prefix + node.name, node
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            yield from public_functions(node.body, f"{prefix}{node.name}.")


def states_a_reason(fn: Function) -> bool:
    """Its docstring has a line ``More than eight parameters: <reason>``."""
    doc = ast.get_docstring(fn) or ""
    return any(
        line.strip().startswith(REASON) and line.strip()[len(REASON) :].strip()
        for line in doc.splitlines()
    )


def offenders() -> list[str]:
    """``module:qualname (N parameters)`` for every public function over the limit without a
    stated reason."""
    found = []
    for mod, path in public_modules():
        for name, fn in public_functions(ast.parse(path.read_text()).body):
            n = named_parameters(fn, method="." in name)
            if n > LIMIT and not states_a_reason(fn):
                found.append(f"{mod}:{name} ({n} parameters)")
    return found


def test_no_public_function_takes_more_than_eight_parameters_without_a_reason():
    bad = offenders()
    assert not bad, (
        f"{len(bad)} public functions take more than {LIMIT} named parameters; pass a config "
        f"object, or give the reason in a docstring line '{REASON} …':\n" + "\n".join(bad)
    )


# ----------------------------------------------------------------------- the rule's own parts
SAMPLE = '''
def nine(a, b, c, d, e, f, g, h, i): ...
def eight(a, b, c, d, e, f, g, h, *args, **kwargs): ...
def keywords(a, /, b, *, c, d, e, f, g, h, i): ...
def stated(a, b, c, d, e, f, g, h, i):
    """Nine.

    More than eight parameters: the mirror of vLLM's signature, kept for comparison.
    """
def empty_reason(a, b, c, d, e, f, g, h, i):
    """More than eight parameters:"""
def _private(a, b, c, d, e, f, g, h, i): ...
class Public:
    def __init__(self, a, b, c, d, e, f, g, h, i): ...
    def method(self, a, b, c, d, e, f, g, h): ...
    @classmethod
    def build(cls, a, b, c, d, e, f, g, h, i): ...
    @staticmethod
    def static(self, a, b, c, d, e, f, g, h): ...
    def _helper(self, a, b, c, d, e, f, g, h, i): ...
    class Inner:
        def deep(self, a, b, c, d, e, f, g, h, i): ...
class _Private:
    def __init__(self, a, b, c, d, e, f, g, h, i): ...
'''


def test_the_rule_counts_what_it_says():
    found = {}
    for name, fn in public_functions(ast.parse(SAMPLE).body):
        n = named_parameters(fn, method="." in name)
        if n > LIMIT and not states_a_reason(fn):
            found[name] = n
    assert found == {
        "nine": 9,
        "keywords": 9,
        "empty_reason": 9,
        "Public.__init__": 9,
        "Public.build": 9,
        "Public.static": 9,
        "Public.Inner.deep": 9,
    }


def test_private_modules_are_skipped():
    mods = dict(public_modules())
    assert "cpbook" in mods and "cpbook.core.config" in mods
    assert not any(part.startswith("_") for m in mods for part in m.split("."))
