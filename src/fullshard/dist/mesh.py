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

from fullshard.policies import FullshardError

DEFAULT_TIMEOUT_S = 600.0


def default_timeout() -> timedelta:
    """How long any blocking wait may take before it raises (``FULLSHARD_TIMEOUT_S`` overrides)."""
    return timedelta(seconds=float(os.environ.get("FULLSHARD_TIMEOUT_S", DEFAULT_TIMEOUT_S)))


@dataclass
class MeshInfo:
    """The group a unit shards over, with its rank, size, device and wait timeout."""

    group: dist.ProcessGroup
    rank: int
    world_size: int
    device: torch.device
    timeout: timedelta = field(default_factory=default_timeout)
    _mesh: DeviceMesh | None = None

    @property
    def device_mesh(self) -> DeviceMesh:
        """The 1-D DeviceMesh of the shard group (created on first use, for DTensor only)."""
        if self._mesh is None:
            self._mesh = DeviceMesh.from_group(self.group, self.device.type)
        return self._mesh

    @property
    def global_rank(self) -> int:
        return dist.get_rank()


def _compute_device(backend: str) -> torch.device:
    if backend == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def mesh_info(mesh: DeviceMesh | None) -> MeshInfo:
    """Build the MeshInfo for ``fully_shard(mesh=...)``."""
    if not dist.is_available() or not dist.is_initialized():
        raise FullshardError(
            "fully_shard needs an initialised process group: call "
            "torch.distributed.init_process_group(...) first (or launch with `fullshard train` / "
            "torchrun, which do it for you)."
        )
    if mesh is None:
        group = dist.group.WORLD
        assert group is not None
        backend = dist.get_backend(group)
        return MeshInfo(group, dist.get_rank(group), dist.get_world_size(group), _compute_device(backend))
    if mesh.ndim != 1:
        raise FullshardError(
            f"fully_shard got a {mesh.ndim}-D DeviceMesh; this version shards over a 1-D mesh "
            "(pass mesh=None for the default group, or a 1-D DeviceMesh)."
        )
    group = mesh.get_group(0)
    device = torch.device(mesh.device_type)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    return MeshInfo(
        group, dist.get_rank(group), dist.get_world_size(group), device, _mesh=mesh
    )
