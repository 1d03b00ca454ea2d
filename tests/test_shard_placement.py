"""``fully_shard(..., shard_placement_fn=...)`` over gloo ranks, against one process in float64.

Two launches serve every test here (each costs seconds on two cores): 4 ranks train the variants
and save a DCP checkpoint of a Shard(1) model; 2 ranks train, check contiguity, state dicts and
a sharded safetensors load, and resume the 4-rank checkpoint. The placements, bad inputs and the
count of collectives per unit and phase are checked in one process
(``tests/fast/test_fast_shard_placement.py``).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from harness import run_ranks
from placement_models import Block, Net, dim1, largest_dim, shard_net
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from toy import batches, full_params, loss_of, reference_step

EXACT = 1e-12
STEPS = 3


def _nets(seed: int = 0) -> tuple[Net, Net]:
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(seed)
    ref = Net()
    return ref, copy.deepcopy(ref)


def _diff(model: nn.Module, ref: nn.Module) -> float:
    got, want = full_params(model), ref.state_dict()
    return max(float((got[k] - want[k]).abs().max()) for k in want)


def _checks(model: Net) -> tuple[list[Any], list[str]]:
    """Forward hooks recording, for each leaf module's parameters, whether the module computes
    with contiguous full-shape plain tensors (and a Block's 3-D ``mix``, seen from its norm)."""
    bad: list[str] = []
    full = {
        id(m): {n: p.shape for n, p in m.named_parameters(recurse=False)} for m in model.modules()
    }

    def check(owner: nn.Module) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            for n, shape in full[id(owner)].items():
                p = getattr(owner, n)
                if isinstance(p, DTensor) or not p.is_contiguous() or p.shape != shape:
                    bad.append(f"{type(owner).__name__}.{n}")

        return hook

    handles = []
    for m in model.modules():
        if not list(m.children()):
            handles.append(m.register_forward_pre_hook(check(m)))
        if isinstance(m, Block):
            handles.append(m.norm.register_forward_pre_hook(check(m)))
    return handles, bad


def _grad_problems(model: nn.Module) -> list[str]:
    out = []
    for name, p in model.named_parameters():
        g = p.grad
        ok = (
            isinstance(g, DTensor)
            and g.placements == p.placements
            and g.to_local().is_contiguous()
            and g.to_local().shape == p.to_local().shape
        )
        if not ok:
            out.append(name)
    return out


def _train(
    model: nn.Module, ref: nn.Module, rank: int, world: int, steps: int = STEPS, check: bool = False
) -> dict[str, Any]:
    """``steps`` Adam steps of the sharded model and of one process fed every rank's batch."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    data = batches(steps, world)
    loss_diff, gathered, grads = 0.0, [], []
    for s in range(steps):
        handles, bad = _checks(model) if check and s == 0 else ([], [])
        loss = loss_of(model, data[s][rank])
        loss.backward()
        for h in handles:
            h.remove()
        gathered += bad
        grads += _grad_problems(model) if check else []
        ref_losses = reference_step(ref, ref_opt, data[s])
        loss_diff = max(loss_diff, abs(loss.item() - ref_losses[rank]))
        opt.step()
        opt.zero_grad()
    return {
        "loss": loss_diff,
        "params": _diff(model, ref),
        "noncontiguous_gathered": gathered,
        "bad_grads": grads,
        "locals": all(p.to_local().is_contiguous() for p in model.parameters()),
        "placements": {k: tuple(p.placements) for k, p in model.named_parameters()},
        "opt": opt,
    }


def _variants(rank: int, world: int) -> dict[str, dict[str, Any]]:
    """Shard(1) for every 2-D and 3-D parameter, and FSDP2's largest-dim function."""
    out = {}
    for name, fn in [("dim1", dim1), ("largest", largest_dim)]:
        ref, model = _nets()
        out[name] = _train(shard_net(model, fn), ref, rank, world, check=name == "dim1")
    return out


def _results(out: dict[str, Any]) -> dict[str, Any]:
    """What goes back to the test: everything but the optimizers."""
    return {k: {kk: vv for kk, vv in v.items() if kk != "opt"} for k, v in out.items()}


def _four(rank: int, world: int, folder: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    import fullshard

    out = _variants(rank, world)
    ref, model = _nets()
    out["raf2"] = _train(shard_net(model, dim1, reshard_after_forward=2), ref, rank, world)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    ref, model = _nets()
    out["hsdp"] = _train(shard_net(model, dim1, mesh=mesh), ref, rank, world, check=True)
    # the checkpoint: a Shard(1) model after 2 steps
    ref, model = _nets()
    res = _train(shard_net(model), ref, rank, world, steps=2)
    msd, osd = fullshard.get_state_dict(model, res["opt"])
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=folder)
    return {**_results(out), "saved_placements": {k: v.placements for k, v in msd.items()}}


def _resume(rank: int, world: int, folder: str, saved_world: int, fn: Any) -> float:
    """Load the Shard(1) checkpoint into a model placed by ``fn``, step once more; the largest
    difference from one process that ran the saved steps and this one."""
    import torch.distributed.checkpoint as dcp

    import fullshard

    ref, model = _nets(seed=5)  # other weights: the load must overwrite them
    shard_net(model, fn)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    msd, osd = fullshard.get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=folder)
    fullshard.set_state_dict(
        model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    ref, _ = _nets()
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    for micro in batches(2, saved_world):
        reference_step(ref, ref_opt, micro)
    nxt = batches(1, world, seed=7)[0]
    loss_of(model, nxt[rank]).backward()
    opt.step()
    reference_step(ref, ref_opt, nxt)
    return _diff(model, ref)


def _load_state_dicts(rank: int, world: int) -> dict[str, float]:
    """``load_state_dict`` into a model placed by ``dst`` of full tensors (``src`` None) or of
    the state dict of a model placed by ``src``: same layout, and Shard(0) <-> Shard(1); and the
    export path's full state dict (one gather and copy-out per unit) of a Shard(1) model."""
    ref, _ = _nets(seed=3)
    out = {}
    cases = [("full", "", dim1), ("same", dim1, dim1), ("dim0->dim1", None, dim1)]
    for name, src, dst in [*cases, ("dim1->dim0", dim1, None)]:
        target = shard_net(_nets()[1], dst)
        if src == "":
            sd = ref.state_dict()
        else:
            sd = shard_net(copy.deepcopy(ref), src).state_dict()
            assert isinstance(sd["head.weight"], DTensor)
        target.load_state_dict(sd)
        out[name] = _diff(target, ref)
        assert target.head.weight.placements == ((Shard(1),) if dst else (Shard(0),))
        if name == "full":  # and the export path's gather (one copy-out per unit) back
            from fullshard.checkpoint import full_state_dict

            full = full_state_dict(target, rank0_only=False)
            out["export"] = max(
                float((full[k] - v).abs().max()) for k, v in ref.state_dict().items()
            )
    return out


def _safetensors(rank: int, world: int, folder: str) -> dict[str, Any]:
    from safetensors.torch import save_file

    from fullshard.checkpoint import load_safetensors

    ref, _ = _nets(seed=4)
    path = Path(folder) / "model.safetensors"
    if rank == 0:
        save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(path))
    dist.barrier()
    with torch.device("meta"):
        model = Net()
    shard_net(model)
    model.to_empty(device="cpu")
    load_safetensors(model, path)
    c = 8 // world
    local = model.head.weight.to_local()
    return {
        "diff": _diff(model, ref),
        "own_columns": torch.equal(local, ref.head.weight[:, rank * c : (rank + 1) * c]),
        "placement": model.head.weight.placements,
    }


