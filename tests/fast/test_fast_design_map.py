"""docs/design.md is the map of ``src/fullshard``: its "Where does a change go" table has a row
for every module and package (a package's row names its ``__init__.py``), and names no module
that is gone; its index of named notes holds every NOTE the source refers to, each at the module
that writes it out, and no note that the source has dropped.

A newcomer reads the map before the code: a module without a row is one that nobody can find
from it, a row naming a module that was moved or merged sends them to nothing, and a NOTE
(a named invariant that spans files, referred to by name) is only as good as the index that says
where it is written. This reads the files (no import), so it runs in milliseconds.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "fullshard"
DESIGN = ROOT / "docs" / "design.md"

OUTSIDE = ("tests/", "scripts/", "benchmarks/", "docs/")  # rows may name these too
_NOTE = re.compile(r"NOTE \[([^\]\n]+)\]")


def modules(src: Path = SRC) -> set[str]:
    """Every module of the package, as the map names it: ``comm/mesh.py``, ``app/__init__.py``."""
    return {p.relative_to(src).as_posix() for p in src.rglob("*.py")}


def section(text: str, heading: str) -> str:
    """The body of the ``## heading`` section of a markdown text."""
    _, found, rest = text.partition(f"\n## {heading}\n")
    assert found, f"docs/design.md has no section '## {heading}'"
    return rest.split("\n## ", 1)[0]


def map_rows(design: str) -> set[str]:
    """The module paths the "Where does a change go" table names (``...py`` in backquotes)."""
    table = section(design, "Where does a change go")
    rows = [line for line in table.splitlines() if line.startswith("|")]
    named = {m for row in rows for m in re.findall(r"`([\w/]+\.py)`", row)}
    return {m for m in named if not m.startswith(OUTSIDE)}


def notes_in_source(src: Path = SRC) -> dict[str, set[str]]:
    """Each NOTE name the source mentions (its brackets on one line) -> the modules that do."""
    found: dict[str, set[str]] = {}
    for path in sorted(src.rglob("*.py")):
        for name in _NOTE.findall(path.read_text(encoding="utf-8")):
            found.setdefault(name, set()).add(path.relative_to(src).as_posix())
    return found


def note_index(design: str) -> dict[str, str]:
    """The index of named notes: NOTE name -> the module it names as the one that writes it."""
    index = section(design, "Named notes")
    out: dict[str, str] = {}
    for line in index.splitlines():
        m = re.match(r"\| NOTE \[([^\]]+)\] \| `([\w/]+\.py)`", line)
        if m:
            assert m.group(1) not in out, f"NOTE [{m.group(1)}] is indexed twice"
            out[m.group(1)] = m.group(2)
    return out


def map_problems(src: Path, design: str) -> list[str]:
    """What the map of ``src`` in ``design`` gets wrong, one line each."""
    have, named = modules(src), map_rows(design)
    wrong = [f"{m}: no row in 'Where does a change go'" for m in sorted(have - named)]
    wrong += [f"{m}: a row for a module that does not exist" for m in sorted(named - have)]
    notes, index = notes_in_source(src), note_index(design)
    wrong += [
        f"NOTE [{n}] (in {', '.join(sorted(notes[n]))}): not in the index of named notes"
        for n in sorted(set(notes) - set(index))
    ]
    wrong += [
        f"NOTE [{n}]: indexed, but no module mentions it" for n in sorted(set(index) - set(notes))
    ]
    wrong += [
        f"NOTE [{n}]: indexed at {where}, which does not mention it "
        f"(it is in {', '.join(sorted(notes[n]))})"
        for n, where in sorted(index.items())
        if n in notes and where not in notes[n]
    ]
    return wrong


def test_every_module_has_a_row_and_every_note_is_indexed() -> None:
    design = DESIGN.read_text(encoding="utf-8")
    # the reader sees the tree and the doc: floors, so that an empty reading cannot pass
    assert len(modules()) > 100 and len(map_rows(design)) > 100 and len(note_index(design)) > 50
    wrong = map_problems(SRC, design)
    assert not wrong, "docs/design.md is not the map of src/fullshard:\n" + "\n".join(wrong)


def test_the_map_check_sees_a_missing_row_a_stale_row_and_each_wrong_note(tmp_path: Path) -> None:
    src = tmp_path / "fullshard"
    (src / "comm").mkdir(parents=True)
    (src / "__init__.py").write_text('"""The package."""\n')
    (src / "comm" / "__init__.py").write_text("")
    (src / "comm" / "mesh.py").write_text('"""NOTE [Mesh rule]\n\nx."""\n')
    (src / "comm" / "wire.py").write_text("# as NOTE [Mesh rule] says; NOTE [Wire rule] too\n")
    design = (
        "# x\n\n## Where does a change go\n\n| to change | edit |\n| --- | --- |\n"
        "| the names | `__init__.py` |\n| meshes (its test: `tests/test_mesh.py`) | `comm/mesh.py` |\n"
        "| gone | `comm/old.py` |\n"
        "\n## Named notes\n\n| note | written in |\n| --- | --- |\n"
        "| NOTE [Mesh rule] | `comm/__init__.py` |\n| NOTE [Old rule] | `comm/mesh.py` |\n\n## Next\n"
    )
    assert map_problems(src, design) == [
        "comm/__init__.py: no row in 'Where does a change go'",
        "comm/wire.py: no row in 'Where does a change go'",
        "comm/old.py: a row for a module that does not exist",
        "NOTE [Wire rule] (in comm/wire.py): not in the index of named notes",
        "NOTE [Old rule]: indexed, but no module mentions it",
        "NOTE [Mesh rule]: indexed at comm/__init__.py, which does not mention it "
        "(it is in comm/mesh.py, comm/wire.py)",
    ]
