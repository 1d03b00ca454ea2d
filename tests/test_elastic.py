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

from fullshard.app.cli import main
from fullshard.app.launch import elastic as elastic_launch
from fullshard.elastic import (
    Joiner,
    Unrecoverable,
    assemble,
    choose_boundary,
    cut_for,
    decide,
    state_dicts,
)
from fullshard.elastic.membership import Decision, admission, after_loss

COMMON = [
    *["--model", "tiny", "--max-steps", "8", "--batch-size", "16", "--micro-batch-size", "2"],
    *["--seq-len", "64", "--sample-tokens", "0", "--no-progress", "--log-every", "1"],
    *["--eval-every", "0"],
    "--deterministic",
]


def _held(own: dict[int, str], copy: dict[int, str]) -> dict[str, Any]:
    return {"own": own, "copy": copy}


@pytest.mark.fast
def test_the_newest_boundary_every_shard_of_which_a_participant_holds() -> None:
    # four ranks (generation 0), rank 2 lost: its copy is on rank 3 (the next in the ring)
    held = {m: _held({4: f"0:{m}", 5: f"0:{m}"}, {4: f"0:{(m - 1) % 4}"}) for m in (0, 1, 3)}
    # boundary 5's copies were not sent yet (a step later): 4 is the newest held in full
    assert choose_boundary(held, {0: 4}) == (4, {"0:0": 0, "0:1": 1, "0:3": 3, "0:2": 3})
    held[3]["copy"] = {}  # rank 3 died in boundary 4's exchange, before it received 2's copy
    assert choose_boundary(held, {0: 4}) is None
    # ranks 1 and 2 lost together: rank 1's copy was on rank 2
    held = {m: _held({5: f"0:{m}"}, {5: f"0:{(m - 1) % 4}"}) for m in (0, 3)}
    assert choose_boundary(held, {0: 4}) is None
    # HSDP, two replicas of two shards (keys rank % 2): rank 2 lost, rank 0 holds shard 0
    held = {m: _held({5: f"1:{m % 2}"}, {}) for m in (0, 1, 3)}
    assert choose_boundary(held, {1: 2}) == (5, {"1:0": 0, "1:1": 1})


def _alive_of(old: list[int], dead: set[int]) -> list[int]:
    return [m for m in old if m not in dead]


def _power_of_two(world: int) -> bool:
    return world & (world - 1) == 0


@pytest.mark.fast
def test_the_next_membership_keeps_slots_fills_them_and_shrinks_to_a_world_the_job_takes() -> None:
    old = [0, 1, 2, 3]
    every = lambda kept: True  # noqa: E731
    # rank 2 lost, its replacement 7 waiting: it takes rank 2's slot
    d = decide(old, _alive_of(old, {2}), [Joiner(7, replaces=2)], _power_of_two, every)
    assert d == Decision([0, 1, 7, 3], lost=[2], joined=[2], left=[])
    # a node (ranks 2, 3) lost, nobody waiting: the two survivors go on at world 2
    d = decide(old, _alive_of(old, {2, 3}), [], _power_of_two, every)
    assert d == Decision([0, 1], lost=[2, 3], joined=[], left=[])
    # one lost, none waiting: three cannot run, so one survivor is left out; the highest rank
    # whose shards the others also hold (rank 3 holds rank 2's copy: rank 1 goes)
    holds_all = lambda kept: 3 in kept  # noqa: E731
    d = decide(old, _alive_of(old, {2}), [], _power_of_two, holds_all)
    assert d == Decision([0, 3], lost=[2], joined=[], left=[1])
    # joiners fill the world after the survivors, in the order they asked
    d = decide([0, 1], [0, 1], [Joiner(5), Joiner(6), Joiner(8)], _power_of_two, every)
    assert d == Decision([0, 1, 5, 6], lost=[], joined=[2, 3], left=[])
    assert decide(old, [], [], _power_of_two, every) is None
    # everyone checked in and nobody waits: not a loss (every rank's error is kept to say so)
    ready = {m: {"error": f"e{m}", "failed_at": 1.0} for m in old}
    assert after_loss(old, ready, {}, [], _power_of_two, every) == {
        "members": old,
        "unchanged": True,
        "errors": [(0, "e0"), (1, "e1"), (2, "e2"), (3, "e3")],
    }
    # joiners are admitted in the order they asked, as many as make a world the job takes
    assert admission([0, 1], [Joiner(5)], _power_of_two) is None
    record = admission([0, 1], [Joiner(5), Joiner(6), Joiner(7)], _power_of_two)
    assert record is not None and (record["members"], record["joined"]) == ([0, 1, 5, 6], [2, 3])


