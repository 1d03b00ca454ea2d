"""One communication unit (layer 6): the parameters one ``fully_shard`` call manages.

A unit owns a flat shard buffer (NOTE [Flat unit layout]), a gathered storage, and the state
machine below. The mechanism's steps live in their own files and act on a unit:
gather (``gather.py``), free (``param.py``, ``CommUnit.reshard``), reduce-scatter
(``reduce_scatter.py``) and prefetch (``prefetch.py``).

NOTE [Unit states]
SHARDED --start_gather--> GATHERING --finish_gather--> GATHERED --reshard--> SHARDED.
While GATHERED the owning modules see the gathered parameters; otherwise they see the shards.
Only ``finish_gather`` and ``reshard`` swap what the modules see, so a module never sees a
half-gathered unit.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

import torch
from torch import nn

from fullshard.dist.collectives import CommStats, Pending
from fullshard.dist.desync import TAG_LEN
from fullshard.dist.mesh import MeshInfo
from fullshard.engine.param import GatheredStorage, ShardedParam
from fullshard.policies import (
    CPUOffloadPolicy,
    FullshardError,
    MixedPrecisionPolicy,
    OffloadPolicy,
)
from fullshard.shard.layout import FlatLayout

if TYPE_CHECKING:
    from fullshard.engine.reduce_scatter import ReduceInFlight


class UnitState(enum.Enum):
    """See NOTE [Unit states]."""

    # Only shards are held; modules see the sharded parameters.
    SHARDED = "sharded"
    # An all-gather is in flight; modules still see the shards.
    GATHERING = "gathering"
    # The gathered storage is allocated and filled; modules see the gathered parameters.
    GATHERED = "gathered"


class CommUnit:
    """The parameters of one ``fully_shard`` call, sharded over one group."""

    def __init__(
        self,
        name: str,
        module: nn.Module,
        params: list[ShardedParam],
        originals: list[torch.Tensor],
        mesh: MeshInfo,
        mp_policy: MixedPrecisionPolicy,
        offload: OffloadPolicy | None = None,
    ) -> None:
        self.name = name
        self.module = module
        self.params = params
        self.mesh = mesh
        self.mp_policy = mp_policy
        self.stats = CommStats()
        self.state = UnitState.SHARDED
        self.reshard_after_forward = True
        self.reshard_after_backward = True
        self.requires_grad_sync = True
        # (pending all-gather, its rank-major output buffer, the tag sent) while GATHERING
        self.gather_in_flight: tuple[Pending, torch.Tensor, torch.Tensor | None] | None = None
        self.reduce_in_flight: ReduceInFlight | None = None

        dtypes = {t.dtype for t in originals}
        if len(dtypes) > 1:
            raise FullshardError(
                f"unit '{name}' mixes parameter dtypes {sorted(str(d) for d in dtypes)}; one "
                "unit gathers in one dtype. Cast the module (module.to(dtype)) or call "
                "fully_shard separately on the submodule whose parameters differ."
            )
        self.dtype = originals[0].dtype if originals else torch.float32
        self.compute_dtype = mp_policy.param_dtype or self.dtype
        self.reduce_dtype = mp_policy.reduce_dtype or self.dtype
        # CPUOffloadPolicy: shards, gradients and the optimizer step live on the CPU
        self.offload = isinstance(offload, CPUOffloadPolicy)
        self.shard_device = torch.device("cpu") if self.offload else mesh.device
        self.pin_memory = (
            self.offload
            and isinstance(offload, CPUOffloadPolicy)
            and offload.pin_memory
            and torch.cuda.is_available()
        )
        # the tail carries the all-gather's position tags (NOTE [Collective positions])
        tail = TAG_LEN if mesh.world_size > 1 else 0
        self.layout = FlatLayout([p.shape for p in params], mesh.world_size, tail=tail)
        self.trainable = [p for p in params if p.requires_grad]
        self.grad_layout = FlatLayout([p.shape for p in self.trainable], mesh.world_size)
        self.shard_flat = torch.zeros(0)
        self.load_shards(originals)

    @property
    def aliased(self) -> bool:
        """One-rank shard group, same dtype, same device: gathered params view the shards."""
        return (
            self.mesh.world_size == 1
            and self.compute_dtype == self.dtype
            and self.shard_device == self.mesh.device
        )

    def _build_storage(self) -> None:
        # (meta shards: real storage for now; refresh_shards rebuilds it once they are real)
        alias = self.shard_flat if self.aliased and not self.shard_flat.is_meta else None
        self.storage = GatheredStorage(
            self.layout.total_numel, self.compute_dtype, self.mesh.device, alias=alias
        )
        self.storage.alloc()
        for i, p in enumerate(self.params):
            p.make_unsharded(self.layout.gathered_view(self.storage.flat, i))
        self.storage.free()

    # -- shards ---------------------------------------------------------------------------
    def load_shards(self, fulls: list[torch.Tensor]) -> None:
        """(Re)build the flat shard buffer from full tensors and point the shards into it.

        The sharded ``nn.Parameter`` objects are kept (only their ``.data`` changes), so an
        optimizer built earlier still holds the right objects.
        """
        device = fulls[0].device if fulls and fulls[0].is_meta else self.shard_device
        flat = self._new_flat(device)
        with torch.no_grad():
            if not flat.is_meta:
                self.layout.pack_shard([t.detach().to(device) for t in fulls], self.mesh.rank, flat)
            for i, p in enumerate(self.params):
                p.set_sharded_data(self.layout.shard_view(flat, i, self.mesh.rank))
        self.shard_flat = flat
        self._build_storage()

    def _new_flat(self, device: torch.device) -> torch.Tensor:
        flat = torch.zeros(self.layout.shard_numel, dtype=self.dtype, device=device)
        return flat.pin_memory() if self.pin_memory and not flat.is_meta else flat

    def refresh_shards(self) -> None:
        """Re-adopt shards that ``_apply`` (``to_empty``, ``.to()``) replaced or moved, and copy
        them back into a flat buffer, so one collective can send the unit again."""
        if self._shards_detached():
            self.reattach_shards()

    def _shards_detached(self) -> bool:
        adopted = [p.adopt_module_param() for p in self.params]
        for p in self.params:
            p.sharded._fullshard_unit = self  # type: ignore[attr-defined]
            if p.sharded.dtype != self.dtype:
                raise FullshardError(
                    f"sharded parameter '{p.fqn}' of unit '{self.name}' changed dtype from "
                    f"{self.dtype} to {p.sharded.dtype} after fully_shard; cast the model "
                    "(model.to(dtype)) before calling fully_shard."
                )
        if any(p.sharded.is_meta for p in self.params):
            return False  # nothing to copy yet; the meta check at first forward explains
        if any(adopted):
            return True
        start = self.shard_flat.data_ptr() if not self.shard_flat.is_meta else -1
        for i, p in enumerate(self.params):
            t = p.sharded
            if t.is_meta != self.shard_flat.is_meta or t.device != self.shard_flat.device:
                return True
            if t.is_meta or t.numel() == 0:
                continue
            expected = start + self.layout.slots[i].offset * t.element_size()
            if t.data_ptr() != expected:
                return True
        return False

    def reattach_shards(self) -> None:
        """Copy shards that were replaced (``to_empty``, ``.to()``) back into a flat buffer."""
        world, rank = self.mesh.world_size, self.mesh.rank
        flat = self._new_flat(self.shard_device)
        with torch.no_grad():
            for i, p in enumerate(self.params):
                view = self.layout.shard_view(flat, i, rank)
                if p.sharded.shape != view.shape:
                    raise FullshardError(
                        f"rank {rank}: sharded parameter '{p.fqn}' of unit '{self.name}' has shape "
                        f"{tuple(p.sharded.shape)}, expected {tuple(view.shape)} ({world} ranks). "
                        "Do not replace sharded parameters with tensors of another shape."
                    )
                view.copy_(p.sharded.detach())
                p.set_sharded_data(view)
        self.shard_flat = flat
        self._build_storage()

    # -- free (the gathered window) -------------------------------------------------------
    def reshard(self) -> None:
        """Free the gathered storage and show the shards to the modules again."""
        if self.state is UnitState.GATHERING:
            # The gather must land before its buffer may go; collectives must also stay paired.
            from fullshard.engine.gather import finish_gather

            finish_gather(self)
        if self.state is UnitState.GATHERED:
            for p in self.params:
                p.expose(unsharded=False)
            self.storage.free()
            self.state = UnitState.SHARDED

    @property
    def gathered(self) -> bool:
        """True while gathered memory is held (in flight or complete)."""
        return self.state is not UnitState.SHARDED

    def __repr__(self) -> str:
        return f"CommUnit({self.name!r}, params={len(self.params)}, state={self.state.value})"
