"""Collectives (layer 4): tensor in, work handle out. All byte counting lives here.

Every collective fullshard issues goes through this file, so ``CommStats`` sees each one with the
unit and phase that issued it. Bytes are counted as the size of the *full* (unsharded) buffer a
collective covers: an all-gather of a unit counts the gathered unit, a reduce-scatter counts the
full gradient it reduces. In those units FULL_SHARD moves 3 model-sizes per step, DDP 2.

NOTE [Waiting without blocking the host]
``Pending.wait()`` orders what comes next after the collective. On gloo the collective runs on
the host, so the wait blocks the host, bounded by a timeout that turns a dead or stuck peer into
an error naming every rank's position. On NCCL it makes the *current CUDA stream* wait for the
collective (``work.wait()`` without a timeout: a stream dependency, no host synchronisation);
a stuck peer is then caught by the process group's own timeout and watchdog. Callers choose the
stream that waits (``engine/streams.py``).

NOTE [A step's collectives on the host]
A unit's collectives (``Comm``) are issued where the host's time per collective decides a
host-bound step (issue 45), so what does not change between them is found once: whether the
group moves the tensor's device (``check_tensor``, NOTE [Device discipline]) and how its work is
waited for (``_host_wait``), per (group, device), and the group's backend name per group
(``comm.device.backend_name``). What may change between collectives keeps the general path,
``_issue``: debug fingerprints, a forward whose gathers are fingerprinted (NOTE [Units every
rank runs]), a timeline, the CUDA emulation's model of each collective, gloo's reduce-scatter as
an all-to-all (NOTE [Reduce-scatter on gloo]), a fixed-order sum, a custom collective. Both
paths count the same bytes and return the same ``Pending``.

NOTE [Issuing on the group itself]
On that plain path the all-gather and reduce-scatter go to the process group's own method
(``ProcessGroup.all_gather_single``, ``_allgather_base`` before torch 2.13; the reduce-scatter's
likewise) with options made once, which is what ``torch.distributed``'s function calls after its
checks: 3.3 us a collective at 64 ranks, three a unit a step (issue 45). Its checks hold by
construction there (two plain tensors, a group this rank is in), except three that can change
between calls, tested at each: a torch function mode (non-strict export traces the function),
a ``_coalescing_manager`` block on the group (the function only records the collective), and a
complex tensor (sent as its real view). Any of them takes ``torch.distributed``'s function.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, NoReturn, Protocol

import torch
import torch.distributed as dist
from torch.overrides import has_torch_function

from fullshard.comm.desync import (
    INTERRUPTS_EVER_SET,
    DesyncError,
    Interrupt,
    Interrupted,
    Position,
    debug_enabled,
    explain_failure,
    fingerprint_check,
    interrupt_for,
    moves_data,
    timed_wait,
)
from fullshard.comm.device import backend_name, check_tensor
from fullshard.comm.runtime import runtime
from fullshard.policies import Phase

# torch 2.13 renamed the single-tensor collectives (the old names warn); torch 2.4 has only those.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# NOTE [Issuing on the group itself]: the methods those functions call (looked up on the group:
# a process group written in Python, such as torch's threaded one, overrides them), and their
# options
_PG_GATHER = (
    "all_gather_single" if hasattr(dist.ProcessGroup, "all_gather_single") else "_allgather_base"
)
_PG_SCATTER = (
    "reduce_scatter_single"
    if hasattr(dist.ProcessGroup, "reduce_scatter_single")
    else "_reduce_scatter_base"
)
_c10d = dist.distributed_c10d
_GATHER_OPTS = _c10d.AllgatherOptions()
_SCATTER_OPTS = _c10d.ReduceScatterOptions()
_SCATTER_OPTS.reduceOp = dist.ReduceOp.SUM  # type: ignore[assignment]  # pybind converts it
for _opts in (_GATHER_OPTS, _SCATTER_OPTS):
    if hasattr(_opts, "asyncOp"):  # torch < 2.7: every collective of a group is async
        _opts.asyncOp = True


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
    seen by the communication thread) and every host wait that blocked the caller ("exposed"
    communication: time the rank could not compute).
    """

    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    unit_bytes: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    timeline: Timeline | None = None
    # collectives whose completion we must observe by polling (gloo has no futures for them)
    open_comm: list[tuple[dist.Work, str, str, float, int]] = field(default_factory=list)
    # NOTE [Collective positions]: this rank's collective count and step, unit names by index
    seq: int = 0
    step: int = 0
    names: dict[int, str] = field(default_factory=dict)
    debug: bool = field(default_factory=debug_enabled)
    # fingerprint the forward all-gathers too, under this store key (a root's first forward,
    # and a forward after one in which a unit ran on no rank: NOTE [Units every rank runs] in
    # engine/schedule.py); "" when off. check_key: the last such key this rank wrote
    check_forward: str = ""
    check_key: str = ""

    def next_position(self, kind: str, unit: str, phase: Phase, index: int) -> Position:
        """The position of the next collective this rank issues (and count it)."""
        pos = Position(self.seq, self.step, kind, unit, phase, index)
        self.seq += 1
        return pos

    def record(self, kind: str, unit: str, nbytes: int) -> None:
        self.calls[kind] += 1
        self.bytes[kind] += nbytes
        self.unit_bytes[(kind, unit)] += nbytes

    def reset(self) -> None:
        self.calls.clear()
        self.bytes.clear()
        self.unit_bytes.clear()

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


