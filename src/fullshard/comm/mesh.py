"""Process groups and mesh information (layer 2). No module-level globals: every unit holds one.

A unit's collectives run on its *shard group*. ``mesh=None`` means the default (world) group; a
1-D ``DeviceMesh`` means its only dimension. The ``DeviceMesh`` itself is needed only at the
state-dict boundary (DTensor), so it is created lazily when none was given.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from fullshard.comm.device import accepted_devices, check_device
from fullshard.policies import FullshardError, FullshardValueError, fsdp2_words

DEFAULT_TIMEOUT_S = 600.0


def default_timeout() -> timedelta:
    """How long any blocking wait may take before it raises (``FULLSHARD_TIMEOUT_S`` overrides)."""
    return timedelta(seconds=float(os.environ.get("FULLSHARD_TIMEOUT_S", DEFAULT_TIMEOUT_S)))


@dataclass
class MeshInfo:
    """The groups a unit works over, with ranks, sizes, device and wait timeout.

    ``group`` is the *shard* group (all-gather and reduce-scatter run there). On a 2-D mesh
    ``(replicate, shard)`` (HYBRID_SHARD; NO_SHARD is the shard size 1 case) ``replicate_group``
    joins the ranks that hold the same shard; their gradients are all-reduced across it.
    """

    group: dist.ProcessGroup
    rank: int
    world_size: int
    device: torch.device
    timeout: timedelta = field(default_factory=default_timeout)
    replicate_group: dist.ProcessGroup | None = None
    replicate_size: int = 1
    _mesh: DeviceMesh | None = None

    @property
    def device_mesh(self) -> DeviceMesh:
        """The DeviceMesh the DTensors of the state dict live on (created on first use)."""
        if self._mesh is None:
            self._mesh = DeviceMesh.from_group(self.group, self.device.type)
        return self._mesh

    @property
    def placements(self) -> tuple[Placement, ...]:
        """DTensor placements of a sharded parameter on ``device_mesh``."""
        return (Shard(0),) if self.replicate_group is None else (Replicate(), Shard(0))

    def post_forward_group(self, size: int) -> tuple[dist.ProcessGroup, int]:
        """The group of ``size`` consecutive ranks of this mesh that this rank belongs to, and its
        rank there: FSDP2's post-forward mesh (the mesh's ranks viewed as rows of ``size``).
        Every rank of the mesh must call it (it creates the groups)."""
        ranks = self.device_mesh.mesh.reshape(-1, size)
        sub = DeviceMesh(self.device.type, ranks, mesh_dim_names=("outer", "post_forward"))
        group = sub.get_group("post_forward")
        return group, dist.get_rank(group)

    def separate_group(self, made: dict[tuple[int, ...], dist.ProcessGroup]) -> dist.ProcessGroup:
        """A new process group over this shard group's ranks, for the reduce-scatter to run
        beside the all-gathers (``set_separate_reduce_scatter_group``); ``made`` holds those
        already created in this call, by ranks, so units over the same ranks share one. The
        ranks of the group must all call it (``use_local_synchronization``)."""
        ranks = tuple(dist.get_process_group_ranks(self.group))
        if ranks not in made:
            made[ranks] = dist.new_group(list(ranks), use_local_synchronization=True)
        return made[ranks]

    @property
    def data_parallel_size(self) -> int:
        """How many ranks see different data: gradients are averaged over this many."""
        return self.world_size * self.replicate_size


def compute_device(group: dist.ProcessGroup, hint: torch.device | None) -> torch.device:
    """Where a unit computes when no mesh says so: the current GPU when the group moves only
    CUDA tensors (NCCL: like FSDP2, the shards move there) or the parameters already live on a
    GPU (gloo sharing GPUs, for tests); else the CPU."""
    if "cpu" not in accepted_devices(group) or (hint is not None and hint.type == "cuda"):
        if not torch.cuda.is_available():
            raise FullshardError(
                f"rank {dist.get_rank()}: the process group's backend ({dist.get_backend(group)}) "
                "needs CUDA, but no CUDA device is visible here. Use the gloo backend on CPU."
            )
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def mesh_info(
    mesh: DeviceMesh | None, hint: torch.device | None = None, where: str = "fully_shard"
) -> MeshInfo:
    """Build the MeshInfo for ``fully_shard(mesh=...)``: None, 1-D (shard) or 2-D (replicate, shard).

    ``hint``: where the module's parameters are now (decides the device when ``mesh`` is None).
    The device is checked against the group's backend here, before any collective
    (NOTE [Device discipline]).
    """
    if not dist.is_available() or not dist.is_initialized():
        raise FullshardError(
            "fully_shard needs an initialised process group: call "
            "torch.distributed.init_process_group(...) first (or launch with `fullshard train` / "
            "torchrun, which do it for you)."
        )
    if mesh is None:
        group = dist.group.WORLD
        assert group is not None
        device = compute_device(group, hint)
        check_device(device, group, where)
        return MeshInfo(group, dist.get_rank(group), dist.get_world_size(group), device)
    if mesh.ndim not in (1, 2):
        raise FullshardValueError(
            fsdp2_words(
                f"fully_shard got a {mesh.ndim}-D DeviceMesh; pass a 1-D mesh (shard) or a 2-D "
                "mesh (replicate, shard) for hybrid sharding.",
                f"fully_shard expects a 1D or 2D DeviceMesh but got {mesh}",
            )
        )
    device = torch.device(mesh.device_type)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    shard_dim = mesh.ndim - 1
    group = mesh.get_group(shard_dim)
    replicate = mesh.get_group(0) if mesh.ndim == 2 else None
    for g in (group, replicate):
        if g is not None:
            check_device(device, g, f"{where} (a '{mesh.device_type}' DeviceMesh)")
    return MeshInfo(
        group,
        dist.get_rank(group),
        dist.get_world_size(group),
        device,
        replicate_group=replicate,
        replicate_size=dist.get_world_size(replicate) if replicate is not None else 1,
        _mesh=mesh,
    )
