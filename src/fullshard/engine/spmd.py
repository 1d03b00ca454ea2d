"""Parameters that already are DTensors when ``fully_shard`` sees them (layer 5): on a separate
tensor-parallel mesh, or on one SPMD mesh of which ``dp_mesh_dims`` names the data-parallel
dims. ``TPSpec`` says how such a parameter's sharded, gathered and gradient DTensors are
placed; ``SpmdMesh`` reads ``fully_shard(..., mesh=spmd_mesh, dp_mesh_dims=...)``.

NOTE [Tensor parallel parameters]
fullshard shards a tensor-parallel parameter's *local* tensor over the data-parallel mesh, as
FSDP2 does: the unit's layout, gathers and reduce-scatters only ever see TP-local tensors.
Around them, three views keep torch's DTensor contract:
- the sharded parameter is a DTensor on the concatenated (data-parallel, TP) mesh, with
  ``Shard(0)`` over the data-parallel dims (``_StridedShard(0, split_factor=tp)`` when TP also
  shards dim 0, since the data-parallel split happens inside each TP shard) followed by TP's
  own placements; so ``full_tensor()``, DCP and ``clip_grad_norm_`` see the whole;
- the gathered parameter the module computes with is a DTensor on the TP mesh with TP's
  placements, over the gathered storage, which TP's module hooks expect;
- its gradient arrives as a DTensor on the TP mesh; its local tensor is what is reduced.

NOTE [SPMD meshes]
torch 2.13's ``fully_shard(module, mesh=spmd_mesh, dp_mesh_dims=DataParallelMeshDims(shard=...,
replicate=...))`` (torchtitan's default path) takes parameters that are DTensors on the whole
SPMD mesh (e.g. ``("dp_replicate", "dp_shard", "tp")``), ``Replicate()`` on its data-parallel
dims. fullshard reads it as the tensor-parallel case above with one difference, the mesh:
- the unit shards over the data-parallel submesh: ``spmd_mesh["dp_shard"]``, or the 2-D
  ``spmd_mesh[("dp_replicate", "dp_shard")]`` for HSDP; a parameter's "TP" spec is its own
  DTensor spec on the SPMD mesh (its local tensor is what the unit shards);
- the gathered parameter is a DTensor on the SPMD mesh with the parameter's own placements
  (``Replicate()`` on the data-parallel dims), as FSDP2's unsharded parameter;
- the sharded parameter is a DTensor on the SPMD mesh, its placements the parameter's with
  ``Shard(0)`` on the shard dim (``_StridedShard`` when later dims shard dim 0 too) and
  ``Replicate()`` on the replicate dim;
- a gradient is redistributed to the parameter's placements on the other dims only: on the
  data-parallel dims its local tensor (a partial sum there, when the batch is sharded over
  them) is what the reduce-scatter sums, as in FSDP2.
One name per role: several shard or replicate dims (FSDP2 flattens them, e.g. ``("dp_shard",
"cp")``) are refused with what to pass instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from fullshard.policies import FullshardNotImplementedError, FullshardValueError


@dataclass(frozen=True)
class TPSpec:
    """A parameter that already was a DTensor when ``fully_shard`` saw it: its mesh, its
    placements and global shape; ``dp_dims`` (SPMD) the data-parallel dims of that mesh, the
    shard dim first (NOTE [Tensor parallel parameters], NOTE [SPMD meshes])."""

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    shape: torch.Size
    stride: tuple[int, ...]
    dp_dims: tuple[int, ...] = ()

    @staticmethod
    def of(param: torch.Tensor, dp_dims: tuple[int, ...] = ()) -> TPSpec | None:
        if not isinstance(param, DTensor):
            return None
        mesh, placements = param.device_mesh, tuple(param.placements)
        return TPSpec(mesh, placements, param.shape, param.stride(), dp_dims)

    def local_part(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's TP slice of a full (global) tensor: no communication."""
        shape, offset = compute_local_shape_and_global_offset(
            self.shape, self.mesh, list(self.placements)
        )
        index = tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))
        return full[index]

    def sharded_mesh(self, dp: DeviceMesh) -> DeviceMesh:
        """The sharded parameter's mesh: (data-parallel, TP) joined, or the SPMD mesh."""
        return self.mesh if self.dp_dims else DeviceMesh._concatenate([dp, self.mesh])

    def sharded_placements(self, dp: tuple[Placement, ...], dim: int) -> tuple[Placement, ...]:
        """The sharded parameter's placements; ``dp``: the unit's (``Shard(dim)`` last)."""
        # TP dims that shard ``dim`` too after the data-parallel split (all of them when TP has
        # a mesh of its own): the data-parallel split happens inside their shards
        first = self.dp_dims[0] if self.dp_dims else -1
        split = 1
        for i, placement in enumerate(self.placements):
            if i > first and isinstance(placement, Shard) and placement.dim == dim:
                split *= self.mesh.size(i)
        shard = _StridedShard(dim, split_factor=split) if split > 1 else dp[-1]
        if not self.dp_dims:
            return (*dp[:-1], shard, *self.placements)
        out = list(self.placements)
        out[first] = shard
        for i in self.dp_dims[1:]:
            out[i] = Replicate()
        return tuple(out)

    def grad_placements(self, grad: Sequence[Placement]) -> tuple[Placement, ...]:
        """What a gathered parameter's gradient is redistributed to before it is reduced: TP's
        placements, and on SPMD data-parallel dims the gradient's own (NOTE [SPMD meshes])."""
        if not self.dp_dims:
            return self.placements
        return tuple(
            g if i in self.dp_dims else p
            for i, (g, p) in enumerate(zip(grad, self.placements, strict=True))
        )


