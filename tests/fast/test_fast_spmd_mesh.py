"""``fully_shard(..., dp_mesh_dims=...)`` arguments fullshard refuses, on every rank, with the
exception type FSDP2 raises (NOTE [SPMD meshes] in ``engine/spmd.py``); training with it is in
``tests/test_spmd_mesh.py``."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import DataParallelMeshDims
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from fullshard import fully_shard

pytestmark = pytest.mark.fast


def _linear(mesh: Any, placements: list[Any] | None) -> nn.Linear:
    lin = nn.Linear(4, 8)
    if placements is not None:
        for n, p in list(lin.named_parameters()):
            setattr(lin, n, nn.Parameter(distribute_tensor(p.detach(), mesh, placements)))
    return lin


@pytest.mark.parametrize(
    "names,shape,placements,dims,exc,says",
    [
        (("dp_shard",), (4,), None, {"shard": "dp_shard"}, ValueError, "a plain tensor"),
        (("dp_shard",), (4,), [Shard(0)], {"shard": "dp_shard"}, ValueError, "Replicate()"),
        (("dp_shard",), (4,), [Replicate()], {"shard": "dp"}, ValueError, "no ['dp']"),
        (
            ("dp_shard", "cp"),
            (2, 2),
            [Replicate(), Replicate()],
            {"shard": ("dp_shard", "cp")},
            NotImplementedError,
            "_flatten",
        ),
        (
            ("dp_shard", "dp_replicate"),
            (2, 2),
            [Replicate(), Replicate()],
            {"shard": "dp_shard", "replicate": "dp_replicate"},
            ValueError,
            "before the shard dim",
        ),
    ],
    ids=["plain_param", "sharded_on_dp", "unknown_dim", "two_shard_dims", "replicate_last"],
)
def test_refused_as_fsdp2_refuses(
    fake_pg: tuple[int, int],
    names: Any,
    shape: Any,
    placements: Any,
    dims: Any,
    exc: Any,
    says: str,
) -> None:
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    lin = _linear(mesh, placements)
    with pytest.raises(exc) as info:
        fully_shard(lin, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(**dims))
    msg = str(info.value)
    assert says in msg and "unit Linear" in msg, msg


def test_a_one_dim_spmd_mesh_shards_over_it(fake_pg: tuple[int, int]) -> None:
    rank, world = fake_pg
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    lin = _linear(mesh, [Replicate()])
    fully_shard(lin, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp_shard"))
    w = lin.weight
    assert w.device_mesh == mesh and tuple(w.placements) == (Shard(0),)
    assert w._local_tensor.shape == (2, 4)  # rank 1's 2 rows of 8
    x = distribute_tensor(torch.randn(world, 4), mesh, [Shard(0)])
    out = lin(x)  # the gathered parameters are DTensors on the SPMD mesh, Replicate()
    assert tuple(out.placements) == (Shard(0),), out.placements
