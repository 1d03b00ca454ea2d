"""None of FSDP2's public API is missing: every public item of the installed torch's FSDP2 (its
exported names, ``fully_shard``'s arguments, ``FSDPModule``'s public methods, the policies'
fields) and each item torch 2.15 adds is provided by fullshard and named in docs/library.md's
table, whose every row names a case of ``tests/fsdp2_api.py`` (which ``tests/test_fsdp2_api.py``
holds against torch's own behaviour)."""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

import fsdp2_api
import pytest
import torch.distributed.fsdp as torch_fsdp
from torch.distributed.fsdp import _fully_shard

import fullshard

pytestmark = pytest.mark.fast

LIBRARY = Path(__file__).resolve().parents[2] / "docs" / "library.md"

# what torch 2.15 adds (torch 2.13, which CI pins, has none of them)
TORCH_2_15 = {
    "FSDPModule.finalize_backward",
    "FSDPModule.set_manual_backward_finalization",
    "FSDPModule.set_keep_unsharded_storage",
    "GradientReductionHandle",
    "MixedPrecisionPolicy.param_dtype_override_fn",
}


def _table() -> dict[str, list[str]]:
    """docs/library.md's API table: each row's item (its first backquoted name) -> its cases."""
    text = LIBRARY.read_text(encoding="utf-8")
    start = text.index("| item | in torch | fullshard | case |")
    rows = {}
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        item = re.match(r"`([^`]+)`", cells[0])
        assert item, line
        rows.setdefault(item.group(1), []).extend(re.findall(r"`([^`]+)`", cells[3]))
    return rows


def _torch_items() -> set[str]:
    """The installed torch's public FSDP2 surface, by the names the table uses."""
    items = set(_fully_shard.__all__) & set(torch_fsdp.__all__)
    items |= {p for p in inspect.signature(torch_fsdp.fully_shard).parameters if p != "module"}
    items |= {
        f"FSDPModule.{name}"
        for name, value in vars(torch_fsdp.FSDPModule).items()
        if not name.startswith("_") and callable(value)
    }
    for cls in ("MixedPrecisionPolicy", "CPUOffloadPolicy", "DataParallelMeshDims"):
        c = getattr(torch_fsdp, cls, None)
        if c is None:
            continue
        items |= {f"{cls}.{f.name}" for f in dataclasses.fields(c)}
        items |= {f"{cls}.{n}" for n, v in vars(c).items() if isinstance(v, property)}
    return items


def _provided(item: str) -> bool:
    """Whether fullshard has ``item`` (a name, ``fully_shard``'s argument, a member)."""
    if item in inspect.signature(fullshard.fully_shard).parameters:
        return True
    owner, _, member = item.partition(".")
    obj = getattr(fullshard, owner, None)
    if obj is None or not member:
        return obj is not None
    fields = {f.name for f in dataclasses.fields(obj)} if dataclasses.is_dataclass(obj) else set()
    return member in fields or hasattr(obj, member)


def test_every_public_item_of_torchs_fsdp2_is_provided_and_in_the_table() -> None:
    table = _table()
    wanted = _torch_items() | TORCH_2_15
    assert not sorted(wanted - set(table)), "not in docs/library.md's table"
    assert not sorted(i for i in wanted if not _provided(i)), "not provided by fullshard"


def test_every_row_names_a_case_that_exists() -> None:
    for item, cases in _table().items():
        assert cases, item
        missing = [c for c in cases if c not in fsdp2_api.CASES]
        assert not missing, (item, missing)