def _names(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


@dataclass(frozen=True)
class SpmdMesh:
    """``fully_shard(..., mesh=spmd, dp_mesh_dims=dims)`` read (NOTE [SPMD meshes]): the
    data-parallel submesh the unit shards over, and the data-parallel dims of ``spmd``."""

    spmd: DeviceMesh
    dp_mesh: DeviceMesh
    dp_dims: tuple[int, ...]  # the shard dim, then the replicate dim (if any)

    @staticmethod
    def of(mesh: DeviceMesh | None, dims: Any, unit: str) -> SpmdMesh:
        shard, rep = _names(getattr(dims, "shard", None)), _names(getattr(dims, "replicate", None))
        names = mesh.mesh_dim_names if mesh is not None else None
        if mesh is None or not names:
            raise FullshardValueError(
                f"fully_shard(..., dp_mesh_dims={dims!r}) for {unit}: dp_mesh_dims names dims "
                "of the SPMD mesh the parameters are DTensors on; pass that mesh as mesh=, built "
                "with mesh_dim_names (init_device_mesh(..., mesh_dim_names=(...)))."
            )
        missing = [n for n in (*shard, *rep) if n not in names]
        if missing or not (shard or rep):
            raise FullshardValueError(
                f"fully_shard(..., dp_mesh_dims={dims!r}) for {unit}: the mesh has dims "
                f"{list(names)}; {'no ' + repr(missing) if missing else 'no dim is named'}. "
                "Name its data-parallel dims: DataParallelMeshDims(shard='dp_shard', "
                "replicate='dp_replicate' or None)."
            )
        if len(shard) != 1 or len(rep) > 1:
            raise FullshardNotImplementedError(
                f"fully_shard(..., dp_mesh_dims={dims!r}) for {unit}: fullshard shards over one "
                "named shard dim and replicates over at most one (FSDP2 flattens several, e.g. "
                "('dp_shard', 'cp')). Flatten them into one dim of the mesh first "
                "(mesh[('dp_shard', 'cp')]._flatten('dp_shard_cp')) and name that, or pass "
                "the data-parallel submesh as mesh= with plain or tensor-parallel parameters."
            )
        order = sorted((*rep, *shard), key=names.index)
        if rep and order[0] != rep[0]:
            raise FullshardValueError(
                f"fully_shard(..., dp_mesh_dims={dims!r}) for {unit}: the replicate dim must "
                f"come before the shard dim in the mesh's dims {list(names)}."
            )
        dp_mesh = mesh[tuple(order)] if rep else mesh[shard[0]]
        dp_dims = tuple(names.index(n) for n in (*shard, *rep))
        return SpmdMesh(mesh, dp_mesh, dp_dims)

    def specs(self, params: Sequence[tuple[str, torch.Tensor]], unit: str) -> list[TPSpec]:
        """Each parameter's spec, after FSDP2's checks: a DTensor on this very mesh,
        ``Replicate()`` on the data-parallel dims."""
        out = []
        for name, p in params:
            where = f"parameter '{name}' of {unit}"
            if not isinstance(p, DTensor) or p.device_mesh != self.spmd:
                what = "a plain tensor" if not isinstance(p, DTensor) else "on another mesh"
                raise FullshardValueError(
                    f"{where} is {what}; with dp_mesh_dims every parameter must be a DTensor on "
                    "the SPMD mesh passed as mesh= (e.g. via distribute_module or "
                    "parallelize_module), Replicate() on its data-parallel dims."
                )
            bad = [i for i in self.dp_dims if not isinstance(p.placements[i], Replicate)]
            if bad:
                names = self.spmd.mesh_dim_names or ()
                raise FullshardValueError(
                    f"{where} is placed {list(p.placements)} on the mesh's dims {list(names)}; "
                    f"fully_shard shards it over '{names[bad[0]]}', where it must be "
                    "Replicate(). Distribute it replicated over the data-parallel dims."
                )
            spec = TPSpec.of(p, self.dp_dims)
            assert spec is not None
            out.append(spec)
        return out


__all__ = ["SpmdMesh", "TPSpec"]
