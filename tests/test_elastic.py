"""``fullshard.elastic`` and ``fullshard train --elastic``: a lost rank's shards rebuilt in memory
from its ring neighbour's copy, the survivors' processes kept, a replacement joined, and the
run's weights the bits of the uninterrupted run (with ``--deterministic``).

The choice of boundary and the reassembly of shards are checked without processes; one launch
of four ranks loses two of them (rank 2, then rank 0, the one that writes the run's files), and
one loses two ring neighbours at once, which cannot be recovered in memory.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from test_app_cli import converted, train_on_ranks

from fullshard.app import supervisor
from fullshard.app.cli import main
from fullshard.elastic import Unrecoverable, choose_boundary, merge_pieces

COMMON = [
    "--model", "tiny", "--max-steps", "8", "--batch-size", "16", "--micro-batch-size", "2",
    "--seq-len", "64", "--sample-tokens", "0", "--no-progress", "--log-every", "1",
    "--eval-every", "0", "--deterministic",
]  # fmt: skip


def _held(own: dict[int, list[int]], copy: dict[int, list[int]]) -> dict[str, Any]:
    return {"own": own, "copy": copy}


@pytest.mark.fast
def test_the_newest_boundary_every_member_of_which_a_participant_holds() -> None:
    # four ranks, rank 2 lost: its copy is on rank 3 (the next in the ring), at steps 4 and 5
    held = {m: _held({m: [4, 5]}, {(m - 1) % 4: [4, 5]}) for m in (0, 1, 3)}
    assert choose_boundary([0, 1, 2, 3], held) == (5, {0: 0, 1: 1, 2: 3, 3: 3})
    # rank 3 died during boundary 5's exchange, before it received rank 2's copy: step 4
    held[3] = _held({3: [4, 5]}, {2: [4]})
    assert choose_boundary([0, 1, 2, 3], held) == (4, {0: 0, 1: 1, 2: 3, 3: 3})
    # ranks 1 and 2 lost together: rank 1's copy was on rank 2
    held = {m: _held({m: [5]}, {(m - 1) % 4: [5]}) for m in (0, 3)}
    assert choose_boundary([0, 1, 2, 3], held) is None


def _pieces(box: tuple[int, int], full: torch.Tensor, step: torch.Tensor) -> dict[str, Any]:
    a, b = box
    return {
        "chunks": {"model\0w": ([4, 3], [a, 0], full[a:b].clone())},
        "fulls": {"optim\0w\0step": step},
        "objects": {"param_groups": [{"lr": 0.1, "params": ["w"]}], "state": {"k": 1}},
    }


@pytest.mark.fast
def test_shards_of_any_layout_reassemble_into_the_full_state() -> None:
    full = torch.arange(12.0).reshape(4, 3)
    step = torch.tensor(5.0)
    # rows 0-1 from one rank, 2-3 from another, written out of order
    model_sd, optim_sd, state = merge_pieces(
        [_pieces((2, 4), full, step), _pieces((0, 2), full, step)]
    )
    assert torch.equal(model_sd["w"], full)
    assert optim_sd == {
        "state": {"w": {"step": step}},
        "param_groups": [{"lr": 0.1, "params": ["w"]}],
    }
    assert state == {"k": 1}
    with pytest.raises(Unrecoverable, match="model.w: no survivor holds all of it"):
        merge_pieces([_pieces((0, 2), full, step)])  # rows 2-3 lost


@pytest.mark.fast
def test_elastic_needs_deterministic_and_its_own_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    assert main(["train", "--elastic", "--nproc", "4", "--max-steps", "1"]) == 2
    assert main(["train", *COMMON, "--elastic", "--nproc", "4", "--async-save"]) == 2


def _sha(ckpt: Path, out: Path) -> str:
    converted(ckpt, out)
    return hashlib.sha256(out.read_bytes()).hexdigest()


def _elastic(argv: list[str], monkeypatch: pytest.MonkeyPatch, fault: str) -> int:
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("FULLSHARD_FAULT", fault)
    bounded = functools.partial(supervisor.launch_elastic, timeout_s=240)
    monkeypatch.setattr(supervisor, "launch_elastic", bounded)
    return main(["train", *COMMON, "--nproc", "4", "--elastic", "--timeout", "60", *argv])


@pytest.mark.e2e
def test_two_lost_ranks_are_replaced_in_memory_and_the_weights_are_the_same_bits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    run = ["--runs-dir", str(tmp_path), "--name", "elastic"]
    assert _elastic(run, monkeypatch, "kill:rank=2:step=3+kill:rank=0:step=6") == 0
    err = capfd.readouterr().err
    before = json.loads(re.search(r"ranks 0-3 are pids (\[.*\])", err).group(1))  # type: ignore[union-attr]
    summary = json.loads((tmp_path / "elastic" / "summary.json").read_text())
    assert summary["process_restarts"] == 0 and summary["resumed_from"] is None
    changes = [{k: c[k] for k in ("step", "world_size", "ranks_lost", "ranks_joined")}
               for c in summary["membership"]]  # fmt: skip
    assert changes == [
        {"step": 3, "world_size": 4, "ranks_lost": [2], "ranks_joined": [2]},
        {"step": 6, "world_size": 4, "ranks_lost": [0], "ranks_joined": [0]},
    ]
    after = summary["pids"]  # the survivors kept their processes; the lost slots are new ones
    assert [after[r] == before[r] for r in range(4)] == [False, True, False, True]
    # the uninterrupted run, on one rank (--deterministic: the same bits at any world size)
    # (the forkserver's environment, from the launch above, has the fault: cleared here)
    reference = [*COMMON, "--runs-dir", str(tmp_path), "--name", "one"]
    ok = train_on_ranks(reference, world=1, env={"FULLSHARD_FAULT": ""})
    assert [r["status"] for r in ok] == [0]
    shas = {
        name: _sha(
            tmp_path / name / "checkpoints" / "step_00000008", tmp_path / f"{name}.safetensors"
        )
        for name in ("one", "elastic")
    }
    assert shas["elastic"] == shas["one"], shas


@pytest.mark.e2e
def test_ring_neighbours_lost_together_end_the_job_naming_the_newest_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    run = ["--runs-dir", str(tmp_path), "--name", "both", "--save-every", "2"]
    assert _elastic(run, monkeypatch, "kill:rank=1:step=6+kill:rank=2:step=6") == 1
    err = capfd.readouterr().err
    newest = tmp_path / "both" / "checkpoints" / "step_00000004"
    # rank 1's copy was on rank 2 (lost too); rank 2's on rank 3, alive
    assert "the shards of rank(s) [1] of generation 0 are held by no survivor" in err, err
    assert f"resume from the newest complete checkpoint with --resume {newest}" in err, err
