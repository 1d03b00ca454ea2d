"""CUDA's stream semantics over CPU tensors, so code written for CUDA streams is checked on CPU.

``with cuda_emulation():`` (or ``FULLSHARD_CUDA_EMULATION=1``, see ``enabled_from_env``) gives
the program *virtual* streams and events (``VirtualStream``, ``VirtualEvent``, shaped like
``torch.cuda.Stream`` / ``torch.cuda.Event``) and checks every aten op against CUDA's ordering
rules, with the algorithm of torch's CUDA sanitizer (``torch.cuda._sanitizer``): a vector clock
per stream, events that carry a snapshot of one, and per storage the last write and the reads
since. Ops still run at once, in program order, on the CPU: only the *ordering* is modelled. An
op the GPU could run in another order than the host issued it raises ``StreamOrderError``.

What is emulated:

- *Device tensors.* The emulated device is the CPU. A storage is a device storage when marked
  with ``as_device`` (or, under ``cuda_emulation(all_device=True)``, unless it is pinned or a
  ``.cpu()`` copy); an op's new outputs are device storages when it touched one, and also
  ``emulated_collective``'s tensors. Other storages are host memory.
- *Pinned memory* (a CPU-only build cannot pin): ``torch.empty(..., pin_memory=True)`` (any
  factory with ``pin_memory=True``) and ``t.pin_memory()`` return tensors marked pinned,
  ``emulated_pinned(t)`` marks one in place, and ``t.is_pinned()`` reports the mark.
- *Who runs an op.* An op touching a device storage is a stream op: it runs on the current
  virtual stream (``current_stream()``; ``with stream:`` changes it). Any other op runs on the
  *host* timeline, synchronously, as ops on CPU tensors do under CUDA. A stream op's accesses to
  device and pinned storages happen on the stream; to pageable host memory (a 0-dim scalar, a
  staged or blocking copy) at once, on the host, so pageable memory is never checked.
- *Host reads.* The host's accesses are: host ops on a pinned buffer (``.item()``, ``.sum()``,
  ``fill_``...) and ``.tolist()`` / ``.numpy()`` of one; and ``.item()`` (``int()``,
  ``float()``), ``bool()``, ``.tolist()``, ``.cpu()`` of a device tensor, each a read on the
  current stream after which the host waits for that stream (a counted synchronisation).
  ``.cpu()`` returns a host copy; ``.to(device)`` of a pinned tensor is a host-to-device copy
  (``non_blocking`` honoured); ``.to("cpu")`` of a device tensor stays a no-op, as the device
  *is* the CPU (write ``.cpu()`` for a device-to-host copy).
- *Copies.* ``dst.copy_(src, non_blocking=True)`` between a device and a pinned buffer is
  asynchronous: a write (or read) by the current stream that the host sees only after
  synchronising. Any other device/host copy blocks the host, as CUDA does (counted below).
- *The caching allocator.* A device storage is allocated on the stream current at its
  creation. Freeing it (its last tensor dies, or ``untyped_storage().resize_()``) returns the
  block to that stream at once, and CUDA's allocator may hand it to the stream's next
  allocation: so the next allocation on the allocating stream raises if a use of a block freed
  there, on another stream, is still not ordered before it (a wait between the free and that
  allocation makes it safe). ``t.record_stream(s)`` (``VirtualStream`` is a ``torch.Stream``)
  covers uses on ``s``.
- *Host memory from Python data.* Under ``all_device``, ``torch.tensor(data)`` and
  ``torch.as_tensor(data)`` with no device (or ``device="cpu"``, as torch's optimizers host
  their step counts) make host memory, as on a GPU machine: copying one into a device tensor is
  a blocking, counted copy.
- *Collectives* (``emulated_collective``): as NCCL's, they run on a side timeline that first
  waits for the issuing stream, become visible to a stream when it calls ``wait()``, and their
  handle holds their tensors until then.
- *Host synchronisations* are counted by kind and call site (``sync_counts``).
- *Kernel contracts* (NOTE [Kernel contracts], ``_emulation_contracts.py``): the ops whose CUDA
  kernels refuse (or misread) what their CPU twins accept check the CUDA preconditions before
  they run (fused optimizers, AMP's unscale and scale update, foreach ops, collectives, and no
  reduction inside ``same_bits()``), raising ``KernelContractError``; torch's deterministic fill
  of new tensors is counted (``fill_counts``).

Against torch's sanitizer: the same clocks and checks for stream accesses (its "kernel launch"
is our stream op, its stream-creation, event and synchronisation callbacks are our
``VirtualStream`` / ``VirtualEvent`` calls); added here are the host as a timeline (pinned
buffers and asynchronous copies), the allocator's free rule (the sanitizer forgets a freed
block), collectives and the counter. The machinery is in ``_cuda_emulation_core.py``.

Not emulated: timing and concurrency (nothing overlaps, so races are found only as missing
orderings, never as wrong values); frees of pinned memory (torch's host allocator waits for
the copies itself); a tensor ``resize_`` that reallocates; autograd's rule that a backward op runs on its forward op's
stream (backward runs on the current stream); c10d ops (collectives are tracked only through
``emulated_collective``); implicit syncs inside ops (``nonzero``, boolean masks); graphs;
several devices; tensors off the CPU. Ops on tensor subclasses (DTensor) are checked at the level
of their inner tensors.

NOTE [Happens-before under CUDA emulation]
There are timelines: the host (0), the default stream ``compute``, each ``VirtualStream``, and
a collective timeline per issuing stream. Each keeps a vector clock ``clock[t]``: for every
timeline ``u``, the sequence number of the last access on ``u`` known to come before ``t``'s next
action. An access on ``t`` increments ``clock[t][t]`` and is recorded as ``(t, seq)``; it is
ordered before the current point of ``c`` when ``clock[c][t] >= seq`` (or ``t == c``). Edges:

1. Launch: every action on a stream (op, event record or wait, collective) first merges the
   host's clock, since work runs after the host issued it (and after what the host did before).
2. ``event.record(s)`` snapshots ``clock[s]``; ``s.wait_event(e)`` merges the snapshot into
   ``clock[s]`` (waiting on a never-recorded event orders nothing, as in CUDA);
   ``a.wait_stream(b)`` is ``a.wait_event(b.record_event())``.
3. ``event.synchronize()`` (or a true ``query()``) merges its snapshot into the host's clock;
   ``stream.synchronize()`` and blocking copies the stream's clock; ``synchronize()`` all clocks.
4. A collective issued on ``s`` runs on ``s``'s collective timeline ``k``, which merges
   ``clock[s]``; ``work.wait()`` merges ``k``'s snapshot after the collective into the clock of
   the stream current at the wait (only that stream).

Checks (the sanitizer's): a read needs the storage's last write ordered before it; a write needs
every read since that write ordered before it, or, with no read since, the last write. A free
needs every access on a stream other than the allocating one, and not covered by
``record_stream``, ordered before the allocating stream's view (its clock merged with the host's).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from fullshard.comm.runtime import DeviceRuntime, runtime, use_runtime
from fullshard.testing import _emulation_contracts as contracts
from fullshard.testing import _emulation_core as core
from fullshard.testing._emulation_contracts import KernelContractError, fill_counts
from fullshard.testing._emulation_core import (
    DEVICE,
    HOST,
    HOST_MEMORY,
    PINNED,
    Emulation,
    StreamOrderError,
    VirtualEvent,
    VirtualStream,
    count_host_sync,
    merge,
    require,
)

__all__ = [
    "Emulation",
    "EmulatedRuntime",
    "EmulatedWork",
    "KernelContractError",
    "StreamOrderError",
    "VirtualEvent",
    "VirtualStream",
    "active_emulation",
    "as_device",
    "as_host",
    "count_host_sync",
    "cuda_emulation",
    "current_stream",
    "default_stream",
    "emulated_collective",
    "emulated_pinned",
    "emulated_runtime",
    "enabled_from_env",
    "fill_counts",
    "in_host_memory",
    "is_active",
    "name_tensor",
    "reset_sync_counts",
    "same_bits",
    "stream",
    "sync_counts",
    "synchronize",
    "untracked",
]

core.OWN_FILES.add(__file__)


def current_stream() -> VirtualStream:
    return require().current


def default_stream() -> VirtualStream:
    """The default (compute) stream, which exists from the start."""
    return require().compute


def stream(s: VirtualStream | None) -> contextlib.AbstractContextManager[Any]:
    """``torch.cuda.stream(s)``: make ``s`` current in a ``with`` block (``None``: no change)."""
    return contextlib.nullcontext() if s is None else s


def synchronize() -> None:
    """``torch.cuda.synchronize()``: the host waits for every stream."""
    emu = require()
    count_host_sync("synchronize")
    for clock in emu.clocks:
        merge(emu.clocks[HOST], clock)


# -- collectives --------------------------------------------------------------------------------
class EmulatedWork:
    """A collective's handle: ``wait()`` orders the current stream after the collective."""

    def __init__(
        self,
        emu: Emulation,
        done: dict[int, int],
        work: Any,
        held: list[torch.Tensor],
        abandon: Callable[[], None] | None = None,
    ) -> None:
        self._emu, self._done, self._work, self._held = emu, done, work, held
        self._abandon = abandon

    def wait(self, timeout: Any = None) -> bool:
        """The stream current now waits for the collective (rule 4). With a ``timeout`` (a
        bounded host wait, as ``work.wait(timeout)``) the host waits too, counted.

        The real gloo handle blocks the host here, as NCCL's never does; so while it runs,
        ``abandon`` (the issuer's) may raise to give the wait up: the test bed's stand-in for a
        communicator aborted from another thread, which fails the waits NCCL has queued."""
        if self._work is not None:
            with self._emu.pause():  # what gloo does inside wait() is the collective's own work
                if self._abandon is not None:
                    while not self._work.is_completed():
                        self._abandon()
                        time.sleep(1e-4)
                self._work.wait() if timeout is None else self._work.wait(timeout)
        s = self._emu.current
        merge(s._live().launch(s.tid), self._done)
        if timeout is not None:
            self._emu.host_sync("work.wait(timeout)", self._done)
        self._held = []  # NCCL's stash, held until now: a free of the last reference is checked
        self._emu.raise_pending()
        return True

    def is_completed(self) -> bool:
        return True


