"""What gets sharded, before and after (layer 8): the sharding plan and the public view of units.

Before wrapping, :func:`plan_sharding` turns a strategy, a model and the module types that become
units into one :class:`ShardingPlan`: the mesh shape, the reshard policy, the hybrid shard group
and the list of units with the parameters each one owns. ``parallelize`` applies it, and the
trainer, bench, trace and the memory planner (``fullshard.plan``) read the same object, so a rule
(which parameter belongs to which unit, what the hybrid default is) is written once, here.
The planner builds the model on the meta device: planning needs no process group.

After wrapping, :func:`units` lists the units of a sharded model and :func:`subscribe` tells an
observer about every :class:`~fullshard.engine.schedule.Point` of a step. Code outside the engine
(checkpoints, observers, bench, tests) reads units through these two functions only.

NOTE [Unit membership]
A parameter belongs to the innermost unit module that holds it: ``parallelize`` wraps the
innermost units first, and ``fully_shard`` leaves out the parameters of children that are
already units. A parameter reached twice (tied) belongs to the first unit that reaches it in
module order, under its first name, as ``named_parameters()`` reports it. The engine applies the
rule at wrap time (``fullshard.engine.collect``); :func:`unit_members` applies it to an unwrapped
(or meta) model, and a test checks that the two agree.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import nn

from fullshard.engine.api import FSDPModule
from fullshard.engine.param import ShardedParam
from fullshard.engine.schedule import Listener, Point, StepSchedule
from fullshard.engine.unit import CommUnit
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
    unit modules in module order, by NOTE [Unit membership]."""
    index = {id(m): -1 for m in unit_modules if m is not model}
    out: list[tuple[str, list[tuple[str, nn.Parameter]]]] = [("", [])]
    seen: set[int] = set()

    def visit(mod: nn.Module, prefix: str, owner: int) -> None:
        for pname, p in mod._parameters.items():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                out[owner][1].append((f"{prefix}{pname}", p))
        for cname, child in mod._modules.items():
            if child is None:
                continue
            own = owner
            if id(child) in index:
                if index[id(child)] < 0:
                    index[id(child)] = len(out)
                    out.append((f"{prefix}{cname}", []))
                own = index[id(child)]
            visit(child, f"{prefix}{cname}.", own)

    visit(model, "", 0)
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


@dataclass(frozen=True)
class UnitView:
    """One unit of a sharded model, as :func:`units` lists it."""

    name: str  # the name of the (first) module ``fully_shard`` was called on ("" for the root)
    module: FSDPModule  # that module
    unit: CommUnit  # the engine's unit: its parameters, dtype groups and gather state
    module_names: tuple[str, ...]  # every module of the unit (more than one for a list)

    def names_of(self, sp: ShardedParam) -> list[str]:
        """Every name of one of the unit's parameters in the model (a tie has several)."""
        bases = [self.module_names[o] for o in sp.owners]
        return [f"{b}.{f}" if b else f for b, f in zip(bases, sp.fqns, strict=True)]

    @property
    def param_names(self) -> list[str]:
        """The first name of each of the unit's parameters, in the unit's order."""
        return [self.names_of(sp)[0] for sp in self.unit.params]


def units(model: nn.Module) -> list[UnitView]:
    """Every unit of ``model`` (each ``fully_shard`` call), in module order."""
    names: dict[int, str] = {}
    found: list[FSDPModule] = []
    for name, m in model.named_modules():
        if isinstance(m, FSDPModule):
            names[id(m)] = name
            if m._fullshard_state.module is m:
                found.append(m)
    views = []
    for m in found:
        state = m._fullshard_state
        module_names = tuple(names.get(id(x), "?") for x in state.modules)
        views.append(UnitView(module_names[0], m, state.unit, module_names))
    return views


def step_schedule(model: nn.Module) -> StepSchedule:
    """The step schedule of a sharded root (it exists after the root's first forward)."""
    state = model._fullshard_state if isinstance(model, FSDPModule) else None
    if state is None or state.schedule is None:
        raise FullshardError(
            "observe a model after fully_shard and after its first forward (the root sets up "
            "its units lazily, on that forward)."
        )
    return state.schedule


class Subscription:
    """Returned by :func:`subscribe`; ``remove()`` stops the calls."""

    def __init__(self, schedule: StepSchedule, listener: Listener) -> None:
        self._schedule: StepSchedule | None = schedule
        self._listener = listener

    def remove(self) -> None:
        if self._schedule is not None:
            self._schedule.listeners.remove(self._listener)
            self._schedule = None


def subscribe(model: nn.Module, listener: Callable[[Point, CommUnit], None]) -> Subscription:
    """Call ``listener(point, unit)`` at every :class:`Point` of every step of ``model`` (a
    sharded root, after its first forward), in the order the points happen on this rank."""
    schedule = step_schedule(model)
    schedule.listeners.append(listener)
    return Subscription(schedule, listener)
