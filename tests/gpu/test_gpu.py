"""The GPU checks as tests: one test per check of ``gpu_check.py`` (every CLI command on NCCL,
every strategy in spawned ranks, bf16 with CPU offload, the CUDA sanitizer, the fake group at
world 8), skipped without CUDA. ``make test-gpu`` runs them on a GPU machine, as one command.

The checks share spawned groups and one time budget, so they run once, together: the first
test runs every check the session selected (``-k`` picks a subset), and each test then reads
its own verdict. ``FULLSHARD_GPU_CHECKS_ON_CPU=1`` runs their gloo/CPU forms instead (the
driver's ``--cpu``), where a check that needs CUDA is skipped.
"""

from __future__ import annotations

import os
from typing import Any

import gpu_check as driver
import pytest
import torch

ON_CPU = os.environ.get("FULLSHARD_GPU_CHECKS_ON_CPU") == "1"
BUDGET_S = float(os.environ.get("FULLSHARD_GPU_CHECKS_BUDGET", "470"))

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        not ON_CPU and not torch.cuda.is_available(),
        reason="needs a CUDA GPU (FULLSHARD_GPU_CHECKS_ON_CPU=1: the gloo/CPU forms)",
    ),
]

# on a GPU the names count its devices (a count only: no CUDA context in this process)
NAMES = driver.all_names(cpu=ON_CPU or not torch.cuda.is_available())


@pytest.fixture(scope="module")
def verdicts(request: pytest.FixtureRequest) -> dict[str, tuple[bool | None, str]]:
    """Every selected check's verdict: (True/False, or None for a SKIP, and its line)."""
    chosen = [
        item.callspec.params["name"]
        for item in request.session.items
        if item.module is request.module and hasattr(item, "callspec")
    ]
    report = Verdicts(BUDGET_S)
    driver.run_checks([n for n in NAMES if n in chosen], ON_CPU, report)
    return report.verdicts


class Verdicts(driver.Report):
    """The driver's report, keeping each check's verdict and line for its test."""

    def __init__(self, budget_s: float) -> None:
        super().__init__(budget_s)
        self.verdicts: dict[str, tuple[bool | None, str]] = {}

    def add(self, name: str, ok: bool | None, info: str, seconds: float) -> None:
        super().add(name, ok, info, seconds)
        self.verdicts[name] = (ok, info)


@pytest.mark.parametrize("name", NAMES)
def test_check(name: str, verdicts: dict[str, Any]) -> None:
    assert name in verdicts, f"{name}: no verdict (the driver did not run it)"
    ok, info = verdicts[name]
    if ok is None:
        pytest.skip(info)
    assert ok, f"{name}: {info}"
