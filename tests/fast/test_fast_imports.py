"""No import cycles in ``src/fullshard`` at any depth: the whole import graph, read from the
source with ``ast``, between modules and between the parts of every package.

A cycle makes the import order matter (the second module of the loop sees the first half
initialised: an ``ImportError`` or a missing name that depends on which module a program imports
first), and it ties modules together so that neither can be read, tested or moved alone.

No loop at any depth is also no arrow that runs back up at any depth: with none, every package's
parts stand on floors, each above all it imports (its longest chain down), and every import runs
down a floor or more; one loop, and one of its arrows must climb. Where the design orders the
floors itself, ``tests/fast/test_fast_layers.py`` holds the code to that order: the layers of
docs/design.md between packages, and the application's parts in the order its ``__init__``
declares.

At every depth: inside each package, its parts (each module, and each subpackage with all that
lies under it) must not import each other in a loop either. Two subpackages whose modules import
each other (once ``app/launch/elastic.py`` -> ``app/train/faults.py`` while
``app/train/trainer.py`` -> ``app/launch/local.py``) are one loop at the package's scale, though no module loop exists:
neither subpackage can be read or moved without the other.

What counts as an edge ``a -> b`` (``b`` a module of the package, ``a`` the importing one):

- ``import fullshard.x.y`` and ``from fullshard.x.y import name``: ``b = fullshard.x.y``, at module
  level *and* inside functions (a lazy import still runs; deferring it hides the loop, it does
  not remove it);
- ``from fullshard.x import y`` where ``fullshard.x.y`` is a module: ``b = fullshard.x.y``
  (else ``fullshard.x``, whose ``__init__`` must provide ``y``);
- relative imports, resolved against the importing module's package.

- imports under ``if TYPE_CHECKING:``: never run, but an annotation ties the two modules for
  every reader and type checker as an import does (a loop of them is a loop of meaning: the
  cure is a lower module both read, or a ``Protocol``).

Not counted: the parent packages an import initialises on the way (``import fullshard.a.b`` runs
``fullshard/__init__`` and ``fullshard/a/__init__`` first, always before ``b``, so they order
nothing: counting them would put every module in one loop through the top ``__init__``);
``importlib.import_module`` strings. It reads the source (no import), so it runs in milliseconds.
"""

from __future__ import annotations

import ast
from collections import deque
from collections.abc import Mapping
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = "fullshard"

Graph = dict[str, dict[str, int]]  # module -> {imported module: first line}


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_nodes(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement, at any depth (``if TYPE_CHECKING:`` bodies included)."""
    return [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]


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


def cycles(graph: Mapping[str, Mapping[str, object]]) -> list[list[str]]:
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


def packages(graph: Graph) -> list[str]:
    """The packages among ``graph``'s modules (those with modules under them)."""
    return sorted({m.rpartition(".")[0] for m in graph if "." in m} & set(graph))


def parts_graph(graph: Graph, package: str) -> dict[str, dict[str, str]]:
    """The import graph between ``package``'s parts: each module directly in it, each
    subpackage with every module under it, and the package's own ``__init__`` (named as the
    package). An edge ``a -> b`` when a module of part ``a`` imports one of part ``b``; its line
    is one such import's, ``"module line N"``."""

    def part(module: str) -> str | None:
        if module == package:
            return package
        if not module.startswith(package + "."):
            return None
        return f"{package}.{module[len(package) + 1 :].split('.')[0]}"

    out: dict[str, dict[str, str]] = {}
    for module, targets in sorted(graph.items()):
        mine = part(module)
        if mine is None:
            continue
        out.setdefault(mine, {})
        for target, line in sorted(targets.items()):
            theirs = part(target)
            if theirs is not None and theirs != mine:
                out[mine].setdefault(theirs, f"{module} line {line} imports {target}")
                out.setdefault(theirs, {})
    return out


def part_loops(graph: Graph) -> list[str]:
    """Each loop between the parts of a package, at every depth, with the imports that close it."""
    found = []
    for package in packages(graph):
        parts = parts_graph(graph, package)
        for component in cycles(parts):
            members = set(component)
            why = [
                f"{a} -> {b}: {parts[a][b]}" for a in component for b in parts[a] if b in members
            ]
            found.append(f"inside {package}: {', '.join(component)}\n    " + "\n    ".join(why))
    return found


def test_the_package_has_no_import_cycles() -> None:
    graph = build_graph(SRC, PACKAGE)
    # the reader sees the package: a floor, so that an empty graph cannot pass
    assert len(graph) > 50 and sum(map(len, graph.values())) > 100
    found = cycles(graph)
    report = [f"{', '.join(c)}\n    e.g. {one_loop(graph, c)}" for c in found]
    assert not found, f"{len(found)} import cycle(s) in src/fullshard:\n" + "\n".join(report)


def test_no_package_has_parts_that_import_each_other() -> None:
    graph = build_graph(SRC, PACKAGE)
    assert {"fullshard", "fullshard.app", "fullshard.app.train"} <= set(packages(graph))
    loops = part_loops(graph)
    assert not loops, f"{len(loops)} loop(s) between a package's parts:\n" + "\n".join(loops)


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
            "pkg/e.py": "import pkg.typed\n",  # a cycle through TYPE_CHECKING: one too
        },
    )
    assert graph["pkg.a"] == {"pkg.b": 1} and graph["pkg.b"] == {"pkg.c": 2}
    assert graph["pkg.typed"] == {"pkg.e": 3, "pkg.a": 5}  # TYPE_CHECKING's import is an edge
    found = cycles(graph)
    assert found == [
        ["pkg.a", "pkg.b", "pkg.c"],
        ["pkg.d", "pkg.sub"],
        ["pkg.e", "pkg.typed"],
        ["pkg.selfish"],
    ]
    assert one_loop(graph, found[0]) == (
        "pkg.a (line 1) -> pkg.b (line 2) -> pkg.c (line 1) -> pkg.a"
    )
    assert one_loop(graph, found[3]) == "pkg.selfish (line 2) -> pkg.selfish"


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


def test_a_loop_between_two_subpackages_is_found_at_their_scale(tmp_path: Path) -> None:
    # no module loop: a.x -> b.y -> a.z; but a and b, the parts of pkg, import each other
    graph = _package(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a/__init__.py": "",
            "pkg/a/x.py": "from pkg.b import y\n",
            "pkg/a/z.py": "",
            "pkg/b/__init__.py": "",
            "pkg/b/y.py": "def f():\n    from pkg.a import z\n",
            "pkg/c.py": "import pkg.a.x\n",  # a part above both: no loop
        },
    )
    assert cycles(graph) == []
    assert packages(graph) == ["pkg", "pkg.a", "pkg.b"]
    assert parts_graph(graph, "pkg")["pkg.b"] == {"pkg.a": "pkg.b.y line 2 imports pkg.a.z"}
    assert part_loops(graph) == [
        "inside pkg: pkg.a, pkg.b\n    pkg.a -> pkg.b: pkg.a.x line 1 imports pkg.b.y\n"
        "    pkg.b -> pkg.a: pkg.b.y line 2 imports pkg.a.z"
    ]
