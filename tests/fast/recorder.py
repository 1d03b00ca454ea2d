"""One timeline of a sharded model's step, as a single process sees it over the fake group.

Two sources, interleaved in the order they happen:

- the collectives, seen at the c10d level (``C10dCounter``: a ``TorchDispatchMode``, so whatever
  code issued them), each tied to its unit by the position tag it carries in its payload
  (NOTE [Collective positions]: an all-gather shard ends in magic, unit index, phase, sequence;
  a reduce-scatter block ends in the same five bytes as bits);
- the schedule's ``Point`` s, through ``fullshard.subscribe``.

Every event also records which units held gathered storage at that moment.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from commcount import C10dCounter
from torch import nn

import fullshard
from fullshard.comm.desync import PHASE_LABELS, TAG_BITS, TAG_LEN, TAG_MAGIC

GATHER, REDUCE = "all_gather", "reduce_scatter"
GATHER_OPS = ("_allgather_base_",)
# a reduce-scatter, or on gloo the all-to-all that stands for one (NOTE [Reduce-scatter on gloo])
REDUCE_OPS = ("_reduce_scatter_base_", "alltoall_base_")


@dataclass(frozen=True)
class Event:
    kind: str  # GATHER, REDUCE, or a Point's name ("FORWARD_START", "FREE", ...)
    unit: str  # the unit's name ("root", "blocks.0", ...)
    phase: str  # a gather's phase ("forward gather", "backward gather", "unshard()"), else ""
    gathered: frozenset[str]  # the units holding gathered storage at that moment


class StepRecorder(C10dCounter):
    """Records :class:`Event` s of ``model`` (a sharded root) while active.

    Use ``events = rec.record(fn)``: runs ``fn`` under the recorder and returns its events. The
    recorder subscribes to the schedule on the root's first forward (the schedule exists from
    then on), so the points of a first forward that come before the root's own forward hooks
    finish (the root's FORWARD_START) are not seen; its collectives are.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.events: list[Event] = []
        self._views: list[fullshard.UnitView] = []
        self._subscribed = False
        model.register_forward_pre_hook(self._subscribe)

    # -- sources ------------------------------------------------------------------------------
    def _subscribe(self, *_: Any) -> None:
        if not self._subscribed:
            fullshard.subscribe(self.model, self._on_point)
            self._views = fullshard.units(self.model)
            self._subscribed = True

    def _on_point(self, point: fullshard.Point, unit: Any) -> None:
        self.events.append(Event(point.name, unit.name, "", self.gathered()))

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.namespace == "c10d":  # args: (output, input, process group, ...)
            if func._opname in GATHER_OPS:
                index, phase = _gather_tag(args[1])
                self.events.append(Event(GATHER, self._name(index), phase, self.gathered()))
            elif func._opname in REDUCE_OPS:
                index = _reduce_tag(args[1])
                self.events.append(Event(REDUCE, self._name(index), "", self.gathered()))
        return super().__torch_dispatch__(func, types, args, kwargs)

    # -- reading --------------------------------------------------------------------------------
    def _name(self, index: int) -> str:
        views = self._views or fullshard.units(self.model)
        return next((v.unit.name for v in views if v.unit.index == index), f"#{index}")

    def gathered(self) -> frozenset[str]:
        views = self._views or fullshard.units(self.model)
        return frozenset(v.unit.name for v in views if v.unit.gathered)

    def record(self, fn: Callable[[], object]) -> list[Event]:
        start = len(self.events)
        with self:
            fn()
        return self.events[start:]


def _gather_tag(send: torch.Tensor) -> tuple[int, str]:
    tag = [int(v) for v in send[-TAG_LEN:].tolist()]
    assert tag[0] == TAG_MAGIC, f"an all-gather without a fullshard tag: {tag}"
    return tag[1] * 256 + tag[2], PHASE_LABELS[tag[3]]


def _reduce_tag(full: torch.Tensor) -> int:
    block = full.view(dist.get_world_size(), -1)[dist.get_rank()]
    bits = [int(v) for v in block[-TAG_BITS:].tolist()]
    tag = [int("".join(map(str, bits[i : i + 8])), 2) for i in range(0, TAG_BITS, 8)]
    assert tag[0] == TAG_MAGIC, f"a reduce-scatter without a fullshard tag: {tag}"
    return tag[1] * 256 + tag[2]


# -- views of a timeline --------------------------------------------------------------------------
def kinds(events: list[Event], *wanted: str) -> list[tuple[str, str]]:
    """``(kind, unit)`` of the events of the given kinds, in order."""
    return [(e.kind, e.unit) for e in events if e.kind in wanted]


def gathers(events: list[Event], phase: str = "") -> list[str]:
    """The units all-gathered, in issue order (of one phase, if given)."""
    return [e.unit for e in events if e.kind == GATHER and (not phase or e.phase == phase)]


def index_of(events: list[Event], kind: str, unit: str) -> int:
    """Position of the first ``kind`` event of ``unit`` (fails the test if there is none)."""
    for i, e in enumerate(events):
        if e.kind == kind and e.unit == unit:
            return i
    raise AssertionError(f"no {kind} of {unit} in {[(e.kind, e.unit) for e in events]}")


def window(e: Event, root: str = "root") -> int:
    """Non-root units holding gathered storage at event ``e``."""
    return len(e.gathered - {root})


def toy_steps(model: nn.Module, steps: int, **backward: Any) -> list[list[Event]]:
    """Record ``steps`` training steps (forward + backward) of a ToyLM-shaped ``model``: one
    event list per step. ``backward``: keyword arguments of ``loss.backward``."""
    from toy import batches, loss_of

    rec = StepRecorder(model)
    data = batches(steps, dist.get_world_size())
    me = dist.get_rank()
    return [
        rec.record(lambda s=s: loss_of(model, data[s][me]).backward(**backward))
        for s in range(steps)
    ]
