"""Step scheduling (layer 7): what each unit does at each point of a step, and the root's
end-of-backward callback.

The hooks (layer 8) only detect *when* something happens (a unit's forward starts or ends, its
backward starts or ends) and call the matching method here. This file decides *what* happens:
gather and wait, prefetch, free, reduce-scatter, and at the end of backward, the clean-up that
makes every rank leave backward in the same state.

NOTE [End of backward]
Autograd gives no per-unit "backward is over" signal that always fires: a unit whose outputs
did not reach the loss, or whose gradients were not asked for (``backward(inputs=...)``), never
completes its post-backward. The root therefore queues one callback per backward
(``Variable._execution_engine.queue_callback``) that runs after the engine has finished: it runs
post-backward for every unit whose backward started but did not finish, waits for every
reduce-scatter in flight (so ``.grad`` is complete when ``backward()`` returns), and frees every
gathered unit that should be resharded.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.autograd import Variable

from fullshard.dist.collectives import CommStats
from fullshard.dist.desync import unit_code
from fullshard.engine.gather import finish_gather
from fullshard.engine.prefetch import Prefetcher
from fullshard.engine.reduce_scatter import finish_reduce_scatter, start_reduce_scatter
from fullshard.engine.unit import CommUnit
from fullshard.policies import Phase

# Reduce-scatters in flight at once: each holds a full copy of its unit's gradients.
MAX_REDUCES_IN_FLIGHT = 1


class StepSchedule:
    """The root's view of all its units across one training step."""

    def __init__(self, root: CommUnit, units: list[CommUnit]) -> None:
        self.root = root
        self.units = units
        self.stats = CommStats()
        for unit in units:
            unit.stats = self.stats  # one set of counters per root, split by unit name
            # every unit's name by its code, to decode other ranks' positions (desync errors)
            self.stats.names[unit_code(unit.name)] = unit.name
        self.prefetcher = Prefetcher(root)
        self.prefetcher.units = units
        self.phase = Phase.IDLE
        self.step = 0
        self._callback_task: int | None = None
        self._reducing: list[CommUnit] = []
        # per-backward bookkeeping: units whose backward started / finished
        self.backward_started: set[CommUnit] = set()
        self.backward_done: set[CommUnit] = set()
        self.forwarded: set[CommUnit] = set()
        # observers (fullshard.observe): called as listener(point, unit) at each point below
        self.listeners: list[Callable[[str, CommUnit], None]] = []

    def _emit(self, point: str, unit: CommUnit) -> None:
        for listener in self.listeners:
            listener(point, unit)

    # -- forward --------------------------------------------------------------------------
    def begin_forward(self) -> None:
        """Root pre-forward: a new forward pass (and, when grad is on, a new step) starts."""
        self._finish_all_reduces()
        self.phase = Phase.FORWARD
        self.prefetcher.begin_forward()
        self.forwarded.clear()

    def pre_forward(self, unit: CommUnit) -> None:
        finish_gather(unit, "forward")
        self.forwarded.add(unit)
        self.prefetcher.record_pre_forward(unit)
        self.prefetcher.prefetch(self.prefetcher.forward_targets(unit), "forward prefetch")
        self._emit("forward_start", unit)

    def pre_recompute(self, unit: CommUnit) -> None:
        """A forward recomputed inside backward (activation checkpointing) needs the unit."""
        finish_gather(unit, "recompute")

    def post_forward(self, unit: CommUnit, reshard: bool) -> None:
        self._emit("forward_end", unit)
        self.prefetcher.record_post_forward(unit)
        if reshard:
            unit.reshard()
            self._emit("free", unit)

    def end_forward(self, grad_enabled: bool) -> None:
        """Root post-forward: free what was prefetched but not used (a changed unit order)."""
        for unit in self.units:
            if unit.gathered and unit not in self.forwarded:
                unit.reshard()
        if not grad_enabled:
            # No backward will come to free the units kept for it (the root, SHARD_GRAD_OP).
            for unit in self.units:
                unit.reshard()
        self.phase = Phase.IDLE

    # -- backward -------------------------------------------------------------------------
    def ensure_end_of_backward_callback(self) -> None:
        """Queue NOTE [End of backward] once per backward pass."""
        task = torch._C._current_graph_task_id()
        if self._callback_task == task:
            return
        self._callback_task = task
        self.phase = Phase.BACKWARD
        Variable._execution_engine.queue_callback(self.end_backward)

    def pre_backward(self, unit: CommUnit) -> None:
        self.ensure_end_of_backward_callback()
        self.backward_started.add(unit)
        self.backward_done.discard(unit)
        finish_gather(unit, "backward")
        self.prefetcher.prefetch(self.prefetcher.backward_targets(unit), "backward prefetch")
        self._emit("backward_start", unit)

    def post_backward(self, unit: CommUnit) -> None:
        """The unit's backward is over: reduce-scatter its gradients and free it."""
        if unit in self.backward_done:
            return
        self.backward_done.add(unit)
        self._emit("backward_end", unit)
        if unit.requires_grad_sync and unit.trainable:
            while len(self._reducing) >= MAX_REDUCES_IN_FLIGHT:
                finish_reduce_scatter(self._reducing.pop(0))
            start_reduce_scatter(unit)
            self._reducing.append(unit)
        if unit.reshard_after_backward:
            unit.reshard()
            self._emit("free", unit)

    def end_backward(self) -> None:
        """The root's end-of-backward callback (NOTE [End of backward])."""
        for unit in self.units:
            if unit in self.backward_started and unit not in self.backward_done:
                self.post_backward(unit)
        self._finish_all_reduces()
        for unit in self.units:
            if unit.reshard_after_backward:
                unit.reshard()
        self._emit("backward_done", self.root)
        self.backward_started.clear()
        self.backward_done.clear()
        self._callback_task = None
        self.phase = Phase.IDLE
        self.step += 1
        self.stats.step = self.step

    def _finish_all_reduces(self) -> None:
        while self._reducing:
            finish_reduce_scatter(self._reducing.pop(0))
