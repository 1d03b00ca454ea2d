"""``fullshard train`` picks up where it stopped: N steps, stop, resume == N + M uninterrupted
steps; a rank killed mid-run restarts from the last checkpoint and ends with the same weights.

Both compare against one uninterrupted run (the ``straight`` fixture), launched once.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from test_app_cli import converted, records, run_train

from fullshard.app.cli import main

# launches the CLI or torchrun as subprocesses: the top of the test pyramid
pytestmark = pytest.mark.e2e

ARGS = [
    "--model", "tiny", "--max-steps", "8", "--seq-len", "64", "--batch-size", "16",
    "--warmup-steps", "2", "--log-every", "1", "--eval-every", "0", "--sample-tokens", "0",
    "--save-every", "2", "--nproc", "2", "--timeout", "60", "--no-progress",
]  # fmt: skip


def _train(root: Path, *extra: str, fault: str = "", deadline_s: float = 240) -> str:
    """One ``fullshard train`` launch (a fresh process, as a user runs it); returns its stdout."""
    proc = run_train([*ARGS, "--runs-dir", str(root), *extra], deadline_s, fault=fault)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted run (8 steps, a checkpoint every 2)."""
    root = tmp_path_factory.mktemp("straight")
    _train(root, "--name", "straight")
    return root / "straight"


def _same_weights(a: Path, b: Path) -> None:
    wa = converted(a / "checkpoints", a.parent / f"{a.name}.safetensors")
    wb = converted(b / "checkpoints", b.parent / f"{b.name}.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_stop_resume_equals_uninterrupted_bitwise(straight: Path, tmp_path: Path) -> None:
    _train(tmp_path, "--name", "cut", "--stop-after", "3")
    cut = tmp_path / "cut" / "checkpoints"
    assert sorted(os.listdir(cut)) == ["step_00000002", "step_00000003"]  # and the stop's own
    out = _train(tmp_path, "--name", "cut", "--resume", "latest")
    assert "resumed from step 3" in out
    # the same losses at every logged step, and the same weights, bit for bit
    assert {r["step"]: r["loss"] for r in records(straight)} == {
        r["step"]: r["loss"] for r in records(tmp_path / "cut")
    }
    _same_weights(straight, tmp_path / "cut")


def test_killed_rank_restarts_from_last_checkpoint_and_matches(
    straight: Path, tmp_path: Path
) -> None:
    # a restart that hangs (a survivor waiting on the dead rank) fails the test at the deadline
    out = _train(tmp_path, "--name", "crash", "--max-restarts", "2", fault="kill:rank=1:step=5")
    assert "[fault] rank 1 killed at step 5" in out
    assert "resumed from step 4" in out
    _same_weights(straight, tmp_path / "crash")  # the same result as never crashing


def test_convert_refuses_a_corrupted_checkpoint(
    straight: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = tmp_path / "step_00000008"
    ckpt.mkdir()
    for f in (straight / "checkpoints" / "step_00000008").iterdir():
        (ckpt / f.name).write_bytes(f.read_bytes())  # a copy: the straight run stays whole
    victim = sorted(ckpt.glob("*.distcp"))[0]
    victim.write_bytes(victim.read_bytes()[:-10])
    capsys.readouterr()
    assert main(["convert", str(ckpt), str(tmp_path / "out.safetensors")]) == 2
    err = capsys.readouterr().err
    assert "failed verification" in err and "truncated" in err
    assert not (tmp_path / "out.safetensors").exists()
