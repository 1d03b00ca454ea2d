"""``--cpu-offload`` reaches the unit through at most four files (issue 44), read from the
source with ``ast``: the modules of ``src/fullshard`` whose code names the flag or its policy
(``cpu_offload``, ``offload_policy``, ``CPUOffloadPolicy``) are exactly the ones listed here, each
with the reason it may.

The walk, as torchtitan's: the config section declares the flag, the application's sharder
builds the policy from that section, ``fully_shard`` takes it, the unit acts on it. Everyone
else asks a fact instead of the flag: the step's decider where the optimizer's parameters live
(``app/train/build.device_decides``), the run line the section's own words
(``ParallelismConfig.describe``), ``apply_plan`` forwards ``fully_shard``'s keywords unnamed.
A new reader of the flag is a new place to change when offloading changes, so it fails here
until it is argued for (in ``BESIDE``) or removed.

Names count in code (names, attributes, keywords, parameters, imports, definitions) and as
strings that are exactly a name (``kwargs["offload_policy"]``, ``getattr(p, "cpu_offload")``,
the option's ``"--cpu-offload"``), never in comments or docstrings.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

SRC = Path(__file__).resolve().parents[2] / "src" / "fullshard"

NAMES = frozenset({"cpu_offload", "offload_policy", "CPUOffloadPolicy"})

# the data path from the command line to the unit (issue 44: at most four files)
WALK = {
    "app/config.py": "declares the flag in [parallelism]; its run-line words (describe)",
    "app/models/wrap.py": "shard_model builds CPUOffloadPolicy from the [parallelism] section",
    "engine/api.py": "fully_shard's offload_policy argument (torch's policy objects as ours)",
    "engine/unit.py": "the unit acts: shards, gradients and the optimizer step on the host",
}
# off the walk: the policy's definition and public names, the FSDP1 vocabulary's signature,
# and the train command's validation of its options
BESIDE = {
    "policies.py": "defines CPUOffloadPolicy",
    "__init__.py": "exports CPUOffloadPolicy (the public names)",
    "engine/install.py": "routes torch.distributed.fsdp.CPUOffloadPolicy to ours (install())",
    "engine/parallelize.py": "parallelize()'s public FSDP1-style signature names offload_policy",
    "app/commands/train.py": "validation: --elastic refuses --cpu-offload (the command's checks)",
}


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring constants of the module, its classes and functions."""
    found: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
    return found


def _as_name(text: str) -> str:
    # the option as written on the command line names the field: --cpu-offload -> cpu_offload
    return text.lstrip("-").replace("-", "_")


def names_read(source: str) -> set[str]:
    """The names of ``NAMES`` that ``source``'s code reads, defines or passes."""
    tree = ast.parse(source)
    docs = _docstrings(tree)
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, (ast.keyword, ast.arg)) and node.arg is not None:
            found.add(node.arg)
        elif isinstance(node, ast.alias):
            found.update({node.name, node.asname or node.name})
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.add(node.name)
        elif (
            isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
        ):
            found.add(_as_name(node.value))
    return found & NAMES


def readers(src: Path = SRC) -> dict[str, set[str]]:
    """Each module of the package whose code names the flag or its policy -> those names."""
    found = {}
    for path in sorted(src.rglob("*.py")):
        names = names_read(path.read_text(encoding="utf-8"))
        if names:
            found[path.relative_to(src).as_posix()] = names
    return found


def test_the_names_count_in_code_and_not_in_prose() -> None:
    code = '''
"""cpu_offload in a docstring."""
# cpu_offload in a comment
def f(cfg, **kw):
    """offload_policy: prose."""
    return getattr(cfg.parallelism, "cpu_offload"), kw["offload_policy"], "--cpu-offload"
'''
    assert names_read(code) == {"cpu_offload", "offload_policy"}
    assert names_read('"""cpu_offload, offload_policy, CPUOffloadPolicy."""\nx = 1\n') == set()
    reads = [
        "p.cpu_offload",
        "f(offload_policy=None)",
        "def g(offload_policy): ...",
        "from fullshard import CPUOffloadPolicy",
        "d = {'cpu-offload': 1}",
    ]
    for line in reads:
        assert names_read(line), line


def test_only_the_walk_and_the_listed_modules_name_cpu_offload() -> None:
    assert len(WALK) <= 4, "issue 44: --cpu-offload reaches the unit through at most 4 files"
    found = readers()
    allowed = {**WALK, **BESIDE}
    extra = {m: sorted(n) for m, n in found.items() if m not in allowed}
    assert not extra, (
        f"{extra}: these modules read the --cpu-offload flag or its policy by name, off the "
        "walk config -> app/models/wrap.py -> fully_shard -> unit. Ask the fact instead (where "
        "the parameters live, the section's describe(), fully_shard's forwarded keywords), or "
        "say in BESIDE of tests/fast/test_fast_offload_walk.py why this module must name it."
    )
    stale = sorted(set(allowed) - set(found))
    assert not stale, f"{stale} no longer name the flag or its policy: drop them from the lists"
