"""Gather (layer 6): one all-gather per unit, then one copy into the gathered parameters.

``start_gather`` issues the collective and returns at once (that is what prefetch overlaps with
compute); ``finish_gather`` waits for it, copies the rank-major result into the parameter-major
gathered storage (NOTE [Flat unit layout]) and shows the gathered parameters to the modules.
"""

from __future__ import annotations

import torch

from fullshard.dist.collectives import Pending, all_gather
from fullshard.engine.unit import CommUnit, UnitState


def _direct(unit: CommUnit) -> bool:
    """With one parameter the rank-major and parameter-major layouts coincide: no copy-out."""
    return len(unit.layout.slots) == 1


def start_gather(unit: CommUnit, why: str = "gather") -> None:
    """Issue the unit's all-gather if it is not gathered or gathering already."""
    if unit.state is not UnitState.SHARDED:
        return
    if unit.storage.aliased:
        # One-rank shard group: the shards are the whole parameters; nothing to move.
        unit.gather_in_flight = (Pending(None, "", unit.mesh.timeout), unit.storage.flat)
        unit.state = UnitState.GATHERING
        return
    # Offload: shards live on the CPU and travel to the compute device for the gather.
    # Mixed precision: the gather moves param_dtype bytes; the shards stay in full precision.
    send = unit.shard_flat.to(unit.mesh.device, unit.compute_dtype, non_blocking=True)
    if unit.mesh.world_size == 1:
        unit.storage.alloc()
        unit.storage.flat.copy_(send)
        unit.gather_in_flight = (Pending(None, "", unit.mesh.timeout), unit.storage.flat)
        unit.state = UnitState.GATHERING
        return
    if _direct(unit):
        unit.storage.alloc()
        out = unit.storage.flat
    else:
        out = torch.empty(unit.layout.total_numel, dtype=unit.compute_dtype, device=send.device)
    pending = all_gather(
        out,
        send,
        unit.mesh.group,
        stats=unit.stats,
        what=f"all-gather ({why}) of unit '{unit.name}'",
        unit=unit.name,
        timeout=unit.mesh.timeout,
    )
    unit.gather_in_flight = (pending, out)
    unit.state = UnitState.GATHERING


def finish_gather(unit: CommUnit, why: str = "gather") -> None:
    """Make the unit GATHERED: issue the gather if needed, wait for it, copy out, expose."""
    if unit.state is UnitState.GATHERED:
        return
    if unit.state is UnitState.SHARDED:
        start_gather(unit, why)
    assert unit.gather_in_flight is not None
    pending, out = unit.gather_in_flight
    unit.gather_in_flight = None
    pending.wait()
    if not (_direct(unit) or unit.mesh.world_size == 1):
        unit.storage.alloc()
        with torch.no_grad():
            unit.layout.copy_out(out, unit.storage.flat)
        del out  # the rank-major buffer is garbage from here on: free it before compute
    for p in unit.params:
        p.expose(unsharded=True)
    unit.state = UnitState.GATHERED
