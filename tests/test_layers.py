"""The package's layers: every ``cpbook`` import goes down the table in ``cpbook/__init__.py``
(or stays inside its sub-package), sits at module top, and the table refines DESIGN.md's."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import cpbook

PKG = Path(cpbook.__file__).resolve().parent
DESIGN = PKG.parents[1] / "shared" / "DESIGN.md"


def layers() -> dict[str, int]:
    """``top-level name -> row`` from the numbered list in ``cpbook/__init__.py``'s docstring."""
    rows = re.findall(r"^(\d+)\. ((?:``\w+``(?:, )?)+) —", cpbook.__doc__, re.M)
    return {name: int(n) for n, names in rows for name in re.findall(r"``(\w+)``", names)}


def modules() -> dict[str, Path]:
    out = {}
    for p in sorted(PKG.rglob("*.py")):
        parts = p.relative_to(PKG.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def cpbook_imports(mod: str, path: Path) -> list[tuple[str, int, bool]]:
    """``(imported module, line, at module top)`` for every import of a ``cpbook`` module."""
    tree = ast.parse(path.read_text())
    pkg = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
    top = {id(n) for n in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = pkg[: len(pkg) - node.level + 1] if node.level else []
            name = ".".join(base + ([node.module] if node.module else []))
            targets = [name] if name != "cpbook" else [f"cpbook.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        for t in targets:
            if t == "cpbook" or t.startswith("cpbook."):
                found.append((t, node.lineno, id(node) in top))
    return found


def row_of(mod: str, table: dict[str, int]) -> tuple[str, int]:
    top = mod.split(".")[1] if "." in mod else ""
    if top not in table:
        raise AssertionError(f"{mod}: sub-package {top!r} is not in cpbook/__init__.py's table")
    return top, table[top]


def test_table_covers_every_subpackage():
    table = layers()
    tops = {
        p.stem if p.is_file() else p.name
        for p in PKG.iterdir()
        if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").exists()
    }
    assert tops == set(table), f"table {sorted(table)} vs package {sorted(tops)}"


@pytest.mark.parametrize("mod", sorted(m for m in modules() if m != "cpbook"))
def test_imports_go_down_the_layers(mod):
    table, path = layers(), modules()[mod]
    top, row = row_of(mod, table)
    bad = []
    for target, line, at_top in cpbook_imports(mod, path):
        if not at_top:
            bad.append(f"line {line}: function-local import of {target}")
            continue
        if target == "cpbook":
            continue
        ttop, trow = row_of(target, table)
        if ttop != top and trow >= row:
            bad.append(f"line {line}: {target} is row {trow}, {mod} is row {row}")
    assert not bad, f"{mod}: " + "; ".join(bad)


@pytest.mark.skipif(not DESIGN.exists(), reason="../shared/DESIGN.md is not beside the repo")
def test_table_refines_design_md():
    """Each row of DESIGN.md's layer table keeps its order here (rows may split, never swap)."""
    design = {}
    for n, cell in re.findall(r"^\| (\d+) \| ([^|]+) \|", DESIGN.read_text(), re.M):
        for name in re.findall(r"`(\w+)/`", cell):
            design[name] = int(n)
    table = layers()
    shared = sorted(set(design) & set(table))
    assert len(shared) >= 8, shared
    for a in shared:
        for b in shared:
            if design[a] < design[b]:
                assert table[a] < table[b], f"DESIGN.md puts {a} below {b}; the table does not"


def test_docstrings_state_their_row():
    """A sub-package (or top-level module) whose docstring says "Layer N" is row N of the table."""
    table, bad = layers(), []
    for name, row in sorted(table.items()):
        path = PKG / name / "__init__.py" if (PKG / name).is_dir() else PKG / f"{name}.py"
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        stated = [int(n) for n in re.findall(r"\bLayer (\d+)\b", doc)]
        bad += [f"{name}: says Layer {n}, is row {row}" for n in stated if n != row]
    assert not bad, "; ".join(bad)
