"""Imports run downward: each module imports only from its own layer or the ones below it, and
inside the application (layer 11) each part only from the parts below it.

Layers are numbered in docs/design.md ("Layers"); a module says its layer in the first lines of
its docstring, "(layer N)", or inherits its package's. The application's parts (``errors``,
``config``, ``train/``, ``commands/``, ``cli``, ...) are ordered in ``fullshard/app/__init__.py``'s
docstring, ground first ("Inside the application" in docs/design.md): an import of a later part
runs upward. Lazy imports inside functions and ``TYPE_CHECKING`` imports count too. This reads
the source (no import), so it runs in milliseconds.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

SRC = Path(__file__).resolve().parents[2] / "src"
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


APP = PACKAGE / "app"


def app_order(init: Path = APP / "__init__.py") -> list[str]:
    """The application's parts, ground first, as its ``__init__`` docstring lists them: the
    ````names```` of the paragraph after "ground first"."""
    doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))) or ""
    _, found, rest = doc.partition("ground first")
    assert found, f"{init} lists no order of its parts ('ground first')"
    return re.findall(r"``(\w+)``", rest.split("\n\n")[0])


def _part(module: str) -> str | None:
    """``train`` for ``fullshard.app.train.trainer``, ``cli`` for ``fullshard.app.cli``."""
    parts = module.split(".")
    return parts[2] if parts[:2] == ["fullshard", "app"] and len(parts) > 2 else None


def app_upward_imports(root: Path = APP) -> list[str]:
    """Each import of a later part of the application from an earlier one."""
    order = app_order(root / "__init__.py")
    rank = {name: i for i, name in enumerate(order)}
    modules = {p.stem for p in root.glob("*.py") if p.stem != "__init__"}
    parts = modules | {d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith("_")}
    unlisted = sorted(parts - set(rank))
    assert not unlisted, f"parts of the application in no order ({root}/__init__.py): {unlisted}"
    wrong = []
    for path in sorted(root.rglob("*.py")):
        mine = _part("fullshard.app." + ".".join(path.relative_to(root).with_suffix("").parts))
        if mine is None or mine == "__init__":
            continue
        for line, target in _imports(path):
            theirs = _part(target)
            if theirs in rank and rank[theirs] > rank[mine]:
                where = path.relative_to(root.parent.parent)
                wrong.append(f"{where}:{line} ({mine}) imports {target} ({theirs}, above it)")
    return wrong


def test_the_application_parts_import_downward() -> None:
    order = app_order()
    assert order[0] == "errors" and order[-1] == "cli" and "train" in order
    wrong = app_upward_imports()
    assert not wrong, "imports that run upward inside the application:\n" + "\n".join(wrong)


def test_the_app_order_checker_sees_an_upward_import(tmp_path: Path) -> None:
    app = tmp_path / "fullshard" / "app"
    (app / "train").mkdir(parents=True)
    (app / "launch").mkdir()
    (app / "__init__.py").write_text(
        '"""x.\n\nIts parts, ground first:\n``launch``, ``train``.\n"""\n'
    )
    (app / "train" / "trainer.py").write_text("from fullshard.app.launch.local import f\n")
    (app / "launch" / "local.py").write_text(
        "def f():\n    from fullshard.app.train import faults\n"
    )
    assert app_order(app / "__init__.py") == ["launch", "train"]
    assert app_upward_imports(app) == [
        "fullshard/app/launch/local.py:2 (launch) imports fullshard.app.train (train, above it)"
    ]


def test_the_layer_checker_sees_an_upward_import(tmp_path: Path) -> None:
    # the checker itself: an upward import in a synthetic module is reported
    mod = tmp_path / "m.py"
    mod.write_text('"""x (layer 3)."""\ndef f():\n    from fullshard.app.cli import main\n')
    assert _declared(mod) == 3
    assert _imports(mod) == [(3, "fullshard.app.cli")]
    assert _layer_of("fullshard.app.cli.main", _layers()) == 11
