"""Imports run downward: each module imports only from its own layer or the ones below it.

Layers are numbered in docs/design.md ("Layers"); a module says its layer in the first lines of
its docstring, "(layer N)", or inherits its package's. Lazy imports inside functions count too.
This reads the source (no import), so it runs in milliseconds.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "fullshard"
TOP = 11  # the package's __init__: the public surface, which only the applications may import


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _declared(path: Path) -> int | None:
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    head = " ".join(doc.splitlines()[:3])
    m = re.search(r"\(layers? (\d+)", head)
    return int(m.group(1)) if m else None


def _layers() -> dict[str, int]:
    out: dict[str, int] = {"fullshard": TOP}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = _module_name(path)
        if name == "fullshard":
            continue
        layer = _declared(path)
        if layer is None:  # the package's layer (its __init__ docstring)
            layer = _declared(path.parent / "__init__.py")
        assert layer is not None, f"{name} declares no layer and neither does its package"
        out[name] = layer
    return out


def _imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "fullshard":  # from fullshard import x: x may be a subpackage
                found += [(node.lineno, f"fullshard.{a.name}") for a in node.names]
            else:
                found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
    return [(line, m) for line, m in found if m == "fullshard" or m.startswith("fullshard.")]


def _layer_of(target: str, layers: dict[str, int]) -> int:
    while target not in layers:  # a name imported from a module: drop the last part
        target = target.rsplit(".", 1)[0]
    return layers[target]


def test_every_import_goes_to_the_same_layer_or_below() -> None:
    layers = _layers()
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = _module_name(path)
        if name == "fullshard":
            continue
        for line, target in _imports(path):
            if _layer_of(target, layers) > layers[name]:
                wrong.append(
                    f"{name} (layer {layers[name]}) line {line} imports {target} "
                    f"(layer {_layer_of(target, layers)})"
                )
    assert not wrong, "imports that run upward:\n" + "\n".join(wrong)


def test_nothing_below_the_applications_imports_them() -> None:
    layers = _layers()
    library = [n for n, layer in layers.items() if layer < 11]
    assert "fullshard.plan.model" in library and "fullshard.observe.memory" in library
    for name in library:
        path = SRC / (name.replace(".", "/") + ".py")
        if not path.exists():
            path = SRC / name.replace(".", "/") / "__init__.py"
        for line, target in _imports(path):
            assert not target.startswith("fullshard.app"), f"{name}:{line} imports {target}"
        assert "argparse" not in path.read_text(encoding="utf-8"), f"{name} holds a CLI"


def test_the_layer_checker_sees_an_upward_import(tmp_path: Path) -> None:
    # the checker itself: an upward import in a synthetic module is reported
    mod = tmp_path / "m.py"
    mod.write_text('"""x (layer 3)."""\ndef f():\n    from fullshard.app.cli import main\n')
    assert _declared(mod) == 3
    assert _imports(mod) == [(3, "fullshard.app.cli")]
    assert _layer_of("fullshard.app.cli.main", _layers()) == 11
