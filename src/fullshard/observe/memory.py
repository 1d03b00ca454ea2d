"""Live memory by category and its peak per phase (layer 10), for one rank.

The categories are :data:`fullshard.policies.MEMORY_CATEGORIES`, the phases
:data:`fullshard.policies.STEP_PHASES` (the planner's vocabulary):

- ``sharded_params``: every unit's flat shard buffer (what the rank owns at rest);
- ``gathered_window``: gathered storages currently allocated (the window of NOTE [Gathered
  window] plus units kept by ``reshard_after_forward=False``), and the rows a unit keeps for
  backward over a smaller group (NOTE [Resharding to a smaller group]);
- ``gradients``: full local gradients not yet reduce-scattered (kept without sync included),
  the sharded ``.grad``s, and an HSDP sum kept without all-reduce;
- ``optimizer_state``: every tensor in the optimizer's state;
- ``activations``: storages of tensors saved for backward by the current forward, found with
  ``saved_tensors_hooks``; a storage counts while autograd still holds a tensor saved on it, so
  backward's progressive release shows;
- ``comm_buffers``: all-gather inputs and outputs in flight (on CUDA also the forward output
  held one unit longer, NOTE [Streams and buffer lifetimes]) and reduce-scatter inputs, outputs
  and receive buffers in flight.

NOTE [Counting each storage once]
A sample counts *storages*, never tensors, and each storage once across every category, so the
total is bytes that really exist. A storage is known by its ``StorageImpl`` (``_cdata``), which
survives ``resize_``: gathering resizes a unit's storage to a new address, so an address
(``data_ptr``) would make a gathered block and the weights that forward saved on it two
storages. Categories are filled in a fixed order and a storage goes to the first that holds it:
parameters before activations (forward saves views of the gathered weights, or of the shards
when a unit is not sharded), gradients before communication buffers (the sharded ``.grad`` is a
view of the reduce-scatter's output), so saved weights are never activations and a buffer that
became a gradient is a gradient.

Samples are taken at the schedule's points (each unit's forward/backward start and end, every
free) and around the optimizer step: a handful of sums over the units, cheap enough to leave on.

NOTE [The loss's activations]
The loss runs after the root's forward and before any backward point, and what it saves (a
language model's log-softmax over the vocabulary: often the largest single activation) is freed
by its own backward node before the root's backward starts. So the saved-tensor hooks stay on
after the root's forward, and each tensor saved until the next schedule point takes a "forward"
sample of its own. They are switched off before the optimizer step, at the next forward or at
``detach``, never from inside backward: autograd runs backward under a copy of the caller's
thread-local state (these hooks included) and restores it afterwards, so hooks popped there
would come back. (They stay on through backward, so activation checkpointing's recomputed
tensors count as activations too.)
:func:`profiler_live_peak` gives what the tracker's total is checked against: the peak of every
live tensor storage, from the profiler's allocator events.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from fullshard.engine.param import local_of
from fullshard.engine.schedule import Point, StepSchedule
from fullshard.engine.unit import CommUnit
from fullshard.engine.view import UnitView, step_schedule, subscribe, units
from fullshard.policies import MEMORY_CATEGORIES, STEP_PHASES, Phase

__all__ = ["MemoryTracker", "profiler_live_peak"]


class _Ledger:
    """One sample's storages (NOTE [Counting each storage once])."""

    def __init__(self) -> None:
        self._seen: set[int] = set()

    def take(self, tensors: Iterable[Any]) -> int:
        """Bytes of the storages under ``tensors`` that no earlier call has counted."""
        total = 0
        for t in tensors:
            t = local_of(t)  # sharded gradients and optimizer state: the rank's own bytes
            if not isinstance(t, torch.Tensor) or t.is_meta:
                continue
            storage = t.untyped_storage()
            key = storage._cdata  # the StorageImpl: the same before and after resize_
            if key not in self._seen:
                self._seen.add(key)
                total += storage.nbytes()
        return total


