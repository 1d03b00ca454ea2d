"""Control-plane collectives (layer 4): barriers, votes, metrics and small objects.

Everything outside ``fullshard.comm`` that needs the other ranks (the trainer's loss and NaN
vote, checkpoint barriers and agreement, bench and trace bookkeeping) calls these, never
``torch.distributed`` directly, so every tensor is made on ``comm_device(group)`` (NOTE [Device
discipline]) and every wait is bounded: by a timeout on gloo, by the process group's own timeout
and watchdog on NCCL (NOTE [Waiting without blocking the host]).

A function that returns a tensor leaves it on the device: reading it (``.tolist()``) is the
caller's choice of when to synchronise, once per step at most.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from fullshard.comm.collectives import _all_gather_single, all_gather, all_reduce, broadcast
from fullshard.comm.desync import interrupt_for, moves_data, timed_wait
from fullshard.comm.device import accepted_devices, as_host, comm_device
from fullshard.comm.mesh import default_timeout
from fullshard.policies import FullshardError

__all__ = [
    "all_gather_objects",
    "all_gather_values",
    "all_reduce_values",
    "barrier",
    "broadcast_object",
    "all_to_all_bytes",
    "broadcast_tensor",
    "ring_exchange",
    "host_barrier",
    "rank",
    "world_size",
]

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def rank(group: dist.ProcessGroup | None = None) -> int:
    """This process's rank in ``group`` (the default group: its global rank)."""
    return dist.get_rank(group)


def world_size(group: dist.ProcessGroup | None = None) -> int:
    return dist.get_world_size(group)


def _timeout(timeout: timedelta | None) -> timedelta:
    return timeout if timeout is not None else default_timeout()


def barrier(
    group: dist.ProcessGroup | None = None,
    *,
    what: str = "barrier",
    timeout: timedelta | None = None,
) -> None:
    """Every rank of ``group`` reaches this point (a one-element all-reduce on its device).

    On NCCL this orders the current stream only; the ranks' hosts meet at the next read.
    """
    flag = torch.zeros(1, device=comm_device(group))
    all_reduce(flag, group, what=what, timeout=_timeout(timeout)).wait()


def host_barrier(
    group: dist.ProcessGroup | None = None,
    *,
    what: str = "host barrier",
    timeout: timedelta | None = None,
) -> None:
    """Every rank's *host* reaches this point before any host leaves it.

    One host synchronisation: for checkpoint commits, timing starts and leaving the process
    group, never for the steady state.

    On NCCL: ``barrier`` plus a read of its result (the read waits for the all-reduce, which
    finishes only once every rank has issued it). On gloo: the backend's own barrier, bounded by
    the group's timeout. It also waits for every collective this rank issued before it, and its
    tensor is made in C++. A tensor made in Python and handed to gloo may be released last by
    gloo's worker thread after the op completes, which then needs the GIL; when that happens
    while the interpreter exits, the process aborts ("terminate called without an active
    exception": measured, about 1 exit in 5 when the last collective before exit was an
    all-reduce of a Python tensor). So the barrier ranks leave on must not be such an op.
    """
    if comm_device(group).type == "cpu":
        dist.barrier(group)
        return
    arrived = all_reduce_values([1.0], "sum", group, what=what, timeout=timeout)
    arrived.tolist()  # the read is the point: it blocks until every rank has arrived


def all_reduce_values(
    values: torch.Tensor | Sequence[float],
    op: str = "sum",
    group: dist.ProcessGroup | None = None,
    *,
    what: str = "all-reduce of values",
    timeout: timedelta | None = None,
) -> torch.Tensor:
    """``values`` reduced over the ranks (``op``: sum, max or min), on the group's device.

    A tensor is reduced where it is, after moving it to the group's device (a device tensor is
    never read here); a list of host numbers becomes one float64 tensor.
    """
    device = comm_device(group)
    if isinstance(values, torch.Tensor):
        t = values.detach().to(device).clone()
    else:
        t = torch.tensor(list(values), dtype=torch.float64, device=device)
    all_reduce(t, group, op=_OPS[op], what=what, timeout=_timeout(timeout)).wait()
    return t


