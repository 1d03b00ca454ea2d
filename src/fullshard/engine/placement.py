"""FSDP2's ``shard_placement_fn``: which dim each parameter of a unit is sharded on (layer 8).

``fully_shard(..., shard_placement_fn=fn)`` calls ``fn(param)`` for every parameter it manages;
``fn`` returns ``Shard(k)`` (``k`` may be negative: ``k + ndim``), ``None`` (``Shard(0)``) or, as
in FSDP2, a ``ShardPlacementResult(placement, mesh_info)`` whose mesh must be the unit's own (one
mesh per unit: per-parameter meshes are not supported). Dim 0 may be uneven, any other dim must
divide by the shard group size (FSDP2's rule: uneven chunks there would need a padded copy on
both sides of each collective). The shard layout of a ``Shard(k)`` parameter is NOTE [Flat unit
layout] (``shard/layout.py``).

Every check depends only on shapes and on ``fn``, so a bad answer raises the same error on every
rank before any collective.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import _StridedShard

from fullshard.comm.mesh import MeshInfo
from fullshard.engine.extension import has_extension_hooks, is_tensor_subclass
from fullshard.engine.param import local_of
from fullshard.policies import (
    FullshardAssertionError,
    FullshardError,
    FullshardNotImplementedError,
    fsdp2_words,
)

try:  # FSDP2's richer answer (torch >= 2.10); older torch has only Shard | None
    from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
except ImportError:  # pragma: no cover - older torch
    ShardPlacementResult = None  # type: ignore[assignment,misc]

ShardPlacementFn = Callable[[nn.Parameter], Any]

_WHAT = (
    "shard_placement_fn must return torch.distributed.tensor.Shard(dim) (dim may be negative) or "
    "None (= Shard(0))"
)


def _same_mesh(result: Any, info: MeshInfo) -> bool:
    """Whether a ``ShardPlacementResult``'s mesh info describes the unit's own mesh."""
    mesh = getattr(result.mesh_info, "mesh", None)
    if mesh is None:
        return False
    if mesh == info.device_mesh:
        return True
    # the same group under another DeviceMesh object (mesh=None: fullshard made its own)
    shard_group = getattr(result.mesh_info, "shard_process_group", None)
    return bool(mesh.ndim == info.device_mesh.ndim and shard_group is info.group)


def _placement(result: Any, where: str, info: MeshInfo) -> Any:
    """The placement inside ``fn``'s answer (unwrapping a ShardPlacementResult)."""
    if ShardPlacementResult is not None and isinstance(result, ShardPlacementResult):
        if not _same_mesh(result, info):
            raise FullshardError(
                f"shard_placement_fn returned a ShardPlacementResult for {where} whose mesh "
                f"({getattr(result.mesh_info, 'mesh', None)}) is not the unit's mesh "
                f"({info.device_mesh}); fullshard shards every parameter of a fully_shard call "
                "over one mesh (per-parameter meshes are not supported). Return Shard(dim) for "
                "it, or call fully_shard separately, with mesh=..., on the modules that need "
                "another mesh."
            )
        return result.placement
    return result


def _dim_of(result: Any, param: torch.Tensor, where: str, info: MeshInfo) -> int:
    placement = _placement(result, where, info)
    if placement is None:
        return 0
    if not isinstance(placement, Shard) or isinstance(placement, _StridedShard):
        raise FullshardError(
            f"shard_placement_fn returned {placement!r} for {where}; {_WHAT}. Every parameter "
            "of a unit is sharded: Replicate(), Partial() or a plain int are not placements it "
            "can take (return Shard(1), not 1)."
        )
    ndim = param.dim()
    dim = placement.dim + ndim if placement.dim < 0 else placement.dim
    if not 0 <= dim < ndim:
        raise FullshardAssertionError(
            fsdp2_words(
                f"shard_placement_fn returned Shard({placement.dim}) for {where}, of shape "
                f"{tuple(param.shape)}, which has no dim {placement.dim}; return Shard(d) with "
                f"{-ndim} <= d < {ndim}, or None for Shard(0).",
                f"Shard dim {placement.dim} is invalid for {ndim}D tensor: {param.shape}",
            )
        )
    return dim


def shard_dims(
    fn: ShardPlacementFn | None,
    params: Sequence[nn.Parameter],
    names: Sequence[str],
    info: MeshInfo,
    unit_name: str,
) -> list[int]:
    """Each parameter's shard dim under ``fn`` (all 0 without one), after the checks above.

    A tensor-parallel parameter's dim is one of its TP-local tensor (NOTE [Tensor parallel
    parameters]); parameters gathered through all-gather extension hooks take dim 0 only.
    """
    if fn is None:
        return [0] * len(params)
    if not callable(fn):
        raise FullshardError(
            f"shard_placement_fn for {unit_name} must be a function param -> Shard | None, "
            f"not {type(fn).__name__}."
        )
    dims = []
    for param, name in zip(params, names, strict=True):
        where = f"parameter '{name}' of {unit_name}"
        local = local_of(param)  # a TP parameter is sharded by its local tensor
        dim = _dim_of(fn(param), local, where, info)
        if dim and (has_extension_hooks(local) or is_tensor_subclass(local)):
            raise FullshardError(
                f"shard_placement_fn returned Shard({dim}) for {where}, a "
                f"{type(local).__name__} gathered through all-gather extension hooks (e.g. "
                "float8 weights); fullshard shards those on dim 0 only. Return Shard(0) (or "
                "None) for it."
            )
        size, world = local.shape[dim], info.world_size
        if dim and size % world:
            raise FullshardNotImplementedError(
                fsdp2_words(
                    f"shard_placement_fn returned Shard({dim}) for {where}, of shape "
                    f"{tuple(local.shape)}: dim {dim} has size {size}, not divisible by the "
                    f"shard group size {world}. Only dim 0 may be sharded unevenly (as in "
                    f"FSDP2); return Shard(0) for it, or a dim whose size is a multiple of "
                    f"{world}.",
                    f"FSDP does not support uneven sharding on dim {dim}: {local.size()} "
                    f"(world size: {world})",
                )
            )
        dims.append(dim)
    return dims


__all__ = ["ShardPlacementFn", "shard_dims"]