class MemoryTracker:
    """Tracks :data:`~fullshard.policies.MEMORY_CATEGORIES` for one sharded root;
    ``peaks[phase][category]`` (and ``peaks[phase]["total"]``) in bytes."""

    def __init__(self) -> None:
        self.peaks: dict[str, dict[str, int]] = {
            p: dict.fromkeys((*MEMORY_CATEGORIES, "total"), 0) for p in STEP_PHASES
        }
        self._schedule: StepSchedule | None = None
        self._units: list[UnitView] = []
        self._optimizer: torch.optim.Optimizer | None = None
        # weak references to the tensors saved for backward: a storage is live while autograd
        # still holds a tensor saved on it (backward releases them as it goes)
        self._saved: list[weakref.ref[torch.Tensor]] = []
        self._handles: list[Any] = []
        self._saved_ctx: Any = None
        self._ctx_thread = 0  # the thread whose (thread-local) saved-tensor hooks are on
        self._after_forward = False  # between the root's forward and the next point

    # -- sampling --------------------------------------------------------------------------
    def current(self) -> dict[str, int]:
        """Live bytes per category right now, each storage counted once."""
        assert self._schedule is not None
        ledger = _Ledger()

        def held(category: str) -> int:
            return ledger.take(t for v in self._units for t in v.buffers(category))

        # the order decides where a shared storage goes (NOTE [Counting each storage once])
        now = {
            "sharded_params": held("sharded_params"),
            "gathered_window": held("gathered_window"),
            "gradients": held("gradients"),
            "optimizer_state": ledger.take(self._optimizer_state()),
            "comm_buffers": held("comm_buffers"),
            "activations": ledger.take(self._live_saved()),
        }
        return {c: now[c] for c in MEMORY_CATEGORIES}

    def _optimizer_state(self) -> Iterable[Any]:
        if self._optimizer is None:
            return []
        return (v for state in self._optimizer.state.values() for v in state.values())

    def _live_saved(self) -> list[torch.Tensor]:
        live = [t for t in (r() for r in self._saved) if t is not None]
        if len(live) < len(self._saved):  # forget what autograd has released
            self._saved = [weakref.ref(t) for t in live]
        return live

    def sample(self, phase: Phase) -> dict[str, int]:
        """Take a sample now and raise ``phase``'s peaks to it; returns the sample."""
        now = self.current()
        peak = self.peaks[phase.value]
        for k, v in now.items():
            peak[k] = max(peak[k], v)
        peak["total"] = max(peak["total"], sum(now.values()))
        return now

    # -- wiring ----------------------------------------------------------------------------
    def _hooks_on(self) -> None:
        self._hooks_off()
        self._saved_ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._saved_ctx.__enter__()
        self._ctx_thread = threading.get_ident()

    def _hooks_off(self) -> None:
        if self._saved_ctx is not None and self._ctx_thread == threading.get_ident():
            self._saved_ctx.__exit__(None, None, None)
            self._saved_ctx = None
        self._after_forward = False

    def _on_point(self, point: Point, unit: CommUnit) -> None:
        self._after_forward = False  # NOTE [The loss's activations]
        if point is Point.FORWARD_START and unit is self._schedule.root:  # type: ignore[union-attr]
            self._saved.clear()
        if point is Point.BACKWARD_DONE:
            self._saved.clear()  # backward has released every saved tensor
        phase = point.phase
        if point is Point.FREE:
            backward = self._schedule is not None and self._schedule.backward_started
            phase = Phase.BACKWARD if backward else Phase.FORWARD
        self.sample(phase)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        # every saved tensor, parameters too: a sample counts parameter storages first, so a
        # saved weight adds nothing (NOTE [Counting each storage once])
        self._saved.append(weakref.ref(t))
        if self._after_forward:  # the loss (NOTE [The loss's activations])
            self.sample(Phase.FORWARD)
        return t

    def attach(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None
    ) -> MemoryTracker:
        """Start tracking ``model`` (a sharded root, after its first forward) and its optimizer."""
        self._schedule = step_schedule(model)
        self._units = units(model)
        self._optimizer = optimizer
        self._handles = [subscribe(model, self._on_point)]

        def enter(*_: Any) -> None:
            self._hooks_on()

        def leave(*_: Any) -> None:
            # keep the hooks on through the loss, unless no backward can follow
            self._after_forward = torch.is_grad_enabled()
            if not self._after_forward:
                self._hooks_off()

        self._handles += [
            model.register_forward_pre_hook(enter),
            model.register_forward_hook(leave, always_call=True),
        ]
        if optimizer is not None:

            def around_step(*_: Any) -> None:  # must return None: a value replaces step's args
                self._hooks_off()
                self.sample(Phase.OPTIMIZER)

            self._handles += [
                optimizer.register_step_pre_hook(around_step),
                optimizer.register_step_post_hook(around_step),
            ]
        return self

    def detach(self) -> None:
        self._hooks_off()
        self._schedule = None
        self._units = []
        for h in self._handles:
            h.remove()
        self._handles = []
        self._saved.clear()

    @property
    def peak_total(self) -> int:
        """The largest total of any sample (bytes): the tracker's peak of the step(s)."""
        return max(p["total"] for p in self.peaks.values())


def profiler_live_peak(prof: Any, marker: str) -> int | None:
    """Peak bytes of live tensor storage after the ``record_function(marker)`` range began,
    from the allocator events of ``prof`` (a finished ``torch.profiler.profile`` with
    ``profile_memory=True``); ``None`` when the profiler recorded no such events.

    The running sum starts at the profiler's start, so the peak is absolute only when nothing
    the run frees was allocated before it: start the profiler before building the model. It
    counts every storage (parameters, gradients, optimizer state, activations, buffers,
    temporaries), so :class:`MemoryTracker`'s total in the same range can only be smaller.
    """
    results = getattr(getattr(prof, "profiler", None), "kineto_results", None)
    if results is None:
        return None
    events = results.events()
    start = min((e.start_ns() for e in events if e.name() == marker), default=None)
    mem = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    if start is None or not mem:
        return None
    live = peak = 0
    for t, nbytes in mem:
        live += nbytes
        if t >= start:
            peak = max(peak, live)
    return peak
