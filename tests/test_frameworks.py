"""accelerate and transformers' Trainer call ``torch.distributed.fsdp.fully_shard`` for their
users; inside ``fullshard.install()`` they shard with fullshard and give torch's answers bit for
bit (``tests/framework_programs.py``: one launch of 2 gloo ranks runs every case under torch's
FSDP2 and then under the swap, in the same processes, which also shows the swap is undone)."""

from __future__ import annotations

import functools
import math
from typing import Any

import framework_programs as fp
import pytest
import torch
from harness import run_ranks

CASES = ("accelerate", "accelerate cpu_ram_efficient_loading", "trainer")


@functools.cache
def _runs() -> list[dict[str, dict[str, Any]]]:
    return run_ranks(fp.frameworks_program, 2, timeout_s=900)  # type: ignore[no-any-return]


@pytest.mark.parametrize("case", CASES)
def test_framework_under_install_equals_torch_bit_for_bit(case: str) -> None:
    for rank, r in enumerate(_runs()):
        theirs, ours = r["torch"][case], r["fullshard"][case]
        # the framework really sharded, and with whose fully_shard
        assert theirs["is_fsdp"] and ours["is_fsdp"], (rank, case)
        assert theirs["fsdp_class"].startswith("torch.distributed.fsdp"), theirs["fsdp_class"]
        assert ours["fsdp_class"] == "fullshard.engine.fsdp_module", ours["fsdp_class"]
        assert len(ours["losses"]) == fp.STEPS
        assert [float(x) for x in ours["losses"]] == [float(x) for x in theirs["losses"]]
        assert theirs["weights"].keys() == ours["weights"].keys()
        for k, v in theirs["weights"].items():
            assert torch.equal(ours["weights"][k], v), (rank, case, k)


@pytest.mark.parametrize("name", fp.EXAMPLES)
def test_readme_recipe_runs_as_written(name: str) -> None:
    # examples/<name> asserts itself that the framework's model is a fullshard FSDPModule
    for r in _runs():
        losses = r["examples"][name]["losses"]
        assert losses and all(math.isfinite(x) for x in losses), losses
