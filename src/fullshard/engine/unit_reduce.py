"""A unit's gradient reduction (layer 6): the reduce half of ``CommUnit``'s lifecycle.

After a unit's backward its full local gradients are packed rank-major (one kernel), summed
across the shard group with one reduce-scatter, across replicas with one all-reduce (HSDP),
divided, and each rank's rows become (or are added to) the sharded DTensor ``.grad``.

NOTE [Which gradients exist]
Plain PyTorch leaves ``.grad`` None for a parameter no backward reached. A rank sets the sharded
``.grad`` exactly where its own backward produced a gradient (missing ones are sent as zeros, so
that every rank issues the same collective). That is exact when every rank's backward reaches
the same parameters, which FSDP2 requires too; fullshard also checks it: each rank's block of the
reduce-scatter carries one presence bit per parameter, and after the sum each must be 0 or the
group size (NOTE [Collective positions]). A disagreement raises on every rank, naming the
parameters, instead of leaving ranks whose shards silently diverge; deciding from the sums
instead would need the host to read them every unit, every step.

NOTE [Accumulating without sync]
With ``set_requires_gradient_sync(False)`` the unsharded gradients stay on the rank and the next
backward adds to them. When they are computed in a narrower dtype than the reduce dtype (bf16
compute, fp32 reduce), they are kept in the reduce dtype between backwards (as FSDP2 does), so
k micro-batches of bf16 gradients are not summed in bf16. ``set_requires_all_reduce(False)``
(HSDP) reduce-scatters every micro-batch but keeps the sum on the rank instead of all-reducing
it across replicas; the next all-reduce sends the total.

NOTE [Reducing on streams]
On CUDA (NCCL, or the CUDA emulation) a unit's whole reduction is queued at its post-backward,
in stream order, and the host never waits: the reduce-scatter on the reduce stream; the reduce
stream waits for it and reads the tags; under HSDP the all-reduce at once, on its own stream
after an event of the reduce stream (so the next unit's reduce-scatter does not queue behind
it); the all-reduce hook, the division, the one cast and (offload) the copy to pinned memory,
and ``.grad``, on the last of those streams. Compute then waits twice, as in FSDP2: for the
reduce-scatter before the packed input it made may be reused (rule 3, at the next unit's
post-backward), and for the end of every reduction once, at the end of backward, before the
optimizer reads ``.grad``. Under HSDP the reduce-scatter's output (which the all-reduce stream
uses) is held until that end-of-backward wait, so the reduce stream's next allocation can never
reuse it while the all-reduce still runs. On gloo the collectives are waited for on the host,
so the finish (wait, local sum, all-reduce, ``.grad``) is deferred to the next unit's
post-backward, where the host would block anyway.

NOTE [Dividing the sum]
The sum over N data-parallel ranks is divided by N once, after the reduction, in the reduce
dtype: in float32 that makes 2 ranks bitwise equal to one process's ``(g0 + g1) / 2``. A float16
sum of N gradients can overflow, so fp16 sums are pre-divided by a power of two p near sqrt(N)
(exact: a power of two) and post-divided by N / p, as FSDP2 does. The reduced shard is then cast
to the parameters' dtype once per unit, on the device, before any copy to host memory: casting
the pinned host copy instead read it before the device had written it (issue 17, defect 1).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from fullshard.comm.desync import TAG_BITS, Position, reduce_tag_row
from fullshard.comm.device import current_stream, use_stream
from fullshard.testing import emulation

if TYPE_CHECKING:
    from fullshard.comm.collectives import Comm, Pending
    from fullshard.comm.desync import Verdict
    from fullshard.comm.mesh import MeshInfo
    from fullshard.engine.param import ShardedParam
    from fullshard.engine.streams import Event, Streams
    from fullshard.shard.layout import FlatLayout


@dataclass
class ReduceInFlight:
    """A reduce-scatter between ``reduce_grads`` and ``finish_reduce``."""

    pending: Pending | None
    out: torch.Tensor  # this rank's summed block (its shard, then the extra columns)
    full: torch.Tensor  # the packed input, held until compute has waited for the collective
    present: list[bool]
    position: Position | None
    reduced: Event | None = None  # CUDA: the reduce stream after the reduce-scatter
    done: Event | None = None  # CUDA: the last stream of the reduction, after ``.grad``


class ReduceGrads:
    """Gradient reduction of a ``CommUnit`` (which provides the attributes below)."""

    comm: Comm
    mesh: MeshInfo
    streams: Streams
    verdict: Verdict
    trainable: list[ShardedParam]
    grad_layout: FlatLayout
    reduce_dtype: torch.dtype
    reduce_tags: bool
    index: int
    offload: bool
    pin_memory: bool
    _offload_event: Event | None

    def init_reduce_state(self) -> None:
        self.requires_grad_sync = True
        self.requires_all_reduce = True
        self.divide_factor: float | None = None  # set_gradient_divide_factor
        self.reduce_in_flight: ReduceInFlight | None = None
        # FSDPModule.set_all_reduce_hook: called on the summed shard before it is divided
        self.all_reduce_hook: Callable[[torch.Tensor], None] | None = None
        self.all_reduce_hook_stream: Any = None  # a torch.cuda.Stream
        self.partial_reduce: torch.Tensor | None = None  # HSDP sum kept without all-reduce
        # NOTE [Accumulating without sync]: full gradients kept in the reduce dtype
        self.accumulated: dict[int, torch.Tensor] = {}
        # CUDA: reductions the backward waits for, with buffers another stream still uses
        self._done_events: list[tuple[Event | None, list[torch.Tensor]]] = []

    def accumulate_unsynced(self) -> None:
        """NOTE [Accumulating without sync]: after a backward that does not reduce, keep the
        gradients computed in a narrower dtype in the reduce dtype."""
        for p in self.trainable:
            u = p.unsharded
            if u is None or u.grad is None or u.grad.dtype == self.reduce_dtype:
                continue
            grad = p.pop_grad()
            assert grad is not None
            kept = self.accumulated.get(id(p))
            if kept is None:
                self.accumulated[id(p)] = grad.to(self.reduce_dtype)
            else:
                kept += grad

    def reduce_grads(self) -> None:
        """Reduce-scatter the unit's unsharded gradients (asynchronously) and drop them."""
        if not self.trainable:
            return
        self.finish_reduce()  # at most one reduce-scatter of a unit in flight
        world, dtype, device = self.mesh.world_size, self.reduce_dtype, self.mesh.device
        grads = [self._full_grad(p) for p in self.trainable]
        present = [g is not None for g in grads]
        pos, extra = None, None
        if self.reduce_tags:
            # NOTE [Which gradients exist] and [Collective positions]: every rank's block ends
            # in this rank's presence bits and tag, so the sum says whether the ranks agreed
            pos = self.comm.position("reduce_scatter", "reduce-scatter", self.index)
            # in the gradients' dtype (0 and 1 are exact in any), so the pack needs no cast;
            # contiguous, so that the pack keeps CUDA's single-kernel _chunk_cat path
            bits = next((g.dtype for g in grads if g is not None), dtype)
            extra = reduce_tag_row(pos, present, bits, device).expand(world, -1).contiguous()
        # packed on the compute stream, where autograd made the gradients (rule 3)
        full = self.grad_layout.pack_for_reduce(grads, dtype=dtype, device=device, extra=extra)
        emulation.name_tensor(full, lambda: f"packed gradients of unit '{self.comm.unit}'")
        del grads  # the packed copy is all we need: the full gradients go now
        pre = self._pre_divide_factor()
        if pre != 1:  # NOTE [Dividing the sum]: the gradient columns only; the tags stay exact
            full[:, : self.grad_layout.shard_numel].div_(pre)
        if world == 1 and self.comm.replicate_group is None:
            # nothing to communicate: the full gradient is the shard, made on compute, and
            # finishing it on compute costs no stream hand-over
            self.reduce_in_flight = ReduceInFlight(None, full.view(-1), full, present, pos)
            return
        s, pending = self.streams, None
        with s.begin_reduce():
            if world == 1:
                out = full.view(-1)  # HSDP with a one-rank shard group: only the all-reduce
            else:
                out = self.comm.reduce_buffer(full.shape[1], dtype, device)
                emulation.name_tensor(
                    out, lambda: f"reduce-scatter output of unit '{self.comm.unit}'"
                )
                pending = self.comm.reduce_scatter(out, full, pos)  # type: ignore[arg-type]
        flight = ReduceInFlight(pending, out, full, present, pos)
        if s.cuda:
            # NOTE [Reducing on streams]: the whole reduction is queued now, in stream order
            self._reduce_on_streams(flight)
            flight.pending = None
        self.reduce_in_flight = flight

    def _full_grad(self, p: ShardedParam) -> torch.Tensor | None:
        """The gradient to reduce (taken off the parameter): this backward's plus what was
        accumulated without sync."""
        grad = p.pop_grad()
        kept = self.accumulated.pop(id(p), None)
        if kept is None:
            return grad
        if grad is not None:
            kept += grad
        return kept

    def _pre_divide_factor(self) -> int:
        """NOTE [Dividing the sum]: fp16 sums are pre-divided by a power of two near
        sqrt(N), as FSDP2 does, so that N gradients cannot overflow; other dtypes divide after
        the sum (exact against one process in fp32)."""
        n = self.mesh.data_parallel_size
        if self.reduce_dtype is not torch.float16 or self.divide_factor is not None or n <= 1:
            return 1
        pre = 1
        while n % (pre * 2) == 0 and n // (pre * 2) >= pre * 2:
            pre *= 2
        return pre

    def _reduce_on_streams(self, flight: ReduceInFlight) -> None:
        """CUDA: the reduce-scatter's result, the HSDP all-reduce (on its own stream, issued at
        once), the division and ``.grad``, queued in stream order without a host wait."""
        s, layout = self.streams, self.grad_layout
        shard = flight.out[: layout.shard_numel]
        with s.on(s.reduce):
            if flight.pending is not None:
                flight.pending.wait()  # the reduce stream waits (NCCL); no host wait
                self._check_reduce(flight)
            flight.reduced = s.record(s.reduce)  # rule 3: compute waits on this before reuse
        last = s.reduce
        summed: torch.Tensor | None = shard
        if self.comm.replicate_group is not None:
            summed = self._hsdp_sum(shard, on=s.all_reduce, after=flight.reduced)
            last = s.all_reduce
        if summed is not None:
            with s.on(last):
                self._finish_shard(summed, flight.present)
        flight.done = s.record(last)  # the end of backward orders compute after it

    def _hsdp_sum(
        self, shard: torch.Tensor, on: object = None, after: Event | None = None
    ) -> torch.Tensor | None:
        """HYBRID / NO_SHARD: the shard's sum over the replicas (or, without all-reduce, kept
        for the next one: NOTE [Accumulating without sync]); ``None`` when kept."""
        s = self.streams
        if on is not None:
            on.wait_event(after)  # type: ignore[attr-defined]
        with s.on(on):
            if self.partial_reduce is not None:
                shard += self.partial_reduce
                self.partial_reduce = None
            if not self.requires_all_reduce:
                self.partial_reduce = shard
                return None
            # ordered after the reduce-scatter by the stream (gloo: by the host wait before)
            self.comm.all_reduce_replicas(shard).wait()
        return shard

    def finish_reduce(self) -> None:
        """Finish the unit's reduction: on gloo, wait for the reduce-scatter (and HSDP
        all-reduce) and accumulate the averaged shard into ``.grad``; on CUDA, where that is
        queued already, make compute wait before the packed input is reused (rule 3)."""
        flight, self.reduce_in_flight = self.reduce_in_flight, None
        if flight is None:
            return
        s, layout = self.streams, self.grad_layout
        side = self.mesh.world_size > 1 or self.comm.replicate_group is not None
        if s.cuda and side:
            s.compute_waits(flight.reduced)  # not the all-reduce: the end of backward waits
            # HSDP: the all-reduce stream still uses the reduce-scatter output (and, at one
            # rank per shard group, the packed input it reduced in place): they are released
            # only once compute has waited for it, at the end of backward
            held = [flight.out, flight.full] if self.comm.replicate_group is not None else []
            self._done_events.append((flight.done, held))
            return
        shard: torch.Tensor | None = flight.out[: layout.shard_numel]
        with s.on(s.reduce if side else None):
            if flight.pending is not None:
                flight.pending.wait()  # gloo: host wait and the local sum
                self._check_reduce(flight)
            if self.comm.replicate_group is not None and shard is not None:
                shard = self._hsdp_sum(shard)
            if shard is not None:
                self._finish_shard(shard, flight.present)
        if side:
            s.compute_waits(s.record(s.reduce))
        del flight

    def end_reduces(self) -> None:
        """End of backward (CUDA): compute waits for every reduction queued this backward."""
        for event, _ in self._done_events:
            self.streams.compute_waits(event)
        self._done_events = []  # and the buffers held for the all-reduce stream go

    def _finish_shard(self, shard: torch.Tensor, present: list[bool]) -> None:
        if self.all_reduce_hook is not None:
            self._run_all_reduce_hook(shard)
        self._set_grads(shard, present)

    def _run_all_reduce_hook(self, shard: torch.Tensor) -> None:
        """FSDP2's all-reduce hook: ``hook(reduce_output)`` on the unit's summed shard (after
        the HSDP all-reduce, else after the reduce-scatter), before the division; e.g. torchft
        all-reduces it across replica groups there. On its own stream when one was given."""
        hook, stream = self.all_reduce_hook, self.all_reduce_hook_stream
        assert hook is not None
        if stream is None or not self.streams.cuda:
            hook(shard)
            return
        here = current_stream(shard.device)
        stream.wait_stream(here)
        with use_stream(stream):
            hook(shard)
        here.wait_stream(stream)

    def _set_grads(self, shard: torch.Tensor, present: list[bool]) -> None:
        factor = (self.divide_factor or self.mesh.data_parallel_size) / self._pre_divide_factor()
        if factor != 1:
            shard.div_(factor)
        # one cast per unit, on the device, before any copy to the host (NOTE [Dividing the sum])
        dtypes = {p.sharded.dtype for p in self.trainable}
        if len(dtypes) == 1 and shard.dtype not in dtypes:
            shard = shard.to(dtypes.pop())
        if self.offload:
            shard = self._to_host(shard)
        for j, p in enumerate(self.trainable):
            if not present[j]:
                continue  # NOTE [Which gradients exist]
            g = self.grad_layout.shard_view(shard, j, self.mesh.rank)
            if g.dtype != p.sharded.dtype:
                g = g.to(p.sharded.dtype)  # a mixed-dtype unit (NOTE [Mixed-dtype units])
            p.add_grad(g)  # a DTensor gradient over these rows
            # NOTE [Post-accumulate-grad hooks on sharded parameters]
            for hook in _post_accumulate_hooks(p):
                hook(p.sharded)

    def _check_reduce(self, flight: ReduceInFlight) -> None:
        if flight.position is None:
            return
        names = [p.fqn for p in self.trainable]
        k = len(names) + TAG_BITS  # presence bits, then tag bits
        rows = flight.pending.rows if flight.pending is not None else None
        group = self.mesh.group
        if rows is not None:  # gloo: every rank's block, before the sum
            self.verdict.reduce_rows(rows[:, -k:], self.mesh.rank, flight.position, group, names)
        else:
            world = self.mesh.world_size
            self.verdict.reduce_sums(flight.out[-k:], world, flight.position, group, names)

    def _to_host(self, shard: torch.Tensor) -> torch.Tensor:
        """Offload: the gradient shard goes to host memory; with pinned memory the copy is
        asynchronous and the end of backward waits for it (``take_offload_event``)."""
        if (
            not self.pin_memory
            or any(p.sharded.grad is not None for p in self.trainable)
            or any(_post_accumulate_hooks(p) for p in self.trainable)
        ):
            return shard.to("cpu")  # accumulating on the host (or a hook) needs the values now
        host = torch.empty(shard.shape, dtype=shard.dtype, pin_memory=True)
        emulation.name_tensor(
            host, lambda: f"gradient shard of unit '{self.comm.unit}' (pinned host)"
        )
        host.copy_(shard, non_blocking=True)
        # recorded on the stream doing the copy (the reduce stream, or compute)
        self._offload_event = current_stream(shard.device).record_event()
        return host

    def take_offload_event(self) -> bool:
        """Whether a copy of gradients to pinned host memory was queued since the last call
        (the end of backward then makes the host wait for it, once for every unit)."""
        queued, self._offload_event = self._offload_event is not None, None
        return queued


def _post_accumulate_hooks(p: ShardedParam) -> list[Callable[[torch.Tensor], None]]:
    """NOTE [Post-accumulate-grad hooks on sharded parameters]
    ``register_post_accumulate_grad_hook`` on a sharded parameter (the optimizer-in-backward
    pattern: step each parameter as soon as its gradient exists) never fires by itself: autograd
    accumulates into the gathered parameter, not the shard. As FSDP2 does, the unit calls those
    hooks itself, once per parameter per reduction, right after the reduced (and, under HSDP,
    all-reduced) shard became ``.grad``."""
    hooks = getattr(p.sharded, "_post_accumulate_grad_hooks", None)
    return list(hooks.values()) if hooks else []