def all_gather_values(
    values: torch.Tensor | Sequence[float],
    group: dist.ProcessGroup | None = None,
    *,
    what: str = "all-gather of values",
    timeout: timedelta | None = None,
) -> torch.Tensor:
    """Every rank's ``values`` as rows of a ``(world, n)`` float64 tensor on the group's device."""
    device = comm_device(group)
    if isinstance(values, torch.Tensor):
        mine = values.detach().to(device, torch.float64).reshape(-1)
    else:
        mine = torch.tensor(list(values), dtype=torch.float64, device=device)
    world = dist.get_world_size(group)
    out = torch.empty(world * mine.numel(), dtype=torch.float64, device=device)
    all_gather(out, mine, group, what=what, timeout=_timeout(timeout)).wait()
    return out.view(world, -1)


def _moves_host(group: dist.ProcessGroup | None) -> bool:
    return "cpu" in accepted_devices(group)


def _polled_objects(group: dist.ProcessGroup | None) -> bool:
    """Whether objects travel in fullshard's polled collectives on ``group``: gloo, not a
    group that moves no data (NOTE [Backends that move no data]: its work never completes to
    a poll) nor NCCL (torch's objects go through the device)."""
    return _moves_host(group) and moves_data(group)


def _wait_host(work: dist.Work, group: dist.ProcessGroup | None, what: str) -> None:
    """Wait for a gloo collective of host memory: bounded by the run's timeout, and under live
    recovery polling the group's token (NOTE [Interrupts]: a peer lost meanwhile makes the wait
    give up at once instead of at the timeout, wherever the lost peer sat in gloo's algorithm).
    A peer's failure is gloo's ``RuntimeError``; a timeout says what did not finish."""
    timeout = default_timeout()
    if not timed_wait(work, timeout, interrupt_for(group)):
        raise FullshardError(
            f"rank {dist.get_rank()}: {what} did not finish within "
            f"{timeout.total_seconds():.0f}s (a rank died or is stuck)"
        )


def _pickled(obj: Any) -> torch.Tensor:
    return as_host(torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8))


def all_gather_objects(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's picklable ``obj``, in rank order.

    On a group that moves host memory (gloo) the bytes travel in two bounded all-gathers whose
    waits are fullshard's (NOTE [Interrupts]), not torch's ``all_gather_object``, whose
    synchronous waits nothing but the timeout ends; elsewhere (NCCL: the watcher aborts the
    communicators; a group that moves no data) torch's, which puts the bytes on the right
    device."""
    world = dist.get_world_size(group)
    if not _polled_objects(group):
        out: list[Any] = [None] * world
        dist.all_gather_object(out, obj, group=group)
        return out
    data = _pickled(obj)
    # device="cpu" on every buffer of these paths: fully_shard may run inside a
    # `with torch.device("meta")` (init on meta), which would make them meta tensors
    sizes = as_host(torch.zeros(world, dtype=torch.int64, device="cpu"))
    mine = as_host(torch.tensor([data.numel()], dtype=torch.int64, device="cpu"))
    what = "all-gather of objects"
    _wait_host(_all_gather_single(sizes, mine, group=group, async_op=True), group, what)
    counts = sizes.tolist()
    top = max(counts)
    padded = as_host(torch.zeros(top, dtype=torch.uint8, device="cpu"))
    padded[: data.numel()] = data
    got = as_host(torch.empty(world * top, dtype=torch.uint8, device="cpu"))
    _wait_host(_all_gather_single(got, padded, group=group, async_op=True), group, what)
    return [
        pickle.loads(got[i * top : i * top + n].numpy().tobytes()) for i, n in enumerate(counts)
    ]


def broadcast_object(obj: Any, src: int = 0, group: dist.ProcessGroup | None = None) -> Any:
    """Rank ``src``'s picklable ``obj``, on every rank (waits as :func:`all_gather_objects`')."""
    if not _polled_objects(group):
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=group)
        return box[0]
    mine = dist.get_rank() == src
    data = _pickled(obj) if mine else None
    size = as_host(
        torch.tensor([0 if data is None else data.numel()], dtype=torch.int64, device="cpu")
    )
    what = "broadcast of an object"
    _wait_host(dist.broadcast(size, src=src, group=group, async_op=True), group, what)
    buf = (
        data
        if data is not None
        else as_host(torch.empty(int(size.item()), dtype=torch.uint8, device="cpu"))
    )
    _wait_host(dist.broadcast(buf, src=src, group=group, async_op=True), group, what)
    return obj if mine else pickle.loads(buf.numpy().tobytes())


def broadcast_tensor(
    t: torch.Tensor,
    src: int = 0,
    group: dist.ProcessGroup | None = None,
    *,
    what: str = "broadcast",
    timeout: timedelta | None = None,
) -> None:
    """Rank ``src``'s values of ``t`` into ``t`` on every rank. A tensor the backend cannot move
    (a CPU buffer under NCCL) travels through the group's device and back."""
    if t.device.type in accepted_devices(group) and t.is_contiguous():
        broadcast(t, src, group, what=what, timeout=_timeout(timeout)).wait()
        return
    buf = t.detach().to(comm_device(group)).contiguous()
    broadcast(buf, src, group, what=what, timeout=_timeout(timeout)).wait()
    with torch.no_grad():
        t.copy_(buf)