def _pieces(box: tuple[int, int], full: torch.Tensor, step: torch.Tensor) -> dict[str, Any]:
    a, b = box
    return {
        "chunks": {
            "model\0w": ([4, 3], [a, 0], full[a:b].clone()),
            "optim\0w\0exp_avg": ([4, 3], [a, 0], -full[a:b]),
        },
        "fulls": {"optim\0w\0step": step},
        "objects": {"param_groups": [{"lr": 0.1, "params": ["w"]}], "state": {"k": 1}},
    }


@pytest.mark.fast
def test_each_new_rank_receives_the_blocks_of_its_new_shard_only() -> None:
    """NOTE [Restore by blocks]: pieces of 2 old ranks (rows 0-1, 2-3) restored at 3 new ranks
    (rows 0-1, 2-3, none: torch.chunk's split of 4 rows): each new rank gets the intersections
    with its own rows, the unsharded tensors and objects from one provider."""
    full = torch.arange(12.0).reshape(4, 3)
    step = torch.tensor(5.0)
    old = [_pieces((0, 2), full, step), _pieces((2, 4), full, step)]
    new_rows = [(0, 2), (2, 4), (4, 4)]
    boxes = [{"w": ([b - a, 3], [a, 0])} for a, b in new_rows]
    sent = [
        [cut_for([part], box, with_whole=p == 0) for box in boxes] for p, part in enumerate(old)
    ]
    for rank, (a, b) in enumerate(new_rows):
        received = [sent[p][rank] for p in range(len(old))]
        blocks, whole = assemble(received, boxes[rank])
        model_sd, optim_sd, state = state_dicts(blocks, whole)
        assert torch.equal(model_sd["w"], full[a:b]) if b > a else model_sd["w"].numel() == 0
        assert torch.equal(optim_sd["state"]["w"]["exp_avg"], -full[a:b])
        assert optim_sd["state"]["w"]["step"] is not None and state == {"k": 1}
        assert optim_sd["param_groups"] == [{"lr": 0.1, "params": ["w"]}]
    # new rank 0 got rows 0-1 of each tensor from old rank 0 alone, nothing from old rank 1
    assert sent[1][0].numel() < sent[0][0].numel()
    with pytest.raises(Unrecoverable, match="model.w: no survivor holds all of it"):
        assemble([sent[0][1]], boxes[1])  # rows 2-3 lost with old rank 1


@pytest.mark.fast
@pytest.mark.parametrize("ordered", [True, False])
def test_a_copy_off_the_device_blocks_no_host_and_the_next_update_waits_for_it(
    ordered: bool,
) -> None:
    """The CUDA path's copies (NOTE [Ring copies]) checked on CPU: async into pinned memory on a
    side stream, read on the host only through their event, with no host synchronisation; the
    optimizer's update, which overwrites what they read, ordered after them (else an error)."""
    from fullshard.comm import device as comm_device
    from fullshard.elastic.pieces import HostCopy, pieces_of, unpacked, update_after_copies
    from fullshard.testing import emulation

    cpu = torch.device("cpu")
    with emulation.cuda_emulation(all_device=True):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        for _ in range(2):
            model(torch.ones(2, 4)).sum().backward()
            opt.step()
        emulation.reset_sync_counts()
        stream = comm_device.new_stream(cpu, "copy")
        pieces, event, flat = pieces_of(model.state_dict(), opt.state_dict(), {}, cpu, stream)
        copy = HostCopy(0, "0:0", pieces, event, flat)
        if ordered:
            update_after_copies(opt, lambda: copy.event, cpu)
        model(torch.ones(2, 4)).sum().backward()
        if not ordered:
            with pytest.raises(emulation.StreamOrderError, match="on stream 'copy' read"):
                opt.step()
            return
        opt.step()
        meta, sent = copy.packed()
        assert emulation.sync_counts() == {}
    got = unpacked(meta, sent)["fulls"]["model\0weight"]  # as the ring neighbour reads it
    assert got.data_ptr() == sent.data_ptr()  # a view of the buffer sent: no copy
    assert not torch.equal(got, model.weight.detach())  # the copy holds the weights before
    assert torch.equal(got, copy.pieces["fulls"]["model\0weight"])


@pytest.mark.fast
def test_what_elastic_refuses_before_launch(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for key in ("RANK", "WORLD_SIZE", "FULLSHARD_ELASTIC_RDZV"):
        monkeypatch.delenv(key, raising=False)
    # without --deterministic: 8 micro-batches (16 in 2s) split over 1, 2, 4 or 8 ranks only
    assert main(["train", "--elastic", "--nproc", "3", "--micro-batch-size", "2"]) == 2
    assert "which split evenly over 1, 2, 4, 8 ranks" in capsys.readouterr().err
    for extra in (["--async-save"], ["--grad-accum", "2"], ["--tp", "2"]):
        assert main(["train", *COMMON, "--elastic", "--nproc", "4", *extra]) == 2
    # under torchrun, its own c10d rendezvous would restart every worker when a node joins
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["train", *COMMON, "--elastic"]) == 2
    assert "--rdzv-backend fullshard" in capsys.readouterr().err


