"""A unit's shards by dtype (layer 5): one flat shard buffer and one gathered storage per dtype.

Almost every unit has one dtype, hence one ``ShardGroup``. A unit that mixes dtypes (fp32 LoRA
adapters on a bf16 base) has one group per dtype; they still travel in one collective
(NOTE [Mixed-dtype units] in unit.py). A group builds its flat buffer from full tensors
(``load``), notices when ``_apply`` (``to_empty``, ``.to()``) replaced the shards
(``detached``) and copies them back (``reattach``), and owns the gathered storage whose views the
modules see while the unit is gathered. Parameters gathered through FSDP2's all-gather
extension hooks (tensor subclasses such as float8 weights) form groups of their own, whose
all-gather sends what the hooks return (``ExtensionGroup``, NOTE [All-gather extensions] in
extension.py); the methods below that an ``ExtensionGroup`` overrides say so.
"""

from __future__ import annotations

import torch

from fullshard.comm.desync import UNREGISTERED, write_static_tag
from fullshard.comm.mesh import MeshInfo
from fullshard.engine.param import GatheredStorage, ShardedParam
from fullshard.policies import FullshardError
from fullshard.shard.layout import FlatLayout

# Bytes each group's shard is padded to, so that groups of different dtypes concatenated in one
# byte buffer keep every group's elements aligned.
GROUP_ALIGN_BYTES = 16


