"""What gets sharded, before and after (layer 8): the sharding plan and the public view of units.

Before wrapping, :func:`plan_sharding` turns a strategy, a model and the module types that become
units into one :class:`ShardingPlan`: the mesh shape, the reshard policy, the hybrid shard group
and the list of units with the parameters each one owns. ``parallelize`` applies it, and the
trainer, bench, trace and the memory planner (``fullshard.plan``) read the same object, so a rule
(which parameter belongs to which unit, what the hybrid default is) is written once, here.
The planner builds the model on the meta device: planning needs no process group.

After wrapping, the public view of units is ``view.py`` (:func:`units`, :func:`subscribe`,
re-exported here). Which parameters a unit owns is NOTE [Unit membership] (``collect.py``), the
one rule both the engine and :func:`unit_members` apply.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from fullshard.engine.collect import collect
from fullshard.engine.view import UnitView, step_schedule, subscribe, units
from fullshard.policies import FullshardError, ShardingStrategy

__all__ = [
    "ShardingPlan",
    "UnitPlan",
    "UnitView",
    "hybrid_shard_size",
    "plan_sharding",
    "step_schedule",
    "subscribe",
    "unit_members",
    "units",
]


def hybrid_shard_size(world_size: int, requested: int = 0, local_world_size: int = 0) -> int:
    """Ranks per shard group of the hybrid strategies: the one default every command uses.

    ``requested`` (> 0) wins. Otherwise, on several nodes the ranks of one node
    (``local_world_size``, default ``LOCAL_WORLD_SIZE``) shard and the nodes replicate; on one
    node, half the ranks shard and the two halves replicate. The size must divide the world and
    be smaller than it (one group is FULL_SHARD); a default below 2 would be NO_SHARD, so it is
    refused and must be asked for.
    """
    size = requested
    if size <= 0:
        local = local_world_size or int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        size = local if local < world_size else world_size // 2
        if size < 2 or world_size % size:
            raise FullshardError(
                f"a hybrid strategy on {world_size} ranks has no default shard group size (a "
                f"node's ranks, or half the ranks: {size}, must be at least 2 and divide "
                f"{world_size}); give one (--shard-size, or mesh=init_device_mesh(device, "
                "(replicas, shard_size))), e.g. 2 with 4 ranks, or use full_shard / shard_grad_op"
            )
    if size < 1 or size >= world_size or world_size % size:
        raise FullshardError(
            f"a hybrid strategy on {world_size} ranks needs a shard group size that divides "
            f"{world_size} and is smaller than it (got {size}); set another one (--shard-size, "
            "or mesh=init_device_mesh(device, (replicas, shard_size))), e.g. 2 with 4 ranks, "
            "or use full_shard / shard_grad_op"
        )
    return size


def as_strategy(strategy: ShardingStrategy | str) -> ShardingStrategy:
    """``strategy`` as the enum (a name like ``"full_shard"`` is accepted)."""
    if isinstance(strategy, ShardingStrategy):
        return strategy
    try:
        return ShardingStrategy(strategy.lower())
    except ValueError:
        names = ", ".join(s.value for s in ShardingStrategy)
        raise FullshardError(f"unknown sharding strategy '{strategy}'; one of: {names}") from None


@dataclass(frozen=True)
class UnitPlan:
    """One unit a plan will create: its module and the parameters it will own."""

    name: str  # the module's name in the model ("" for the root)
    params: tuple[str, ...]  # names of the parameters it owns (NOTE [Unit membership])
    numel: int  # elements of those parameters
    trainable_numel: int  # elements of those that require gradients

    @property
    def is_root(self) -> bool:
        return self.name == ""


@dataclass(frozen=True)
class ShardingPlan:
    """How a model will be sharded: the strategy's mesh shape and reshard policy, and its units.

    ``units`` lists the root first, then the unit modules in module order (the order their
    forwards usually run).
    """

    strategy: ShardingStrategy
    world_size: int
    shard_size: int  # ranks one parameter is split over (1: replicated)
    units: tuple[UnitPlan, ...]

    @property
    def replicas(self) -> int:
        """Copies of each shard (> 1 for NO_SHARD and the hybrid strategies)."""
        return self.world_size // self.shard_size

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """``(shard,)`` for a 1-D mesh, ``(replicate, shard)`` for NO_SHARD and hybrid."""
        if self.strategy is ShardingStrategy.NO_SHARD or self.strategy.hybrid:
            return (self.replicas, self.shard_size)
        return (self.world_size,)

    @property
    def reshard_after_forward(self) -> bool:
        """Whether the non-root units free their gathered parameters after forward."""
        return self.strategy.reshard_after_forward

    @property
    def root_reshard_after_forward(self) -> bool | None:
        """The root keeps its parameters after forward (backward needs them first), unless it
        is the only unit: then FULL_SHARD's memory promise needs it freed."""
        return None if len(self.units) > 1 else self.reshard_after_forward

    def summary(self) -> str:
        """One line for a log, e.g. ``full_shard over mesh (4,): 13 units (root + 12), freed
        after forward``."""
        kept = "freed after forward" if self.reshard_after_forward else "kept for backward"
        return (
            f"{self.strategy.value} over mesh {self.mesh_shape}: {len(self.units)} units "
            f"(root + {len(self.units) - 1}), gathered parameters {kept}"
        )

    def unit_modules(self, model: nn.Module) -> list[nn.Module]:
        """The non-root unit modules of ``model``, in plan order."""
        return [model.get_submodule(u.name) for u in self.units if not u.is_root]