def _sha(ckpt: Path, out: Path) -> str:
    converted(ckpt, out)
    return hashlib.sha256(out.read_bytes()).hexdigest()


def _elastic(
    argv: list[str],
    monkeypatch: pytest.MonkeyPatch,
    fault: str,
    nproc: int = 4,
    common: list[str] = COMMON,
) -> int:
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("FULLSHARD_FAULT", fault)
    bounded = functools.partial(elastic_launch.launch_elastic, timeout_s=240)
    monkeypatch.setattr(elastic_launch, "launch_elastic", bounded)
    return main(["train", *common, "--nproc", str(nproc), "--elastic", "--timeout", "60", *argv])


def uninterrupted_sha(tmp: Path) -> str:
    """The weights' sha256 after the uninterrupted run on one rank (--deterministic: the same
    bits at any world size)."""
    # (a forkserver started by an earlier launch may hold a fault: cleared here)
    ok = train_on_ranks(
        [*COMMON, "--runs-dir", str(tmp), "--name", "one"], world=1, env={"FULLSHARD_FAULT": ""}
    )
    assert [r["status"] for r in ok] == [0]
    return _sha(tmp / "one" / "checkpoints" / "step_00000008", tmp / "one.safetensors")


@pytest.fixture(scope="module")
def reference_sha(tmp_path_factory: pytest.TempPathFactory) -> str:
    return uninterrupted_sha(tmp_path_factory.mktemp("one", numbered=False))


def _changes(summary: dict[str, Any]) -> list[dict[str, Any]]:
    keys = ("step", "reason", "world_size", "ranks_lost", "ranks_joined", "ranks_left")
    return [{k: c[k] for k in keys} for c in summary["membership"]]


@pytest.mark.e2e
def test_two_lost_ranks_are_replaced_in_memory_and_the_weights_are_the_same_bits(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
    reference_sha: str,
) -> None:
    run = ["--runs-dir", str(tmp_path), "--name", "elastic"]
    # rank 2 in the first step (the boundary before any update holds no shard: any survivor's
    # copy restores it), rank 0 later
    assert _elastic(run, monkeypatch, "kill:rank=2:step=1+kill:rank=0:step=6") == 0
    err = capfd.readouterr().err
    before = json.loads(re.search(r"ranks 0-3 are pids (\[.*\])", err).group(1))  # type: ignore[union-attr]
    summary = json.loads((tmp_path / "elastic" / "summary.json").read_text())
    assert summary["process_restarts"] == 0 and summary["resumed_from"] is None
    # the first loss replays step 1; the second from the newest boundary whose copies were sent
    lost = {"reason": "loss", "world_size": 4, "ranks_left": []}
    assert _changes(summary) == [
        {"step": 1, **lost, "ranks_lost": [2], "ranks_joined": [2]},
        {"step": 5, **lost, "ranks_lost": [0], "ranks_joined": [0]},
    ]
    assert summary["pids_at_start"] == before
    after = summary["pids"]  # the survivors kept their processes; the lost slots are new ones
    assert [after[r] == before[r] for r in range(4)] == [False, True, False, True]
    ckpt = tmp_path / "elastic" / "checkpoints" / "step_00000008"
    assert _sha(ckpt, tmp_path / "elastic.safetensors") == reference_sha


@pytest.mark.e2e
def test_under_hsdp_a_lost_replica_is_rebuilt_from_the_other_replica(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reference_sha: str
) -> None:
    # two replicas of a shard group of two: rank 2 holds what rank 0 holds, nothing is sent
    run = [
        "--runs-dir",
        str(tmp_path),
        *["--name", "hsdp", "--strategy", "hybrid_shard", "--shard-size", "2"],
    ]
    assert _elastic(run, monkeypatch, "kill:rank=2:step=4") == 0
    summary = json.loads((tmp_path / "hsdp" / "summary.json").read_text())
    # the newest boundary (3) is held in full by the survivors themselves: no step replayed
    assert _changes(summary) == [
        {
            "step": 4,
            "reason": "loss",
            "world_size": 4,
            "ranks_lost": [2],
            "ranks_joined": [2],
            "ranks_left": [],
        },
    ]
    ckpt = tmp_path / "hsdp" / "checkpoints" / "step_00000008"
    assert _sha(ckpt, tmp_path / "hsdp.safetensors") == reference_sha


