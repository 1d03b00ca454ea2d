"""``FSDPModule`` (layer 8): the class ``fully_shard`` mixes into a module's class, its
``unshard`` / ``reshard`` and ``set_*`` controls, and ``register_fsdp_forward_method``.

Its own module so that ``collect.py`` (which parameters a call manages: it stops at nested
``FSDPModule`` s) and ``api.py`` (``fully_shard``, which uses ``collect``) import it without a
cycle.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fullshard.engine.fsdp2_interop import TORCH_FSDP_MODULE
from fullshard.engine.hooks import FSDPState, outside_compile
from fullshard.engine.unit import CommUnit
from fullshard.engine.unit_parts import refuse_narrow_fixed_order
from fullshard.policies import (
    FullshardAssertionError,
    FullshardError,
    FullshardValueError,
    Phase,
)


class UnshardHandle:
    """Returned by ``FSDPModule.unshard(async_op=True)``: ``wait()`` finishes the gather."""

    def __init__(self, unit: CommUnit | None) -> None:
        self._unit = unit

    def wait(self) -> None:
        if self._unit is not None:
            self._unit.wait_for_unshard(Phase.IDLE)
            self._unit = None


class FSDPModule:
    """Mixin that ``fully_shard`` adds to a module's class (like FSDP2's ``FSDPModule``)."""

    _fullshard_state: FSDPState

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # A container indexed by a slice builds ``type(self)(...)``: build the original class
        # then, not an FSDP module without a unit (FSDP2 does the same).
        orig = cls.__mro__[2]
        self = orig.__new__(orig)  # type: ignore[call-overload]
        self.__init__(*args, **kwargs)
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        raise FullshardAssertionError(
            "a module passed to fully_shard cannot be deep-copied (its parameters are shards of "
            "one flat buffer per unit, as in FSDP2); copy the model before fully_shard, or move "
            "weights with state_dict()/load_state_dict()."
        )

    @outside_compile  # NOTE [Hooks run outside torch.compile]
    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """Gather this unit's parameters now (``async_op=True``: return a handle to wait on)."""
        unit = self._fullshard_state.unit
        unit.unshard(Phase.IDLE)
        handle = UnshardHandle(unit)
        if async_op:
            return handle
        handle.wait()
        return None

    @outside_compile  # NOTE [Hooks run outside torch.compile]
    def reshard(self) -> None:
        """Free this unit's gathered parameters (the modules see the shards again)."""
        self._fullshard_state.unit.reshard()

    def set_requires_gradient_sync(
        self, requires_gradient_sync: bool, *, recurse: bool = True
    ) -> None:
        """``False``: skip the reduce-scatter (and HSDP all-reduce) and keep accumulating full
        local gradients, in the reduce dtype.

        Use it for gradient accumulation: off for the first k-1 micro-batches, on for the last,
        whose backward then reduce-scatters the accumulated sum.
        """
        for unit in self._units(recurse):
            unit.requires_grad_sync = requires_gradient_sync
            unit.requires_all_reduce = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: ``False`` reduce-scatters every micro-batch but accumulates the result instead
        of all-reducing it across replicas; the next backward with ``True`` all-reduces the sum
        (gradient accumulation with less communication)."""
        for unit in self._units(recurse):
            unit.requires_all_reduce = requires_all_reduce

    def set_reshard_after_backward(
        self, reshard_after_backward: bool, *, recurse: bool = True
    ) -> None:
        """Whether to free gathered parameters after backward (default ``True``)."""
        for unit in self._units(recurse):
            unit.reshard_after_backward = reshard_after_backward

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Whether to free gathered parameters after forward (FULL_SHARD) or keep them (ZeRO-2)."""
        for unit in self._units(recurse):
            unit.reshard_after_forward = reshard_after_forward

    def set_optional(self, optional: bool = True) -> None:
        """Declare that some ranks may skip this unit in a step (an image encoder where only
        some batches hold images). Every rank then joins its collectives at points all ranks
        reach: gathered when the root's forward starts, kept through backward, reduce-scattered
        when backward ends, with zero gradients from the ranks where it did not run, so the
        result equals one process on every rank's data (NOTE [Optional units]). Call it on every
        rank, outside a forward/backward; not on the root, which always runs."""
        state = self._fullshard_state
        if state.is_root or (state.schedule is not None and state.schedule.root is state.unit):
            raise FullshardValueError(
                f"unit '{state.unit.name}' is the root: its forward starts every step, so it "
                "cannot be optional. Call set_optional() on the unit that some ranks skip."
            )
        state.unit.optional = optional

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """``False``: do not gather this unit in backward, for units whose backward needs no
        parameter (an embedding). Its gradients are still reduce-scattered."""
        self._fullshard_state.unit.unshard_in_backward = unshard_in_backward

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide this unit's summed gradients by ``factor`` instead of the data-parallel size
        (``1.0``: a plain sum)."""
        if not factor > 0:
            raise FullshardError(
                f"set_gradient_divide_factor needs a positive factor, got {factor}"
            )
        self._fullshard_state.unit.divide_factor = float(factor)

    def set_fixed_order_reduction(self) -> None:
        """Reduce this unit's gradients as a plain sum over the ranks in one fixed order, a
        balanced tree in rank order (NOTE [Sums in a fixed order]), so that they have the same
        bits at any world size (``fullshard.deterministic``). Not with a custom reduce-scatter,
        nor with a reduce dtype narrower than the parameters (the tree's partial sums would be
        rounded at other levels at each world size)."""
        unit = self._fullshard_state.unit
        if unit.comm.custom_reduce_scatter is not None:
            raise FullshardError(
                f"unit '{unit.name}' has a custom reduce-scatter: fixed-order mode sums the "
                "ranks' blocks itself; drop set_custom_reduce_scatter"
            )
        refuse_narrow_fixed_order(unit.trainable, unit.reduce_dtype, unit.name)
        unit.comm.fixed_order = True

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """FSDP2's older name of :meth:`set_gradient_divide_factor`."""
        self.set_gradient_divide_factor(factor)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """``False``: the next backward is not the last of the step, so its end does not wait
        for gradient reductions in flight (the following backward or forward does)."""
        root = self._root_state()
        root.is_last_backward = is_last_backward
        if root.schedule is not None:
            root.schedule.is_last_backward = is_last_backward

    def set_post_optim_event(self, event: torch.Event) -> None:
        """The next forward's all-gathers wait for ``event`` (recorded after the optimizer step)
        instead of for everything the current stream has queued. Set a new event every step."""
        self._root_state().post_optim_event = event

    def set_custom_all_gather(self, comm: Any) -> None:
        """Replace this unit's all-gather by ``comm`` (FSDP2's ``AllGather``:
        ``comm.allocate(size, dtype=, device=)`` makes the output, ``comm(output, input, group,
        async_op=True)`` fills it and returns a work handle or None)."""
        self._check_comm(comm, "set_custom_all_gather", "AllGather")
        self._fullshard_state.unit.comm.custom_all_gather = comm

    def set_custom_reduce_scatter(self, comm: Any) -> None:
        """Replace this unit's reduce-scatter by ``comm`` (FSDP2's ``ReduceScatter``:
        ``comm.allocate(...)`` makes the output, ``comm(output, input, group, op, async_op=True)``
        sums every rank's block for this rank into it; fullshard passes ``ReduceOp.SUM`` and
        divides afterwards)."""
        self._check_comm(comm, "set_custom_reduce_scatter", "ReduceScatter")
        unit = self._fullshard_state.unit
        if unit.comm.fixed_order:  # it would silently drop the fixed order
            raise FullshardError(
                f"set_custom_reduce_scatter on unit '{unit.name}', whose reduction is in a fixed "
                "order (set_fixed_order_reduction, fullshard.deterministic.enable): fixed-order "
                "mode sums the ranks' blocks itself"
            )
        unit.comm.custom_reduce_scatter = comm

    def set_all_reduce_hook(
        self, hook: Callable[[torch.Tensor], None], *, stream: torch.cuda.Stream | None = None
    ) -> None:
        """``hook(reduce_output)`` runs on this unit's summed gradient shard every reduction:
        after the reduce-scatter (1-D mesh) or after the HSDP all-reduce (2-D mesh), before the
        division by the data-parallel size. ``stream``: where it runs (not with HSDP, whose
        hook runs where the all-reduce ran)."""
        unit = self._fullshard_state.unit
        if stream is not None and unit.comm.replicate_group is not None:
            raise FullshardValueError(
                f"set_all_reduce_hook(stream=...) on unit '{unit.name}', which is HSDP (a 2-D "
                "mesh): its hook runs after the replica all-reduce, on that stream. Drop stream=."
            )
        unit.all_reduce_hook = hook
        unit.all_reduce_hook_stream = stream

    def _check_comm(self, comm: Any, method: str, kind: str) -> None:
        if not callable(comm) or not callable(getattr(comm, "allocate", None)):
            raise FullshardError(
                f"{method} needs an object with allocate(size, *, dtype, device) and __call__ "
                f"(torch.distributed.fsdp's {kind} interface); got {type(comm).__name__}."
            )

    def reset_iter_state(self) -> None:
        """Recover after an exception aborted a forward or backward mid-way (FSDP2's): call it
        on the root, then run the next iteration normally. Collectives in flight are landed and
        their results dropped; the failed iteration's gradients not yet reduced are lost, as is
        accumulation without sync (restart a micro-batch sequence)."""
        state = self._fullshard_state
        if state.parent is not None or (state.schedule is not None and not state.is_root):
            raise FullshardError(
                f"reset_iter_state() was called on unit '{state.unit.name}', which is not a "
                "root; call it on the outermost module passed to fully_shard."
            )
        state.reset_iter_state()

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Gather these units when this one starts its forward (replaces implicit prefetch)."""
        self._fullshard_state.explicit_prefetch.forward = _prefetch_units(modules)

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Gather these units when this one starts its backward (replaces implicit prefetch)."""
        self._fullshard_state.explicit_prefetch.backward = _prefetch_units(modules)

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        # .to(), .cuda(), to_empty(): show the shards first, and put the (possibly new) shard
        # tensors back into one flat buffer at once, as FSDP2 re-pads its shards here
        unit = self._fullshard_state.unit
        unit.reshard()
        out = super()._apply(*args, **kwargs)  # type: ignore[misc]
        unit.refresh_shards()
        return out

    # -- helpers --------------------------------------------------------------------------
    def _states(self, recurse: bool) -> list[FSDPState]:
        if not recurse:
            return [self._fullshard_state]
        assert isinstance(self, nn.Module)
        states = [m._fullshard_state for m in self.modules() if isinstance(m, FSDPModule)]
        return list({id(s): s for s in states}.values())  # a list unit's modules share one

    def _units(self, recurse: bool) -> list[CommUnit]:
        return [s.unit for s in self._states(recurse)]

    def _root_state(self) -> FSDPState:
        state = self._fullshard_state
        while state.parent is not None:
            state = state.parent
        return state


