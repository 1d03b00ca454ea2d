"""``fullshard train`` picks up where it stopped: N steps, stop, resume == N + M uninterrupted
steps; a rank killed mid-run restarts from the last checkpoint and ends with the same weights.

Both happen in one run (a launch each costs seconds), compared against one uninterrupted run
(the ``straight`` fixture), run once.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from test_app_cli import converted, main_in_process, records, train_on_ranks

from fullshard.app.cli import main

# launches the CLI or torchrun as subprocesses: the top of the test pyramid
pytestmark = pytest.mark.e2e

ARGS = [
    *["--model", "tiny", "--max-steps", "8", "--seq-len", "64"],
    *["--batch-size", "16", "--warmup-steps", "2", "--log-every", "1"],
    *["--eval-every", "0", "--sample-tokens", "0", "--save-every", "2"],
    *["--nproc", "2", "--timeout", "60", "--no-progress"],
]


def _train(
    root: Path, monkeypatch: pytest.MonkeyPatch, *extra: str, fault: str = ""
) -> dict[str, Any]:
    """One ``fullshard train`` launch, its launcher in this process (what is checked is what
    the launch writes: tests/test_app_faults.py and test_app_launch.py check what a launch
    prints); returns the run's summary.json."""
    with monkeypatch.context() as mp:
        if fault:
            mp.setenv("FULLSHARD_FAULT", fault)
            # a survivor's error asks every rank where it is, and the killed one never answers
            mp.setenv("FULLSHARD_REPORT_WAIT_S", "2")
        assert main_in_process(["train", *ARGS, "--runs-dir", str(root), *extra], mp) == 0
    name = extra[extra.index("--name") + 1]
    return json.loads((root / name / "summary.json").read_text())  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted run (8 steps, a checkpoint every 2): its ranks on the harness's, no
    launch (what is compared is what the ranks compute; the runs compared with it launch)."""
    root = tmp_path_factory.mktemp("straight")
    ranks = train_on_ranks([*ARGS, "--runs-dir", str(root), "--name", "straight"])
    assert [r["status"] for r in ranks] == [0, 0], ranks
    return root / "straight"


def _same_weights(a: Path, b: Path) -> None:
    wa = converted(a / "checkpoints", a.parent / f"{a.name}.safetensors")
    wb = converted(b / "checkpoints", b.parent / f"{b.name}.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_killed_rank_restarts_then_stop_and_resume_equal_uninterrupted_bitwise(
    straight: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One run through both ways of stopping early, checked against ``straight`` at the end.

    Rank 1 is killed as step 4 starts: torchrun restarts both ranks, which resume from the last
    checkpoint (step 2; step 3 is trained again). That attempt stops after 5 steps
    (``--stop-after`` counts from where it resumed; the killed attempt would have stopped after
    step 5) with a checkpoint of its own, off the ``--save-every`` grid; ``--resume latest`` then
    trains the rest. Every logged loss (the retrained step 3 both times) and the final weights
    are the uninterrupted run's, bit for bit.
    """
    # a restart that hangs (a survivor waiting on the dead rank) fails the test at the deadline
    summary = _train(
        tmp_path,
        monkeypatch,
        *["--name", "cut", "--max-restarts", "2", "--stop-after", "5"],
        fault="kill:rank=1:step=4",
    )
    assert (summary["resumed_from"], summary["stopped_after"]) == (2, 7)  # the restart's
    cut = tmp_path / "cut" / "checkpoints"  # the last 3 (--keep): the stop's own is the third
    assert sorted(os.listdir(cut)) == ["step_00000004", "step_00000006", "step_00000007"]
    summary = _train(tmp_path, monkeypatch, "--name", "cut", "--resume", "latest")
    assert (summary["resumed_from"], summary["stopped_after"]) == (7, None)
    # the same losses at every logged step, and the same weights, bit for bit
    want = {r["step"]: r["loss"] for r in records(straight)}
    got = [(r["step"], r["loss"]) for r in records(tmp_path / "cut")]
    assert {step for step, _ in got} == set(want) == set(range(1, 9))
    assert [step for step, _ in got].count(3) == 2  # logged by the killed attempt, and again
    assert all(loss == want[step] for step, loss in got), (got, want)
    _same_weights(straight, tmp_path / "cut")


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
