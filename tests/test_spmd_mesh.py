"""``fully_shard(..., mesh=spmd_mesh, dp_mesh_dims=DataParallelMeshDims(...))`` (torch 2.13;
torchtitan's default path; NOTE [SPMD meshes] in ``engine/spmd.py``): parameters that are
DTensors on one SPMD mesh, ``Replicate()`` on its data-parallel dims, inputs sharded over them.
Under both imports, as threads of this process, against one process in float64: a 1-D mesh
``("dp_shard",)`` of 2, and ``("dp_shard", "tp")`` of 2 x 2 with the first layer's weight and
bias sharded over ``tp`` (the sharded parameter is then ``_StridedShard`` on ``dp_shard``). The
refusals (what FSDP2 refuses, and several shard dims) are in ``tests/fast``.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from fsdp2_programs import fully_shard_of
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import DataParallelMeshDims
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.testing._internal.common_distributed import spawn_threads_and_init_comms

STEPS, DP = 3, 2


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 6), nn.Linear(6, 8))


def _run(impl: str, tp: int) -> dict[int, dict[str, Any]]:
    torch.set_default_dtype(torch.float64)
    ref0 = _model()
    xs = torch.randn(STEPS, 2 * DP, 8)
    ref = copy.deepcopy(ref0)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(STEPS):  # the mean over the data-parallel ranks of their losses' grads
        (ref(xs[step]).pow(2).sum() / DP).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    want = {k: v.detach() for k, v in ref.named_parameters()}
    out: dict[int, dict[str, Any]] = {}

    @spawn_threads_and_init_comms(world_size=DP * tp)
    def train(_: object) -> None:
        rank = torch.distributed.get_rank()
        names = ("dp_shard", "tp") if tp > 1 else ("dp_shard",)
        mesh = init_device_mesh("cpu", (DP, tp) if tp > 1 else (DP,), mesh_dim_names=names)
        model = copy.deepcopy(ref0)
        for i, layer in enumerate(model):
            for n, p in list(layer.named_parameters(recurse=False)):
                tp_place = [Shard(0) if i == 0 else Replicate()] if tp > 1 else []
                dt = distribute_tensor(p.detach(), mesh, [Replicate(), *tp_place])
                setattr(layer, n, nn.Parameter(dt))
        fully_shard = fully_shard_of(impl)
        dims = DataParallelMeshDims(shard="dp_shard")
        fully_shard(model[2], mesh=mesh, dp_mesh_dims=dims)
        fully_shard(model, mesh=mesh, dp_mesh_dims=dims)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        x_place = [Shard(0)] + ([Replicate()] if tp > 1 else [])
        for step in range(STEPS):
            model(distribute_tensor(xs[step], mesh, x_place)).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
        got = {k: p.detach().full_tensor() for k, p in model.named_parameters()}
        out[rank] = {
            "diff": max(float((got[k] - want[k]).abs().max()) for k in want),
            "placements": {k: str(p.placements) for k, p in model.named_parameters()},
            "gathered": type(model[0].weight).__name__,  # the sharded one, between steps
            "params": got,
        }

    try:
        train(object())
    finally:
        torch.set_default_dtype(torch.float32)
    assert sorted(out) == list(range(DP * tp))
    return out


@pytest.mark.parametrize("tp", [1, 2], ids=["dp_shard", "dp_shard_x_tp"])
def test_spmd_mesh_trains_as_torch_and_one_process(tp: int) -> None:
    runs = {impl: _run(impl, tp) for impl in ("torch", "fullshard")}
    for rank, res in runs["fullshard"].items():
        theirs = runs["torch"][rank]
        print(f"\nrank {rank}: diff {res['diff']:.1e} (torch {theirs['diff']:.1e})")
        assert res["diff"] <= 1e-12, res["diff"]
        assert res["placements"] == theirs["placements"], (res["placements"], theirs)
        for k, t in res["params"].items():
            assert torch.equal(t, theirs["params"][k]), k  # bit for bit as torch
    placements = runs["fullshard"][0]["placements"]
    if tp > 1:  # the data-parallel split happens inside each tp shard of dim 0
        assert placements["0.weight"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"
    assert placements["2.weight"].startswith("(Shard(dim=0)"), placements