def ring_exchange(
    payloads: Sequence[torch.Tensor],
    group: dist.ProcessGroup | None = None,
    *,
    distance: int = 1,
    reuse: Sequence[torch.Tensor] = (),
) -> list[torch.Tensor]:
    """Send this rank's host uint8 ``payloads`` (any lengths) to the rank ``distance`` ahead in
    rank order and return those of the rank ``distance`` behind (``fullshard.elastic``'s ring
    copies): their sizes first, then each payload. Everything stays on the host, so ``group``
    must move CPU tensors (gloo). Each transfer is an all-to-all in which only the ring pairs
    carry bytes, not a send and a receive: a gloo send's work never reports itself complete to
    a poll (measured), so its wait could not give up when the membership changes, while an
    all-to-all's wait polls (NOTE [Interrupts]) and is bounded by the run's timeout. ``reuse``:
    receive buffers to fill again where the sizes match (one per payload), instead of
    allocating new ones."""
    if not _moves_host(group):
        raise FullshardError("ring_exchange moves host bytes: give it a gloo group")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    nxt, prv = (rank + distance) % world, (rank - distance) % world
    n = len(payloads)
    # host memory on a GPU machine too (made from data, or marked: the CUDA emulation's
    # all-device mode would otherwise take a plain CPU buffer for device memory)
    sizes = as_host(torch.zeros(world, n, dtype=torch.int64, device="cpu"))
    sizes[nxt] = torch.tensor([p.numel() for p in payloads], dtype=torch.int64, device="cpu")
    theirs = as_host(torch.zeros(world, n, dtype=torch.int64, device="cpu"))
    what = "ring exchange of copies"
    _wait_host(dist.all_to_all_single(theirs, sizes, group=group, async_op=True), group, what)
    got: list[torch.Tensor] = []
    old: list[torch.Tensor | None] = [*reuse, *[None] * (n - len(reuse))]
    for payload, size, buf in zip(payloads, theirs[prv].tolist(), old, strict=True):
        if buf is not None and buf.numel() == size and buf.dtype == torch.uint8:
            into = buf
        else:
            into = as_host(torch.empty(size, dtype=torch.uint8, device="cpu"))
        send = payload.contiguous()
        send = send if send.is_pinned() else as_host(send)
        outs, ins = [0] * world, [0] * world
        outs[prv], ins[nxt] = size, send.numel()
        work = dist.all_to_all_single(into, send, outs, ins, group=group, async_op=True)
        _wait_host(work, group, what)
        got.append(into)
    return got


def all_to_all_bytes(
    sends: Sequence[torch.Tensor], group: dist.ProcessGroup | None = None
) -> list[torch.Tensor]:
    """Every rank's host uint8 ``sends[r]`` (any lengths) to rank ``r``; what each rank sent
    this one, in rank order: the sizes first (one small all-to-all), then the bytes (one
    all-to-all of uneven blocks). Host memory on a gloo ``group``, waits as
    :func:`ring_exchange`'s."""
    if not _moves_host(group):
        raise FullshardError("all_to_all_bytes moves host bytes: give it a gloo group")
    world = dist.get_world_size(group)
    if len(sends) != world:
        raise ValueError(f"all_to_all_bytes needs one block per rank ({world}), got {len(sends)}")
    what = "all-to-all of restore blocks"
    sizes = as_host(torch.tensor([s.numel() for s in sends], dtype=torch.int64, device="cpu"))
    theirs = as_host(torch.zeros(world, dtype=torch.int64, device="cpu"))
    _wait_host(dist.all_to_all_single(theirs, sizes, group=group, async_op=True), group, what)
    send = as_host(torch.cat([s.reshape(-1) for s in sends]) if world else sizes[:0])
    counts = theirs.tolist()
    recv = as_host(torch.empty(sum(counts), dtype=torch.uint8, device="cpu"))
    work = dist.all_to_all_single(recv, send, counts, sizes.tolist(), group=group, async_op=True)
    _wait_host(work, group, what)
    return list(recv.split(counts))
