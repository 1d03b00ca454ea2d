"""A per-rank timeline of what FSDP does (layer 10): gather, compute, free, reduce-scatter, step.

``Recorder`` listens to a root's schedule (compute spans per unit, frees) and to its
collectives (spans from issue to completion, as the communication thread sees them, and every
wait that blocked the rank: the *exposed* communication). Cheap enough to leave on: a few list
appends per unit per step.

Event lanes (rows of the Chrome/Perfetto trace and of the PNG):
- ``compute``: a unit's forward or backward, from its gathered parameters being ready to its
  end; the optimizer step.
- ``gather`` / ``reduce``: each all-gather, and each reduce-scatter / all-reduce, from issue to
  completion (a reduce-scatter's completion is seen at its wait: gloo does not report it).
- ``exposed``: the rank blocked waiting for a collective (communication not hidden by compute).
- ``free``: instants where a unit's gathered storage was released.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fullshard.comm.control import all_gather_objects
from fullshard.engine.schedule import Point, StepSchedule
from fullshard.engine.sharding import step_schedule, subscribe
from fullshard.engine.unit import CommUnit

LANES = ("compute", "gather", "reduce", "exposed", "free")


@dataclass
class Event:
    """One span (``end > start``) or instant (``end == start``) on one rank."""

    name: str
    cat: str  # one of LANES
    unit: str
    start: float
    end: float
    nbytes: int = 0
    rank: int = 0


class Recorder:
    """Collects :class:`Event` s for one rank. ``attach`` starts, ``detach`` stops."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.origin = time.perf_counter()
        self._open: dict[tuple[str, str], float] = {}
        self._schedule: StepSchedule | None = None
        self._hooks: list[Any] = []
        self.rank = dist.get_rank() if dist.is_initialized() else 0

    # -- Timeline protocol (collectives) ---------------------------------------------------
    def record(
        self, name: str, cat: str, unit: str, start: float, end: float, nbytes: int = 0
    ) -> None:
        self.events.append(Event(name, cat, unit, start, end, nbytes, self.rank))

    # -- schedule listener -----------------------------------------------------------------
    def _on_point(self, point: Point, unit: CommUnit) -> None:
        if self._schedule is not None:
            self._schedule.stats.poll()
        now = time.perf_counter()
        phase = point.phase.value
        if point in (Point.FORWARD_START, Point.BACKWARD_START):
            self._open[(phase, unit.name)] = now
        elif point in (Point.FORWARD_END, Point.BACKWARD_END):
            start = self._open.pop((phase, unit.name), None)
            if start is not None:
                self.record(phase, "compute", unit.name, start, now)
        elif point is Point.FREE:
            self.record("free", "free", unit.name, now, now)

    def attach(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Recorder:
        """Start recording ``model`` (a sharded root) and, if given, ``optimizer.step``."""
        schedule = step_schedule(model)
        self._schedule = schedule
        self._hooks = [subscribe(model, self._on_point)]
        schedule.stats.timeline = self
        if optimizer is not None:
            box: dict[str, float] = {}

            def pre(*_: Any) -> None:
                box["t"] = time.perf_counter()

            def post(*_: Any) -> None:
                self.record("optimizer step", "compute", "optimizer", box["t"], time.perf_counter())

            self._hooks += [
                optimizer.register_step_pre_hook(pre),
                optimizer.register_step_post_hook(post),
            ]
        return self

    def detach(self) -> None:
        if self._schedule is not None:
            self._schedule.stats.timeline = None
            self._schedule = None
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def clear(self) -> None:
        self.events.clear()
        self._open.clear()

    def mark(self, name: str) -> None:
        """An instant on the compute lane (e.g. a step boundary)."""
        now = time.perf_counter()
        self.record(name, "compute", "", now, now)


def exposed_seconds(events: list[Event]) -> float:
    """Time blocked on communication: the union of ``exposed`` spans (they may nest)."""
    spans = sorted((e.start, e.end) for e in events if e.cat == "exposed")
    total, cur_s, cur_e = 0.0, None, None
    for s, e in spans:
        if cur_e is None or s > cur_e:
            if cur_e is not None and cur_s is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None and cur_s is not None:
        total += cur_e - cur_s
    return total


def gather_events(events: list[Event]) -> list[Event]:
    """Every rank's events, on every rank (a collective). Times stay each rank's
    ``perf_counter``; ``chrome_trace`` shifts each rank to its own origin, which callers take
    right after a barrier so that the ranks line up."""
    out = all_gather_objects([asdict(e) for e in events])
    return [Event(**d) for per_rank in out for d in per_rank]


def chrome_trace(events: list[Event], origin: dict[int, float]) -> dict[str, Any]:
    """Chrome/Perfetto ``traceEvents``: one process per rank, one thread per lane."""
    trace: list[dict[str, Any]] = []
    for rank in sorted(origin):
        trace.append(
            {"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}}
        )
        for tid, lane in enumerate(LANES):
            trace.append(
                {"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": lane}}
            )
    for e in events:
        ts = (e.start - origin[e.rank]) * 1e6
        base = {
            "pid": e.rank,
            "tid": LANES.index(e.cat),
            "name": f"{e.name} {e.unit}".strip(),
            "ts": ts,
        }
        args = {"unit": e.unit, **({"bytes": e.nbytes} if e.nbytes else {})}
        if e.end > e.start:
            trace.append({**base, "ph": "X", "dur": (e.end - e.start) * 1e6, "args": args})
        else:
            trace.append({**base, "ph": "i", "s": "t", "args": args})
    return {"traceEvents": trace, "displayTimeUnit": "ms"}
