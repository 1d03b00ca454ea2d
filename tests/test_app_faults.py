"""``fullshard train`` under faults: NaN on one rank, a rank killed mid-run with restarts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from harness import run_command
from safetensors.torch import load_file
from test_app_cli import records

from fullshard.app.faults import Fault, fault_from_env
from fullshard.policies import FullshardError

# launches the CLI or torchrun as subprocesses: the top of the test pyramid
pytestmark = pytest.mark.e2e

ARGS = [
    "--model", "tiny", "--seq-len", "64", "--batch-size", "16", "--warmup-steps", "2",
    "--log-every", "1", "--eval-every", "0", "--sample-tokens", "0", "--nproc", "2",
    "--timeout", "60", "--no-progress",
]  # fmt: skip


def _train(
    args: list[str], fault: str = "", deadline_s: float = 300, emulated: bool = False
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    if fault:
        env["FULLSHARD_FAULT"] = fault
    if emulated:  # the CUDA path, checked on CPU (NOTE [The CUDA path on CPU])
        env["FULLSHARD_CUDA_EMULATION"] = "1"
    return run_command(
        [sys.executable, "-m", "fullshard.app.cli", "train", *ARGS, *args],
        deadline_s=deadline_s,
        what=f"fullshard train{' with fault ' + fault if fault else ''}",
        env=env,
    )


def _weights(ckpt: Path, out: Path) -> dict[str, torch.Tensor]:
    proc = subprocess.run(
        [sys.executable, "-m", "fullshard.app.cli", "convert", str(ckpt), str(out)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return load_file(out)


def test_nan_on_one_rank_skips_the_step_on_every_rank(tmp_path: Path) -> None:
    proc = _train(
        [
            "--max-steps",
            "4",
            "--save-every",
            "1",
            "--keep",
            "4",
            "--runs-dir",
            str(tmp_path),
            "--name",
            "n",
        ],
        fault="nan:rank=1:step=3",
    )
    assert proc.returncode == 0, proc.stderr
    assert "step 3: non-finite loss or gradient, optimizer step skipped" in proc.stdout
    assert {"step": 3, "skipped": "non-finite loss or gradient"} in records(tmp_path / "n")
    ckpts = tmp_path / "n" / "checkpoints"
    w2 = _weights(ckpts / "step_00000002", tmp_path / "2.safetensors")
    w3 = _weights(ckpts / "step_00000003", tmp_path / "3.safetensors")
    w4 = _weights(ckpts / "step_00000004", tmp_path / "4.safetensors")
    assert all(torch.equal(w2[k], w3[k]) for k in w2)  # step 3 changed nothing, on any rank
    assert not all(torch.equal(w3[k], w4[k]) for k in w3)  # and training went on


def test_on_the_cuda_path_the_device_skips_the_step_and_quiet_steps_never_sync(
    tmp_path: Path,
) -> None:
    """NOTE [The step's verdict on the device], under the CUDA emulation: fused AdamW skips
    the non-finite step 3 on the device, the device schedule stays put, the host hears of it a
    step later; no quiet step synchronises the host. The weights match the host-decided run's
    (the same command on plain CPU; fused AdamW rounds differently from foreach AdamW)."""
    common = ["--max-steps", "5", "--log-every", "5", "--save-every", "0"]
    runs = {"cpu": False, "emulated": True}
    for name, emulated in runs.items():
        proc = _train(
            [*common, "--runs-dir", str(tmp_path), "--name", name],
            fault="nan:rank=1:step=3",
            emulated=emulated,
        )
        assert proc.returncode == 0, proc.stderr
        assert "step 3: non-finite loss or gradient, optimizer step skipped" in proc.stdout
    summary = json.loads((tmp_path / "emulated" / "summary.json").read_text())
    syncs = summary["host_syncs_per_step"]
    print(f"\nhost syncs per step under the emulation: {syncs}")
    assert summary["skipped_nonfinite"] == [3]
    assert [syncs[str(s)] for s in (2, 3, 4)] == [0, 0, 0], syncs  # quiet steps, step 3 too
    a = _weights(tmp_path / "cpu" / "checkpoints", tmp_path / "a.safetensors")
    b = _weights(tmp_path / "emulated" / "checkpoints", tmp_path / "b.safetensors")
    assert all(torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-6) for k in a)


def test_nan_with_on_nonfinite_stop_fails_every_rank_with_the_step(tmp_path: Path) -> None:
    proc = _train(
        ["--max-steps", "4", "--on-nonfinite", "stop", "--runs-dir", str(tmp_path), "--name", "s"],
        fault="nan:rank=1:step=3",
    )
    assert proc.returncode != 0
    assert proc.stderr.count("step 3 produced a non-finite loss") == 2  # both ranks say so


def test_killed_rank_restarts_from_last_checkpoint_and_matches(tmp_path: Path) -> None:
    common = ["--max-steps", "8", "--save-every", "2", "--runs-dir", str(tmp_path)]
    assert _train([*common, "--name", "straight"]).returncode == 0
    # a restart that hangs (a survivor waiting on the dead rank) fails the test at the deadline
    proc = _train(
        [*common, "--name", "crash", "--max-restarts", "2"],
        fault="kill:rank=1:step=5",
        deadline_s=240,
    )
    assert proc.returncode == 0, proc.stderr
    assert "[fault] rank 1 killed at step 5" in proc.stdout
    assert "resumed from step 4" in proc.stdout
    a = _weights(tmp_path / "straight" / "checkpoints", tmp_path / "a.safetensors")
    b = _weights(tmp_path / "crash" / "checkpoints", tmp_path / "b.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)  # the same result as never crashing


def test_signal_fault_spec(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.setenv("FULLSHARD_FAULT", "signal:rank=1:step=3:sig=usr1:repeat=2")
    assert fault_from_env() == Fault("signal", 1, 3, signal.SIGUSR1, 2)
    monkeypatch.setenv("FULLSHARD_FAULT", "signal:step=3")
    assert fault_from_env() == Fault("signal", 0, 3, signal.SIGTERM, 1)
    monkeypatch.setenv("FULLSHARD_FAULT", "signal:sig=KILL")
    with pytest.raises(FullshardError, match="sig=TERM or sig=USR1"):
        fault_from_env()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # a restarted attempt: no fault
    assert fault_from_env() is None
