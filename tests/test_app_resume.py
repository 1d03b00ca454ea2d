"""``fullshard train --resume``: N steps, stop, resume, M steps == N + M uninterrupted steps."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_app_cli import records, run_train

# launches the CLI or torchrun as subprocesses: the top of the test pyramid
pytestmark = pytest.mark.e2e

ARGS = [
    "--model", "tiny", "--max-steps", "12", "--seq-len", "64", "--batch-size", "16",
    "--warmup-steps", "3", "--log-every", "2", "--eval-every", "0", "--sample-tokens", "0",
    "--nproc", "2", "--timeout", "120", "--no-progress",
]  # fmt: skip


def _convert(ckpt: Path, out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fullshard.app.cli", "convert", str(ckpt), str(out)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def test_stop_resume_equals_uninterrupted_bitwise(tmp_path: Path) -> None:
    root = str(tmp_path)
    for extra in (["--name", "straight"], ["--name", "cut", "--stop-after", "6"]):
        proc = run_train([*ARGS, "--runs-dir", root, *extra])
        assert proc.returncode == 0, proc.stderr
    cut = tmp_path / "cut" / "checkpoints"
    assert sorted(os.listdir(cut)) == ["step_00000006"]  # stopped after step 6, checkpointed
    proc = run_train([*ARGS, "--runs-dir", root, "--name", "cut", "--resume", "latest"])
    assert proc.returncode == 0, proc.stderr
    assert "resumed from step 6" in proc.stdout
    # the same losses at every logged step, and the same weights, bit for bit
    straight = {r["step"]: r["loss"] for r in records(tmp_path / "straight")}
    resumed = {r["step"]: r["loss"] for r in records(tmp_path / "cut")}
    assert straight == resumed
    for name in ("straight", "cut"):
        proc = _convert(tmp_path / name / "checkpoints", tmp_path / f"{name}.safetensors")
        assert proc.returncode == 0, proc.stderr
    a, b = load_file(tmp_path / "straight.safetensors"), load_file(tmp_path / "cut.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_convert_refuses_a_corrupted_checkpoint(tmp_path: Path) -> None:
    proc = run_train([*ARGS, "--runs-dir", str(tmp_path), "--name", "r", "--max-steps", "2"])
    assert proc.returncode == 0, proc.stderr
    ckpt = tmp_path / "r" / "checkpoints" / "step_00000002"
    victim = sorted(ckpt.glob("*.distcp"))[0]
    victim.write_bytes(victim.read_bytes()[:-10])
    proc = _convert(ckpt, tmp_path / "out.safetensors")
    assert proc.returncode == 2
    assert "failed verification" in proc.stderr and "truncated" in proc.stderr
