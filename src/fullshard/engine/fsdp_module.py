"""``FSDPModule`` (layer 8): the class ``fully_shard`` mixes into a module's class, its
``unshard`` / ``reshard`` and ``set_*`` controls, and ``register_fsdp_forward_method``.

Its own module so that ``collect.py`` (which parameters a call manages: it stops at nested
``FSDPModule`` s) and ``api.py`` (``fully_shard``, which uses ``collect``) import it without a
cycle.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import nn

from fullshard.engine.fsdp2_interop import TORCH_FSDP_MODULE
from fullshard.engine.hooks import FSDPState, outside_compile
from fullshard.engine.schedule import StepSchedule
from fullshard.engine.unit import CommUnit, refuse_narrow_fixed_order
from fullshard.policies import (
    FullshardAssertionError,
    FullshardError,
    FullshardTypeError,
    FullshardValueError,
    Phase,
    fsdp2_exact,
    fsdp2_words,
)


class UnshardHandle:
    """Returned by ``FSDPModule.unshard(async_op=True)``: ``wait()`` finishes the gather.
    ``UnshardHandle()`` (no unit, as FSDP2's base class) waits for nothing."""

    def __init__(self, unit: CommUnit | None = None) -> None:
        self._unit = unit

    def wait(self) -> None:
        if self._unit is not None:
            self._unit.wait_for_unshard(Phase.IDLE)
            self._unit = None


class GradientReductionHandle:
    """Returned by ``FSDPModule.finalize_backward(async_op=True)`` (torch 2.15's): the
    gradient reductions it started are in flight; ``wait()`` finishes them (``.grad`` is then
    set, gathered units resharded as asked) before the optimizer step or the next forward.
    ``wait()`` twice, or on a handle built without a schedule, does nothing."""

    def __init__(self, schedule: StepSchedule | None = None) -> None:
        self._schedule = schedule

    def wait(self) -> None:
        if self._schedule is not None:
            schedule, self._schedule = self._schedule, None
            schedule.finalize()


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
            fsdp2_words(
                "a module passed to fully_shard cannot be deep-copied (its parameters are shards "
                "of one flat buffer per unit, as in FSDP2); copy the model before fully_shard, "
                "or move weights with state_dict()/load_state_dict().",
                "FSDP does not support deepcopy. Please use state dict for serialization.",
            )
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
        """Whether to free gathered parameters after forward (FULL_SHARD) or keep them (ZeRO-2).
        A bool only (``ValueError`` otherwise, as FSDP2); it replaces an int given to
        ``fully_shard`` (``True`` then reshards over the whole group)."""
        if not isinstance(reshard_after_forward, bool):
            raise FullshardValueError(
                fsdp2_words(
                    f"set_reshard_after_forward takes True or False, not "
                    f"{reshard_after_forward!r}; an int (resharding to a smaller group) is "
                    "given to fully_shard(reshard_after_forward=...) only.",
                    f"reshard_after_forward should be a bool, got {type(reshard_after_forward)}",
                )
            )
        for unit in self._units(recurse):
            unit.reshard_after_forward = reshard_after_forward
            unit.post_forward = None  # FSDP2: the bool replaces the post-forward group
            unit.post_forward_shard = None

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
        """FSDP2's older name of :meth:`set_gradient_divide_factor`, deprecated there: the same
        ``DeprecationWarning`` here."""
        warnings.warn("Use `set_gradient_divide_factor` instead", DeprecationWarning, stacklevel=2)
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """FSDP2's: let the collectives reduce with ``SUM`` only, dividing separately.
        fullshard's collectives always sum (gloo has no average; the division by the
        data-parallel size follows the sum, NOTE [Dividing the sum]), so the wire does not
        change. What changes is what :meth:`set_all_reduce_hook` receives, as in FSDP2: the
        plain sum (fp16/fp64: divided by FSDP2's pre-factor) instead of the average."""
        self._fullshard_state.unit.force_sum_reduction = enable

    def set_reduce_scatter_unused_params(
        self, reduce_scatter_unused_params: bool, *, recurse: bool = True
    ) -> None:
        """FSDP2's: reduce zeros for the trainable parameters a backward did not reach, so
        every one gets a gradient. fullshard always sends zeros for them (its collectives pair
        whatever each rank used: NOTE [Which gradients exist]); ``True`` also gives ``.grad``
        (zero where no rank used it) to every trainable parameter, as FSDP2 does, where
        ``False`` (the default) leaves it None where no rank used it."""
        for unit in self._units(recurse):
            unit.reduce_scatter_unused_params = reduce_scatter_unused_params

    def set_reduce_scatter_max_input_buffers(
        self, max_input_buffers: int, *, recurse: bool = True
    ) -> None:
        """FSDP2's: how many reduce-scatters may be in flight at once, each holding its packed
        input (default 1). More lets backward's compute go on instead of waiting for the
        previous reduce-scatter before packing the next unit's gradients (CUDA: the stream
        wait; gloo: the host wait), for the memory of the packed inputs held. ``TypeError``
        for a non-int (a bool included), ``ValueError`` below 1, as FSDP2."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise FullshardTypeError(
                "max_input_buffers must be an int, got " + type(max_input_buffers).__name__
            )
        if max_input_buffers < 1:
            raise FullshardValueError(
                fsdp2_words(
                    "set_reduce_scatter_max_input_buffers needs at least 1 (one reduce-scatter "
                    "in flight is the default).",
                    f"max_input_buffers must be a positive int, got {max_input_buffers}",
                )
            )
        for unit in self._units(recurse):
            unit.max_reduces_in_flight = max_input_buffers

    def set_separate_reduce_scatter_group(
        self, enable: bool = True, *, recurse: bool = True
    ) -> None:
        """FSDP2's: reduce-scatter on a process group of its own over the same ranks, so that
        it can progress beside backward's all-gathers (one communicator runs one collective at
        a time; gloo too). Creating the group is collective: call it on every rank of the
        units' groups, alike. Units that shard over the same ranks share one new group per
        call; ``False`` goes back to the shard group."""
        made: dict[tuple[int, ...], Any] = {}
        for unit in self._units(recurse):
            unit.comm.reduce_group = unit.mesh.separate_group(made) if enable else None

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """FSDP2's: allocate the buffers fullshard's collectives write (the all-gather output,
        the reduce-scatter output) from the process group's own allocator where its backend
        has one (NCCL: its memory pool, for zero-copy transfers); gloo has none, so there it
        changes nothing. Not with a custom all-gather or reduce-scatter (``AssertionError``,
        as FSDP2)."""
        unit = self._fullshard_state.unit
        for kind, custom in (
            ("all gather", unit.comm.custom_all_gather),
            ("reduce scatter", unit.comm.custom_reduce_scatter),
        ):
            if custom is not None and enable:
                raise FullshardAssertionError(
                    fsdp2_words(
                        f"unit '{unit.name}' has a custom {kind}, which allocates its own "
                        "buffers; drop set_custom_* or this call.",
                        "cannot call set_allocate_memory_from_process_group() when "
                        f"{kind} comm is custom: {type(custom).__name__}",
                    )
                )
        unit.comm.allocate_from_group = enable

    def set_symm_mem_for_comm(self, backend: Literal["NCCL"] = "NCCL") -> None:
        """FSDP2's symmetric-memory all-gather (NCCL's copy-engine or symmetric kernels).
        fullshard does not allocate from symmetric memory: the call is checked as FSDP2 checks
        it (not with a custom all-gather or reduce-scatter: ``AssertionError``) and then
        changes nothing, on every backend; the all-gathers stay ordinary ones."""
        unit = self._fullshard_state.unit
        for kind, custom in (
            ("all gather", unit.comm.custom_all_gather),
            ("reduce scatter", unit.comm.custom_reduce_scatter),
        ):
            if custom is not None:
                raise FullshardAssertionError(
                    fsdp2_words(
                        f"unit '{unit.name}' has a custom {kind}; symmetric memory applies to "
                        "the default collectives only.",
                        f"cannot call set_symm_mem() when {kind} comm is custom: "
                        f"{type(custom).__name__}",
                    )
                )
        if backend != "NCCL":
            raise FullshardValueError(
                f"set_symm_mem_for_comm(backend={backend!r}): FSDP2 supports 'NCCL' only."
            )

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """``False``: the next backward is not the last of the step: its end does not wait for
        the reductions it queued (CUDA: the compute stream does not wait for them; the
        following backward or forward does). ``.grad`` is set as after any backward, as in
        FSDP2 (on gloo the host waits for each reduction anyway)."""
        root = self._root_state()
        root.is_last_backward = is_last_backward
        if root.schedule is not None:
            root.schedule.is_last_backward = is_last_backward

    def set_manual_backward_finalization(self, enabled: bool) -> None:
        """torch 2.15's: ``True``: a backward's end finishes nothing (reductions in flight,
        units left gathered, the step's checks); call :meth:`finalize_backward` after the
        step's last backward. For schedules that run a step's backward as several backward
        calls (pipeline stages, expert-parallel overlap). Not during a backward."""
        if torch._C._current_graph_task_id() != -1:
            raise FullshardError(
                "set_manual_backward_finalization() cannot run in backward; call it between "
                "steps (or before the step's first forward)."
            )
        root = self._root_state()
        root.manual_finalization = enabled
        if root.schedule is not None:
            root.schedule.manual_finalization = enabled

    def finalize_backward(self, *, async_op: bool = False) -> GradientReductionHandle | None:
        """torch 2.15's: finish backward now, as the end of a backward does: reduce (if
        gradient sync is on) the gradients that backwards without sync accumulated, also of
        units no backward reached this time, finish every reduction, reshard units a backward
        left gathered (as ``set_reshard_after_backward`` asks) and close the step. Call it
        after a backward, on the root, not between a forward and its backward.
        ``async_op=True`` returns a :class:`GradientReductionHandle` with the reductions in
        flight; call its ``wait()`` before using ``.grad`` or the next forward."""
        schedule = self._root_state().schedule
        if schedule is None:  # no forward ran: nothing to finish
            return GradientReductionHandle() if async_op else None
        schedule.reduce_unsynced()
        handle = GradientReductionHandle(schedule)
        if async_op:
            return handle
        handle.wait()
        return None

    def set_keep_unsharded_storage(self, keep: bool, *, recurse: bool = True) -> None:
        """torch 2.15's: ``True``: resharding shows the modules their shards again but keeps
        the gathered storage allocated, so each gather refills the same memory and the
        gathered parameters keep their addresses (CUDA graphs captured over them stay valid;
        torchtitan's RL generator). Costs the gathered unit's memory between uses."""
        for unit in self._units(recurse):
            unit.keep_unsharded_storage = keep

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
        """``hook(reduce_output)`` runs on this unit's reduced gradient shard every reduction:
        after the reduce-scatter (1-D mesh) or after the HSDP all-reduce (2-D mesh). It sees
        what FSDP2's hook sees (NOTE [What the all-reduce hook sees] in unit.py): the
        average in fp32/bf16, the sum divided by FSDP2's pre-factor in other dtypes or after
        ``set_force_sum_reduction_for_comms(True)``; what it writes in place is then divided by
        the rest. ``stream``: where it runs (not with HSDP, whose hook runs where the
        all-reduce ran)."""
        unit = self._fullshard_state.unit
        if stream is not None and unit.comm.replicate_group is not None:
            raise fsdp2_exact(
                FullshardValueError("stream cannot be set when using native HSDP"),
                f"fullshard: set_all_reduce_hook(stream=...) on unit '{unit.name}', which is "
                "HSDP (a 2-D mesh): its hook runs after the replica all-reduce, on that "
                "stream. Drop stream=.",
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
        """Gather these units, in this order, when this one starts its forward (after its own
        gather: replaces implicit prefetch). All of them, beyond NOTE [Gathered window]: a
        list of two or more is asked-for memory, as in FSDP2."""
        self._fullshard_state.explicit_prefetch.forward = _prefetch_units(modules)

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Gather these units, in this order, when this one starts its backward (replaces
        implicit prefetch; beyond NOTE [Gathered window], as the forward list)."""
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
            raise FullshardValueError(
                fsdp2_words(
                    "prefetch targets must be modules passed to fully_shard; got "
                    f"{type(m).__name__}",
                    f"Expects FSDPModule but got {type(m)}: {m}",
                )
            )
    return [m._fullshard_state.unit for m in modules]


def share_comm_ctx(modules: list[FSDPModule]) -> None:
    """Let several roots (pipeline-parallel model chunks) share one communication context,
    as FSDP2's ``share_comm_ctx``. In fullshard every unit on a device already uses the
    process's one gather stream and one reduce stream (``engine/streams.py``), so this only
    checks that each module was passed to ``fully_shard``."""
    for m in modules:
        if not isinstance(m, FSDPModule):
            raise FullshardValueError(
                fsdp2_words(
                    f"share_comm_ctx expects modules passed to fully_shard; got "
                    f"{type(m).__name__}.",
                    f"Expects list of FSDPModules but got {m}",
                )
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
        raise FullshardValueError(
            fsdp2_words(
                f"register_fsdp_forward_method: {type(module).__name__} has no method "
                f"{method_name!r}",
                f"{type(module)} does not have a method {method_name}",
            )
        )
    original = getattr(module, method_name)
    state = module._fullshard_state

    @functools.wraps(original)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        assert isinstance(module, nn.Module)
        args, kwargs = state.pre_forward(module, args, kwargs)
        return state.post_forward(module, args, original(*args, **kwargs))

    setattr(module, method_name, wrapped)
