"""Gather (layer 6): one all-gather per unit, then one copy into the gathered parameters.

``start_gather`` issues the collective and returns at once (that is what prefetch overlaps with
compute); ``finish_gather`` waits for it, copies the rank-major result into the parameter-major
gathered storage (NOTE [Flat unit layout]) and shows the gathered parameters to the modules.
"""

from __future__ import annotations

import torch

from fullshard.dist.collectives import Pending, all_gather
from fullshard.dist.desync import check_tags, make_tag
from fullshard.engine.unit import CommUnit, UnitState


def _phase(why: str) -> str:
    if why.startswith("forward"):
        return "forward gather"
    if why.startswith("backward") or why == "recompute":
        return "backward gather"
    return "unshard()"


def start_gather(unit: CommUnit, why: str = "gather") -> None:
    """Issue the unit's all-gather if it is not gathered or gathering already."""
    if unit.state is not UnitState.SHARDED:
        return
    if unit.storage.aliased or not unit.params:
        # One-rank shard group: the shards are the whole parameters; nothing to move. (An empty
        # unit has nothing to move either; every rank agrees, see NOTE [Same model on every rank].)
        unit.gather_in_flight = (Pending(None, "", unit.mesh.timeout), unit.storage.flat, None)
        unit.state = UnitState.GATHERING
        return
    tag = None
    position = unit.stats.next_position("all_gather", unit.name, _phase(why))
    if unit.layout.tail:
        # NOTE [Collective positions]: say which collective this is, inside the payload
        tag = make_tag(position)
        unit.shard_flat[-unit.layout.tail :] = tag.to(unit.shard_flat.dtype)
    # Offload: shards live on the CPU and travel to the compute device for the gather.
    # Mixed precision: the gather moves param_dtype bytes; the shards stay in full precision.
    send = unit.shard_flat.to(unit.mesh.device, unit.compute_dtype, non_blocking=True)
    if unit.mesh.world_size == 1:
        unit.storage.alloc()
        unit.storage.flat.copy_(send)
        unit.gather_in_flight = (Pending(None, "", unit.mesh.timeout), unit.storage.flat, None)
        unit.state = UnitState.GATHERING
        return
    # With several ranks every shard ends in the position tags, so the rank-major output never
    # coincides with the parameter-major storage: gather into a buffer, then copy out.
    out = torch.empty(unit.layout.total_numel, dtype=unit.compute_dtype, device=send.device)
    pending = all_gather(
        out,
        send,
        unit.mesh.group,
        stats=unit.stats,
        what=f"all-gather ({why}) of unit '{unit.name}'",
        unit=unit.name,
        position=position,
        timeout=unit.mesh.timeout,
    )
    unit.gather_in_flight = (pending, out, tag)
    unit.state = UnitState.GATHERING


def finish_gather(unit: CommUnit, why: str = "gather") -> None:
    """Make the unit GATHERED: issue the gather if needed, wait for it, copy out, expose."""
    if unit.state is UnitState.GATHERED:
        return
    if unit.state is UnitState.SHARDED:
        start_gather(unit, why)
    assert unit.gather_in_flight is not None
    pending, out, tag = unit.gather_in_flight
    unit.gather_in_flight = None
    pending.wait()
    if unit.mesh.world_size > 1:
        unit.storage.alloc()
        tails = None
        if tag is not None:
            tails = torch.empty(
                unit.mesh.world_size, unit.layout.tail, dtype=out.dtype, device=out.device
            )
        with torch.no_grad():
            unit.layout.copy_out(out, unit.storage.flat, tails)
        del out  # the rank-major buffer is garbage from here on: free it before compute
        if tag is not None and tails is not None:
            assert pending.position is not None
            sent = tag.to(unit.compute_dtype).double()
            check_tags(tails, sent, pending.position, unit.stats.names, unit.mesh.group)
    for p in unit.params:
        p.expose(unsharded=True)
    unit.state = UnitState.GATHERED
