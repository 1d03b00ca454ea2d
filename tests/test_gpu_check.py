"""The GPU check script: on CUDA when present (skipped otherwise), and as a gloo dry run."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "scripts", "gpu_check.py")


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=600, env=env
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (NCCL)")
def test_gpu_check_on_cuda() -> None:
    res = _run()
    assert res.returncode == 0, res.stdout + res.stderr
    assert "FAIL" not in res.stdout and "PASS" in res.stdout


def test_gpu_check_script_dry_run_on_gloo() -> None:
    res = _run("--cpu")
    assert res.returncode == 0, res.stdout + res.stderr
    lines = [line for line in res.stdout.splitlines() if line.startswith(("PASS", "FAIL"))]
    assert len(lines) == 5 and all(line.startswith("PASS") for line in lines), res.stdout