def _disagreement(rank: int) -> str:
    """What ``fully_shard`` raises when the ranks' functions answer differently."""
    from fullshard import FullshardError, fully_shard

    def fn(p: nn.Parameter) -> Shard | None:
        return Shard(1) if rank == 0 and p.dim() == 2 else None

    try:
        fully_shard(nn.Linear(8, 4), shard_placement_fn=fn)
    except FullshardError as exc:
        return str(exc)
    return ""


def _two(rank: int, world: int, folder: str, saved: str) -> dict[str, Any]:
    out: dict[str, Any] = {"disagreement": _disagreement(rank), **_results(_variants(rank, world))}
    out["state_dicts"] = _load_state_dicts(rank, world)
    out["safetensors"] = _safetensors(rank, world, folder)
    out["resume_dim1"] = _resume(rank, world, saved, 4, dim1)
    out["resume_dim0"] = _resume(rank, world, saved, 4, None)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[dict[str, Any]]]:
    saved = str(tmp_path_factory.mktemp("ckpt4"))
    four = run_ranks(_four, 4, saved, timeout_s=240)
    two = run_ranks(_two, 2, str(tmp_path_factory.mktemp("st")), saved, timeout_s=240)
    return {4: four, 2: two}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("variant", ["dim1", "largest"])
def test_training_matches_one_process(runs: dict, world: int, variant: str) -> None:
    for r in runs[world]:
        res = r[variant]
        assert res["loss"] <= EXACT and res["params"] <= EXACT, res
    placed = runs[world][0][variant]["placements"]
    if variant == "dim1":
        assert placed["blocks.0.fc1.weight"] == (Shard(1),), placed
        assert placed["blocks.0.fc1.bias"] == (Shard(0),), placed
    else:
        assert placed["blocks.0.fc2.weight"] == (Shard(1),), placed
        assert placed["blocks.0.fc1.weight"] == (Shard(0),), placed


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_gathered_and_gradients_are_contiguous(runs: dict, world: int) -> None:
    for r in runs[world]:
        res = r["dim1"]
        assert res["locals"] and not res["noncontiguous_gathered"] and not res["bad_grads"], res


def test_reshard_after_forward_2_and_hsdp_at_4_ranks(runs: dict) -> None:
    for r in runs[4]:
        for variant in ("raf2", "hsdp"):
            res = r[variant]
            assert res["loss"] <= EXACT and res["params"] <= EXACT, (variant, res)
        assert not r["hsdp"]["noncontiguous_gathered"] and not r["hsdp"]["bad_grads"], r["hsdp"]
    from torch.distributed.tensor import Replicate

    assert runs[4][0]["hsdp"]["placements"]["head.weight"] == (Replicate(), Shard(1))


def test_state_dicts_load_any_layout(runs: dict) -> None:
    assert runs[4][0]["saved_placements"]["blocks.1.mix"] == (Shard(1),)
    for r in runs[2]:
        assert all(v <= EXACT for v in r["state_dicts"].values()), r["state_dicts"]


def test_dcp_saved_at_4_ranks_resumes_at_2(runs: dict) -> None:
    for r in runs[2]:
        # into the same Shard(1) placements, and into Shard(0) ones (DCP reshards both)
        assert r["resume_dim1"] <= EXACT and r["resume_dim0"] <= EXACT, r


def test_load_safetensors_reads_this_ranks_columns(runs: dict) -> None:
    for r in runs[2]:
        st = r["safetensors"]
        assert st["diff"] == 0.0 and st["own_columns"] and st["placement"] == (Shard(1),), st


def test_ranks_whose_functions_disagree_all_raise(runs: dict) -> None:
    for r in runs[2]:
        msg = r["disagreement"]
        assert "differs across ranks" in msg and "'weight'" in msg, msg
        assert "shard_placement_fn dim 0 vs 1" in msg, msg
