"""The machinery of ``cuda_emulation`` (read its module docstring first): the emulation's
state (timelines, vector clocks, storages and their accesses, the checks), the virtual streams
and events, the host synchronisation counter, and the two modes that see every op.
NOTE [Happens-before under CUDA emulation] is in ``emulation.py``.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import weakref
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, NamedTuple

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from fullshard.testing import _emulation_contracts as contracts

HOST = 0  # the host's timeline
DEVICE = contracts.DEVICE  # what a storage is: device memory, host memory, pinned host memory
HOST_MEMORY, PINNED = "host", "pinned"

aten = torch.ops.aten
_FACTORY = re.compile(r"(new_.*|.*_like)$")  # their tensor inputs give only metadata
_SKIP_NAMESPACES = frozenset({"c10d", "_c10d_functional"})  # see emulated_collective
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
OWN_FILES = {__file__, contracts.__file__}  # not call sites (emulation.py adds itself)
ORIGINAL_RESIZE = torch.UntypedStorage.resize_

_EMU: Emulation | None = None
_COUNTS: Counter[tuple[str, str]] = Counter()


class StreamOrderError(RuntimeError):
    """An access, or a free, that CUDA would not order after what it must follow."""


class _Access(NamedTuple):
    tid: int  # timeline
    seq: int
    op: str
    write: bool


@dataclass(eq=False)
class _Storage:
    kind: str
    alloc: int  # the timeline it was allocated on
    desc: str  # shape and dtype of the last tensor seen on it
    name: str | None = None
    write: _Access | None = None
    reads: dict[int, _Access] = field(default_factory=dict)  # since the write, last per timeline
    recorded: set[int] = field(default_factory=set)  # record_stream
    finalizer: Any = None


def merge(into: dict[int, int], other: dict[int, int]) -> None:
    for tid, seq in other.items():
        if into.get(tid, -1) < seq:
            into[tid] = seq


def _call_site() -> str:
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        path = frame.f_code.co_filename
        if path not in OWN_FILES and not path.startswith(_TORCH_DIR):
            return f"{path}:{frame.f_lineno}"
        frame = frame.f_back
    return "<unknown>"


def _describe(t: torch.Tensor) -> str:
    return f"shape {list(t.shape)}, {str(t.dtype).removeprefix('torch.')}"


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, torch.Tensor)]
    return []


class Emulation:
    """The state of the active ``cuda_emulation()`` (at most one at a time)."""

    def __init__(self, all_device: bool) -> None:
        self.all_device = all_device
        self.names: list[str] = ["host"]
        self.clocks: list[dict[int, int]] = [{HOST: 0}]
        self.storages: dict[int, _Storage] = {}  # by id() of the (preserved) storage object
        self.collective_timelines: dict[int, int] = {}
        self.pending: list[StreamOrderError] = []
        # allocating stream -> (use not ordered before it, tensor, how freed): check_reuse
        self.freed: dict[int, list[tuple[_Access, str, str]]] = {}
        self.paused = False
        self.sync_kind: str | None = None
        self.active = True
        self.stack: list[VirtualStream] = []
        self.compute = self.current = VirtualStream("compute", _emulation=self)
        # objects the code under test keeps per emulation (the engine's virtual streams)
        self.owned: dict[Any, Any] = {}
        # open same_bits() blocks, innermost last (NOTE [Kernel contracts]: no reductions)
        self.same_bits: list[str] = []

    # -- timelines ------------------------------------------------------------------------
    def timeline(self, name: str) -> int:
        """A new timeline, after everything the host has seen."""
        tid = len(self.names)
        self.names.append(name)
        self.clocks.append({**self.clocks[HOST], tid: 0})
        return tid

    def launch(self, tid: int) -> dict[int, int]:
        """Rule 1: work on a stream comes after what the host did before issuing it."""
        clock = self.clocks[tid]
        if tid != HOST:
            merge(clock, self.clocks[HOST])
        return clock

    def who(self, tid: int) -> str:
        return "the host" if tid == HOST else f"stream {self.names[tid]!r}"

    def host_sync(self, kind: str, clock: dict[int, int]) -> None:
        """Rule 3: the host waits until ``clock``'s point (counted as ``kind``)."""
        count_host_sync(kind)
        merge(self.clocks[HOST], clock)

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        self.paused, was = True, self.paused
        try:
            yield
        finally:
            self.paused = was

    def raise_pending(self) -> None:
        if self.pending:
            error = self.pending[0]
            self.pending.clear()
            raise error

    # -- storages -------------------------------------------------------------------------
    def info(self, t: torch.Tensor, create: bool) -> _Storage | None:
        if t.device.type != "cpu":
            return None
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return None
        found = self.storages.get(id(storage))
        if found is None and create:
            kind = DEVICE if self.all_device else HOST_MEMORY
            found = self._register(storage, _Storage(kind, self.compute.tid, _describe(t)))
        return found

    def _register(self, storage: torch.UntypedStorage, info: _Storage) -> _Storage:
        key = id(storage)
        info.finalizer = weakref.finalize(storage, self._freed, key)
        self.storages[key] = info
        return info

    def kind(self, t: torch.Tensor) -> str:
        found = self.info(t, create=False)
        if found is not None:
            return found.kind
        return DEVICE if self.all_device else HOST_MEMORY

    def mark(self, t: torch.Tensor, kind: str) -> _Storage | None:
        """Make ``t``'s storage ``kind``; a change starts it afresh (no accesses yet): marked a
        device storage, it counts as allocated now, on the current stream."""
        new = self.info(t, create=False) is None  # made now (a paused op's output)
        found = self.info(t, create=True)
        if found is not None and (found.kind != kind or new):
            if kind == DEVICE:
                self.check_reuse(self.current.tid, f"a new {_describe(t)}")
            found.kind, found.write, found.reads = kind, None, {}
            found.alloc = self.current.tid
        return found

    def label(self, found: _Storage, desc: str) -> str:
        return f"tensor {found.name!r} ({desc})" if found.name else f"a tensor ({desc})"

    # -- accesses -------------------------------------------------------------------------
    def access(
        self,
        op: str,
        tid: int,
        reads: Sequence[torch.Tensor],
        writes: Sequence[torch.Tensor],
        outputs: Sequence[torch.Tensor] = (),
    ) -> None:
        """Check, then record, one op's accesses on timeline ``tid`` (``HOST`` or a stream).

        ``outputs``: new storages the op made (device ones when it ran on a stream)."""
        plan: dict[int, tuple[_Storage, torch.Tensor, bool]] = {}
        for write, group in ((False, reads), (True, writes)):
            for t in group:
                found = self.info(t, create=tid != HOST and self.all_device)
                if found is not None and found.kind != HOST_MEMORY:
                    seen = plan.get(id(found))  # several tensors of one storage: the first
                    plan[id(found)] = (
                        (found, t, write) if seen is None else (*seen[:2], seen[2] or write)
                    )
        clock = self.launch(tid)
        for found, t, write in plan.values():
            last = found.write
            before = list(found.reads.values()) if write and found.reads else [last] if last else []
            for prev in before:
                if prev.tid != tid and clock.get(prev.tid, 0) < prev.seq:
                    raise self._conflict(op, tid, t, write, found, prev)
        clock[tid] += 1
        seq = clock[tid]
        for found, t, write in plan.values():
            entry = _Access(tid, seq, op, write)
            if write:
                found.write, found.reads = entry, {}
            else:
                found.reads[tid] = entry
            found.desc = _describe(t)
        for t in outputs:
            if tid == HOST:
                if self.all_device:
                    self.mark(t, HOST_MEMORY)
                continue
            try:
                storage = t.untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue
            if id(storage) not in self.storages:  # else an unannotated view: metadata only
                if storage.nbytes() > 0:
                    self.check_reuse(tid, op)
                made = _Storage(DEVICE, tid, _describe(t), write=_Access(tid, seq, op, True))
                self._register(storage, made)

    def _conflict(
        self, op: str, tid: int, t: torch.Tensor, write: bool, found: _Storage, prev: _Access
    ) -> StreamOrderError:
        here, there = self.who(tid), self.who(prev.tid)
        if tid == HOST:
            fix = (
                f"the host sees what {there} did only after event.synchronize() on an event "
                "recorded there after it (or that stream's synchronize())"
            )
        else:
            fix = (
                f"record an event on {there} after that access and make {here} wait on it "
                "(wait_event, wait_stream, or work.wait() for a collective)"
            )
        return StreamOrderError(
            f"{op} on {here} {'writes' if write else 'reads'} {self.label(found, _describe(t))}, "
            f"which {prev.op} on {there} {'wrote' if prev.write else 'read'} with nothing "
            f"ordering that before this point: {fix}"
        )

    def check_free(self, found: _Storage, how: str) -> None:
        """The caching allocator's rule (NOTE [Happens-before under CUDA emulation]): a freed
        block goes back to its allocating stream's pool at once. Each use on another stream
        (not covered by ``record_stream``) that is not yet ordered before that stream is kept,
        and checked at the stream's next allocation (``check_reuse``), which may get the block."""
        if found.kind != DEVICE:
            return  # the pinned allocator waits for its copies itself
        view = {**self.clocks[found.alloc]}
        merge(view, self.clocks[HOST])
        for prev in [found.write, *found.reads.values()]:
            if prev is None or prev.tid in (found.alloc, *found.recorded):
                continue
            if view.get(prev.tid, 0) < prev.seq:
                what = self.label(found, found.desc)
                self.freed.setdefault(found.alloc, []).append((prev, what, how))

    def check_reuse(self, tid: int, made: str) -> None:
        """An allocation on stream ``tid``: raise if a block freed there may still be in use
        on another stream (an access of it not ordered before this point)."""
        hazards = self.freed.get(tid)
        if not hazards:
            return
        view = {**self.clocks[tid]}
        merge(view, self.clocks[HOST])
        for prev, what, how in hazards:
            if view.get(prev.tid, 0) < prev.seq:
                del self.freed[tid]
                alloc, there = self.who(tid), self.who(prev.tid)
                raise StreamOrderError(
                    f"{what}, allocated on {alloc}, was freed ({how}) while {prev.op} on "
                    f"{there} {'writing' if prev.write else 'reading'} it was not ordered before "
                    f"{alloc}; the caching allocator may hand that memory to this allocation "
                    f"on {alloc} ({made}) at once. Make {alloc} wait on an event recorded on "
                    f"{there} after that use before it allocates again (or call "
                    "tensor.record_stream() with that stream)"
                )
        del self.freed[tid]  # every hazard is ordered now: the block is safe to reuse

    def _freed(self, key: int) -> None:
        found = self.storages.pop(key, None)
        if found is not None and self.active:
            self.check_free(found, "its last tensor was deleted")

    def close(self) -> None:
        self.active = False
        for found in self.storages.values():
            found.finalizer.detach()
        self.storages.clear()

    def stream_read(self, op: str, t: torch.Tensor, kind: str) -> None:
        """``t`` read on the current stream, then the host waits for it (``.tolist()``...)."""
        self.access(op, self.current.tid, [t], [])
        self.host_sync(kind, self.clocks[self.current.tid])


