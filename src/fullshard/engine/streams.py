"""CUDA streams and events for one root's collectives (layer 6). On CPU every call is a no-op,
except under the CUDA emulation (NOTE [The CUDA path on CPU] in ``comm/runtime.py``).

NOTE [Streams and buffer lifetimes]
Compute runs on the current stream. All-gathers (with their copy-in: the cast to
``param_dtype``, or the host-to-device copy of offloaded shards) run on a *gather* stream,
reduce-scatters (with the HSDP all-reduce and the division and accumulation into ``.grad``) on a
*reduce* stream, so neither queues behind compute and compute never waits for either unless it
needs its result. No step of this synchronises the host: producers record events, consumers
make their stream wait on them.

The allocation discipline (FSDP2's). The caching allocator hands a freed block to the next
allocation *on the stream it was allocated on*, at once, without waiting for other streams, so:

1. Shards are read by the gather stream and written by the optimizer on compute: the gather
   stream waits for compute once per forward, at the root's pre-forward (``gather_ready``),
   and before a gather outside forward and backward (``FSDPModule.unshard``). Other gathers
   do not wait for compute, so the next unit's all-gather may start as soon as the previous
   one has finished, however far behind the host the compute stream is.
2. The all-gather output, allocated on the gather stream and read by compute's copy-out, is
   released only after the gather stream has waited for an event recorded on compute after
   the copy-out. In forward that wait is deferred by one unit (``hold`` keeps the buffer until
   the next unit's copy-out, and the root's post-forward releases the last): the next
   all-gather then need not wait for this copy-out, which is queued behind compute. In backward
   the buffer is released at once.
3. A buffer allocated on compute and read by a side stream (the packed gradients that the
   reduce-scatter reads) is held until compute has waited for the side stream's event after
   the read (at most ``MAX_REDUCES_IN_FLIGHT`` held).
4. The reduce stream waits for compute before every reduce-scatter (the gradients are made
   there), so the ``.grad`` buffers it allocates, read by the optimizer on compute after the end
   of backward waited for the reduce stream, are reused only after that read.

Gathered parameter storage and activations are allocated and freed on compute, in its order.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from fullshard.comm.device import cuda_semantics, current_stream, new_stream, use_stream
from fullshard.comm.runtime import runtime

# torch.cuda.Event, or the emulation's VirtualEvent (NOTE [The CUDA path on CPU])
Event = Any
# the block of a stream switch where there is no stream (nullcontext keeps no state)
_SERIAL = contextlib.nullcontext()


class Streams:
    """The gather and reduce streams of one device (``None`` on CPU: everything is serial)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = cuda_semantics(device)
        self.device = device
        self.gather: Any = None
        self.reduce: Any = None
        self.all_reduce: Any = None  # HSDP's replica all-reduce (NOTE [Reducing on streams])
        # rule 2: the last forward all-gather's buffers and the event after their copy-out
        self._held: tuple[list[torch.Tensor], Event] | None = None
        if self.cuda:
            # High priority (-1, as FSDP2): a collective's launch and its copies should not wait
            # behind queued compute kernels.
            self.gather = new_stream(device, "gather")
            self.reduce = new_stream(device, "reduce")
            self.all_reduce = new_stream(device, "all-reduce")

    def _compute(self) -> Any:
        return current_stream(self.device)

    def gather_ready(self) -> None:
        """Rule 1: the gather stream waits for everything compute has queued (the optimizer)."""
        if self.gather is not None:
            self.gather.wait_stream(self._compute())

    def on(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        """Run on ``stream`` (its order against compute is set by events and waits)."""
        if stream is None:
            return _SERIAL  # CPU: nothing to switch (a shared object, nothing made per call)
        return use_stream(stream)

    def begin_reduce(self) -> contextlib.AbstractContextManager[Any]:
        """Rule 4: run on the reduce stream after everything compute has queued."""
        if self.reduce is None:
            return _SERIAL
        self.reduce.wait_stream(self._compute())
        return use_stream(self.reduce)

    def record(self, stream: Any) -> Event | None:
        """An event at the current end of ``stream`` (``None`` on CPU)."""
        if stream is None:
            return None
        return stream.record_event()

    def record_compute(self) -> Event | None:
        """An event at the current end of the compute stream (``None`` on CPU)."""
        return self._compute().record_event() if self.cuda else None

    def compute_waits(self, event: Event | None) -> None:
        """The compute stream waits for ``event`` (no host synchronisation)."""
        if event is not None:
            self._compute().wait_event(event)

    def gather_waits(self, event: Event | None) -> None:
        """The gather stream waits for ``event`` (no host synchronisation)."""
        if event is not None and self.gather is not None:
            self.gather.wait_event(event)

    def gathered(self, buffers: list[torch.Tensor], defer: bool) -> None:
        """Rule 2, after a copy-out of ``buffers`` (the all-gather's) was queued on compute:
        hold them one unit longer (``defer``, forward) or release them now."""
        if self.gather is None:
            return  # CPU: no other stream can be reading them
        event = self._compute().record_event()
        if defer:
            self.release_held()
            self._held = (buffers, event)
        else:
            self.gather.wait_event(event)

    @property
    def held_buffers(self) -> list[torch.Tensor]:
        """The last forward all-gather's buffers, held one unit longer (empty on CPU)."""
        return self._held[0] if self._held is not None else []

    def release_held(self) -> None:
        """Release the held all-gather buffers (the root's post-forward, or the next hold)."""
        if self._held is not None and self.gather is not None:
            self.gather.wait_event(self._held[1])
            self._held = None


def streams_for(device: torch.device) -> Streams:
    """The gather and reduce streams for ``device`` (shared by every unit on it), the device
    runtime's own: under the CUDA emulation, that emulation's virtual ones (NOTE [The CUDA path
    on CPU])."""
    cache: dict[torch.device, Streams] = runtime().owned
    found = cache.get(device)
    if found is None:
        found = cache[device] = Streams(device)
    return found