def emulated_collective(
    outputs: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    *,
    name: str = "collective",
    work: Any = None,
    abandon: Callable[[], None] | None = None,
) -> EmulatedWork:
    """Model an async collective issued now on the current stream, which reads ``inputs`` and
    writes ``outputs`` (an in-place one lists its tensor in both).

    As NCCL's, it runs on a collective timeline of the issuing stream that first waits for that
    stream; its results are visible to a stream only after ``wait()`` there; the handle holds its
    tensors until ``wait()`` (NCCL's stash), so they are freed, and checked, no earlier: a buffer
    allocated on compute and read by a collective on a side stream may be freed only once
    compute is ordered after it (NOTE [Streams and buffer lifetimes] rule 3). Its tensors are
    device tensors. ``work``, the real (gloo) handle, is waited for in ``wait()``, untracked;
    the real c10d op is not tracked either (``abandon``: see ``EmulatedWork.wait``). Outside an
    emulation, returns ``work`` wrapped so that ``wait()`` just waits for it."""
    emu = core.active()
    if emu is None:
        return _PassThroughWork(work)
    emu.raise_pending()
    issuer = emu.current
    tid = emu.collective_timelines.get(issuer.tid)
    if tid is None:
        tid = emu.collective_timelines[issuer.tid] = emu.timeline(f"{issuer.name} (collective)")
    merge(emu.launch(tid), emu.launch(issuer.tid))
    if emu.all_device:  # NCCL's own checks (NOTE [Kernel contracts])
        contracts.check_collective(emu, name, [*inputs, *outputs])
    for t in [*inputs, *outputs]:
        if emu.kind(t) == HOST_MEMORY:
            emu.mark(t, DEVICE)
    emu.access(name, tid, inputs, outputs)
    return EmulatedWork(emu, dict(emu.clocks[tid]), work, [*inputs, *outputs], abandon)