def _host_wait(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> bool:
    """NOTE [Waiting without blocking the host]: only NCCL on CUDA tensors orders by stream
    (and, under the CUDA emulation, every collective: NOTE [The CUDA path on CPU])."""
    if runtime().checked:
        return False
    # torch's fake group on CUDA takes NCCL's path too (scripts/gpu_check.py runs it at world 8)
    backend = backend_name(group)
    return not (tensor.is_cuda and ("nccl" in backend or backend == "fake"))


class Pending:
    """A collective in flight (NOTE [Waiting without blocking the host])."""

    def __init__(
        self,
        work: dist.Work | None,
        what: str,
        timeout: timedelta,
        stats: CommStats | None = None,
        unit: str = "",
        position: Position | None = None,
        group: dist.ProcessGroup | None = None,
        host_wait: bool = True,
        interrupt: Interrupt | None = None,
    ) -> None:
        self._work = work
        self._interrupt = interrupt
        self.what = what
        self._timeout = timeout
        self._stats = stats
        self._unit = unit
        self.position = position
        self._group = group
        self._host_wait = host_wait
        # work to do once the collective has landed (e.g. the local sum of NOTE [Reduce-scatter
        # on gloo]); it runs inside wait(), so a result is never read before it is complete
        self.then: Callable[[], None] | None = None
        # buffers the collective owns until it is waited for (for memory accounting)
        self.buffers: list[torch.Tensor] = []
        # gloo's reduce-scatter: every rank's block for this rank's shard, before the sum
        self.rows: torch.Tensor | None = None

    def wait(self) -> None:
        if self._work is None:
            return
        work, self._work = self._work, None
        if self._host_wait:
            self._bounded_wait(work)
        else:
            work.wait()  # the current stream waits; the host goes on
        if self.then is not None:
            then, self.then = self.then, None
            then()
        self.buffers = []

    def _bounded_wait(self, work: dist.Work) -> None:
        timeline = self._stats.timeline if self._stats is not None else None
        if timeline is not None and self._stats is not None:
            self._stats.poll()
        t0 = time.perf_counter()
        try:
            ok = timed_wait(work, self._timeout, self._interrupt)
        except Interrupted:
            raise  # the membership changed: fullshard.elastic recovers, no verdict to give
        except RuntimeError as exc:  # gloo raises on timeout or on a peer that went away
            self._fail(f"failed ({str(exc).splitlines()[0][:200]})")
        if ok is False:
            self._fail(f"did not finish within {self._timeout.total_seconds():.0f}s")
        if timeline is not None and self._stats is not None:
            timeline.record(
                "wait " + self.what.split(" ")[0], "exposed", self._unit, t0, time.perf_counter()
            )
            self._stats.poll(done=work)

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
    position: Position | None,
    reads: list[torch.Tensor] | None = None,
    writes: list[torch.Tensor] | None = None,
    interrupt: Interrupt | None = None,
) -> Pending:
    """Issue ``work_fn()``'s collective, which reads ``reads`` and writes ``writes`` (default:
    ``tensor``, in place); under the CUDA emulation it is modelled as NCCL's, on the current
    stream. ``interrupt``: its waits' way out (NOTE [Interrupts]; default: the group's)."""
    if interrupt is None:
        interrupt = interrupt_for(group)
    check_tensor(tensor, group, what)  # NOTE [Device discipline]
    if stats is not None:
        stats.record(kind, unit, nbytes)
        first = (
            bool(stats.check_forward)
            and position is not None
            and position.label == "forward gather"
            and moves_data(group)
        )
        if (stats.debug or first) and position is not None:
            wrote = fingerprint_check(
                position,
                tensor.numel(),
                tensor.dtype,
                group,
                tensor.device,
                timeout,
                stats.names,
                first=stats.check_forward if first and not stats.debug else "",
                previous=stats.check_key,
            )
            stats.check_key = wrote or stats.check_key
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
    rt = runtime()
    if rt.checked:  # the CUDA emulation models the collective as NCCL's
        ins, outs = (
            reads if reads is not None else [tensor],
            writes if writes is not None else [tensor],
        )
        # under live recovery a wait gives up when the membership changes (EmulatedWork.wait)
        abandon = None if interrupt is None else interrupt.check
        work = rt.collective(outs, ins, name=what, work=work, abandon=abandon)
    host_wait = _host_wait(tensor, group)
    return Pending(work, what, timeout, stats, unit, position, group, host_wait, interrupt)


