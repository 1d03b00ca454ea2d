"""No import cycles in ``src/fullshard``: the whole import graph, read from the source with ``ast``.

A cycle makes the import order matter (the second module of the loop sees the first half
initialised: an ``ImportError`` or a missing name that depends on which module a program imports
first), and it ties modules together so that neither can be read, tested or moved alone. Layers
(``tests/test_layers.py``) forbid upward imports between layers; this forbids loops inside one.

What counts as an edge ``a -> b`` (``b`` a module of the package, ``a`` the importing one):

- ``import fullshard.x.y`` and ``from fullshard.x.y import name``: ``b = fullshard.x.y``, at module
  level *and* inside functions (a lazy import still runs; deferring it hides the loop, it does
  not remove it);
- ``from fullshard.x import y`` where ``fullshard.x.y`` is a module: ``b = fullshard.x.y``
  (else ``fullshard.x``, whose ``__init__`` must provide ``y``);
- relative imports, resolved against the importing module's package.

Not counted: the parent packages an import initialises on the way (``import fullshard.a.b`` runs
``fullshard/__init__`` and ``fullshard/a/__init__`` first, always before ``b``, so they order
nothing: counting them would put every module in one loop through the top ``__init__``); imports
under ``if TYPE_CHECKING:`` (never run: annotations only); ``importlib.import_module`` strings.
It reads the source (no import), so it runs in milliseconds.
"""

from __future__ import annotations

import ast
from collections import deque
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = "fullshard"

Graph = dict[str, dict[str, int]]  # module -> {imported module: first line}


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    """``if TYPE_CHECKING:`` or ``if typing.TYPE_CHECKING:``."""
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    return isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


def _import_nodes(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement, at any depth, except those in an ``if TYPE_CHECKING:`` body."""
    found: list[ast.Import | ast.ImportFrom] = []
    todo: list[ast.AST] = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            todo.extend(node.orelse)  # the else branch does run
            continue
        todo.extend(ast.iter_child_nodes(node))
    return found


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module name ``node`` imports from (relative levels resolved)."""
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _known(name: str, modules: set[str]) -> str | None:
    """``name`` or the nearest enclosing module that exists (``a.b.func`` -> ``a.b``)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def build_graph(root: Path, package: str) -> Graph:
    """The import graph of ``root/package`` (see the module doc for what is an edge)."""
    paths = {_module_name(p, root): p for p in sorted((root / package).rglob("*.py"))}
    modules = set(paths)
    graph: Graph = {m: {} for m in modules}
    for module, path in paths.items():
        is_package = path.name == "__init__.py"
        for node in _import_nodes(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                source = _resolve(module, is_package, node)
                # from X import Y: the submodule X.Y when there is one, else X itself
                targets = [
                    f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source
                    for a in node.names
                ]
            for target in targets:
                known = _known(target, modules)
                if known is not None:
                    graph[module].setdefault(known, node.lineno)
    return graph


def cycles(graph: Graph) -> list[list[str]]:
    """The strongly connected components with more than one module, and self-importing
    modules, each sorted; Tarjan's algorithm, iterative (no recursion limit to meet)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph[node]:
                    found.append(sorted(component))
    return sorted(found)


def one_loop(graph: Graph, component: list[str]) -> str:
    """A shortest loop through the component's first module, with each import's line."""
    first, members = component[0], set(component)
    came: dict[str, str] = {}
    queue = deque([first])
    while queue:
        node = queue.popleft()
        for nxt in sorted(graph[node]):
            if nxt not in members:
                continue
            if nxt == first:
                path = [node]
                while path[-1] != first:
                    path.append(came[path[-1]])
                path.reverse()
                hops = zip(path, [*path[1:], first], strict=True)
                return " -> ".join(f"{a} (line {graph[a][b]})" for a, b in hops) + f" -> {first}"
            if nxt not in came:
                came[nxt] = node
                queue.append(nxt)
    raise AssertionError(f"{component} is no cycle")


def test_the_package_has_no_import_cycles() -> None:
    graph = build_graph(SRC, PACKAGE)
    # the reader sees the package: a floor, so that an empty graph cannot pass
    assert len(graph) > 50 and sum(map(len, graph.values())) > 100
    found = cycles(graph)
    report = [f"{', '.join(c)}\n    e.g. {one_loop(graph, c)}" for c in found]
    assert not found, f"{len(found)} import cycle(s) in src/fullshard:\n" + "\n".join(report)


def _package(root: Path, files: dict[str, str]) -> Graph:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return build_graph(root, "pkg")


def test_the_finder_sees_planted_cycles(tmp_path: Path) -> None:
    graph = _package(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "from pkg import b\n",  # b is a submodule: an edge to pkg.b
            "pkg/b.py": "def f():\n    from . import c\n",  # lazy and relative
            "pkg/c.py": "import pkg.a.thing\n",  # a name inside a module: the module
            "pkg/sub/__init__.py": "from .. import d\n",
            "pkg/d.py": "from .sub import x\n",  # x is no module: the package pkg.sub
            "pkg/selfish.py": "def g():\n    import pkg.selfish\n",
            "pkg/typed.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
            "    from pkg import e\nelse:\n    from pkg import a\n",
            "pkg/e.py": "import pkg.typed\n",  # a cycle only through TYPE_CHECKING: none
        },
    )
    assert graph["pkg.a"] == {"pkg.b": 1} and graph["pkg.b"] == {"pkg.c": 2}
    assert graph["pkg.typed"] == {"pkg.a": 5}  # the TYPE_CHECKING import is not an edge
    found = cycles(graph)
    assert found == [["pkg.a", "pkg.b", "pkg.c"], ["pkg.d", "pkg.sub"], ["pkg.selfish"]]
    assert one_loop(graph, found[0]) == (
        "pkg.a (line 1) -> pkg.b (line 2) -> pkg.c (line 1) -> pkg.a"
    )
    assert one_loop(graph, found[2]) == "pkg.selfish (line 2) -> pkg.selfish"


def test_the_top_package_closes_a_loop_and_a_chain_does_not(tmp_path: Path) -> None:
    graph = _package(
        tmp_path,
        {
            "pkg/__init__.py": "from pkg.a import f\n",  # the top package's re-export
            "pkg/a.py": "from pkg.b import g\nfrom pkg import b\n",
            "pkg/b.py": "import os\nimport pkg\n",  # the top package: an edge, and a loop
        },
    )
    assert graph["pkg.b"] == {"pkg": 2}
    assert cycles(graph) == [["pkg", "pkg.a", "pkg.b"]]
    graph["pkg.b"].clear()
    assert cycles(graph) == []
