"""Live recovery beyond the step (issue 43), on launched ranks: a rank lost in a checkpoint's
commit and one lost in the final save, a rank lost the instant the next generation is written,
the launcher lost (the ranks stop with a checkpoint and one message, and ``--resume latest``
gives the same bits), and a full disk (one message, no traceback).

Each fault strikes at an exact moment (``FULLSHARD_FAULT``'s ``at=commit``, ``at=save``,
``at=generation``, ``launcher``, ``diskfull``), so no test depends on timing. The mechanisms
have tests of their own without a launch: a save's waits given up when the membership moves on
and the disk checks (``test_checkpoint.py``); a generation formed only once its members
arrived, a process waiting to join that outlives the timeout and a left-out member of a job
that finished (``test_elastic_protocol.py``).
"""

from __future__ import annotations

import functools
import json
import os
import shlex
import sys
from pathlib import Path

import pytest
from harness import run_command
from test_elastic import COMMON, _elastic, _sha, uninterrupted_sha

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def reference_sha(tmp_path_factory: pytest.TempPathFactory) -> str:
    return uninterrupted_sha(tmp_path_factory.mktemp("reference"))


def _launch(monkeypatch: pytest.MonkeyPatch, argv: list[str], fault: str = "") -> int:
    """``fullshard ARGV`` in this process, no fault, its --elastic launch bounded."""
    from fullshard.app.cli import main
    from fullshard.app.launch import elastic as elastic_launch

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("FULLSHARD_FAULT", fault)
    bounded = functools.partial(elastic_launch.launch_elastic, timeout_s=240)
    monkeypatch.setattr(elastic_launch, "launch_elastic", bounded)
    return main(argv)


def _losses(summary: dict) -> list[tuple[list[int], list[int]]]:
    return [(c["ranks_lost"], c["ranks_joined"]) for c in summary["membership"]]


def test_losses_in_a_commit_and_in_the_final_save_are_recovered_with_the_same_bits(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
    reference_sha: str,
) -> None:
    """Rank 0 lost once step 6's ``.metadata`` is written, before the commit (its peers waited
    in DCP's broadcast, which nothing interrupts, and one was fenced as hung); rank 1 lost once
    its files of the final save (after step 8, not a multiple of --save-every) are written
    (that save ran outside recovery). Both recover, and the weights are the uninterrupted
    run's."""
    run = ["--runs-dir", str(tmp_path), "--name", "saves", "--save-every", "3"]
    fault = "kill:rank=0:step=6:at=commit+kill:rank=1:step=8:at=save"
    assert _elastic(run, monkeypatch, fault) == 0
    err = capfd.readouterr().err
    assert "Traceback" not in err and "fenced" not in err, err
    summary = json.loads((tmp_path / "saves" / "summary.json").read_text())
    assert _losses(summary) == [([0], [0]), ([1], [1])]
    ckpt = tmp_path / "saves" / "checkpoints" / "step_00000008"
    assert _sha(ckpt, tmp_path / "saves.safetensors") == reference_sha


def test_a_loss_the_instant_the_next_generation_is_written_is_recovered(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
    reference_sha: str,
) -> None:
    """Rank 2 lost at step 6, then rank 0 the instant it has the next generation's record,
    before that generation forms: the others no longer wait in gloo's rendezvous for it (nor
    does the replacement give up and end the job); they settle the generation after, and the
    replacement admitted to the one that never formed builds and restores with them."""
    run = ["--runs-dir", str(tmp_path), "--name", "restore"]
    assert _elastic(run, monkeypatch, "kill:rank=2:step=6+kill:rank=0:step=6:at=generation") == 0
    err = capfd.readouterr().err
    said = [ln for ln in err.splitlines() if ln.strip() and "are pids" not in ln]
    assert len(said) == 2 and all("exited with status -9" in ln for ln in said), err
    summary = json.loads((tmp_path / "restore" / "summary.json").read_text())
    assert summary["membership"][-1]["world_size"] == 4
    ckpt = tmp_path / "restore" / "checkpoints" / "step_00000008"
    assert _sha(ckpt, tmp_path / "restore.safetensors") == reference_sha


def test_the_launchers_loss_stops_the_ranks_with_a_checkpoint_and_one_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reference_sha: str
) -> None:
    """The launcher (it hosts the job's store) SIGKILLed at step 4: the ranks stop after the
    same step, save a checkpoint, and rank 0 says so once, naming it and the command that
    resumes; no C++ stacks (NOTE [Losing the store]). That command gives the same bits."""
    run = [
        *COMMON,
        *["--nproc", "4", "--elastic", "--timeout", "60", "--runs-dir"],
        str(tmp_path),
        "--name",
        "orphans",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "FULLSHARD_FAULT": "launcher:step=4"}
    cmd = [sys.executable, "-m", "fullshard.app.cli", "train", *run]
    # the ranks outlive the launcher; the command's output ends when the last of them does
    done = run_command(cmd, deadline_s=300, what="a launch whose launcher is killed", env=env)
    assert done.returncode == -9, done.stderr
    said = [ln for ln in done.stderr.splitlines() if ln.strip() and "are pids" not in ln]
    ckpt = tmp_path / "orphans" / "checkpoints" / "step_00000004"
    assert len(said) == 1, done.stderr
    assert said[0].startswith("fullshard: the job's store at 127.0.0.1:"), said
    assert f"saved checkpoint {ckpt} (complete); exiting with status 75. Resume: " in said[0]
    resume = shlex.split(said[0].split("Resume: ")[1])
    assert resume[:4] == ["python", "-m", "fullshard.app.cli", "train"], resume
    summary = json.loads((tmp_path / "orphans" / "summary.json").read_text())
    assert summary["preempted_after"] == 4
    assert _launch(monkeypatch, resume[3:]) == 0  # the command as printed
    last = tmp_path / "orphans" / "checkpoints" / "step_00000008"
    assert _sha(last, tmp_path / "orphans.safetensors") == reference_sha


def test_a_full_disk_ends_the_run_with_one_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """Rank 1's write of step 4's checkpoint fails as on a full disk, without --elastic: status
    1 and one message, from the launcher, naming the disk, the newest complete checkpoint and
    the command that resumes; nothing of step 4 is left."""
    run = ["--runs-dir", str(tmp_path), "--name", "full", "--save-every", "2", "--nproc", "2"]
    assert _launch(monkeypatch, ["train", *COMMON, *run], "diskfull:rank=1:step=4") == 1
    err = capfd.readouterr().err
    ckpts = tmp_path / "full" / "checkpoints"
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(
        f"fullshard train: the disk is full: saving checkpoint step 4 under {ckpts} failed on "
        "rank(s) [1] (OSError: [Errno 28] No space left on device (a drill))"
    ), err
    assert f"still the latest ({ckpts / 'step_00000002'})" in err, err
    assert err.rstrip().endswith("--name full --save-every 2 --nproc 2 --resume latest"), err
    assert sorted(os.listdir(ckpts)) == ["step_00000002"]