class _PassThroughWork(EmulatedWork):
    def __init__(self, work: Any) -> None:
        self._work = work

    def wait(self, timeout: Any = None) -> bool:
        if self._work is not None:
            self._work.wait() if timeout is None else self._work.wait(timeout)
        return True


# -- marking tensors ----------------------------------------------------------------------------
def as_device(t: torch.Tensor) -> torch.Tensor:
    """Mark ``t``'s storage as living on the emulated device (allocated on the current stream,
    no access pending); returns ``t``. A no-op outside an emulation."""
    emu = core.active()
    if emu is not None:
        emu.mark(t, DEVICE)
    return t


def as_host(t: torch.Tensor) -> torch.Tensor:
    """Mark ``t``'s storage as host (pageable) memory: on a GPU machine a CPU tensor of the
    host's own (a gloo group's host buffers, bytes from ``torch.frombuffer``), which the
    all-device mode would otherwise take for device memory; returns ``t`` (no-op outside)."""
    emu = core.active()
    if emu is not None:
        emu.mark(t, HOST_MEMORY)
    return t


def in_host_memory(t: torch.Tensor) -> bool:
    """Whether ``t`` lives in host memory (pinned or pageable) in the emulation's model (outside
    one: a CPU tensor)."""
    emu = core.active()
    if emu is None:
        return t.device.type == "cpu"
    return emu.kind(t) != DEVICE


