"""``fully_shard`` and ``FSDPModule`` (layer 8): the public entry points of the engine.

Mirrors ``torch.distributed.fsdp.fully_shard`` (FSDP2) so that swapping the import works.
"""

from __future__ import annotations

import functools
import weakref

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fullshard.dist.mesh import mesh_info
from fullshard.engine.consistency import OPTIMIZER_GUARD, check_same_model, signature
from fullshard.engine.hooks import FSDPState
from fullshard.engine.param import ShardedParam
from fullshard.engine.state_dict_hooks import install_state_dict_hooks
from fullshard.engine.unit import CommUnit
from fullshard.policies import FullshardError, MixedPrecisionPolicy, OffloadPolicy


class UnshardHandle:
    """Returned by ``FSDPModule.unshard(async_op=True)``: ``wait()`` finishes the gather."""

    def __init__(self, unit: CommUnit | None) -> None:
        self._unit = unit

    def wait(self) -> None:
        if self._unit is not None:
            self._unit.wait_for_unshard("unshard()")
            self._unit = None


class FSDPModule:
    """Mixin that ``fully_shard`` adds to a module's class (like FSDP2's ``FSDPModule``)."""

    _fullshard_state: FSDPState

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """Gather this unit's parameters now (``async_op=True``: return a handle to wait on)."""
        unit = self._fullshard_state.unit
        unit.unshard("unshard()")
        handle = UnshardHandle(unit)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Free this unit's gathered parameters (the modules see the shards again)."""
        self._fullshard_state.unit.reshard()

    def set_requires_gradient_sync(
        self, requires_gradient_sync: bool, *, recurse: bool = True
    ) -> None:
        """``False``: skip the reduce-scatter and keep accumulating full local gradients.

        Use it for gradient accumulation: off for the first k-1 micro-batches, on for the last,
        whose backward then reduce-scatters the accumulated sum.
        """
        for state in self._states(recurse):
            state.unit.requires_grad_sync = requires_gradient_sync

    def set_reshard_after_backward(
        self, reshard_after_backward: bool, *, recurse: bool = True
    ) -> None:
        """Whether to free gathered parameters after backward (default ``True``)."""
        for state in self._states(recurse):
            state.unit.reshard_after_backward = reshard_after_backward

    def set_reshard_after_forward(
        self, reshard_after_forward: bool, *, recurse: bool = True
    ) -> None:
        """Whether to free gathered parameters after forward (FULL_SHARD) or keep them (ZeRO-2)."""
        for state in self._states(recurse):
            state.reshard_after_forward_arg = reshard_after_forward
            state.unit.reshard_after_forward = reshard_after_forward

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Gather these units when this one starts its forward (replaces implicit prefetch)."""
        self._explicit("explicit_forward", modules)

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Gather these units when this one starts its backward (replaces implicit prefetch)."""
        self._explicit("explicit_backward", modules)

    # -- helpers --------------------------------------------------------------------------
    def _states(self, recurse: bool) -> list[FSDPState]:
        if not recurse:
            return [self._fullshard_state]
        assert isinstance(self, nn.Module)
        return [m._fullshard_state for m in self.modules() if isinstance(m, FSDPModule)]

    def _explicit(self, attr: str, modules: list[FSDPModule]) -> None:
        for m in modules:
            if not isinstance(m, FSDPModule):
                raise FullshardError(
                    f"prefetch targets must be modules passed to fully_shard; got {type(m).__name__}"
                )
        state = self._fullshard_state
        self._pending_prefetch = getattr(self, "_pending_prefetch", {})
        self._pending_prefetch[attr] = [m._fullshard_state.unit for m in modules]
        _apply_pending_prefetch(state, self._pending_prefetch)


def _apply_pending_prefetch(state: FSDPState, pending: dict[str, list[CommUnit]]) -> None:
    # Explicit lists may be set before the root exists; they are applied once it does.
    if state.schedule is None:
        state.module.register_forward_pre_hook(
            lambda *_: _apply_pending_prefetch(state, pending), prepend=False
        )
        return
    for attr, units in pending.items():
        getattr(state.schedule.prefetcher, attr)[state.unit] = units


@functools.cache
def _fsdp_class(cls: type) -> type:
    # One subclass per original class, so isinstance(m, OriginalClass) stays true.
    return type(f"FSDP{cls.__name__}", (FSDPModule, cls), {"__module__": cls.__module__})


_Found = dict[int, tuple[list[str], nn.Parameter, list[tuple[nn.Module, str]]]]