def _prefetch_units(modules: list[FSDPModule]) -> list[CommUnit]:
    """The units of ``set_modules_to_*_prefetch``'s modules. Kept on the module's state, which
    the root's prefetcher holds from its first forward on, so a list set before that already
    prefetches in the first forward."""
    for m in modules:
        if not isinstance(m, FSDPModule):
            raise FullshardError(
                f"prefetch targets must be modules passed to fully_shard; got {type(m).__name__}"
            )
    return [m._fullshard_state.unit for m in modules]


def share_comm_ctx(modules: list[FSDPModule]) -> None:
    """Let several roots (pipeline-parallel model chunks) share one communication context,
    as FSDP2's ``share_comm_ctx``. In fullshard every unit on a device already uses the
    process's one gather stream and one reduce stream (``engine/streams.py``), so this only
    checks that each module was passed to ``fully_shard``."""
    for m in modules:
        if not isinstance(m, FSDPModule):
            raise FullshardError(
                f"share_comm_ctx expects modules passed to fully_shard; got {type(m).__name__}."
            )


@functools.cache
def fsdp_class(cls: type) -> type:
    """The ``FSDPModule`` subclass of ``cls`` a sharded module of class ``cls`` becomes: one
    per original class, so ``isinstance(m, OriginalClass)`` stays true; torch's
    ``FSDPModule`` last, so that torch's code that imported it recognises the module too
    (NOTE [What pipelining reads from an FSDP2 module])."""
    bases = (FSDPModule, cls, TORCH_FSDP_MODULE)
    return type(f"FSDP{cls.__name__}", bases, {"__module__": cls.__module__})


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>`` gather and free the unit like ``forward`` does (e.g.
    ``generate``, which calls the submodules without going through ``forward``). A no-op for a
    module that is not an :class:`FSDPModule`, so the same code runs with and without FSDP."""
    if not isinstance(module, FSDPModule):
        return
    if not hasattr(module, method_name):
        raise FullshardError(f"{type(module).__name__} has no method {method_name!r}")
    original = getattr(module, method_name)
    state = module._fullshard_state

    @functools.wraps(original)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        assert isinstance(module, nn.Module)
        args, kwargs = state.pre_forward(module, args, kwargs)
        return state.post_forward(module, args, original(*args, **kwargs))

    setattr(module, method_name, wrapped)