@pytest.mark.e2e
def test_the_cuda_path_recovers_with_no_ordering_error_and_no_host_sync_in_a_quiet_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole run on the CUDA code path, checked on CPU (fullshard.testing.cuda_emulation):
    copies on a side stream into pinned memory, the optimizer's update and the next gathers
    ordered after them, the exchange a step later; a lost rank recovered."""
    quiet = ["--log-every", "100"]
    monkeypatch.setenv("FULLSHARD_CUDA_EMULATION", "1")
    run = ["--runs-dir", str(tmp_path), "--name", "cuda", *quiet]
    assert _elastic(run, monkeypatch, "kill:rank=1:step=4", nproc=2) == 0
    summary = json.loads((tmp_path / "cuda" / "summary.json").read_text())
    assert [c["step"] for c in summary["membership"]] == [3]  # step 3 replayed
    syncs = summary["host_syncs_per_step"]
    # 1: lazy init; 2: the step the loss interrupted, and recovery; 8: evaluation and save
    assert {s: n for s, n in syncs.items() if s not in ("1", "2", "8")} == dict.fromkeys(
        "34567", 0
    ), syncs
    # --deterministic turns torch's deterministic algorithms on, but not its fill of every new
    # tensor: each is written whole before it is read (NOTE [Kernel contracts])
    assert summary["filled_bytes"] == 0
    # the CUDA path's own bits (fused AdamW), uninterrupted, on one rank
    ok = train_on_ranks(
        [*COMMON, *quiet, "--runs-dir", str(tmp_path), "--name", "one"],
        world=1,
        env={"FULLSHARD_FAULT": "", "FULLSHARD_CUDA_EMULATION": "1"},
    )
    assert [r["status"] for r in ok] == [0]
    shas = [
        _sha(tmp_path / name / "checkpoints" / "step_00000008", tmp_path / f"{name}.safetensors")
        for name in ("cuda", "one")
    ]
    assert shas[0] == shas[1]


@pytest.mark.e2e
def test_without_deterministic_a_lost_rank_is_recovered_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--elastic alone: the global sampler and micro-batches, plain sums (no fixed order).

    The reference is the same run uninterrupted, not the fixed-order one: plain sums add the
    micro-batches' gradients in another order than the fixed tree, and AdamW turns that
    rounding into differences no tolerance bounds (a gradient near zero can change the sign of
    its update). At the same world size the plain sums are the same sums: each rank adds its
    own micro-batches in order and the reduce-scatter adds two ranks' (one addition, the same
    bits in either order). The replacement takes the lost rank's slot, so the recovered run
    replays step 3 on 2 ranks: the same bits as the uninterrupted run, on any CPU."""
    plain = [a for a in COMMON if a != "--deterministic"]
    for name, fault in (("plain", "kill:rank=1:step=4"), ("uninterrupted", "")):
        run = ["--runs-dir", str(tmp_path), "--name", name]
        assert _elastic(run, monkeypatch, fault, nproc=2, common=plain) == 0
    summary = json.loads((tmp_path / "plain" / "summary.json").read_text())
    assert [(c["step"], c["ranks_lost"], c["world_size"]) for c in summary["membership"]] == [
        (3, [1], 2)
    ]
    shas = [
        _sha(tmp_path / name / "checkpoints" / "step_00000008", tmp_path / f"{name}.safetensors")
        for name in ("plain", "uninterrupted")
    ]
    assert shas[0] == shas[1]


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
    assert f"the newest complete checkpoint is {newest}; resume with: fullshard train " in err
    assert err.rstrip().endswith("--name both --save-every 2 --resume latest"), err
    assert "Traceback" not in err, err


@pytest.mark.e2e
def test_a_hung_rank_is_fenced_killed_and_replaced_with_the_same_bits(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
    reference_sha: str,
) -> None:
    """Rank 1 hangs in step 4, alive and beating (NOTE [Fencing]): its peer's collective outlives
    --timeout, the decider finds its step unmoved and fences it, the launcher kills it and starts
    a replacement, which restores from the survivor's copies."""
    run = ["--runs-dir", str(tmp_path), "--name", "hung", "--timeout", "16"]
    assert _elastic(run, monkeypatch, "hang:rank=1:step=4", nproc=2) == 0
    err = capfd.readouterr().err
    assert re.search(r"member 1 \(pid \d+\) was fenced \(.*\(hung\)\): killed", err), err
    summary = json.loads((tmp_path / "hung" / "summary.json").read_text())
    assert [(c["ranks_lost"], c["ranks_joined"]) for c in summary["membership"]] == [([1], [1])]
    after, before = summary["pids"], summary["pids_at_start"]
    assert after[0] == before[0] and after[1] != before[1]  # the survivor kept its process
    ckpt = tmp_path / "hung" / "checkpoints" / "step_00000008"
    assert _sha(ckpt, tmp_path / "hung.safetensors") == reference_sha