def active() -> Emulation | None:
    return _EMU


def activate(emu: Emulation | None) -> None:
    global _EMU
    _EMU = emu


def require() -> Emulation:
    if _EMU is None:
        raise RuntimeError("no cuda_emulation() is active")
    _EMU.raise_pending()
    return _EMU


# -- virtual streams and events ----------------------------------------------------------------
class VirtualStream(torch.Stream):
    """A stream of the active emulation (``torch.cuda.Stream``'s methods; a context manager).

    A ``torch.Stream`` so that ``tensor.record_stream(s)`` accepts it."""

    def __new__(cls, name: str = "stream", *, _emulation: Emulation | None = None) -> VirtualStream:
        return super().__new__(cls, device="cpu")

    def __init__(self, name: str = "stream", *, _emulation: Emulation | None = None) -> None:
        self._emu = _emulation or require()
        self.name = name
        self.tid = self._emu.timeline(name)

    def _live(self) -> Emulation:
        if not self._emu.active:
            raise RuntimeError(f"{self!r} belongs to a cuda_emulation() that has ended")
        self._emu.raise_pending()
        return self._emu

    def wait_event(self, event: VirtualEvent) -> None:  # type: ignore[override]
        """Work queued on this stream from now on runs after ``event``'s point."""
        merge(self._live().launch(self.tid), event._snapshot)

    def wait_stream(self, other: VirtualStream) -> None:  # type: ignore[override]
        """Work queued on this stream from now on runs after all work queued on ``other``."""
        self._live()
        self.wait_event(other.record_event())

    def record_event(self, event: VirtualEvent | None = None) -> VirtualEvent:  # type: ignore[override]
        event = VirtualEvent() if event is None else event
        event.record(self)
        return event

    def synchronize(self) -> None:
        """The host waits for all work queued on this stream (a host synchronisation)."""
        emu = self._live()
        emu.host_sync("stream.synchronize", emu.clocks[self.tid])

    def query(self) -> bool:
        """Always true on the CPU; orders the host after this stream's work, as a true answer
        does on CUDA (not counted as a synchronisation)."""
        emu = self._live()
        merge(emu.clocks[HOST], emu.clocks[self.tid])
        return True

    def __enter__(self) -> VirtualStream:
        emu = self._live()
        emu.stack.append(emu.current)
        emu.current = self
        return self

    def __exit__(self, *exc: object) -> None:
        self._emu.current = self._emu.stack.pop()

    def __eq__(self, other: object) -> bool:
        return self is other

    def __ne__(self, other: object) -> bool:
        return self is not other

    __hash__ = object.__hash__

    def __repr__(self) -> str:
        return f"VirtualStream({self.name!r})"


