"""Module state-dict hooks (layer 8, the DTensor boundary): DTensor shards out, any layout in.

``module.state_dict()`` yields every managed parameter as its sharded DTensor (``Shard(0)`` on the
unit's mesh, NOTE [Sharded parameters are DTensors]) *without copying or communicating*, also
while the unit is gathered: the DTensor's local tensor is the shard itself, so
``torch.distributed.checkpoint.load`` writes straight into it and reshards across world sizes.

``load_state_dict`` accepts, for each managed parameter, a DTensor (any placement/mesh: same
layout is taken as is, anything else is redistributed), a full tensor (each rank keeps its rows)
or a tensor that already has this rank's shard shape; each becomes a DTensor of the parameter's
layout, which ``nn.Module`` then copies into the shard.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fullshard.engine.param import as_dtensor
from fullshard.engine.unit import CommUnit
from fullshard.policies import FullshardError
from fullshard.shard.layout import chunk_of, local_shape


def to_local_shard(unit: CommUnit, index: int, value: Any, key: str) -> torch.Tensor:
    """This rank's rows of ``value`` for parameter ``index`` of ``unit`` (see the module doc)."""
    p = unit.params[index]
    world, rank = unit.mesh.world_size, unit.mesh.rank
    want = local_shape(p.shape, world, rank)
    if isinstance(value, DTensor):
        if value.shape != p.shape:
            raise FullshardError(
                f"rank {rank}: state dict entry '{key}' has shape {tuple(value.shape)}, the model's "
                f"parameter has {tuple(p.shape)}."
            )
        same = (
            tuple(value.placements) == unit.mesh.placements
            and value.device_mesh.size() == world * unit.mesh.replicate_size
            and value.to_local().shape == want
        )
        if same:
            return value.to_local()
        return chunk_of(value.full_tensor(), world, rank)
    if not isinstance(value, torch.Tensor):
        raise FullshardError(f"state dict entry '{key}' is a {type(value).__name__}, not a tensor.")
    if value.shape == p.shape:
        return chunk_of(value, world, rank)
    if value.shape == want:
        return value
    raise FullshardError(
        f"rank {rank}: state dict entry '{key}' has shape {tuple(value.shape)}; expected the full "
        f"shape {tuple(p.shape)} or this rank's shard {tuple(want)}."
    )


def install_state_dict_hooks(module: nn.Module, unit: CommUnit, owner: int = 0) -> None:
    """Make ``module.state_dict()``/``load_state_dict()`` speak sharded DTensors for ``unit``'s
    parameters that ``module`` holds (module ``owner`` of a list given to fully_shard)."""
    mine = [(i, p) for i, p in enumerate(unit.params) if p.owner == owner]

    def save_hook(mod: nn.Module, sd: dict[str, Any], prefix: str, meta: Any) -> None:
        unit.verdict.flush()  # a save reads the desync verdict first (NOTE [Reading the verdict])
        for _, p in mine:
            for fqn in p.fqns:
                if prefix + fqn in sd:
                    sd[prefix + fqn] = p.sharded.detach()  # the shard, even while gathered

    def load_hook(mod: nn.Module, sd: dict[str, Any], prefix: str, *args: Any) -> None:
        unit.reshard()  # loading writes the shards; the modules must be showing them
        unit.refresh_shards()  # adopt parameters replaced since (to_empty, load with assign)
        for i, p in mine:
            for fqn in p.fqns:
                key = prefix + fqn
                if key in sd:
                    local = to_local_shard(unit, i, sd[key], key)
                    sd[key] = as_dtensor(local.to(p.local.device, p.local.dtype), p.sharded)

    module.register_state_dict_post_hook(save_hook)
    module.register_load_state_dict_pre_hook(load_hook)
