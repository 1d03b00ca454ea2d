"""Checkpoints: reshard on load, exact resume, atomic commit, checksums, async, full export, and
interop with torch's FSDP2 through torch.distributed.checkpoint."""

from __future__ import annotations

import copy
import glob
import os
import shutil
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from harness import RanksFailed, run_ranks
from toy import ToyLM, batches, full_params, loss_of, shard_toy

from fullshard import FullshardError, get_state_dict, set_state_dict
from fullshard.checkpoint import (
    CheckpointManager,
    convert,
    export_safetensors,
    latest_checkpoint,
)


def _setup(
    dtype: torch.dtype = torch.float64, seed: int = 0
) -> tuple[ToyLM, ToyLM, torch.optim.Optimizer]:
    torch.set_default_dtype(dtype)
    torch.manual_seed(seed)
    ref = ToyLM()
    model = shard_toy(copy.deepcopy(ref))
    return ref, model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, idx: torch.Tensor) -> float:
    loss = loss_of(model, idx)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _ref_step(ref: ToyLM, opt: torch.optim.Optimizer, micro: list[torch.Tensor]) -> None:
    for idx in micro:
        loss_of(ref, idx).backward()
    for p in ref.parameters():
        if p.grad is not None:
            p.grad.div_(len(micro))
    opt.step()
    opt.zero_grad()


def _save(rank: int, world: int, root: str, steps: int) -> dict:
    _, model, opt = _setup()
    data = batches(steps, world)
    for s in range(steps):
        _step(model, opt, data[s][rank])
    model_sd, optim_sd = get_state_dict(model, opt)
    CheckpointManager(root).save(steps, {"model": model_sd, "optim": optim_sd})
    return {}


def _resume(rank: int, world: int, root: str, saved_world: int, steps: int) -> dict:
    ref, model, opt = _setup(seed=123)  # other weights: the load must overwrite them
    torch.manual_seed(0)
    ref = ToyLM()
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    CheckpointManager(root).load(state)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    nxt = batches(1, world, seed=7)[0]
    _step(model, opt, nxt[rank])
    # the uninterrupted run: saved_world micro-batches for `steps` steps, then this step
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    old = batches(steps, saved_world)
    for s in range(steps):
        _ref_step(ref, ref_opt, old[s])
    _ref_step(ref, ref_opt, nxt)
    got, want = full_params(model), ref.state_dict()
    return {"diff": max((got[k] - want[k]).abs().max().item() for k in want)}


def _resume_each(rank: int, world: int, cases: list[tuple[str, int]]) -> list[dict]:
    """``_resume`` of each ``(root, saved_world)`` checkpoint in turn, on the same ranks."""
    return [_resume(rank, world, root, saved, 2) for root, saved in cases]


RESHARDS = [(4, 3), (4, 2), (1, 4), (3, 4)]  # (saved world size, loaded world size)


@pytest.fixture(scope="module")
def reshard_diffs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[int, int], list]:
    """Every rank's result of each ``RESHARDS`` case. A checkpoint is saved once per saved world
    size (4 -> 3 and 4 -> 2 load the same one: a load only reads it), and the checkpoints loaded
    on one world size are loaded by one launch of it, one after the other."""
    roots = {}
    for saved in sorted({s for s, _ in RESHARDS}):
        roots[saved] = str(tmp_path_factory.mktemp(f"saved_on_{saved}"))
        run_ranks(_save, saved, roots[saved], 2)
    out: dict[tuple[int, int], list] = {}
    for loaded in sorted({n for _, n in RESHARDS}):
        saved_on = [s for s, n in RESHARDS if n == loaded]
        per_rank = run_ranks(_resume_each, loaded, [(roots[s], s) for s in saved_on])
        for i, s in enumerate(saved_on):
            out[(s, loaded)] = [r[i] for r in per_rank]
    return out


@pytest.mark.parametrize("saved,loaded", RESHARDS)
def test_load_on_another_world_size_then_step_matches(
    reshard_diffs: dict[tuple[int, int], list], saved: int, loaded: int
) -> None:
    results = reshard_diffs[(saved, loaded)]
    assert len(results) == loaded
    for res in results:
        assert res["diff"] <= 1e-12, res