def emulated_pinned(t: torch.Tensor) -> torch.Tensor:
    """Mark the host tensor ``t`` as pinned memory, in place; returns ``t`` (no-op outside)."""
    emu = core.active()
    if emu is not None:
        if emu.kind(t) == DEVICE:
            raise ValueError("only host tensors can be pinned, not an emulated device tensor")
        emu.mark(t, PINNED)
    return t


def name_tensor(t: torch.Tensor, name: str | Callable[[], str]) -> torch.Tensor:
    """Name ``t``'s storage in error messages (e.g. ``"unit 3 param weight"``); returns ``t``.
    ``name`` may be a function, called only under an emulation (hot paths pass a lambda, so
    the name is never formatted outside one)."""
    emu = core.active()
    if emu is not None:
        found = emu.info(t, create=True)
        if found is not None:
            found.name = name if isinstance(name, str) else name()
    return t


def sync_counts() -> dict[tuple[str, str], int]:
    """Host synchronisations by ``(kind, "file:line")`` since the last reset. Kinds: ``item``
    (also ``int()``, ``float()``), ``bool``, ``tolist``, ``cpu``, ``copy_to_host``,
    ``copy_to_device``, ``event.synchronize``, ``stream.synchronize``, ``synchronize``,
    ``work.wait(timeout)``, and those given to ``count_host_sync``."""
    return core.counts()


def reset_sync_counts() -> None:
    core.reset_counts()


@contextlib.contextmanager
def same_bits(what: str) -> Iterator[None]:
    """A block whose results must have the same bits whatever the shapes of its device
    tensors (the rows a rank holds): under an emulation, a reduction there raises
    ``KernelContractError`` (NOTE [Kernel contracts]); outside one, nothing."""
    emu = core.active()
    if emu is None:
        yield
        return
    emu.same_bits.append(what)
    try:
        yield
    finally:
        emu.same_bits.pop()


# -- entry points -------------------------------------------------------------------------------
def enabled_from_env() -> bool:
    """Whether ``FULLSHARD_CUDA_EMULATION`` asks for the emulation (``1``/``true``/``yes``)."""
    return os.environ.get("FULLSHARD_CUDA_EMULATION", "").strip().lower() in ("1", "true", "yes")


def is_active() -> bool:
    return core.active() is not None


def active_emulation() -> Emulation | None:
    """The active emulation (``None`` outside one)."""
    return core.active()


@contextlib.contextmanager
def untracked() -> Iterator[None]:
    """Ops in this block are neither checked nor recorded: for the test bed's own mechanics
    (e.g. a bounded host wait on a real gloo handle, whose internal copies would otherwise count
    as the waiting stream's), never for the code under test."""
    emu = core.active()
    with contextlib.nullcontext() if emu is None else emu.pause():
        yield


# -- what the emulation patches while it is active ----------------------------------------------
@contextlib.contextmanager
def _backward_sees(mode: core.FunctionMode) -> Iterator[None]:
    """A ``TorchFunctionMode`` is off while its handler runs, so all of ``loss.backward()``
    (the engine's hooks included) would run unseen; the autograd engine's entry is wrapped to
    put the mode back for the backward pass itself."""
    import torch.autograd as autograd
    import torch.autograd.graph as graph

    original = graph._engine_run_backward

    def run_backward(*args: Any, **kwargs: Any) -> Any:
        if core.active() is None or torch._C._is_torch_function_mode_enabled():
            return original(*args, **kwargs)
        with mode:
            return original(*args, **kwargs)

    autograd._engine_run_backward = graph._engine_run_backward = run_backward  # type: ignore[attr-defined]
    try:
        yield
    finally:
        autograd._engine_run_backward = graph._engine_run_backward = original  # type: ignore[attr-defined]


