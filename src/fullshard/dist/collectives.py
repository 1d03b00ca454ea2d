"""Collectives (layer 4): tensor in, work handle out. All byte counting lives here.

Every collective fullshard issues goes through this file, so ``CommStats`` sees each one with the
unit and phase that issued it. Bytes are counted as the size of the *full* (unsharded) buffer a
collective covers: an all-gather of a unit counts the gathered unit, a reduce-scatter counts the
full gradient it reduces. In those units FULL_SHARD moves 3 model-sizes per step, DDP 2.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import NoReturn, Protocol

import torch
import torch.distributed as dist

from fullshard.dist.desync import (
    DesyncError,
    Position,
    check_tags,
    debug_enabled,
    explain_failure,
    fingerprint_check,
    unit_code,
)

# torch 2.13 renamed the single-tensor collectives (the old names warn); torch 2.4 has only those.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Timeline(Protocol):
    """Where timed events go when someone is watching (``fullshard.observe`` implements it).

    ``record`` may be called from a communication thread (collective completion), so an
    implementation must only append.
    """

    def record(
        self, name: str, cat: str, unit: str, start: float, end: float, nbytes: int = 0
    ) -> None: ...


@dataclass
class CommStats:
    """Per-rank counters of collectives issued: calls and bytes by kind and by (kind, unit).

    With ``timeline`` set, every collective also records its span (issue to completion, as
    seen by the communication thread) and every wait that blocked the caller ("exposed"
    communication: time the rank could not compute).
    """

    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    unit_bytes: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    timeline: Timeline | None = None
    exposed_s: float = 0.0  # time spent blocked in waits (only counted while timeline is set)
    # collectives whose completion we must observe by polling (gloo has no futures for them)
    open_comm: list[tuple[dist.Work, str, str, float, int]] = field(default_factory=list)
    # NOTE [Collective positions]: this rank's collective count and step, unit names by code
    seq: int = 0
    step: int = 0
    names: dict[int, str] = field(default_factory=dict)
    debug: bool = field(default_factory=debug_enabled)

    def next_position(self, kind: str, unit: str, phase: str) -> Position:
        """The position of the next collective this rank issues (and count it)."""
        pos = Position(self.seq, self.step, kind, unit, phase)
        self.seq += 1
        self.names.setdefault(unit_code(unit), unit)
        return pos

    def record(self, kind: str, unit: str, nbytes: int) -> None:
        self.calls[kind] += 1
        self.bytes[kind] += nbytes
        self.unit_bytes[(kind, unit)] += nbytes

    def reset(self) -> None:
        self.calls.clear()
        self.bytes.clear()
        self.unit_bytes.clear()
        self.exposed_s = 0.0

    def poll(self, done: dist.Work | None = None) -> None:
        """Close the timeline spans of polled collectives that have completed by now.

        Called at every wait (``done``: the work just waited for) and at every schedule point,
        so a span ends at most one unit of compute after the transfer really finished. (gloo's
        reduce-scatter work never reports ``is_completed()``; its span ends at its wait.)
        """
        if not self.open_comm or self.timeline is None:
            return
        now = time.perf_counter()
        still = []
        for work, kind, unit, t0, nbytes in self.open_comm:
            if work is done or work.is_completed():
                lane = "gather" if kind == "all_gather" else "reduce"
                self.timeline.record(kind, lane, unit, t0, now, nbytes)
            else:
                still.append((work, kind, unit, t0, nbytes))
        self.open_comm = still


class Pending:
    """A collective in flight: ``wait()`` blocks at most ``timeout`` and names what it waited for."""

    def __init__(
        self,
        work: dist.Work | None,
        what: str,
        timeout: timedelta,
        stats: CommStats | None = None,
        unit: str = "",
        position: Position | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self._work = work
        self.what = what
        self._timeout = timeout
        self._stats = stats
        self._unit = unit
        self.position = position
        self._group = group
        # work to do once the collective has landed (e.g. the local sum of NOTE [Reduce-scatter
        # on gloo]); it runs inside wait(), so a result is never read before it is complete
        self.then: Callable[[], None] | None = None
        # buffers the collective owns until it is waited for (for memory accounting)
        self.buffers: list[torch.Tensor] = []

    def wait(self) -> None:
        if self._work is None:
            return
        work, self._work = self._work, None
        self._wait(work)
        if self.then is not None:
            then, self.then = self.then, None
            then()
        self.buffers = []

    def _wait(self, work: dist.Work) -> None:
        timeline = self._stats.timeline if self._stats is not None else None
        if timeline is not None and self._stats is not None:
            self._stats.poll()
        t0 = time.perf_counter()
        try:
            ok = work.wait(self._timeout)
        except RuntimeError as exc:  # gloo raises on timeout or on a peer that went away
            self._fail(f"failed ({str(exc).splitlines()[0][:200]})")
        if ok is False:
            self._fail(f"did not finish within {self._timeout.total_seconds():.0f}s")
        if timeline is not None and self._stats is not None:
            t1 = time.perf_counter()
            self._stats.exposed_s += t1 - t0
            timeline.record("wait " + self.what.split(" ")[0], "exposed", self._unit, t0, t1)
            self._stats.poll(done=work)

    @property
    def done(self) -> bool:
        return self._work is None

    def _fail(self, how: str) -> NoReturn:
        where = explain_failure(self.position, self.what, self._group)
        raise DesyncError(
            f"rank {dist.get_rank()}: {self.what} {how}. Where every rank is: {where}. A rank "
            "that did not report died or is stuck; ranks at different positions ran different "
            "forward/backward sequences."
        )


def _issue(
    kind: str,
    work_fn: Callable[[], dist.Work | None],
    tensor: torch.Tensor,
    nbytes: int,
    *,
    stats: CommStats | None,
    what: str,
    unit: str,
    timeout: timedelta,
    group: dist.ProcessGroup | None,
    phase: str,
    position: Position | None,
) -> Pending:
    if stats is not None:
        stats.record(kind, unit, nbytes)
        if position is None:
            position = stats.next_position(kind, unit, phase)
        if stats.debug:
            fingerprint_check(
                position, tensor.numel(), tensor.dtype, group, tensor.device, timeout, stats.names
            )
    t0 = time.perf_counter()
    work = work_fn()
    timeline = stats.timeline if stats is not None else None
    lane = "gather" if kind == "all_gather" else "reduce"
    if timeline is not None and stats is not None and work is not None:
        try:
            # completion as the communication thread sees it: the true end of the transfer
            work.get_future().then(
                lambda _: timeline.record(kind, lane, unit, t0, time.perf_counter(), nbytes)
            )
        except RuntimeError:  # gloo: "Work::getFuture not implemented" for these collectives
            stats.open_comm.append((work, kind, unit, t0, nbytes))
    return Pending(work, what, timeout, stats, unit, position, group)


def all_gather(
    out: torch.Tensor,
    shard: torch.Tensor,
    group: dist.ProcessGroup | None,
    *,
    what: str,
    timeout: timedelta,
    stats: CommStats | None = None,
    unit: str = "",
    phase: str = "all-gather",
    position: Position | None = None,
) -> Pending:
    """Start ``all_gather_into_tensor(out, shard)`` asynchronously."""
    return _issue(
        "all_gather",
        lambda: _all_gather_single(out, shard, group=group, async_op=True),
        out,
        out.numel() * out.element_size(),
        stats=stats,
        what=what,
        unit=unit,
        timeout=timeout,
        group=group,
        phase=phase,
        position=position,
    )


def reduce_scatter(
    out: torch.Tensor,
    full: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    stats: CommStats,
    what: str,
    unit: str,
    timeout: timedelta,
    position: Position | None = None,
    tag: torch.Tensor | None = None,
) -> Pending:
    """Start a summing reduce-scatter of ``full`` (rank-major blocks) into ``out``, async.

    With ``tag`` (the last ``len(tag)`` columns of every block of ``full``), the ranks' tags are
    compared before the sum is used (NOTE [Collective positions]): exactly, row by row, on gloo;
    as a sum (``world * tag``) where the backend sums them.

    SUM, not AVG: gloo has no AVG, and summing then dividing by the world size on our side makes
    the 2-rank float32 result bitwise equal to a single process's ``(g0 + g1) / 2``.

    NOTE [Reduce-scatter on gloo]
    gloo's own reduce-scatter is slow: 20 MB at 2 ranks took 26-33 ms where an all-reduce of the
    same tensor took 12-20 ms and an all-to-all plus a local sum 9.5 ms (measured here, see
    docs/design.md). On gloo each rank therefore receives every rank's block for its own shard
    (``all_to_all_single``, exactly the bytes a reduce-scatter moves) and sums them locally, in
    rank order, when the collective is waited for. NCCL keeps its reduce-scatter.
    """
    world = dist.get_world_size(group)
    buffers: list[torch.Tensor] = []
    work_fn: Callable[[], dist.Work | None]
    then: Callable[[], None] | None
    if dist.get_backend(group) == "gloo":
        recv = torch.empty_like(full.view(-1))
        buffers.append(recv)

        def local_sum() -> None:
            rows = recv.view(world, -1)
            if tag is not None and position is not None:
                check_tags(rows[:, -tag.numel() :], tag.double(), position, stats.names, group)
            torch.sum(rows, dim=0, out=out)

        work_fn = lambda: dist.all_to_all_single(recv, full.view(-1), group=group, async_op=True)  # noqa: E731
        then = local_sum
    else:

        def check_sum() -> None:
            if tag is None:
                return
            if not torch.equal(out[-tag.numel() :].double().cpu(), world * tag.double().cpu()):
                raise DesyncError(
                    f"rank {dist.get_rank()}: ranks paired different reduce-scatters; this rank "
                    f"was at {position}. The ranks ran different backward sequences."
                )

        work_fn = lambda: _reduce_scatter_single(  # noqa: E731
            out, full.view(-1), op=dist.ReduceOp.SUM, group=group, async_op=True
        )
        then = check_sum
    pending = _issue(
        "reduce_scatter",
        work_fn,
        full,
        full.numel() * full.element_size(),
        stats=stats,
        what=what,
        unit=unit,
        timeout=timeout,
        group=group,
        phase="reduce-scatter",
        position=position,
    )
    pending.then = then
    pending.buffers.extend(buffers)
    return pending


def all_reduce(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None,
    *,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    stats: CommStats | None = None,
    what: str,
    unit: str = "",
    timeout: timedelta,
) -> Pending:
    """Start an ``all_reduce`` asynchronously."""
    return _issue(
        "all_reduce",
        lambda: dist.all_reduce(tensor, op=op, group=group, async_op=True),
        tensor,
        tensor.numel() * tensor.element_size(),
        stats=stats,
        what=what,
        unit=unit,
        timeout=timeout,
        group=group,
        phase="all-reduce",
        position=None,
    )