class VirtualEvent:
    """An event of the active emulation (``torch.cuda.Event``'s methods)."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False) -> None:
        self._emu = require()
        self._snapshot: dict[int, int] = {}  # never recorded: waiting on it orders nothing

    def record(self, stream: VirtualStream | None = None) -> None:
        """Capture ``stream``'s (default: the current stream's) point."""
        s = self._emu.current if stream is None else stream
        self._snapshot = dict(s._live().launch(s.tid))

    def wait(self, stream: VirtualStream | None = None) -> None:
        (self._emu.current if stream is None else stream).wait_event(self)

    def synchronize(self) -> None:
        """The host waits for this event's point (a host synchronisation)."""
        require().host_sync("event.synchronize", self._snapshot)

    def query(self) -> bool:
        """Always true on the CPU; orders the host as ``synchronize`` (not counted)."""
        merge(require().clocks[HOST], self._snapshot)
        return True


# -- host synchronisation counter ---------------------------------------------------------------
def count_host_sync(kind: str, site: str | None = None) -> None:
    """Count one host synchronisation of ``kind`` at ``site`` (default: the first caller's
    frame outside torch and this module). A no-op outside an emulation."""
    if _EMU is not None:
        _COUNTS[(kind, site or _call_site())] += 1


def reset_counts() -> None:
    _COUNTS.clear()