def _exact_resume(rank: int, world: int, root: str) -> dict:
    # fp32, 2 ranks: 2 steps, save, fresh model + load, 1 step == 3 uninterrupted steps, bitwise
    _, model, opt = _setup(torch.float32)
    _, straight, straight_opt = _setup(torch.float32)
    data = batches(3, world)
    for s in range(2):
        _step(model, opt, data[s][rank])
    mgr = CheckpointManager(root, keep=2)
    msd, osd = get_state_dict(model, opt)
    mgr.save(2, {"model": msd, "optim": osd})
    _, fresh, fresh_opt = _setup(torch.float32, seed=9)
    msd, osd = get_state_dict(fresh, fresh_opt)
    state = {"model": msd, "optim": osd}
    mgr.load(state)
    set_state_dict(
        fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    _step(fresh, fresh_opt, data[2][rank])
    for s in range(3):
        _step(straight, straight_opt, data[s][rank])
    a, b = full_params(fresh), full_params(straight)
    return {"bitwise": all(torch.equal(a[k], b[k]) for k in a)}


def test_resume_is_bitwise_exact_fp32_two_ranks(tmp_path: str) -> None:
    assert all(r["bitwise"] for r in run_ranks(_exact_resume, 2, str(tmp_path)))


def _crash_mid_save(rank: int, world: int, root: str) -> dict:
    _, model, opt = _setup()
    mgr = CheckpointManager(root, keep=2)
    msd, osd = get_state_dict(model, opt)
    mgr.save(1, {"model": msd, "optim": osd})
    before = full_params(model)
    _step(model, opt, batches(1, world)[0][rank])
    if rank == 1:  # rank 1's writer fails halfway through step 2's save
        from torch.distributed.checkpoint import FileSystemWriter

        def broken(self, plan, planner):  # type: ignore[no-untyped-def]
            raise OSError("disk full (injected)")

        FileSystemWriter.write_data = broken  # type: ignore[method-assign]
    error = ""
    try:
        msd, osd = get_state_dict(model, opt)
        mgr.save(2, {"model": msd, "optim": osd})
    except FullshardError as e:
        error = str(e)
    dist.barrier()
    latest = latest_checkpoint(root)
    _, fresh, fresh_opt = _setup(seed=5)
    msd, osd = get_state_dict(fresh, fresh_opt)
    state = {"model": msd, "optim": osd}
    mgr.load(state)
    set_state_dict(
        fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    after = full_params(fresh)
    return {
        "error": error,
        "latest": os.path.basename(latest or ""),
        "partial_left": os.path.isdir(os.path.join(root, "step_00000002.partial")),
        "restored": all(torch.equal(before[k], after[k]) for k in before),
    }


def test_crash_mid_save_keeps_previous_checkpoint(tmp_path: str) -> None:
    for res in run_ranks(_crash_mid_save, 2, str(tmp_path)):
        assert "previous checkpoint is still the latest" in res["error"], res  # on every rank
        assert "failed on rank(s) [1] (OSError: disk full (injected))" in res["error"], res
        # nothing is left half written: rank 0 removed the folder the failed save began
        assert res["latest"] == "step_00000001" and not res["partial_left"]
        assert res["restored"]


def _corrupt(rank: int, world: int, root: str, how: str) -> str:
    _, model, opt = _setup()
    mgr = CheckpointManager(root)
    msd, osd = get_state_dict(model, opt)
    folder = mgr.save(1, {"model": msd, "optim": osd})
    if rank == 0:
        victim = sorted(glob.glob(os.path.join(folder, "*.distcp")))[-1]
        if how == "flip":
            with open(victim, "r+b") as f:
                f.seek(os.path.getsize(victim) // 2)
                byte = f.read(1)
                f.seek(-1, os.SEEK_CUR)
                f.write(bytes([byte[0] ^ 0x01]))
        else:
            os.truncate(victim, os.path.getsize(victim) - 100)
    dist.barrier()
    try:
        mgr.load({"model": msd, "optim": osd})
    except FullshardError as e:
        return str(e)
    return ""


def _corrupt_each(rank: int, world: int, root: str, hows: list[str]) -> dict[str, str]:
    """``_corrupt`` for each kind of damage, each in a folder of its own, on the same ranks."""
    return {how: _corrupt(rank, world, os.path.join(root, how), how) for how in hows}


CORRUPTIONS = [("flip", "SHA-256"), ("truncate", "truncated")]


@pytest.fixture(scope="module")
def corrupt_messages(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, str]]:
    root = str(tmp_path_factory.mktemp("corrupt"))
    return run_ranks(_corrupt_each, 2, root, [how for how, _ in CORRUPTIONS])


@pytest.mark.parametrize("how,says", CORRUPTIONS)
def test_corrupted_checkpoint_is_a_clear_error_on_every_rank(
    corrupt_messages: list[dict[str, str]], how: str, says: str
) -> None:
    assert len(corrupt_messages) == 2
    for by_how in corrupt_messages:
        msg = by_how[how]
        assert says in msg and ".distcp" in msg, msg


def _keep_async_export(rank: int, world: int, root: str) -> dict:
    ref, model, opt = _setup()
    mgr = CheckpointManager(os.path.join(root, "ckpt"), keep=2, async_save=True)
    data = batches(4, world)
    snapshots = {}
    for s in range(1, 4):
        _step(model, opt, data[s][rank])
        msd, osd = get_state_dict(model, opt)
        mgr.save(s, {"model": msd, "optim": osd})
        snapshots[s] = full_params(model)
        _step(model, opt, data[0][rank])  # training goes on while the save is written
    mgr.wait()
    kept = sorted(os.listdir(os.path.join(root, "ckpt")))
    _, fresh, fresh_opt = _setup(seed=3)
    msd, osd = get_state_dict(fresh, fresh_opt)
    mgr.load({"model": msd, "optim": osd})
    got = full_params(fresh)
    path = export_safetensors(model, os.path.join(root, "export"))
    full = full_params(model)  # a collective: every rank calls it
    return {
        "kept": kept,
        "async_ok": all(torch.equal(got[k], snapshots[3][k]) for k in got),
        "full": {k: v.clone() for k, v in full.items()} if rank == 0 else {},
        "saved": snapshots[3] if rank == 0 else {},
        "path": path,
    }


def test_keep_last_k_async_save_and_safetensors_export(tmp_path: str) -> None:
    from safetensors.torch import load_file

    res = run_ranks(_keep_async_export, 2, str(tmp_path))
    assert res[0]["kept"] == ["step_00000002", "step_00000003"]
    assert all(r["async_ok"] for r in res)
    assert res[1]["path"] is None
    exported = load_file(res[0]["path"])
    full = res[0]["full"]
    assert "head.weight" not in exported  # tied to embed.weight: stored once
    for k, v in full.items():
        assert torch.equal(exported.get(k, exported["embed.weight"]), v), k
    # offline convert of the latest sharded checkpoint: no process group needed
    out = convert(latest_checkpoint(os.path.join(str(tmp_path), "ckpt")), str(tmp_path / "conv"))
    converted = load_file(out)
    # offline the tie is not known: both names are written, with equal values
    assert set(converted) == set(exported) | {"head.weight"}
    for k, v in res[0]["saved"].items():  # the newest checkpoint: step 3's weights
        assert torch.equal(converted[k], v), k


def _interop(rank: int, world: int, root: str, direction: str) -> dict:
    from torch.distributed.checkpoint import state_dict as tsd
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    base = ToyLM()
    theirs = copy.deepcopy(base)
    for b in theirs.blocks:
        torch_fully_shard(b)
    torch_fully_shard(theirs)
    their_opt = torch.optim.AdamW(theirs.parameters(), lr=1e-2, weight_decay=0.1)
    ours = shard_toy(copy.deepcopy(base))
    our_opt = torch.optim.AdamW(ours.parameters(), lr=1e-2, weight_decay=0.1)
    data = batches(3, world)
    src, src_opt = (theirs, their_opt) if direction == "fsdp2_to_fullshard" else (ours, our_opt)
    for s in range(2):
        _step(src, src_opt, data[s][rank])
    if direction == "fsdp2_to_fullshard":
        msd, osd = tsd.get_state_dict(theirs, their_opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=root)
        msd, osd = get_state_dict(ours, our_opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=root)
        set_state_dict(
            ours, our_opt, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
        dst, dst_opt = ours, our_opt
    else:
        msd, osd = get_state_dict(ours, our_opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=root)
        msd, osd = tsd.get_state_dict(theirs, their_opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=root)
        tsd.set_state_dict(
            theirs, their_opt, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
        dst, dst_opt = theirs, their_opt
    _step(dst, dst_opt, data[2][rank])
    _step(src, src_opt, data[2][rank])  # the source, uninterrupted
    a, b = full_params(dst), full_params(src)
    return {"diff": max((a[k] - b[k]).abs().max().item() for k in a)}


def _interop_each(rank: int, world: int, root: str, directions: list[str]) -> dict[str, dict]:
    """``_interop`` in each direction, each with a checkpoint folder of its own."""
    out = {}
    for d in directions:
        os.makedirs(os.path.join(root, d), exist_ok=True)
        out[d] = _interop(rank, world, os.path.join(root, d), d)
    return out


DIRECTIONS = ["fsdp2_to_fullshard", "fullshard_to_fsdp2"]


@pytest.fixture(scope="module")
def interop_diffs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, dict]]:
    return run_ranks(_interop_each, 2, str(tmp_path_factory.mktemp("interop")), DIRECTIONS)


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_interop_with_torch_fsdp2_checkpoints(
    interop_diffs: list[dict[str, dict]], direction: str
) -> None:
    assert len(interop_diffs) == 2
    for by_direction in interop_diffs:
        res = by_direction[direction]
        assert res["diff"] <= 1e-12, res


def test_harness_reports_save_failures_as_failures(tmp_path: str) -> None:
    # loading a folder that was never committed fails clearly, on every rank
    with pytest.raises(RanksFailed, match="no committed checkpoint"):
        run_ranks(_load_nothing, 2, str(tmp_path))


def _load_nothing(rank: int, world: int, root: str) -> None:
    _, model, opt = _setup()
    msd, osd = get_state_dict(model, opt)
    CheckpointManager(root).load({"model": msd, "optim": osd})


def _state_of(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def _lost_in_a_commit(rank: int, world: int, root: str) -> str:
    """NOTE [Saving without DCP's collectives]: rank 0 moves on (as to a recovery) once the
    merged ``.metadata`` is written, without its verdict; rank 1 waits for that verdict. Under
    live recovery its wait polls the membership's token, which fires here once rank 0 has
    moved on: rank 1 gives up at once, where DCP's own broadcast waited out the timeout."""
    from fullshard.comm.desync import Interrupt, Interrupted, set_interrupt

    _, model, opt = _setup()
    moved_on = os.path.join(root, "moved-on")
    set_interrupt(Interrupt(lambda: os.path.exists(moved_on), "rank 0 moved on"))

    def hook(point: str, step: int) -> None:
        if point == "metadata":  # rank 0, after .metadata, before the commit
            open(moved_on, "w").close()
            raise RuntimeError("rank 0 left the save")

    done = os.path.join(root, "rank-1-done")
    try:
        CheckpointManager(root, hook=hook).save(1, _state_of(model, opt))
    except Interrupted as exc:
        open(done, "w").close()
        return f"interrupted: {exc}"
    except RuntimeError as exc:
        # alive, as a survivor in recovery is (its sockets stay open), until rank 1 is done
        while not os.path.exists(done):
            time.sleep(0.05)
        return str(exc)
    finally:
        set_interrupt(None)
    return "saved"


def test_a_rank_waiting_in_a_save_gives_up_when_the_membership_moves_on(tmp_path: str) -> None:
    # (the waits are bounded by the run's timeout, 600 s: far past the harness's deadline)
    got = run_ranks(_lost_in_a_commit, 2, str(tmp_path))
    assert got == ["rank 0 left the save", "interrupted: rank 0 moved on while this rank waited"]
    assert latest_checkpoint(str(tmp_path)) is None  # never committed: never loaded


def _disk_full(rank: int, world: int, root: str) -> dict:
    """A full disk, found before a save (the newest checkpoint's size against the free space)
    and at a rank's write (ENOSPC): the same error on every rank, naming the disk and the newest
    complete checkpoint, and nothing left half written."""
    import errno
    from collections import namedtuple

    from fullshard.checkpoint import store

    _, model, opt = _setup()
    mgr = CheckpointManager(root)
    first = mgr.save(1, _state_of(model, opt))
    out: dict = {}
    usage = shutil.disk_usage(root)
    small = namedtuple("usage", "total used free")(usage.total, usage.used, 1000)
    real = store.shutil.disk_usage
    store.shutil.disk_usage = lambda path: small  # type: ignore[assignment]
    try:
        mgr.save(2, _state_of(model, opt))
    except store.CheckpointDiskFull as exc:
        out["before"] = (str(exc), exc.newest)
    finally:
        store.shutil.disk_usage = real  # type: ignore[assignment]

    def full(point: str, step: int) -> None:
        if point == "write" and rank == 1:
            raise OSError(errno.ENOSPC, "No space left on device")

    mgr.hook = full
    try:
        mgr.save(3, _state_of(model, opt))
    except store.CheckpointDiskFull as exc:
        out["during"] = (str(exc), exc.newest)
    dist.barrier()
    out["left"] = sorted(os.listdir(root))
    out["first"] = first
    return out


def test_a_full_disk_is_named_before_and_during_a_save(tmp_path: str) -> None:
    for res in run_ranks(_disk_full, 2, str(tmp_path)):
        first = res["first"]
        before, newest = res["before"]
        assert newest == first and before.startswith(f"the disk is full: {tmp_path} has 0.0 MiB"), (
            res
        )
        assert f"Nothing was written; {first} is the newest complete checkpoint" in before
        during, newest = res["during"]
        assert newest == first, res
        assert "saving checkpoint step 3" in during and "failed on rank(s) [1]" in during, during
        assert "No space left on device" in during and f"still the latest ({first})" in during
        assert res["left"] == ["step_00000001"], res  # no .partial of step 2 or step 3
