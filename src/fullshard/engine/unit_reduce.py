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
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from fullshard.dist.desync import TAG_BITS, Position, reduce_tag_row

if TYPE_CHECKING:
    from fullshard.dist.collectives import Comm, Pending
    from fullshard.dist.desync import Verdict
    from fullshard.dist.mesh import MeshInfo
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
        self.all_reduce_hook_stream: torch.cuda.Stream | None = None
        self.partial_reduce: torch.Tensor | None = None  # HSDP sum kept without all-reduce
        # NOTE [Accumulating without sync]: full gradients kept in the reduce dtype
        self.accumulated: dict[int, torch.Tensor] = {}

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
            # in the gradients' dtype (0 and 1 are exact in any), so the pack needs no cast
            bits = next((g.dtype for g in grads if g is not None), dtype)
            extra = reduce_tag_row(pos, present, bits, device).expand(world, -1)
        # packed on the compute stream, where autograd made the gradients (rule 3)
        full = self.grad_layout.pack_for_reduce(grads, dtype=dtype, device=device, extra=extra)
        del grads  # the packed copy is all we need: the full gradients go now
        if world == 1 and self.comm.replicate_group is None:
            # nothing to communicate: the full gradient is the shard, made on compute, and
            # finishing it on compute costs no stream hand-over
            self.reduce_in_flight = ReduceInFlight(None, full.view(-1), full, present, pos)
            return
        pending = None
        with self.streams.begin_reduce():
            if world == 1:
                out = full.view(-1)  # HSDP with a one-rank shard group: only the all-reduce
            else:
                out = self.comm.reduce_buffer(full.shape[1], dtype, device)
                pending = self.comm.reduce_scatter(out, full, pos)  # type: ignore[arg-type]
        self.reduce_in_flight = ReduceInFlight(pending, out, full, present, pos)

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

    def finish_reduce(self) -> None:
        """Wait for the unit's reduce-scatter (and HSDP all-reduce) and accumulate the averaged
        shard into ``.grad``; on the reduce stream when there was a collective."""
        flight, self.reduce_in_flight = self.reduce_in_flight, None
        if flight is None:
            return
        s, layout = self.streams, self.grad_layout
        shard = flight.out[: layout.shard_numel]
        side = self.mesh.world_size > 1 or self.comm.replicate_group is not None
        with s.on(s.reduce if side else None):
            if flight.pending is not None:
                flight.pending.wait()  # gloo: host wait and the local sum; NCCL: stream wait
                self._check_reduce(flight)
            if self.comm.replicate_group is not None:
                if self.partial_reduce is not None:
                    shard += self.partial_reduce
                    self.partial_reduce = None
                if not self.requires_all_reduce:
                    # NOTE [Accumulating without sync]: keep the sum, all-reduce it later
                    self.partial_reduce = shard
                    shard = None  # type: ignore[assignment]
                else:
                    # HYBRID / NO_SHARD: the shard's sum over the replicas, ordered after the
                    # reduce-scatter by the reduce stream (gloo: by the host wait above)
                    self.comm.all_reduce_replicas(shard).wait()
            if shard is not None and self.all_reduce_hook is not None:
                self._run_all_reduce_hook(shard)
            if shard is not None:
                self._set_grads(shard, flight.present)
        if side:
            # rule 3: compute waits before the packed input (and the gradients) may be reused
            s.compute_waits(s.record(s.reduce))
        del flight

    def _run_all_reduce_hook(self, shard: torch.Tensor) -> None:
        """FSDP2's all-reduce hook: ``hook(reduce_output)`` on the unit's summed shard (after
        the HSDP all-reduce, else after the reduce-scatter), before the division; e.g. torchft
        all-reduces it across replica groups there. On its own stream when one was given."""
        hook, stream = self.all_reduce_hook, self.all_reduce_hook_stream
        assert hook is not None
        if stream is None or shard.device.type != "cuda":
            hook(shard)
            return
        stream.wait_stream(torch.cuda.current_stream(shard.device))
        with torch.cuda.stream(stream):
            hook(shard)
        torch.cuda.current_stream(shard.device).wait_stream(stream)

    def _set_grads(self, shard: torch.Tensor, present: list[bool]) -> None:
        factor = self.divide_factor or self.mesh.data_parallel_size
        if factor != 1:
            shard.div_(factor)
        if self.offload:
            shard = self._to_host(shard)
        for j, p in enumerate(self.trainable):
            if not present[j]:
                continue  # NOTE [Which gradients exist]
            g = self.grad_layout.shard_view(shard, j, self.mesh.rank)
            if g.dtype != p.sharded.dtype:
                g = g.to(p.sharded.dtype)
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
        asynchronous and ``sync_offloaded_grads`` (end of backward) waits for it."""
        if (
            not self.pin_memory
            or any(p.sharded.grad is not None for p in self.trainable)
            or any(_post_accumulate_hooks(p) for p in self.trainable)
        ):
            return shard.to("cpu")  # accumulating on the host (or a hook) needs the values now
        host = torch.empty(shard.shape, dtype=shard.dtype, pin_memory=True)
        host.copy_(shard, non_blocking=True)
        # recorded on the stream doing the copy (the reduce stream, or compute)
        self._offload_event = torch.cuda.current_stream(shard.device).record_event()
        return host

    def sync_offloaded_grads(self) -> None:
        """Block the host until offloaded gradients have landed (the CPU optimizer reads them)."""
        if self._offload_event is not None:
            self._offload_event.synchronize()
            self._offload_event = None


def _post_accumulate_hooks(p: ShardedParam) -> list[Callable[[torch.Tensor], None]]:
    """NOTE [Post-accumulate-grad hooks on sharded parameters]
    ``register_post_accumulate_grad_hook`` on a sharded parameter (the optimizer-in-backward
    pattern: step each parameter as soon as its gradient exists) never fires by itself: autograd
    accumulates into the gathered parameter, not the shard. As FSDP2 does, the unit calls those
    hooks itself, once per parameter per reduction, right after the reduced (and, under HSDP,
    all-reduced) shard became ``.grad``."""
    hooks = getattr(p.sharded, "_post_accumulate_grad_hooks", None)
    return list(hooks.values()) if hooks else []