def all_gather(
    out: torch.Tensor,
    shard: torch.Tensor,
    group: dist.ProcessGroup | None,
    *,
    what: str,
    timeout: timedelta,
    stats: CommStats | None = None,
    unit: str = "",
    position: Position | None = None,
    interrupt: Interrupt | None = None,
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
        position=position,
        reads=[shard],
        writes=[out],
        interrupt=interrupt,
    )


def reduce_scatter(
    out: torch.Tensor,
    full: torch.Tensor,
    group: dist.ProcessGroup | None,
    *,
    what: str,
    timeout: timedelta,
    stats: CommStats | None = None,
    unit: str = "",
    position: Position | None = None,
    fixed_order: bool = False,
    interrupt: Interrupt | None = None,
) -> Pending:
    """Start a summing reduce-scatter of ``full`` (rank-major blocks) into ``out``, async.

    ``fixed_order``: NOTE [Sums in a fixed order], on every backend.

    SUM, not AVG: gloo has no AVG, and summing then dividing by the world size on our side makes
    the 2-rank float32 result bitwise equal to a single process's ``(g0 + g1) / 2``.

    NOTE [Reduce-scatter on gloo]
    gloo's own reduce-scatter is slow: 20 MB at 2 ranks took 26-33 ms where an all-reduce of the
    same tensor took 12-20 ms and an all-to-all plus a local sum 9.5 ms (measured on the 2-core
    development machine). On gloo each rank therefore receives every rank's block for its own
    shard (``all_to_all_single``, exactly the bytes a reduce-scatter moves) and sums them
    locally, in rank order, when the collective is waited for; ``Pending.rows`` then holds the
    blocks, so the caller can compare the ranks' tags exactly. NCCL keeps its reduce-scatter.
    """
    world = dist.get_world_size(group)
    gloo = backend_name(group) == "gloo"
    if gloo or fixed_order:
        recv = torch.empty_like(full.view(-1))
        pending = _summed_locally(
            "reduce_scatter",
            lambda: dist.all_to_all_single(recv, full.view(-1), group=group, async_op=True),
            full,
            recv.view(world, -1),
            out,
            fixed_order,
            stats=stats,
            what=what,
            unit=unit,
            timeout=timeout,
            group=group,
            position=position,
            interrupt=interrupt,
        )
        if gloo:  # the tags are compared per rank on the host (NCCL: from the sums, on device)
            pending.rows = recv.view(world, -1)
        return pending
    return _issue(
        "reduce_scatter",
        lambda: _reduce_scatter_single(
            out, full.view(-1), op=dist.ReduceOp.SUM, group=group, async_op=True
        ),
        full,
        full.numel() * full.element_size(),
        stats=stats,
        what=what,
        unit=unit,
        timeout=timeout,
        group=group,
        position=position,
        reads=[full],
        writes=[out],
        interrupt=interrupt,
    )