class ShardGroup:
    """The parameters of one unit that share a dtype, and their buffers."""

    extension = False  # an ExtensionGroup (NOTE [All-gather extensions])

    def __init__(
        self,
        params: list[ShardedParam],
        dtype: torch.dtype,
        compute_dtype: torch.dtype,
        mesh: MeshInfo,
        shard_device: torch.device,
        pin_memory: bool,
        tail: int,
        align: bool,
    ) -> None:
        self.params = params
        self.dtype = dtype
        self.compute_dtype = compute_dtype
        self.mesh = mesh
        self.shard_device = shard_device
        self.pin_memory = pin_memory
        # alignment only matters when groups share one buffer: in compute-dtype elements
        size = max(torch.empty((), dtype=compute_dtype).element_size(), 1)
        pad = GROUP_ALIGN_BYTES // size if align else 1
        self.layout = FlatLayout(
            [p.shape for p in params],
            mesh.world_size,
            tail=tail,
            pad_to=pad,
            dims=[p.dim for p in params],
        )
        self.flat = torch.zeros(0, dtype=dtype)
        self.storage = GatheredStorage(0, compute_dtype, mesh.device)
        self.unit_name = ""

    @property
    def aliased(self) -> bool:
        """One-rank shard group, same dtype, same device: gathered params view the shards."""
        return (
            self.mesh.world_size == 1
            and self.compute_dtype == self.dtype
            and self.shard_device == self.mesh.device
        )

    def write_static_tag(self, index: int) -> None:
        if self.layout.tail and not self.flat.is_meta:
            write_static_tag(self.flat[-self.layout.tail :], index)

    def build_storage(self) -> None:
        # (meta shards: real storage for now; refresh rebuilds it once they are real)
        alias = self.flat if self.aliased and not self.flat.is_meta else None
        self.storage = GatheredStorage(
            self.layout.total_numel, self.compute_dtype, self.mesh.device, alias=alias
        )
        self.storage.alloc()
        for i, p in enumerate(self.params):
            p.make_unsharded(self.layout.gathered_view(self.storage.flat, i))
        self.storage.free()

    def _new_flat(self, device: torch.device) -> torch.Tensor:
        flat = torch.zeros(self.layout.shard_numel, dtype=self.dtype, device=device)
        return flat.pin_memory() if self.pin_memory and not flat.is_meta else flat

    def load(self, fulls: list[torch.Tensor]) -> None:
        """(Re)build the flat shard buffer from full tensors and point the shards into it.

        The sharded ``nn.Parameter`` objects are kept (only their local tensor changes), so an
        optimizer built earlier still holds the right objects.
        """
        device = fulls[0].device if fulls and fulls[0].is_meta else self.shard_device
        flat = self._new_flat(device)
        rank = self.mesh.rank
        with torch.no_grad():
            if not flat.is_meta:
                self.layout.pack_shard([t.detach().to(device) for t in fulls], rank, flat)
            for i, p in enumerate(self.params):
                p.set_sharded_data(self.layout.shard_view(flat, i, rank))
        self.flat = flat
        self.build_storage()
        # a gather issued before the root's first forward (unshard()) carries a valid tag too
        self.write_static_tag(UNREGISTERED)

    def detached(self, unit: object) -> bool:
        """Adopt parameters ``_apply`` replaced; whether the shards left the flat buffer."""
        adopted = [p.adopt_module_param() for p in self.params]
        for p in self.params:
            p.sharded._fullshard_unit = unit  # type: ignore[attr-defined]
            if p.sharded.dtype != self.dtype:
                return True  # cast after fully_shard: the unit rebuilds its groups
        if any(p.sharded.is_meta for p in self.params):
            return False  # nothing to copy yet; the meta check at first forward explains
        if any(adopted):
            return True
        start = self.flat.data_ptr() if not self.flat.is_meta else -1
        for i, p in enumerate(self.params):
            t = self.values(p)
            if t.is_meta != self.flat.is_meta or t.device != self.flat.device:
                return True
            if t.is_meta or t.numel() == 0:
                continue
            if t.data_ptr() != start + self.layout.slots[i].offset * t.element_size():
                return True
        return False

    def reattach(self) -> None:
        """Copy shards that were replaced (``to_empty``, ``.to()``) back into a flat buffer."""
        world, rank = self.mesh.world_size, self.mesh.rank
        flat = self._new_flat(self.shard_device)
        with torch.no_grad():
            for i, p in enumerate(self.params):
                view = self.layout.shard_view(flat, i, rank)
                if p.local.shape != view.shape:
                    raise FullshardError(
                        f"rank {rank}: sharded parameter '{p.fqn}' of unit '{self.unit_name}' "
                        f"has shape {tuple(p.local.shape)}, expected {tuple(view.shape)} "
                        f"({world} ranks). Do not replace sharded parameters with tensors of "
                        "another shape."
                    )
                view.copy_(self.values(p).detach())
                p.set_sharded_data(view)
        self.flat = flat
        self.build_storage()

    def values(self, p: ShardedParam) -> torch.Tensor:
        """The plain tensor holding ``p``'s rows (an extension's local tensor wraps it)."""
        return p.local

    def wire(self) -> torch.Tensor:
        """This rank's shard as the all-gather sends it: on the compute device, in the compute
        dtype (the flat buffer itself when nothing needs to change)."""
        return self.flat.to(self.mesh.device, self.compute_dtype, non_blocking=True)

    # -- the all-gather (the unit concatenates its groups' parts; NOTE [Mixed-dtype units]) ---
    def wire_parts(self) -> list[torch.Tensor]:
        """What this group adds to the unit's send buffer; the last part ends in the tag when
        this group carries it."""
        return [self.wire()]

    def wire_width(self, wire_dtype: torch.dtype) -> int:
        """Columns of the rank-major gather output (in ``wire_dtype``) this group's part takes."""
        n = self.layout.shard_numel
        if wire_dtype == torch.uint8:  # a byte buffer of several dtypes
            n *= torch.empty((), dtype=self.compute_dtype).element_size()
        return n

    @property
    def tail_dtype(self) -> torch.dtype:
        """The dtype of the position tag when this group carries it."""
        return self.compute_dtype

    def copy_out(self, cols: torch.Tensor, tails: torch.Tensor | None) -> None:
        """This group's columns of the gather output -> its gathered storage (the tag -> tails)."""
        self.storage.alloc()
        if cols.dtype != self.compute_dtype:
            cols = cols.view(self.compute_dtype)
        with torch.no_grad():
            self.layout.copy_out(cols, self.storage.flat, tails if self.layout.tail else None)

    def gather_locally(self) -> None:
        """One rank: the gather is a cast or a host-to-device copy (none when aliased)."""
        if self.aliased or not self.params:
            return
        self.storage.alloc()
        with torch.no_grad():
            self.storage.flat.copy_(self.flat, non_blocking=True)

    def free(self) -> None:
        """Release the gathered memory (NOTE [Freeing while autograd holds a view])."""
        self.storage.free()

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()