def counts() -> dict[tuple[str, str], int]:
    return dict(_COUNTS)


# -- the modes ----------------------------------------------------------------------------------
class DispatchMode(TorchDispatchMode):
    """Every aten op: which storages it reads and writes, on which timeline; the checks."""

    def __init__(self, emu: Emulation) -> None:
        super().__init__()
        self.emu = emu

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        emu = self.emu
        if any(t is not torch.Tensor for t in types):
            if any(issubclass(t, FakeTensor) for t in types):
                return func(*args, **kwargs)  # shape propagation (DTensor's): no data, no stream
            return NotImplemented  # a subclass: its inner tensors' ops come back here
        if emu.paused or func.namespace in _SKIP_NAMESPACES or func is aten.record_stream.default:
            return func(*args, **kwargs)
        emu.raise_pending()
        if func is aten.is_pinned.default:  # a subclass's inner tensor (FunctionMode: the rest)
            return emu.kind(args[0]) == PINNED
        if func in (aten._pin_memory.default, aten.pin_memory.default):
            t = args[0]
            emu.access(str(func), emu.current.tid if emu.kind(t) == DEVICE else HOST, [t], [])
            out = t.clone()  # a host copy, marked pinned as FunctionMode's pin_memory
            emu.mark(out, PINNED)
            return out
        contracts.check(emu, func, args, kwargs)  # NOTE [Kernel contracts]
        schema = func._schema
        factory = bool(_FACTORY.match(schema.name.split("::")[-1]))
        reads: list[torch.Tensor] = []
        writes: list[torch.Tensor] = []
        metadata: list[torch.Tensor] = []
        for i, arg in enumerate(schema.arguments):
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            alias = arg.alias_info
            if alias is not None and alias.is_write:
                writes.extend(_tensors(value))
            else:
                (metadata if factory or alias is not None else reads).extend(_tensors(value))
        touched = [*reads, *writes, *metadata]
        on_stream = any(emu.kind(t) == DEVICE for t in touched) or (not touched and emu.all_device)
        tid = emu.current.tid if on_stream else HOST
        # check before running: an op that raises has not happened
        emu.access(str(func), tid, reads, writes)
        out = func(*args, **kwargs)
        contracts.count_fill(func, out, _call_site)
        values = (out,) if len(schema.returns) == 1 else out
        made = [
            t
            for ret, value in zip(schema.returns, values or (), strict=False)
            if ret.alias_info is None
            for t in _tensors(value)
        ]
        if made:
            emu.access(str(func), tid, [], [], made)
        if func is aten._local_scalar_dense.default and on_stream:
            emu.host_sync(emu.sync_kind or "item", emu.clocks[tid])
        elif func is aten.copy_.default:
            dst, src = emu.kind(args[0]), emu.kind(args[1])
            non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
            if src == DEVICE and dst != DEVICE and not (dst == PINNED and non_blocking):
                emu.host_sync("copy_to_host", emu.clocks[tid])
            elif dst == DEVICE and src != DEVICE and not non_blocking:
                emu.host_sync("copy_to_device", emu.clocks[tid])
        return out


