"""torch FSDP2's public API, item by item, against torch's own on 2 ranks: every case of
``tests/fsdp2_api.py`` runs once under each import (one launch each) and records what a user
can observe; each record must be the same under both (tensors to 1e-12 in float64).
docs/library.md's table names the case that shows each item.
"""

from __future__ import annotations

import functools
from typing import Any

import fsdp2_api
import pytest
import torch
from harness import run_ranks

EXACT = 1e-12
WORLD = 2


@functools.cache
def _records(impl: str) -> list[dict[str, dict]]:
    return run_ranks(fsdp2_api.api_program, WORLD, impl, timeout_s=900)


def _differences(a: Any, b: Any, where: str = "") -> list[str]:
    """Where two records differ: tensors by more than EXACT (or in shape or dtype), anything
    else by value."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return [f"{where}: {type(a).__name__} vs {type(b).__name__}"]
        if a.shape != b.shape or a.dtype != b.dtype:
            return [f"{where}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"]
        d = float((a.double() - b.double()).abs().max()) if a.numel() else 0.0
        # float64 to 1e-12; a float32 record (mixed precision cases) to its own rounding
        bound = EXACT if a.dtype == torch.float64 else 1e-5 * max(1.0, float(a.abs().max()))
        return [f"{where}: differs by {d:.1e}"] if d > bound else []
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{where}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"]
        return [x for k in a for x in _differences(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{where}: {a!r} vs {b!r}"]
        return [
            x
            for i, (p, q) in enumerate(zip(a, b, strict=True))
            for x in _differences(p, q, f"{where}[{i}]")
        ]
    return [] if a == b else [f"{where}: {a!r} vs {b!r}"]


TORCH_2_13 = sorted(
    name
    for name in fsdp2_api.CASES
    if name not in ("manual_finalization", "keep_unsharded_storage", "param_dtype_override")
)


@pytest.mark.parametrize("case", TORCH_2_13)
def test_each_item_behaves_as_torchs(case: str) -> None:
    for rank, (t, f) in enumerate(zip(_records("torch"), _records("fullshard"), strict=True)):
        assert "raised" not in t[case], t[case]["raised"]
        assert "raised" not in f[case], f[case]["raised"]
        diffs = _differences(t[case], f[case], case)
        assert not diffs, f"rank {rank}: " + "\n".join(diffs)


TORCH_2_15 = ("manual_finalization", "keep_unsharded_storage", "param_dtype_override")


def _fullshard_as_2_15_documents(case: str, r: dict) -> None:
    """What torch 2.15 documents for its additions, checked on fullshard's record."""
    if case == "manual_finalization":
        # backwards without sync reduce nothing; one finalize reduces each unit once, leaves
        # every unit resharded and the gradients of one process over both micro-batches
        assert r["grads_before"] is False and r["handle"] == "GradientReductionHandle", r
        assert r["rs_per_unit"] == ["RS b0", "RS b1", "RS b2", "RS root"], r["rs_per_unit"]
        assert all(r["after"].values()) and r["vs_one_process"] and r["next step"], r
        assert r["in_backward"] == "RuntimeError" and r["sync finalize"] == "None", r
        # a unit no backward reached stays gathered until finalize_backward, only under it
        assert r["left_gathered"] == {"False": (True, True), "True": (False, True)}, r
    elif case == "keep_unsharded_storage":
        assert r["True"]["kept"] and r["True"]["same_address"], r["True"]
        assert not r["False"]["kept"], r["False"]  # freed by default
        assert all(r["True"]["after"].values()) and all(r["False"]["after"].values())
        assert not _differences(r["True"]["grads"], r["False"]["grads"], case)
    else:
        # block 1's input and lin.weight in bf16, its extra kept in its own float64
        assert r["seen"] == ["torch.bfloat16", "torch.bfloat16", "torch.float64"], r
        assert r["grad_dtypes"] == ["torch.float64"], r
        assert r["bad"] == "ValueError" and r["keyword_only"] == "TypeError", r


@pytest.mark.parametrize("case", TORCH_2_15)
def test_torch_2_15_additions(case: str) -> None:
    # torch 2.13 lacks them (``absent``): fullshard is held to what 2.15 documents, and to
    # torch's own record on a torch that has them
    for rank, (t, f) in enumerate(zip(_records("torch"), _records("fullshard"), strict=True)):
        assert "raised" not in f[case], f[case]["raised"]
        assert "absent" not in f[case], f"rank {rank}: fullshard lacks {case}"
        _fullshard_as_2_15_documents(case, f[case])
        if not t[case].get("absent"):
            assert "raised" not in t[case], t[case]["raised"]
            diffs = _differences(t[case], f[case], case)
            assert not diffs, f"rank {rank}: " + "\n".join(diffs)
