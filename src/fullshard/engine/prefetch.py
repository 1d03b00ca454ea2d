"""Prefetch (layer 7): which unit to gather next, and how many may be gathered at once.

NOTE [Prefetch order]
Forward runs units in *pre-forward* order (root first, then the blocks), and the next unit's
gather is issued as soon as the current one's has been waited on, so it overlaps with the
current unit's compute. Backward visits units in reverse *post-forward* order (the root finishes
its forward last, so it is first in backward); while unit i runs its backward, the gather of the
unit before it is in flight. Both orders are recorded during each forward and used by the next
step's forward (forward order) or by this step's backward (backward order), so the first
forward of a run has no forward prefetch: it cannot know the order yet. An explicit list set with
``set_modules_to_forward_prefetch`` / ``set_modules_to_backward_prefetch`` replaces the implicit
choice for that unit.

NOTE [Gathered window]
At most ``max_gathered`` non-root units hold gathered storage because of *our* choices (the one
computing plus the prefetched one; default 2). Units that keep their parameters by request
(``reshard_after_forward=False``) do not count: the user asked for that memory. A prefetch that
would exceed the window is skipped, never queued, so the bound holds in every phase.
"""

from __future__ import annotations

from collections.abc import Sequence

from fullshard.engine.unit import CommUnit

DEFAULT_MAX_GATHERED = 2


class Prefetcher:
    """Records the unit order of each forward and issues gathers ahead of use."""

    def __init__(self, root: CommUnit, max_gathered: int = DEFAULT_MAX_GATHERED) -> None:
        self.root = root
        self.max_gathered = max_gathered
        self.units: list[CommUnit] = []
        self.pre_forward_order: list[CommUnit] = []
        self.post_forward_order: list[CommUnit] = []
        # the previous forward's pre-forward order, used to prefetch in this forward
        self.last_forward_order: list[CommUnit] = []
        self.explicit_forward: dict[CommUnit, list[CommUnit]] = {}
        self.explicit_backward: dict[CommUnit, list[CommUnit]] = {}

    # -- recording ------------------------------------------------------------------------
    def begin_forward(self) -> None:
        if self.pre_forward_order:
            self.last_forward_order = self.pre_forward_order
        self.pre_forward_order = []
        self.post_forward_order = []

    def record_pre_forward(self, unit: CommUnit) -> None:
        self.pre_forward_order.append(unit)

    def record_post_forward(self, unit: CommUnit) -> None:
        self.post_forward_order.append(unit)

    # -- choosing -------------------------------------------------------------------------
    def _next(self, order: Sequence[CommUnit], unit: CommUnit) -> list[CommUnit]:
        # A unit may run more than once per forward; the most recent position is the one we're at.
        for i in range(len(order) - 1, -1, -1):
            if order[i] is unit:
                return list(order[i + 1 : i + 2])
        return []

    def forward_targets(self, unit: CommUnit) -> list[CommUnit]:
        if unit in self.explicit_forward:
            return self.explicit_forward[unit]
        # Position in this forward = how many times we've seen units so far.
        pos = len(self.pre_forward_order)
        order = self.last_forward_order
        if pos < len(order) and order[pos - 1] is unit:
            return [order[pos]]
        return []

    def backward_targets(self, unit: CommUnit) -> list[CommUnit]:
        if unit in self.explicit_backward:
            return self.explicit_backward[unit]
        return self._next(list(reversed(self.post_forward_order)), unit)

    # -- the window -----------------------------------------------------------------------
    def counts_in_window(self, unit: CommUnit) -> bool:
        return unit is not self.root and unit.reshard_after_forward

    def window(self) -> int:
        """Non-root units gathered (or gathering) that count against NOTE [Gathered window]."""
        return sum(1 for u in self.units if u.gathered and self.counts_in_window(u))

    def prefetch(self, targets: Sequence[CommUnit], why: str) -> list[CommUnit]:
        """Start the gathers of ``targets`` that fit the window; returns the ones started."""
        started = []
        for target in targets:
            if target.gathered:
                continue
            if why.startswith("backward") and not target.unshard_in_backward:
                continue  # FSDPModule.set_unshard_in_backward(False)
            if self.counts_in_window(target) and self.window() >= self.max_gathered:
                break
            target.unshard(why)
            started.append(target)
        return started