def pairwise_sum(rows: torch.Tensor) -> torch.Tensor:
    """The sum of ``rows`` (``(n, ...)``, ``n`` a power of two) over its first dimension, in a
    balanced tree: row pairs (0, 1), (2, 3), ... first, then pairs of those sums, up to the root.

    NOTE [Sums in a fixed order]
    A sum of floats depends on its order. A reduce-scatter's order is the backend's: gloo's
    rank order (a chain, whose shape changes with the number of ranks) or NCCL's ring, which
    differs between world sizes. Fixed-order mode (``fullshard.deterministic``) receives every
    rank's block (``all_to_all_single``, the bytes a reduce-scatter moves) and sums the blocks
    here, in a balanced tree over the ranks in rank order. With micro-batch ``i`` of a step on
    rank ``i % world`` (``MicroBatches``), one reduce-scatter sums an aligned run of ``world``
    consecutive micro-batches, which is a subtree of the same tree over all of them, and
    ``GradientTree`` adds those subtrees in the tree above: every gradient is then the same sum,
    bit for bit, at any power-of-two world size. The HSDP all-reduce across replicas is the
    next levels of that tree (``all_reduce_fixed_order``): shard groups are consecutive ranks.
    """
    n = rows.shape[0]
    if n & (n - 1):
        raise ValueError(f"a fixed-order sum needs a power-of-two number of rows, got {n}")
    while rows.shape[0] > 1:
        rows = rows[0::2] + rows[1::2]
    return rows[0]


def all_reduce_fixed_order(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None,
    *,
    what: str,
    timeout: timedelta,
    stats: CommStats | None = None,
    unit: str = "",
    interrupt: Interrupt | None = None,
) -> Pending:
    """Start an all-reduce (SUM) whose sum is NOTE [Sums in a fixed order]'s: every rank's
    ``tensor`` is gathered and summed here in a balanced tree, in rank order, into ``tensor``
    when the collective is waited for (the gather moves ``world`` times the bytes of ``tensor``
    into each rank, which a ring all-reduce does not: the price of the same bits)."""
    world = dist.get_world_size(group)
    flat = tensor.view(-1)
    recv = torch.empty(world * flat.numel(), dtype=tensor.dtype, device=tensor.device)
    return _summed_locally(
        "all_reduce",
        lambda: _all_gather_single(recv, flat, group=group, async_op=True),
        tensor,
        recv.view(world, -1),
        flat,
        True,
        stats=stats,
        what=what,
        unit=unit,
        timeout=timeout,
        group=group,
        position=None,
        interrupt=interrupt,
    )


def _summed_locally(
    kind: str,
    work_fn: Callable[[], dist.Work | None],
    send: torch.Tensor,
    rows: torch.Tensor,
    out: torch.Tensor,
    tree: bool,
    **bound: Any,
) -> Pending:
    """Issue ``work_fn()``, a collective that reads ``send`` and writes every rank's block as
    ``rows``; when it is waited for, the blocks are summed into ``out``: in rank order, or in
    NOTE [Sums in a fixed order]'s tree (``tree``)."""
    pending = _issue(
        kind,
        work_fn,
        send,
        send.numel() * send.element_size(),
        reads=[send],
        writes=[rows],
        **bound,
    )

    def local_sum() -> None:
        if tree:
            out.copy_(pairwise_sum(rows))
        else:
            torch.sum(rows, dim=0, out=out)

    pending.then = local_sum
    pending.buffers.append(rows)
    return pending


def all_reduce(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None,
    *,
    what: str,
    timeout: timedelta,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    stats: CommStats | None = None,
    unit: str = "",
    interrupt: Interrupt | None = None,
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
        position=None,
        interrupt=interrupt,
    )


def all_to_all(
    out: torch.Tensor,
    send: torch.Tensor,
    out_splits: list[int],
    send_splits: list[int],
    group: dist.ProcessGroup | None,
    *,
    what: str,
    timeout: timedelta,
    stats: CommStats | None = None,
) -> Pending:
    """Start ``all_to_all_single(out, send, out_splits, send_splits)`` asynchronously: block
    ``r`` of ``send`` (``send_splits[r]`` elements) goes to rank ``r``, and block ``r`` of
    ``out`` comes from it (``fullshard.optim``'s matrices to their owners and back). Counted as
    the larger of the two buffers, as the c10d counter does."""
    return _issue(
        "all_to_all",
        lambda: dist.all_to_all_single(
            out, send, out_splits, send_splits, group=group, async_op=True
        ),
        send,
        max(out.numel(), send.numel()) * out.element_size(),
        stats=stats,
        what=what,
        unit="",
        timeout=timeout,
        group=group,
        position=None,
        reads=[send],
        writes=[out],
    )


