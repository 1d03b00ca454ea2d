"""``scripts/gpu_check.py``: the whole check on CUDA (skipped here), a quick dry run on gloo/CPU
that drives the real CLI and spawned ranks, and the verdict logic (a FAIL is never lost)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

# launches the CLI or torchrun as subprocesses: the top of the test pyramid
pytestmark = pytest.mark.e2e

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
SCRIPT = SCRIPTS / "gpu_check.py"


def _run(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    # The script puts this checkout's src on PYTHONPATH itself; start it from elsewhere to
    # show that it needs no install and no PYTHONPATH of ours.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RANK", "WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True, text=True, timeout=timeout, env=env, cwd="/", check=False,
    )  # fmt: skip


def _lines(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith(("PASS", "FAIL"))]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (NCCL)")
def test_gpu_check_on_cuda() -> None:
    res = _run()
    assert res.returncode == 0, res.stdout + res.stderr
    assert "FAIL" not in res.stdout and len(_lines(res.stdout)) >= 30


def test_quick_dry_run_on_gloo_drives_the_cli_and_the_ranks() -> None:
    # cli.train / cli.resume / cli.convert run `python -m fullshard.app.cli` (torchrun and its
    # rank included); the gloo2 checks run in two spawned ranks.
    res = _run("--cpu", "--quick", timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = _lines(res.stdout)
    names = [line.split()[1].rstrip(":") for line in lines]
    assert names == [
        "cli.train",
        "cli.resume",
        "cli.convert",
        "gloo2.parity.full_shard",
        "gloo2.checkpoint",
    ]
    assert all(line.startswith("PASS") for line in lines), res.stdout
    assert "resumed from step 4 to 6" in res.stdout
    assert "5 of 5 checks passed" in res.stdout


def test_every_command_and_strategy_is_checked() -> None:
    res = _run("--cpu", "--list", timeout=120)
    assert res.returncode == 0, res.stderr
    names = res.stdout.split()
    for command in ("train", "resume", "convert", "hf", "trace", "bench", "plan", "share"):
        assert f"cli.{command}" in names
    for world in (2, 4):
        for check in ("parity.full_shard", "parity.shard_grad_op", "parity.no_shard",
                      "bf16", "offload", "checkpoint"):  # fmt: skip
            assert f"gloo{world}.{check}" in names
    assert "gloo4.parity.hybrid_shard" in names and "gloo4.parity.hybrid_shard_zero2" in names
    assert "gloo2.parity.hybrid_shard" not in names  # hybrid needs an even world of 4 or more


def test_nothing_chosen_is_a_failure() -> None:
    res = _run("--cpu", "--only", "no-such-check", timeout=120)
    assert res.returncode == 1 and "0 of 0 checks passed" in res.stdout


@pytest.fixture
def script(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.syspath_prepend(str(SCRIPTS))
    import gpu_check

    return gpu_check


def test_a_rank_that_raises_fails_its_check_and_the_rest(script: Any, tmp_path: Path) -> None:
    # a real spawned rank: the first check passes, the unknown one raises, the third is not run
    results = script.run_group(
        "gloo", "cpu", 1, ["parity.full_shard", "no-such", "offload"], tmp_path,
        time.monotonic() + 120,
    )  # fmt: skip
    verdicts = {name: (ok, info) for name, ok, info, _ in results}
    assert verdicts["gloo1.parity.full_shard"][0] is True
    assert verdicts["gloo1.no-such"] == (False, "rank 0: raised KeyError: 'no-such'")
    assert verdicts["gloo1.offload"] == (False, "rank 0: not run")


def test_merge_needs_every_rank(script: Any) -> None:
    per_rank = [
        [{"name": "a", "ok": True, "info": "fine", "s": 1.0}],
        [{"name": "a", "ok": False, "info": "diff 1e-2", "s": 2.0}],
        [],
    ]
    [(name, ok, info, seconds)] = script.merge("gloo3.", ["a"], per_rank, late=[2])
    assert (name, ok, seconds) == ("gloo3.a", False, 2.0)
    assert info == "rank 1: diff 1e-2; rank 2: not run; ranks [2] killed at the time limit"
    [(_, ok, info, _)] = script.merge("gloo2.", ["a"], per_rank[:1] * 2, late=[])
    assert ok and info == "fine"
