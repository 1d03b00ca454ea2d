"""The public view of a sharded model's units (layer 8): what code outside the engine may read.

:func:`units` lists the units of a sharded model as :class:`UnitView` s: each unit's module,
names and parameters, the tensors it holds by memory category (:meth:`UnitView.buffers`, for the
memory tracker) and its parameters gathered whole (:meth:`UnitView.full_parameters`, for full
state dicts and exports). :func:`subscribe` tells an observer about every
:class:`~fullshard.engine.schedule.Point` of a step. Checkpoints, observers, bench and tests
read units through these only; nothing outside ``engine/`` touches a unit's buffers or
``module._fullshard_state``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from fullshard.comm.collectives import all_gather
from fullshard.engine.copy_in import CopyInGroup
from fullshard.engine.fsdp_module import FSDPModule
from fullshard.engine.param import ShardedParam, ShardGroup
from fullshard.engine.schedule import Listener, Point, StepSchedule
from fullshard.engine.unit import CommUnit
from fullshard.policies import MEMORY_CATEGORIES, FullshardError

__all__ = [
    "ParamShard",
    "Subscription",
    "UnitView",
    "param_shard",
    "step_schedule",
    "subscribe",
    "unit_buffers",
    "units",
]


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

    def buffers(self, category: str) -> Iterator[torch.Tensor | None]:
        """The tensors this unit holds now in memory ``category`` (see :func:`unit_buffers`)."""
        return unit_buffers(self.unit, category)

    def full_parameters(self) -> Iterator[tuple[ShardedParam, torch.Tensor]]:
        """Every parameter of the unit as one whole tensor, in its master dtype on the unit's
        device: one all-gather per dtype group inside the shard group (a tensor-parallel
        parameter is then joined over its TP mesh too). A collective: every rank of the unit's
        mesh must iterate it. A group's gathered buffer lives until the next group starts."""
        for group in self.unit.groups:  # one unless the unit mixes dtypes
            if isinstance(group, CopyInGroup):  # NOTE [Shards of their own]
                yield from group.full_parameters()
                continue
            flat = _gather_group(self.unit, group)
            for i, p in enumerate(group.params):
                full = group.layout.gathered_view(flat, i).detach()
                if p.tp is not None:  # the TP-local whole: join the TP ranks' (all of them call)
                    full = DTensor.from_local(
                        full,
                        p.tp.mesh,
                        list(p.tp.placements),
                        run_check=False,
                        shape=p.tp.shape,
                        stride=p.tp.stride,
                    ).full_tensor()
                yield p, full
            del flat


def _gather_group(unit: CommUnit, group: ShardGroup) -> torch.Tensor:
    """One dtype group's parameters in master dtype, parameter-major (NOTE [Flat unit layout])."""
    send = group.flat.to(unit.mesh.device)
    if unit.mesh.world_size == 1:
        return send
    gathered = torch.empty(group.layout.total_numel, dtype=send.dtype, device=send.device)
    all_gather(
        gathered,
        send,
        unit.mesh.group,
        stats=unit.stats,
        what=f"full-state-dict all-gather of unit '{unit.name}'",
        unit=unit.name,
        timeout=unit.mesh.timeout,
    ).wait()
    param_major = torch.empty_like(gathered)
    group.layout.copy_out(gathered, param_major)
    return param_major


def unit_buffers(unit: CommUnit, category: str) -> Iterator[torch.Tensor | None]:
    """The tensors ``unit`` holds now in one of :data:`~fullshard.policies.MEMORY_CATEGORIES`
    (``None`` where a slot is empty; a storage may appear under several categories, and the
    memory tracker counts it once: NOTE [Counting each storage once]). ``optimizer_state`` and
    ``activations`` are not a unit's: nothing is yielded for them."""
    if category not in MEMORY_CATEGORIES:
        raise FullshardError(
            f"unknown memory category {category!r}; one of: {', '.join(MEMORY_CATEGORIES)}"
        )
    if category == "sharded_params":
        for g in unit.groups:
            yield g.flat
        for p in unit.params:
            if p.sharded is not None:
                yield p.sharded  # its shard: the flat buffer, unless _apply replaced it
    elif category == "gathered_window":
        for g in unit.groups:
            yield g.storage.flat  # 0 bytes while freed; the shards themselves when aliased
        yield unit.post_forward_shard  # NOTE [Resharding to a smaller group]
    elif category == "gradients":
        for p in unit.trainable:
            if p.unsharded is not None:
                yield p.unsharded.grad
            if p.sharded is not None:
                yield p.sharded.grad
                local = getattr(p.sharded, "_fullshard_local", None)  # NOTE [Local optimizer steps]
                yield local.grad if local is not None else None
        yield from unit.accumulated.values()  # NOTE [Accumulating without sync]
        yield unit.partial_reduce
    elif category == "comm_buffers":
        gather = unit.gather_in_flight
        if gather is not None:
            yield gather.out
            yield gather.send  # a cast copy of the shard (else the shard: counted already)
        reduce = unit.reduce_in_flight
        if reduce is not None:
            yield reduce.full
            yield reduce.out
            if reduce.pending is not None:
                yield from reduce.pending.buffers
        # CUDA: the last forward gather's, one unit longer (shared by the units of a device)
        yield from unit.streams.held_buffers


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


@dataclass(frozen=True)
class ParamShard:
    """Where fullshard shards a parameter (:func:`param_shard`): its unit's name, the ranks
    that hold its rows (``group``) and the dimensions of the unit's data-parallel mesh (a
    parameter's placements past them are tensor parallel's)."""

    unit: str
    group: dist.ProcessGroup
    dp_dims: int


def param_shard(p: torch.Tensor) -> ParamShard | None:
    """Where fullshard shards ``p`` (a parameter as an optimizer sees it); ``None`` for a
    tensor fullshard does not manage."""
    unit: CommUnit | None = getattr(p, "_fullshard_unit", None)
    if unit is None:
        return None
    return ParamShard(unit.name, unit.mesh.group, unit.mesh.device_mesh.ndim)


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