def broadcast(
    tensor: torch.Tensor,
    src: int,
    group: dist.ProcessGroup | None,
    *,
    what: str,
    timeout: timedelta,
) -> Pending:
    """Start a ``broadcast`` of rank ``src``'s ``tensor`` (a global rank) asynchronously."""
    return _issue(
        "broadcast",
        lambda: dist.broadcast(tensor, src=src, group=group, async_op=True),
        tensor,
        tensor.numel() * tensor.element_size(),
        stats=None,
        what=what,
        unit="",
        timeout=timeout,
        group=group,
        position=None,
    )


@dataclass
class Comm:
    """One unit's collectives, bound once: its groups, counters, wait bound and name.

    The unit's lifecycle (``engine/unit.py``) calls these with tensors and positions only; the
    functions above stay pure over tensors and groups.
    """

    group: dist.ProcessGroup
    timeout: timedelta
    unit: str
    stats: CommStats = field(default_factory=CommStats)
    replicate_group: dist.ProcessGroup | None = None
    # FSDP2's set_custom_all_gather / set_custom_reduce_scatter: objects with
    # ``allocate(size, *, dtype, device)`` and ``__call__(out, inp, group, [op,] async_op)``
    custom_all_gather: Any = None
    custom_reduce_scatter: Any = None
    # NOTE [Sums in a fixed order] (fullshard.deterministic.enable)
    fixed_order: bool = False
    # NOTE [Interrupts]: its waits' way out under live recovery (its group's, taken when built)
    interrupt: Interrupt | None = None
    # FSDP2's set_separate_reduce_scatter_group: a group of its own over the same ranks
    reduce_group: dist.ProcessGroup | None = None
    # FSDP2's set_allocate_memory_from_process_group_for_comm: output buffers from the
    # group's own allocator where its backend has one (NCCL), else ordinary ones
    allocate_from_group: bool = False

    def __post_init__(self) -> None:
        if self.interrupt is None:
            self.interrupt = interrupt_for(self.group)
        # (group, device) -> how its collectives are waited for, once its device was checked
        self._routes: dict[tuple[dist.ProcessGroup, torch.device], bool] = {}

    def _plain_route(
        self, group: dist.ProcessGroup, tensor: torch.Tensor, what: str
    ) -> bool | None:
        """NOTE [A step's collectives on the host]: how a collective of ``group`` on
        ``tensor``'s device is waited for (``_host_wait``) when nothing asks more of it than
        issuing, counting and waiting; ``None`` when something does: ``_issue`` then."""
        stats = self.stats
        if stats.debug or stats.check_forward or stats.timeline is not None:
            return None
        if runtime().checked:
            return None
        key = (group, tensor.device)
        host = self._routes.get(key)
        if host is None:
            check_tensor(tensor, group, what)  # NOTE [Device discipline], once per device
            host = self._routes[key] = _host_wait(tensor, group)
        return host

    def _issued(
        self,
        kind: str,
        work: dist.Work | None,
        nbytes: int,
        what: str,
        pos: Position,
        group: dist.ProcessGroup,
        host_wait: bool,
    ) -> Pending:
        self.stats.record(kind, self.unit, nbytes)
        interrupt = self.interrupt
        if (
            interrupt is None and INTERRUPTS_EVER_SET[0]
        ):  # ``interrupt_for``'s own first test, inline
            interrupt = interrupt_for(group)
        return Pending(
            work, what, self.timeout, self.stats, self.unit, pos, group, host_wait, interrupt
        )

    def position(self, kind: str, phase: Phase, index: int) -> Position:
        return self.stats.next_position(kind, self.unit, phase, index)

    def gather_buffer(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The all-gather output (from the custom comm's allocator when there is one)."""
        if self.custom_all_gather is not None:
            return self.custom_all_gather.allocate((numel,), dtype=dtype, device=device)  # type: ignore[no-any-return]
        return self._empty(self.group, numel, dtype, device)

    def reduce_buffer(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The reduce-scatter output (from the custom comm's allocator when there is one)."""
        if self.custom_reduce_scatter is not None:
            return self.custom_reduce_scatter.allocate((numel,), dtype=dtype, device=device)  # type: ignore[no-any-return]
        return self._empty(self.reduce_group or self.group, numel, dtype, device)

    def _empty(
        self, group: dist.ProcessGroup, numel: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        if self.allocate_from_group:
            backend = group._get_backend(device)
            # torch >= 2.8 backends say whether they allocate (NCCL's memory pool); gloo does not
            if getattr(backend, "supports_tensor_alloc", lambda d: False)(device):
                return backend.allocate_tensor(numel, dtype=dtype, device=device)  # type: ignore[no-any-return]
        return torch.empty(numel, dtype=dtype, device=device)

    def all_gather(self, out: torch.Tensor, send: torch.Tensor, pos: Position) -> Pending:
        what = f"all-gather ({pos.label}) of unit '{self.unit}'"
        custom = self.custom_all_gather
        if custom is None:
            host_wait = self._plain_route(self.group, out, what)
            if host_wait is not None:
                # NOTE [Issuing on the group itself] (inline: three a unit a step)
                if not (
                    has_torch_function((out, send))
                    or self.group in _c10d._world.pg_coalesce_state
                    or out.is_complex()
                ):
                    work = getattr(self.group, _PG_GATHER)(out, send, _GATHER_OPTS)
                else:
                    work = _all_gather_single(out, send, group=self.group, async_op=True)
                nbytes = out.numel() * out.element_size()
                return self._issued("all_gather", work, nbytes, what, pos, self.group, host_wait)
            return all_gather(out, send, self.group, position=pos, **self._bound(what))
        work_fn = lambda: custom(out, send, self.group, async_op=True)  # noqa: E731
        nbytes = out.numel() * out.element_size()
        return _issue(
            "all_gather",
            work_fn,
            out,
            nbytes,
            group=self.group,
            position=pos,
            reads=[send],
            writes=[out],
            **self._bound(what),
        )

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor, pos: Position) -> Pending:
        what = f"reduce-scatter of unit '{self.unit}'"
        custom = self.custom_reduce_scatter
        group = self.reduce_group or self.group
        if custom is None:
            # gloo's and the fixed order's sums are made here (NOTE [Reduce-scatter on gloo])
            plain = not self.fixed_order and backend_name(group) != "gloo"
            host_wait = self._plain_route(group, full, what) if plain else None
            if host_wait is not None:
                flat = full.view(-1)
                if not (
                    has_torch_function((out, flat))
                    or group in _c10d._world.pg_coalesce_state
                    or out.is_complex()
                ):  # NOTE [Issuing on the group itself]
                    work = getattr(group, _PG_SCATTER)(out, flat, _SCATTER_OPTS)
                else:
                    work = _reduce_scatter_single(
                        out, flat, op=dist.ReduceOp.SUM, group=group, async_op=True
                    )
                nbytes = full.numel() * full.element_size()
                return self._issued("reduce_scatter", work, nbytes, what, pos, group, host_wait)
            return reduce_scatter(
                out,
                full,
                group,
                position=pos,
                fixed_order=self.fixed_order,
                **self._bound(what),
            )
        op = dist.ReduceOp.SUM
        work_fn = lambda: custom(out, full.view(-1), group, op, async_op=True)  # noqa: E731
        nbytes = full.numel() * full.element_size()
        return _issue(
            "reduce_scatter",
            work_fn,
            full,
            nbytes,
            group=group,
            position=pos,
            reads=[full],
            writes=[out],
            **self._bound(what),
        )

    def _bound(self, what: str) -> dict[str, Any]:
        """The keyword arguments every collective of this unit passes."""
        return {
            "what": what,
            "timeout": self.timeout,
            "stats": self.stats,
            "unit": self.unit,
            "interrupt": self.interrupt,
        }

    def all_reduce_replicas(self, tensor: torch.Tensor) -> Pending:
        """HSDP: the sum of a gradient shard over the replicas that hold the same shard."""
        reduce = all_reduce_fixed_order if self.fixed_order else all_reduce
        return reduce(
            tensor,
            self.replicate_group,
            what=f"all-reduce across replicas of unit '{self.unit}'",
            timeout=self.timeout,
            stats=self.stats,
            unit=self.unit,
            interrupt=self.interrupt,
        )
