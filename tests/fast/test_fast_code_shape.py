"""The shape rules of docs/design.md, read from the source with ``ast`` (no import), in
milliseconds: no function in ``src/`` longer than 100 lines (a function that long holds several
steps that want names of their own), and no ``# fmt: skip`` (ruff lays the code out; a line
that reads better as a table says why in a comment above it, and a table written as data needs
no skip). A file has no length rule: it is as long as its one concern needs.
"""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "fullshard"
MAX_FUNCTION_LINES = 100


def long_functions(root: Path = PACKAGE) -> list[str]:
    """``path:line name (N lines)`` of every function (nested ones too) over the limit."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    where = path.relative_to(root.parent)
                    found.append(f"{where}:{node.lineno} {node.name} ({lines} lines)")
    return found


def format_skips(root: Path = PACKAGE) -> list[str]:
    """``path:line`` of every ``# fmt: skip`` comment (comments only: a string may say it)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        source = io.StringIO(path.read_text(encoding="utf-8")).readline
        for tok in tokenize.generate_tokens(source):
            if tok.type == tokenize.COMMENT and "fmt: skip" in tok.string:
                found.append(f"{path.relative_to(root.parent)}:{tok.start[0]}")
    return found


def test_no_function_in_src_is_over_100_lines() -> None:
    found = long_functions()
    assert not found, "functions over 100 lines (split them by step):\n" + "\n".join(found)


def test_no_format_skips_in_src() -> None:
    found = format_skips()
    assert not found, "'# fmt: skip' in src (let ruff lay it out):\n" + "\n".join(found)


def test_the_checks_find_a_long_function_and_a_skip(tmp_path: Path) -> None:
    """The checks themselves: a 101-line function and a skip in a string are told apart from a
    100-line function and a real skip."""
    pkg = tmp_path / "fullshard"
    pkg.mkdir()
    body = "".join(f"    x{i} = {i}\n" for i in range(99))
    (pkg / "a.py").write_text(f"def ok():\n{body}\n\ndef long():\n{body}    return x0\n")
    (pkg / "b.py").write_text('S = "# fmt: skip"\nT = [1,  2]  # fmt: skip\n')
    assert long_functions(pkg) == ["fullshard/a.py:103 long (101 lines)"]
    assert format_skips(pkg) == ["fullshard/b.py:2"]
