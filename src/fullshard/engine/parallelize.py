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
import inspect
from typing import Any

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fullshard.comm.mesh import compute_device
from fullshard.engine.api import FSDPModule, fully_shard
from fullshard.engine.sharding import ShardingPlan, as_strategy, plan_sharding
from fullshard.policies import FullshardError, MixedPrecisionPolicy, OffloadPolicy, ShardingStrategy

# what apply_plan passes on to every unit as given: fully_shard's keywords but the two it sets
_PER_UNIT_OPTIONS = frozenset(inspect.signature(fully_shard).parameters) - {
    "module",
    "mesh",
    "reshard_after_forward",
}


def mesh_device_type(model: nn.Module | None) -> str:
    """The device type of a mesh built for ``model``: the device ``fully_shard`` would pick
    for it without a mesh (``fullshard.comm.mesh.compute_device``)."""
    p = next(model.parameters(), None) if model is not None else None
    hint = p.device if p is not None and not p.is_meta else None
    group = dist.group.WORLD
    assert group is not None
    return compute_device(group, hint).type


def plan_mesh(
    plan: ShardingPlan, mesh: DeviceMesh | None = None, model: nn.Module | None = None
) -> DeviceMesh | None:
    """The mesh ``plan`` shards over (``None`` = the default group, 1-D). A given ``mesh`` must
    have the plan's shape."""
    shape = plan.mesh_shape
    if mesh is not None:
        if tuple(mesh.shape) != shape:
            kind = "(replicate, shard)" if len(shape) == 2 else "(shard,)"
            raise FullshardError(
                f"{plan.strategy.name} on {plan.world_size} ranks shards over a {len(shape)}-D "
                f"mesh {kind} of shape {shape}; got a mesh of shape {tuple(mesh.shape)}."
            )
        return mesh
    if len(shape) == 1:
        return None
    return init_device_mesh(mesh_device_type(model), shape, mesh_dim_names=("replicate", "shard"))


def _mesh_shard_size(strategy: ShardingStrategy, mesh: DeviceMesh | None) -> int:
    # a hybrid mesh given by the caller decides the shard group size
    if mesh is None or not strategy.hybrid:
        return 0
    if mesh.ndim != 2:
        raise FullshardError(
            f"{strategy.name} needs a 2-D mesh (replicate, shard); got {mesh.ndim}-D."
        )
    return mesh.size(1)


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
            for you when omitted (hybrid: ``fullshard.engine.sharding.hybrid_shard_size``).
        offload_policy: ``CPUOffloadPolicy()`` to keep shards and the optimizer step on CPU.
    """
    strategy = as_strategy(strategy)
    plan = plan_sharding(
        model,
        strategy,
        list(unit_types),
        dist.get_world_size(),
        shard_size=_mesh_shard_size(strategy, mesh),
    )
    return apply_plan(
        model,
        plan,
        mesh=mesh,
        mp_policy=mp_policy,
        activation_checkpointing=activation_checkpointing,
        offload_policy=offload_policy,
    )


def apply_plan(
    model: nn.Module,
    plan: ShardingPlan,
    *,
    mesh: DeviceMesh | None = None,
    activation_checkpointing: bool = False,
    reshard_after_forward: bool | int | None = None,
    **options: Any,
) -> nn.Module:
    """``fully_shard`` every unit of ``plan`` (innermost first), then the root; returns ``model``.

    ``mesh``: the plan's mesh (:func:`plan_mesh`). ``reshard_after_forward``: what the units
    (not the root) do after forward, in place of the strategy's (``fully_shard``'s argument;
    ``None``: the plan's). ``options``: any other keyword of :func:`~fullshard.fully_shard`
    (``mp_policy``, ``offload_policy``, ``ignored_params``, ``shard_placement_fn``...), given
    to every unit and the root alike; one left out or ``None`` is ``fully_shard``'s default."""
    unknown = sorted(set(options) - _PER_UNIT_OPTIONS)
    if unknown:  # before any unit is sharded: a half-sharded model helps no one
        raise TypeError(
            f"apply_plan() got {', '.join(unknown)}, which fully_shard does not take per unit; "
            f"it takes {', '.join(sorted(_PER_UNIT_OPTIONS))} (and mesh, reshard_after_forward)"
        )
    # None as FSDP1's vocabulary says "the default" (fully_shard takes no mp_policy=None)
    options = {k: v for k, v in options.items() if v is not None}
    shard_mesh = plan_mesh(plan, mesh, model)
    if reshard_after_forward is None:
        reshard_after_forward = plan.reshard_after_forward
    targets = [m for m in plan.unit_modules(model) if not isinstance(m, FSDPModule)]
    for module in reversed(targets):  # innermost first: fully_shard wants children done first
        if activation_checkpointing:
            _checkpoint_forward(module)
        fully_shard(module, mesh=shard_mesh, reshard_after_forward=reshard_after_forward, **options)
    fully_shard(
        model, mesh=shard_mesh, reshard_after_forward=plan.root_reshard_after_forward, **options
    )
    return model
