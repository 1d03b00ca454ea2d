"""Live memory by category and its peak per phase (layer 10), for one rank.

Categories (bytes, each storage counted once):

- ``sharded_params``: every unit's flat shard buffer (what the rank owns at rest);
- ``gathered_window``: gathered storages currently allocated (the window of NOTE [Gathered
  window] plus units kept by ``reshard_after_forward=False``);
- ``gradients``: full local gradients not yet reduce-scattered, plus the sharded ``.grad``s;
- ``optimizer_state``: every tensor in the optimizer's state;
- ``activations``: storages of tensors saved for backward by the current forward (parameters
  excluded), found with ``saved_tensors_hooks``; a storage counts while autograd still holds a
  tensor saved on it, so backward's progressive release shows;
- ``comm_buffers``: all-gather outputs waiting for copy-out and reduce-scatter inputs/outputs in
  flight.

Samples are taken at the schedule's points (each unit's forward/backward start and end, every
free) and around the optimizer step: a handful of sums over the units, cheap enough to leave on.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from fullshard.engine.param import local_of
from fullshard.engine.schedule import Point, StepSchedule
from fullshard.engine.sharding import step_schedule, subscribe
from fullshard.engine.unit import CommUnit

CATEGORIES = (
    "sharded_params",
    "gathered_window",
    "gradients",
    "optimizer_state",
    "activations",
    "comm_buffers",
)
PHASES = ("forward", "backward", "optimizer")


def _unique_bytes(tensors: Any) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        t = local_of(t)  # sharded gradients and optimizer state: the rank's own bytes
        if isinstance(t, torch.Tensor) and t.numel() > 0:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


class MemoryTracker:
    """Tracks :data:`CATEGORIES` for one sharded root; ``peaks[phase][category]`` in bytes."""

    def __init__(self) -> None:
        self.peaks: dict[str, dict[str, int]] = {
            p: dict.fromkeys((*CATEGORIES, "total"), 0) for p in PHASES
        }
        self._schedule: StepSchedule | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        # weak references to the tensors saved for backward: a storage is live while autograd
        # still holds a tensor saved on it (backward releases them as it goes)
        self._saved: list[weakref.ref[torch.Tensor]] = []
        self._param_storages: set[int] = set()
        self._handles: list[Any] = []
        self._saved_ctx: Any = None

    # -- sampling --------------------------------------------------------------------------
    def current(self) -> dict[str, int]:
        """Live bytes per category right now."""
        assert self._schedule is not None
        units = self._schedule.units
        grads: list[torch.Tensor] = []
        comm = 0
        for u in units:
            for p in u.trainable:
                if p.unsharded is not None and p.unsharded.grad is not None:
                    grads.append(p.unsharded.grad)
                if p.sharded.grad is not None:
                    grads.append(p.sharded.grad)
            gather = u.gather_in_flight
            if gather is not None and gather.out is not None:
                comm += gather.out.numel() * gather.out.element_size()
            if u.reduce_in_flight is not None:
                inflight = u.reduce_in_flight
                held = inflight.pending.buffers if inflight.pending is not None else []
                comm += _unique_bytes([inflight.full, inflight.out, *held])
        opt_state = 0
        if self._optimizer is not None:
            opt_state = _unique_bytes(
                v for state in self._optimizer.state.values() for v in state.values()
            )
        return {
            "sharded_params": sum(g.nbytes for u in units for g in u.groups),
            "gathered_window": sum(
                g.storage.nbytes
                for u in units
                for g in u.groups
                if g.storage.allocated and not g.storage.aliased
            ),
            "gradients": _unique_bytes(grads),
            "optimizer_state": opt_state,
            "activations": self._live_activations(),
            "comm_buffers": comm,
        }

    def _live_activations(self) -> int:
        live = [t for t in (r() for r in self._saved) if t is not None]
        return _unique_bytes(live)

    def sample(self, phase: str) -> dict[str, int]:
        now = self.current()
        peak = self.peaks[phase]
        for k, v in now.items():
            peak[k] = max(peak[k], v)
        peak["total"] = max(peak["total"], sum(now.values()))
        return now

    # -- wiring ----------------------------------------------------------------------------
    def _on_point(self, point: Point, unit: CommUnit) -> None:
        if point is Point.FORWARD_START and unit is self._schedule.root:  # type: ignore[union-attr]
            self._saved.clear()
        if point is Point.BACKWARD_DONE:
            self._saved.clear()  # backward has released every saved tensor
        phase = point.pass_name
        if point is Point.FREE:
            phase = "backward" if self._schedule and self._schedule.backward_started else "forward"
        self.sample(phase)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self._param_storages:
            self._saved.append(weakref.ref(t))
        return t

    def attach(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None
    ) -> MemoryTracker:
        """Start tracking ``model`` (a sharded root, after its first forward) and its optimizer."""
        schedule = step_schedule(model)
        self._schedule = schedule
        self._optimizer = optimizer
        self._handles = [subscribe(model, self._on_point)]
        for g in (g for u in schedule.units for g in u.groups):
            # parameters are not activations: they live in these storages
            self._param_storages.add(g.storage.flat.untyped_storage().data_ptr())
            self._param_storages.add(g.flat.untyped_storage().data_ptr())

        def enter(*_: Any) -> None:
            self._param_storages |= {
                g.storage.flat.untyped_storage().data_ptr()
                for u in schedule.units
                for g in u.groups
            }
            self._saved_ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
            self._saved_ctx.__enter__()

        def leave(*_: Any) -> None:
            if self._saved_ctx is not None:
                self._saved_ctx.__exit__(None, None, None)
                self._saved_ctx = None

        self._handles += [
            model.register_forward_pre_hook(enter),
            model.register_forward_hook(leave, always_call=True),
        ]
        if optimizer is not None:

            def around_step(*_: Any) -> None:  # must return None: a value replaces step's args
                self.sample("optimizer")

            self._handles += [
                optimizer.register_step_pre_hook(around_step),
                optimizer.register_step_post_hook(around_step),
            ]
        return self

    def detach(self) -> None:
        self._schedule = None
        for h in self._handles:
            h.remove()
        self._handles = []

    def reset_peaks(self) -> None:
        for peak in self.peaks.values():
            for k in peak:
                peak[k] = 0