def _collect_params(module: nn.Module) -> tuple[_Found, list[FSDPState]]:
    """Parameters this unit manages (not those of nested units), grouped by object identity."""
    found: _Found = {}
    children: list[FSDPState] = []
    seen: set[tuple[int, str]] = set()

    def visit(mod: nn.Module, prefix: str) -> None:
        for name, p in mod._parameters.items():
            if p is None or (id(mod), name) in seen:
                continue
            seen.add((id(mod), name))
            entry = found.setdefault(id(p), ([], p, []))
            entry[0].append(prefix + name)
            entry[2].append((mod, name))
        for cname, child in mod._modules.items():
            if child is None:
                continue
            if isinstance(child, FSDPModule):
                if child._fullshard_state not in children:
                    children.append(child._fullshard_state)
                continue
            visit(child, f"{prefix}{cname}.")

    visit(module, "")
    return found, children


def _param_device(found: _Found) -> torch.device | None:
    """Where the unit's parameters are now (None: none, or on the meta device)."""
    for _fqns, p, _refs in found.values():
        return None if p.is_meta else p.device
    return None


def _check_params(
    found: _Found, children: list[FSDPState], unit_name: str, module: nn.Module
) -> None:
    child_path = {id(m): name for name, m in module.named_modules() if isinstance(m, FSDPModule)}
    for fqns, p, _refs in found.values():
        fqn = fqns[0]
        owner = getattr(p, "_fullshard_unit", None)
        if owner is not None:
            raise FullshardError(
                f"parameter '{fqn}' of {unit_name} is already sharded by unit "
                f"'{owner.name}'. Call fully_shard on inner modules first, then on the "
                "outer ones, and on each module once."
            )
        for child in children:
            other = child.originals.get(id(p))
            if other is not None and other[1]() is p:
                path = child_path.get(id(child.module), type(child.module).__name__)
                raise FullshardError(
                    f"parameter '{fqn}' of {unit_name} is tied to '{path}.{other[0]}' of the "
                    f"nested unit '{path}'; tied parameters must live in one unit. Do not call "
                    f"fully_shard on '{path}' on its own (its parent's unit will hold both), or "
                    "untie the weights."
                )
        if p.dim() == 0:
            raise FullshardError(
                f"parameter '{fqn}' of {unit_name} is 0-dim; fullshard shards along dim 0. "
                "Make it shape (1,) (e.g. nn.Parameter(t.reshape(1))) before fully_shard."
            )
        if not (p.is_floating_point() or p.is_complex()):
            raise FullshardError(
                f"parameter '{fqn}' of {unit_name} has dtype {p.dtype}; only floating-point "
                "parameters can be sharded and trained. Register it as a buffer instead."
            )


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy | None = None,
) -> nn.Module:
    """Shard ``module``'s parameters over ``mesh`` and gather them around its forward/backward.

    Call it on each block first, then on the root model; build the optimizer afterwards.
    ``module.parameters()`` then yields each rank's dim-0 shard; the module's class becomes a
    subclass of :class:`FSDPModule`.

    Args:
        module: the module (a one-element list is accepted too).
        mesh: 1-D ``DeviceMesh`` to shard over; ``None`` = the default process group.
        reshard_after_forward: free gathered parameters after forward (``True``, FULL_SHARD) or
            keep them for backward (``False``, SHARD_GRAD_OP). ``None``: ``True`` for every unit
            except the root, which backward needs first anyway.
        mp_policy: dtypes for gather/compute and gradient reduction.
        offload_policy: ``CPUOffloadPolicy()`` keeps shards and the optimizer step on CPU.
    """
    if isinstance(module, list):
        if len(module) != 1:
            raise FullshardError(
                f"fully_shard got a list of {len(module)} modules; grouping several modules into "
                "one unit is not supported yet. Put them under one parent module and shard that."
            )
        module = module[0]
    unit_name = f"unit {type(module).__name__}"
    if isinstance(module, FSDPModule):
        raise FullshardError(
            f"{unit_name} was already passed to fully_shard; wrap each module once."
        )
    found, children = _collect_params(module)
    info = mesh_info(mesh, _param_device(found), unit_name)
    _check_params(found, children, unit_name, module)
    entries = list(found.values())
    check_same_model(unit_name, signature(entries), info)
    params = [
        ShardedParam(fqns, refs, i, p.shape, p.requires_grad, info)
        for i, (fqns, p, refs) in enumerate(entries)
    ]
    unit = CommUnit(
        type(module).__name__,
        module,
        params,
        [p for _, p, _ in entries],
        info,
        mp_policy,
        offload_policy,
    )
    for sp in params:
        sp.sharded._fullshard_unit = unit  # type: ignore[attr-defined]
        sp.expose(unsharded=False)
    state = FSDPState(module, unit, reshard_after_forward)
    state.originals = {id(p): (fqns[0], weakref.ref(p)) for fqns, p, _ in entries}
    OPTIMIZER_GUARD.track([(fqns[0], p) for fqns, p, _ in entries])
    install_state_dict_hooks(module, unit)
    for child in children:
        child.parent = state
    module._fullshard_state = state  # type: ignore[assignment]
    module.__class__ = _fsdp_class(type(module))  # type: ignore[arg-type]
    return module