class FunctionMode(TorchFunctionMode):
    """The Python-level calls the dispatcher does not see: pinning, ``record_stream``,
    ``.tolist()``, ``.cpu()``, ``.to()``; and the kind of an ``.item()`` (``bool()``)."""

    def __init__(self, emu: Emulation) -> None:
        super().__init__()
        self.emu = emu

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        emu = self.emu
        if emu.paused:
            return func(*args, **kwargs)
        if kwargs.get("pin_memory"):
            out = func(*args, **{**kwargs, "pin_memory": False})
            emu.mark(out, PINNED)
            return out
        if func in _FROM_DATA and emu.all_device and kwargs.get("device") in (None, "cpu"):
            # a tensor made from Python data with no device (or the string "cpu", as torch's
            # optimizers host their step counts) is host memory on a CUDA machine, e.g.
            # torch.tensor(values) staged for a copy to the device (pageable: blocking)
            out = func(*args, **kwargs)
            from_tensor = bool(args) and isinstance(args[0], torch.Tensor)  # may share storage
            if isinstance(out, torch.Tensor) and not from_tensor:
                emu.mark(out, HOST_MEMORY)
            return out
        t = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if t is None or func not in _METHODS:
            return func(*args, **kwargs)
        emu.raise_pending()
        name, kind = _METHODS[func], emu.kind(t)
        if name == "__bool__":
            emu.sync_kind = "bool"
            try:
                return func(*args, **kwargs)
            finally:
                emu.sync_kind = None
        if type(t) not in (torch.Tensor, torch.nn.Parameter):
            return self._subclass(func, types, name, t, args, kwargs)
        if name == "is_pinned":
            return kind == PINNED
        if name == "record_stream":
            if not isinstance(args[1], VirtualStream):
                return func(*args, **kwargs)
            found = emu.info(t, create=True)
            if found is not None:
                found.recorded.add(args[1].tid)
            return None
        if name == "pin_memory":
            if kind == DEVICE and not emu.all_device:
                raise RuntimeError("cannot pin an emulated device tensor: only host tensors")
            out = t.clone()  # a host read of t
            emu.mark(out, PINNED)
            return out
        if name in ("tolist", "numpy"):
            if kind == DEVICE:
                if name == "numpy":
                    raise TypeError("can't convert an emulated device tensor to numpy: .cpu()")
                emu.stream_read("Tensor.tolist", t, "tolist")
            elif kind == PINNED:
                emu.access(f"Tensor.{name}", HOST, [t], [])
            return func(*args, **kwargs)
        if name == "cpu" and kind == DEVICE:
            emu.stream_read("Tensor.cpu", t, "cpu")
            with emu.pause():
                out = t.clone()
            emu.mark(out, HOST_MEMORY)
            return out
        if name == "to" and (kind == PINNED or (kind == HOST_MEMORY and emu.all_device)):
            devices = [*args[1:], kwargs.get("device")]
            if any(isinstance(d, (str, torch.device)) and _is_cpu(d) for d in devices):
                with emu.pause():
                    out = func(*args, **{**kwargs, "copy": True})
                emu.mark(out, DEVICE)
                emu.access("Tensor.to", emu.current.tid, [t], [out])
                if not kwargs.get("non_blocking", False):
                    emu.host_sync("copy_to_device", emu.clocks[emu.current.tid])
                return out
        return func(*args, **kwargs)

    def _subclass(
        self, func: Any, types: Any, name: str, t: torch.Tensor, args: Any, kwargs: Any
    ) -> Any:
        """A tensor subclass (torchao's ``NF4Tensor``, CPU offload's shards): it pins through its
        own dispatch, whose inner tensors come back as plain ops (``DispatchMode``); a device
        move of one with inner tensors in host memory moves each inner tensor as a plain tensor
        (its own ``to`` would run them outside this mode, unseen; one on the device already
        stays), then rebuilds it."""
        # a DTensor moves its local tensor through its own dispatch, which this mode sees as a
        # plain op (and its flattened names include the mesh, not a tensor)
        if name != "to" or isinstance(t, DTensor) or not hasattr(t, "__tensor_flatten__"):
            return func(*args, **kwargs)
        device, dtype, _, _ = torch._C._nn._parse_to(*args[1:], **kwargs)
        names, ctx = t.__tensor_flatten__()  # type: ignore[attr-defined]
        inner = {n: getattr(t, n) for n in names}
        if not all(isinstance(x, torch.Tensor) for x in inner.values()):
            return func(*args, **kwargs)
        host = any(
            self.emu.kind(x) == PINNED or (self.emu.kind(x) == HOST_MEMORY and self.emu.all_device)
            for x in inner.values()
        )
        if dtype is not None or device is None or not _is_cpu(device) or not host:
            return func(*args, **kwargs)
        moved = {
            n: self.__torch_function__(func, types, (x, *args[1:]), kwargs)
            for n, x in inner.items()
        }
        return type(t).__tensor_unflatten__(inner | moved, ctx, t.shape, t.stride())  # type: ignore[attr-defined]


_FROM_DATA = (torch.tensor, torch.as_tensor)


def _is_cpu(device: str | torch.device) -> bool:
    try:
        return torch.device(device).type == "cpu"
    except (RuntimeError, TypeError):
        return False


_METHODS = {
    getattr(torch.Tensor, name): name
    for name in ("__bool__", "is_pinned", "record_stream", "pin_memory", "tolist", "numpy")
    + ("cpu", "to")
}
