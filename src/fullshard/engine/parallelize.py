"""FSDP1 vocabulary on top of ``fully_shard`` (layer 8): ``ShardingStrategy`` and ``parallelize``.

Every strategy is one ``fully_shard`` configuration:

| strategy            | mesh                          | reshard_after_forward |
| ------------------- | ----------------------------- | --------------------- |
| FULL_SHARD          | 1-D (all ranks shard)         | True                  |
| SHARD_GRAD_OP       | 1-D                           | False                 |
| NO_SHARD            | 2-D (world, 1): replicate all | False                 |
| HYBRID_SHARD        | 2-D (replicas, shard size)    | True                  |
| HYBRID_SHARD_ZERO2  | 2-D (replicas, shard size)    | False                 |
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fullshard.dist.mesh import compute_device
from fullshard.engine.api import FSDPModule, fully_shard
from fullshard.policies import FullshardError, MixedPrecisionPolicy, OffloadPolicy, ShardingStrategy

_HYBRID = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy.HYBRID_SHARD_ZERO2)


def mesh_device_type(model: nn.Module | None) -> str:
    """The device type of a mesh built for ``model``: the device ``fully_shard`` would pick
    for it without a mesh (``fullshard.dist.mesh.compute_device``)."""
    p = next(model.parameters(), None) if model is not None else None
    hint = p.device if p is not None and not p.is_meta else None
    group = dist.group.WORLD
    assert group is not None
    return compute_device(group, hint).type


def strategy_mesh(
    strategy: ShardingStrategy, mesh: DeviceMesh | None = None, model: nn.Module | None = None
) -> DeviceMesh | None:
    """The mesh ``strategy`` shards over (``None`` = the default group, 1-D)."""
    world = dist.get_world_size()
    if strategy is ShardingStrategy.NO_SHARD:
        if mesh is not None and mesh.ndim == 2 and mesh.size(1) == 1:
            return mesh
        return init_device_mesh(
            mesh_device_type(model), (world, 1), mesh_dim_names=("replicate", "shard")
        )
    if strategy in _HYBRID:
        if mesh is not None:
            if mesh.ndim != 2:
                raise FullshardError(
                    f"{strategy.name} needs a 2-D mesh (replicate, shard); got {mesh.ndim}-D."
                )
            return mesh
        shard = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        if shard >= world or world % shard:
            raise FullshardError(
                f"{strategy.name} on {world} ranks needs a shard group size that divides the "
                f"world and is smaller than it (LOCAL_WORLD_SIZE={shard}); pass "
                "mesh=init_device_mesh(device, (replicas, shard_size))."
            )
        return init_device_mesh(
            mesh_device_type(model), (world // shard, shard), mesh_dim_names=("replicate", "shard")
        )
    if mesh is not None and mesh.ndim != 1:
        raise FullshardError(f"{strategy.name} shards over a 1-D mesh; got {mesh.ndim}-D.")
    return mesh


def reshards_after_forward(strategy: ShardingStrategy) -> bool:
    """FULL_SHARD and HYBRID_SHARD free after forward; the others keep parameters for backward."""
    return strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD)


def _checkpoint_forward(module: nn.Module) -> None:
    # Checkpoint inside the unit's hooks: recomputation reruns only the module's own forward,
    # while the unit is still gathered for its backward.
    forward = module.forward

    @functools.wraps(forward)
    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)

    module.forward = checkpointed  # type: ignore[method-assign]


def parallelize(
    model: nn.Module,
    *,
    strategy: ShardingStrategy | str = ShardingStrategy.FULL_SHARD,
    unit_types: tuple[type[nn.Module], ...] | list[type[nn.Module]] = (),
    mp_policy: MixedPrecisionPolicy | None = None,
    activation_checkpointing: bool = False,
    mesh: DeviceMesh | None = None,
    offload_policy: OffloadPolicy | None = None,
) -> nn.Module:
    """Shard ``model`` with one unit per module of ``unit_types`` plus the root.

    Args:
        strategy: a ``ShardingStrategy`` (or its name, e.g. ``"full_shard"``).
        unit_types: module classes that become units (e.g. your transformer block).
        mp_policy: mixed precision for every unit.
        activation_checkpointing: recompute each unit's activations in backward.
        mesh: 1-D mesh for FULL_SHARD/SHARD_GRAD_OP; 2-D (replicate, shard) for hybrid. Built
            for you when omitted (hybrid: shard groups of ``LOCAL_WORLD_SIZE`` ranks).
        offload_policy: ``CPUOffloadPolicy()`` to keep shards and the optimizer step on CPU.
    """
    if isinstance(strategy, str):
        try:
            strategy = ShardingStrategy(strategy.lower())
        except ValueError:
            names = ", ".join(s.value for s in ShardingStrategy)
            raise FullshardError(
                f"unknown sharding strategy '{strategy}'; one of: {names}"
            ) from None
    shard_mesh = strategy_mesh(strategy, mesh, model)
    raf = reshards_after_forward(strategy)
    kwargs: dict[str, Any] = {"mesh": shard_mesh, "offload_policy": offload_policy}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    targets = [
        m
        for m in model.modules()
        if m is not model and isinstance(m, tuple(unit_types)) and not isinstance(m, FSDPModule)
    ]
    for module in reversed(targets):  # innermost first: fully_shard wants children done first
        if activation_checkpointing:
            _checkpoint_forward(module)
        fully_shard(module, reshard_after_forward=raf, **kwargs)
    # The root keeps its parameters after forward (backward needs them first) unless it is
    # the only unit, where FULL_SHARD's memory promise needs it freed.
    fully_shard(model, reshard_after_forward=None if targets else raf, **kwargs)
    return model