def _resize_storage(storage: torch.UntypedStorage, size: int) -> Any:
    """``UntypedStorage.resize_`` under emulation: a device storage's memory is freed (checked)
    and allocated anew on the current stream."""
    emu = core.active()
    if emu is not None and not emu.paused:
        emu.raise_pending()
        found = emu.storages.get(id(storage))
        if found is None and emu.all_device:
            found = emu._register(storage, core._Storage(DEVICE, HOST, f"{storage.nbytes()} bytes"))
        if found is not None and found.kind == DEVICE:
            if storage.nbytes() > 0:
                emu.check_free(found, f"untyped_storage().resize_({size})")
            if size > 0:
                emu.check_reuse(emu.current.tid, f"untyped_storage().resize_({size})")
            found.write, found.reads, found.recorded = None, {}, set()
            found.alloc = emu.current.tid
    return core.ORIGINAL_RESIZE(storage, size)


@contextlib.contextmanager
def cuda_emulation(*, all_device: bool = False) -> Iterator[Emulation]:
    """Emulate CUDA streams over CPU tensors in this block (see the module docstring); the
    code under test reaches it as the device runtime in use (``fullshard.comm.runtime``).

    ``all_device``: every storage is a device storage unless pinned or made by ``.cpu()``
    (for running a whole CUDA code path); else only those marked with ``as_device`` and what
    ops make from them. A free hazard detected at the end is raised on exit."""
    if core.active() is not None:
        raise RuntimeError("cuda_emulation() is already active")
    emu = Emulation(all_device)
    core.activate(emu)
    reset_sync_counts()
    contracts.reset_fill_counts()
    torch.UntypedStorage.resize_ = _resize_storage  # type: ignore[method-assign,assignment]
    try:
        with (
            core.DispatchMode(emu),
            core.FunctionMode(emu) as mode,
            _backward_sees(mode),
            use_runtime(EmulatedRuntime(emu)),
        ):
            yield emu
    finally:
        torch.UntypedStorage.resize_ = core.ORIGINAL_RESIZE  # type: ignore[method-assign]
        emu.close()
        core.activate(None)
    emu.raise_pending()


class EmulatedRuntime(DeviceRuntime):
    """The CUDA emulation as the device runtime the code under test talks to (NOTE [The CUDA
    path on CPU] in ``fullshard.comm.runtime``): virtual streams and events, checked
    collectives, named tensors, host-memory marks, and the counts."""

    checked = True

    def __init__(self, emu: Emulation) -> None:
        super().__init__()
        self.emu = emu
        self.owned = emu.owned  # per emulation: a new one starts with new virtual streams

    def cuda_semantics(self, device: torch.device) -> bool:
        return True

    def new_stream(self, device: torch.device, name: str) -> Any:
        return VirtualStream(name)

    def current_stream(self, device: torch.device) -> Any:
        return current_stream()

    def use_stream(self, s: Any) -> contextlib.AbstractContextManager[Any]:
        return stream(s)

    def synchronize(self, device: torch.device) -> None:
        synchronize()

    def new_event(self) -> Any:
        return VirtualEvent()

    def same_bits(self, what: str) -> contextlib.AbstractContextManager[Any]:
        return same_bits(what)

    def name_tensor(self, t: torch.Tensor, name: str | Callable[[], str]) -> torch.Tensor:
        return name_tensor(t, name)

    def as_host(self, t: torch.Tensor) -> torch.Tensor:
        return as_host(t)

    def in_host_memory(self, t: torch.Tensor) -> bool:
        return in_host_memory(t)

    def collective(
        self,
        outputs: Sequence[torch.Tensor],
        inputs: Sequence[torch.Tensor],
        *,
        name: str,
        work: Any,
        abandon: Callable[[], None] | None,
    ) -> Any:
        return emulated_collective(outputs, inputs, name=name, work=work, abandon=abandon)

    def host_syncs(self) -> int | None:
        return sum(sync_counts().values())

    def reset_host_syncs(self) -> None:
        reset_sync_counts()

    def filled_bytes(self) -> int | None:
        return sum(fill_counts().values())


def emulated_runtime() -> contextlib.AbstractContextManager[DeviceRuntime]:
    """The factory ``FULLSHARD_CUDA_EMULATION=1`` names (``fullshard.comm.runtime``): a whole
    run's CUDA path on CPU, every tensor a device tensor unless pinned or a host copy."""

    @contextlib.contextmanager
    def run() -> Iterator[DeviceRuntime]:
        with cuda_emulation(all_device=True):
            yield runtime()

    return run()