def unit_members(
    model: nn.Module, unit_modules: Sequence[nn.Module]
) -> list[tuple[str, list[tuple[str, nn.Parameter]]]]:
    """``(module name, [(parameter name, parameter)])`` per unit, root first (``""``), then the
    unit modules in module order: NOTE [Unit membership], by the engine's own ``collect``."""
    ids = {id(m) for m in unit_modules if m is not model}
    owners = [("", model)] + [(n, m) for n, m in model.named_modules() if id(m) in ids]
    out: list[tuple[str, list[tuple[str, nn.Parameter]]]] = []
    taken: set[int] = set()
    for name, module in owners:
        found, _ = collect([module], is_unit=lambda m: id(m) in ids)
        members = []
        for f in found:
            if id(f.param) not in taken:  # a tie across units: the first unit's
                taken.add(id(f.param))
                members.append((f"{name}.{f.fqns[0]}" if name else f.fqns[0], f.param))
        out.append((name, members))
    return out


def plan_sharding(
    model: nn.Module,
    strategy: ShardingStrategy | str,
    unit_types: Sequence[type[nn.Module]],
    world_size: int,
    *,
    shard_size: int = 0,
    local_world_size: int = 0,
) -> ShardingPlan:
    """The :class:`ShardingPlan` for ``model`` on ``world_size`` ranks. Pure: no process group,
    and a meta-device model works. ``shard_size``: ranks per shard group of the hybrid
    strategies (default: :func:`hybrid_shard_size`)."""
    strategy = as_strategy(strategy)
    types = tuple(unit_types)
    modules = [m for m in model.modules() if m is not model and isinstance(m, types)]
    if strategy is ShardingStrategy.NO_SHARD:
        size = 1
    elif strategy.hybrid:
        size = hybrid_shard_size(world_size, shard_size, local_world_size)
    else:
        size = world_size
    plans = [
        UnitPlan(
            name=name,
            params=tuple(n for n, _ in params),
            numel=sum(p.numel() for _, p in params),
            trainable_numel=sum(p.numel() for _, p in params if p.requires_grad),
        )
        for name, params in unit_members(model, modules)
    ]
    return ShardingPlan(strategy, world_size, size, tuple(plans))
