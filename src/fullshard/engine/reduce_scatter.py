"""Reduce-scatter (layer 6): one per unit after its backward, then accumulate into ``.grad``.

The full local gradients of the unit's trainable parameters are packed rank-major (one ``cat``),
summed across ranks with one ``reduce_scatter_tensor``, divided by the world size, and each
rank's slice becomes (or is added to) ``.grad`` of its sharded parameters.

NOTE [Which gradients exist]
Plain PyTorch leaves ``.grad`` None for a parameter no backward reached. To keep that exact
without an extra collective, every rank appends one column per trainable parameter to its block
of the reduce-scatter input: 1 where it has a gradient, 0 where not. After the sum each rank knows
how many ranks contributed, and leaves ``.grad`` None only where none did. Missing gradients are
sent as zeros so that every rank issues the same collective.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fullshard.dist.collectives import Pending, all_reduce, reduce_scatter
from fullshard.dist.desync import make_tag
from fullshard.engine.unit import CommUnit


@dataclass
class ReduceInFlight:
    """A unit's reduce-scatter in flight: the collective and the buffers it uses."""

    pending: Pending
    out: torch.Tensor
    full: torch.Tensor  # kept alive until the collective has read it
    replicate_pending: Pending | None = None  # HYBRID: the all-reduce across replicas


def start_reduce_scatter(unit: CommUnit) -> None:
    """Reduce-scatter the unit's unsharded gradients (asynchronously) and drop them."""
    if not unit.trainable:
        return
    finish_reduce_scatter(unit)  # at most one reduce-scatter of a unit in flight
    world = unit.mesh.world_size
    grads: list[torch.Tensor | None] = []
    for p in unit.trainable:
        assert p.unsharded is not None
        grads.append(p.unsharded.grad)
    dtype, device = unit.reduce_dtype, unit.mesh.device
    present = torch.tensor([[g is not None for g in grads]], dtype=dtype, device=device)
    extra = present.expand(world, -1)
    position, tag = None, None
    if world > 1:
        # NOTE [Collective positions]: every rank's block carries this rank's tag too, so a
        # reduce-scatter paired with another unit's is caught before its sum is used
        position = unit.stats.next_position("reduce_scatter", unit.name, "reduce-scatter")
        tag = make_tag(position).to(dtype)
        extra = torch.cat([extra, tag.to(device).expand(world, -1)], dim=1)
    full = unit.grad_layout.pack_for_reduce(grads, dtype=dtype, device=device, extra=extra)
    for p in unit.trainable:
        assert p.unsharded is not None
        p.unsharded.grad = None  # the packed copy is all we need: free the full gradients now
    if world == 1:
        out = full.view(-1)  # one-rank shard group: the full gradient is the shard
        pending = Pending(None, "", unit.mesh.timeout)
    else:
        out = torch.empty(full.shape[1], dtype=dtype, device=device)
        pending = reduce_scatter(
            out,
            full,
            unit.mesh.group,
            stats=unit.stats,
            what=f"reduce-scatter of unit '{unit.name}'",
            unit=unit.name,
            timeout=unit.mesh.timeout,
            position=position,
            tag=tag,
        )
    unit.reduce_in_flight = ReduceInFlight(pending, out, full)
    if unit.mesh.replicate_group is not None:
        # HYBRID / NO_SHARD: the shard's sum over the replicas. Collectives of two different
        # groups are not ordered against each other, so the reduce-scatter must land first;
        # the all-reduce then overlaps with the next unit's backward.
        pending.wait()
        unit.reduce_in_flight.replicate_pending = all_reduce(
            out,
            unit.mesh.replicate_group,
            stats=unit.stats,
            what=f"all-reduce across replicas of unit '{unit.name}'",
            unit=unit.name,
            timeout=unit.mesh.timeout,
        )


def finish_reduce_scatter(unit: CommUnit) -> None:
    """Wait for the unit's reduce-scatter and accumulate the averaged shard into ``.grad``."""
    inflight = unit.reduce_in_flight
    if inflight is None:
        return
    unit.reduce_in_flight = None
    inflight.pending.wait()
    if inflight.replicate_pending is not None:
        inflight.replicate_pending.wait()
    layout, rank = unit.grad_layout, unit.mesh.rank
    out = inflight.out.to(unit.shard_device)  # offload: grads live on CPU (blocking: read next)
    shard = out[: layout.shard_numel]
    k = len(unit.trainable)
    counts = out[layout.shard_numel : layout.shard_numel + k].tolist()  # [Which gradients exist]
    shard.div_(unit.mesh.data_parallel_size)
    for j, p in enumerate(unit.trainable):
        if counts[j] == 0:
            continue
        g = layout.shard_view(shard, j, rank)
        if g.dtype != p.sharded.dtype:
            g = g.to(p.sharded.dtype)
        if p.sharded.grad is None:
            p.sharded.grad = g
        else:
            p.sharded.grad += g
