"""No module reads another package's private attributes, read from the source with ``ast``.

A name with one leading underscore (``_units``, ``_fullshard_state``) is its package's own: a
module of another package that reads it depends on internals its owner may change at any time,
and the dependency is invisible in any interface. The packages are fullshard's subpackages
(``engine``, ``comm``, ``elastic``...), the top-level modules each on their own, and the
application's folders (``app.train``, ``app.launch``...). What counts:

- ``x._name`` (an attribute read or write) in package ``Q`` where ``_name`` is defined
  (``def``, ``class``, an assignment ``self._name = ...`` or ``_name = ...``) only in other
  packages of fullshard; a private name fullshard never defines (torch's) is not ours to judge;
- the same read spelled ``getattr(x, "_name", ...)`` (or ``hasattr``, ``setattr``, ``delattr``):
  the string hides it from the attribute check, not from the dependency;
- ``from fullshard.p.m import _name`` from another package.

Like ``test_fast_imports.py``, it reads the source (no import), in milliseconds.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = SRC / "fullshard"


def package_of(path: Path) -> str:
    """``fullshard.engine`` for engine/unit.py, ``fullshard.app.train`` for app/train/state.py,
    ``fullshard.policies`` for policies.py."""
    parts = path.relative_to(SRC).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    depth = 3 if parts[:2] == ("fullshard", "app") and len(parts) > 3 else 2
    return ".".join(parts[:depth])


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _defined(tree: ast.AST) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        targets = node.targets if isinstance(node, ast.Assign) else []
        if isinstance(node, ast.AnnAssign):
            targets = [node.target]
        for t in targets:
            if isinstance(t, ast.Attribute):
                names.add(t.attr)
            elif isinstance(t, ast.Name):
                names.add(t.id)
    return {n for n in names if _private(n)}


_BY_NAME = {"getattr", "hasattr", "setattr", "delattr"}


def _attr_by_name(node: ast.AST) -> str | None:
    """``_name`` of ``getattr(x, "_name", ...)`` and its relatives; else ``None``."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
        return None
    if node.func.id not in _BY_NAME or len(node.args) < 2:
        return None
    name = node.args[1]
    if isinstance(name, ast.Constant) and isinstance(name.value, str) and _private(name.value):
        return name.value
    return None


def violations(root: Path = PACKAGE) -> list[str]:
    trees = {p: ast.parse(p.read_text(encoding="utf-8")) for p in sorted(root.rglob("*.py"))}
    owners: dict[str, set[str]] = {}
    for path, tree in trees.items():
        for name in _defined(tree):
            owners.setdefault(name, set()).add(package_of(path))
    found = []
    for path, tree in trees.items():
        mine = package_of(path)
        for node in ast.walk(tree):
            names: list[tuple[int, str]] = []
            if isinstance(node, ast.Attribute) and _private(node.attr):
                names.append((node.lineno, node.attr))
            elif (by_name := _attr_by_name(node)) is not None:
                names.append((node.lineno, by_name))
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fullshard"):
                module = node.module or ""
                if not module.startswith(mine):  # a private module of its own package is fine
                    names += [(node.lineno, a.name) for a in node.names if _private(a.name)]
            for line, name in names:
                theirs = owners.get(name, set())
                if theirs and mine not in theirs:
                    where = path.relative_to(SRC)
                    found.append(f"{where}:{line} reads {name} of {', '.join(sorted(theirs))}")
    return found


def test_no_module_reads_another_packages_private_attributes() -> None:
    found = violations()
    assert not found, "private attributes read across packages:\n" + "\n".join(found)


def test_the_check_finds_a_private_read_across_packages(tmp_path: Path) -> None:
    """The check itself: an engine-private method called from another package is found; the
    same call inside the engine is not."""
    pkg = tmp_path / "fullshard"
    (pkg / "engine").mkdir(parents=True)
    (pkg / "engine" / "units.py").write_text("class M:\n    def _units(self):\n        pass\n")
    (pkg / "engine" / "hooks.py").write_text("def f(m):\n    return m._units()\n")
    (pkg / "deterministic.py").write_text(
        "def enable(m):\n    return m._units()\n\n\ndef unit(p):\n"
        "    return getattr(p, '_units', None)\n"
    )
    global SRC
    saved, SRC = SRC, tmp_path
    try:
        found = violations(pkg)
    finally:
        SRC = saved
    assert sorted(found) == [
        "fullshard/deterministic.py:2 reads _units of fullshard.engine",
        "fullshard/deterministic.py:6 reads _units of fullshard.engine",
    ]
