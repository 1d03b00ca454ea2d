"""One sharded parameter, the gathered storage it views, and a unit's shard buffers by dtype
(layer 5): shard, unsharded view, free; one flat shard buffer and one gathered storage per dtype.

Almost every unit has one dtype, hence one ``ShardGroup``. A unit that mixes dtypes (fp32 LoRA
adapters on a bf16 base) has one group per dtype; they still travel in one collective
(NOTE [Mixed-dtype units] in unit.py). A group builds its flat buffer from full tensors
(``load``), notices when ``_apply`` (``to_empty``, ``.to()``) replaced the shards
(``detached``) and copies them back (``reattach``), and owns the gathered storage whose views the
modules see while the unit is gathered. Parameters gathered through FSDP2's all-gather
extension hooks (tensor subclasses such as float8 weights) form groups of their own, whose
all-gather sends what the hooks return (``ExtensionGroup``, NOTE [All-gather extensions] in
extension.py); the ``ShardGroup`` methods that an ``ExtensionGroup`` overrides say so.

NOTE [Freeing while autograd holds a view]
Forward saves gathered parameters (or views of them) for backward. We must not drop those tensors,
only their memory: ``free()`` resizes the underlying *storage* to 0 bytes and ``alloc()`` resizes
it back. Every view (the module's parameter, autograd's saved tensors) keeps pointing at the same
storage object, so once backward re-gathers into it, the saved views see the gathered values again.

NOTE [Gather writes do not bump versions]
Re-gathering writes into storage that autograd saved in forward. Autograd would see the in-place
write through the version counter and refuse to run backward. The gathered ``nn.Parameter`` is
therefore built on ``.data`` of its view, which has a version counter of its own: our copy-out
writes through the flat buffer and leaves the parameter's counter alone. What we write back is
bit-for-bit what forward saw, so the check is safe to bypass here (FSDP2 does the same with
``_unsafe_preserve_version_counter``).

NOTE [Sharded parameters are DTensors]
FSDP2 programs rely on it: ``torch.nn.utils.clip_grad_norm_`` reduces DTensor norms across
ranks, DCP's full state dicts call ``full_tensor()``, an EMA of ``model.parameters()`` holds
what the model holds. Each sharded parameter is therefore an ``nn.Parameter`` DTensor (``Shard(0)``
on the unit's mesh, or the ``Shard(k)`` its ``shard_placement_fn`` chose; ``(Replicate(),
Shard(k))`` under HSDP) whose *local tensor is a contiguous view of the unit's flat shard
buffer*: the optimizer's in-place updates land in that buffer, and one collective still sends
the whole unit. Gradients are DTensors over views of the reduce-scatter
output. The engine itself only ever touches the local tensors (``ShardedParam.local``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import Placement

from fullshard.comm.desync import UNREGISTERED, phase_seq_rows, write_static_tag
from fullshard.comm.mesh import MeshInfo
from fullshard.engine.spmd import TPSpec
from fullshard.policies import FullshardError
from fullshard.shard.layout import FlatLayout, chunk_of, contiguous_stride, local_shape


def local_of(t: Any) -> Any:
    """The rank's own tensor of a DTensor (a sharded parameter, gradient or state), else ``t``."""
    return t._local_tensor if isinstance(t, DTensor) else t


def as_dtensor(local: torch.Tensor, like: torch.Tensor) -> DTensor:
    """``local`` as a DTensor with ``like``'s mesh, placements and global shape: no copy, no
    communication, no autograd history (a gradient, or a state tensor of a parameter)."""
    assert isinstance(like, DTensor)
    if local.dtype == like.dtype:
        # FSDP2's ``_from_local_no_grad`` without ``__init__``: ``DTensor.__new__`` makes the
        # whole object (local tensor and spec set; no autograd, no argument checks), and
        # ``DTensor.__init__`` only calls ``object.__init__`` behind a ``torch._disable_dynamo``
        # wrapper, a third of the cost (issue 45: a gradient of every parameter, every step)
        return DTensor.__new__(DTensor, local, like._spec, requires_grad=local.requires_grad)  # type: ignore[call-arg]
    with torch.no_grad():
        return DTensor.from_local(
            local,
            like.device_mesh,
            like.placements,
            run_check=False,
            shape=like.shape,
            stride=like.stride(),
        )


class GatheredStorage:
    """A unit's parameter-major gathered buffer whose memory comes and goes (see NOTEs above).

    With ``alias`` the gathered parameters view the shard buffer itself: a shard group of one
    rank (NO_SHARD, or the shard dimension of size 1) holds whole parameters, so there is nothing
    to gather and nothing to free.
    """

    def __init__(
        self,
        numel: int,
        dtype: torch.dtype,
        device: torch.device,
        alias: torch.Tensor | None = None,
    ) -> None:
        self.aliased = alias is not None
        self.flat = alias if alias is not None else torch.empty(numel, dtype=dtype, device=device)
        self._nbytes = numel * self.flat.element_size()
        self.free()

    @property
    def allocated(self) -> bool:
        return self.aliased or self.flat.untyped_storage().size() > 0

    @property
    def nbytes(self) -> int:
        """Bytes this buffer holds when allocated."""
        return self._nbytes

    def alloc(self) -> None:
        # ``allocated``, inline (twice per unit per step)
        if not self.aliased and self.flat.untyped_storage().size() == 0:
            self.flat.untyped_storage().resize_(self._nbytes)

    def free(self) -> None:
        """Release the memory; views stay valid (NOTE [Freeing while autograd holds a view])."""
        if not self.aliased and self.flat.untyped_storage().size() > 0:
            self.flat.untyped_storage().resize_(0)


class ShardedParam:
    """One parameter of a unit: its rank-local shard and its gathered (unsharded) form.

    ``sharded`` is the ``nn.Parameter`` the optimizer sees: a DTensor whose local tensor is a view
    of the unit's flat shard buffer (NOTE [Sharded parameters are DTensors]). ``unsharded`` is a
    plain view of the unit's ``GatheredStorage`` and is what the module sees while the unit is
    gathered. ``refs`` lists every ``(module, attribute)`` that holds this parameter (more than
    one for parameters tied inside the unit).
    """

    def __init__(
        self,
        fqns: list[str],
        refs: list[tuple[nn.Module, str]],
        index: int,
        shape: torch.Size,
        requires_grad: bool,
        mesh: Any,  # MeshInfo (its device_mesh and placements)
        owners: list[int] | None = None,
        tp: TPSpec | None = None,
        dim: int = 0,
    ) -> None:
        self.fqns = fqns  # one per ref, relative to the unit's module
        self.fqn = fqns[0]
        self.refs = refs
        self.index = index
        self.shape = shape
        self.requires_grad = requires_grad
        self.mesh = mesh
        # which module of a list given to fully_shard each name is under (parallel to fqns)
        self.owners = owners if owners is not None else [0] * len(fqns)
        self.owner = self.owners[0]
        self.tp = tp  # NOTE [Tensor parallel parameters]; ``shape`` is then the TP-local one
        self.dim = dim  # the shard dim (``shard_placement_fn``; NOTE [Flat unit layout])
        # MixedPrecisionPolicy.param_dtype_override_fn kept it in its own dtype (fully_shard)
        self.keeps_dtype = False
        self.sharded: nn.Parameter = None  # type: ignore[assignment]  # set by set_sharded_data
        self.unsharded: nn.Parameter | None = None
        # NOTE [All-gather extensions] (extension.py): wraps a flat-buffer view as the subclass
        self.wrap_local: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.grad_hooks: list[Callable[[torch.Tensor], None]] = []
        self._hooked: nn.Parameter | None = None  # the gathered parameter holding grad_hooks

    @property
    def local(self) -> torch.Tensor:
        """This rank's shard: the sharded DTensor's local tensor (a view of the flat buffer)."""
        return self.sharded._local_tensor  # type: ignore[attr-defined,no-any-return]

    # -- the DTensor boundary: values coming in from state dicts, optimizer state going out ----
    @property
    def global_shape(self) -> torch.Size:
        """The parameter's shape as the model defines it (``shape`` is TP-local under TP)."""
        return self.tp.shape if self.tp is not None else self.shape

    @property
    def spmd_mesh(self) -> DeviceMesh:
        """The mesh of the sharded DTensor: the unit's, joined with TP's under TP."""
        if self.tp is None:
            return self.mesh.device_mesh  # type: ignore[no-any-return]
        return self.tp.sharded_mesh(self.mesh.device_mesh)

    @property
    def spmd_placements(self) -> tuple[Placement, ...]:
        """The sharded DTensor's placements (NOTE [Tensor parallel parameters])."""
        dp: tuple[Placement, ...] = self.mesh.placements
        if self.dim:  # the shard dim is the last mesh dim's (HSDP: after Replicate())
            dp = (*dp[:-1], Shard(self.dim))
        return dp if self.tp is None else self.tp.sharded_placements(dp, self.dim)

    def shard_of(self, value: Any, key: str) -> torch.Tensor:
        """This rank's rows of a loaded ``value`` for this parameter: a DTensor (same layout:
        taken as is; any other placement or mesh: redistributed), a full tensor (this rank
        keeps its rows) or a tensor that already has this rank's shard shape."""
        world, rank = self.mesh.world_size, self.mesh.rank
        want = local_shape(self.shape, world, rank, self.dim)
        full_shape = self.global_shape
        if isinstance(value, DTensor):
            if value.shape != full_shape:
                raise FullshardError(
                    f"rank {rank}: state dict entry '{key}' has shape {tuple(value.shape)}, the "
                    f"model's parameter has {tuple(full_shape)}."
                )
            same = (
                tuple(value.placements) == self.spmd_placements
                and value.device_mesh.size() == self.spmd_mesh.size()
                and value.to_local().shape == want
            )
            if same:
                return value.to_local()
            value = value.full_tensor()
        if not isinstance(value, torch.Tensor):
            raise FullshardError(
                f"state dict entry '{key}' is a {type(value).__name__}, not a tensor."
            )
        if value.shape == full_shape:
            part = self.tp.local_part(value) if self.tp is not None else value
            # a Shard(k) chunk is strided in the full tensor: give it the shard's own layout
            return chunk_of(part, world, rank, self.dim).contiguous()
        if value.shape == want:
            return value
        raise FullshardError(
            f"rank {rank}: state dict entry '{key}' has shape {tuple(value.shape)}; expected the "
            f"full shape {tuple(full_shape)} or this rank's shard {tuple(want)}."
        )

    def state_as_dtensor(self, value: Any) -> Any:
        """Optimizer state of this parameter as a DTensor of its layout (state made by a torch
        optimizer over DTensor parameters already is one; a plain shard-shaped tensor is
        wrapped; anything else, e.g. a step count or factored state, is kept as it is)."""
        if not isinstance(value, torch.Tensor) or isinstance(value, DTensor) or value.dim() == 0:
            return value
        if value.shape != self.local.shape:
            return value
        return as_dtensor(value, self.sharded)

    def set_sharded_data(self, view: torch.Tensor) -> None:
        """Point the sharded parameter at ``view`` (this rank's rows in the flat buffer).

        The ``nn.Parameter`` object is kept where possible (an optimizer may hold it); only a
        first call or a change of device (meta -> cpu) needs a new one.
        """
        if self.wrap_local is not None:
            view = self.wrap_local(view)
        if isinstance(self.sharded, DTensor) and self.sharded.device == view.device:
            self.sharded._local_tensor = view  # type: ignore[attr-defined]  # as FSDP2 does
        else:
            with torch.no_grad():
                dt = DTensor.from_local(
                    view,
                    self.spmd_mesh,
                    list(self.spmd_placements),
                    run_check=False,
                    shape=self.global_shape,
                    stride=contiguous_stride(self.global_shape),
                )
            self.sharded = nn.Parameter(dt, requires_grad=self.requires_grad)
        self._attach_local()

    def _attach_local(self) -> None:
        """NOTE [Local optimizer steps]: a plain parameter over the same local rows, kept on the
        DTensor parameter itself (it lives and dies with it)."""
        local = nn.Parameter(self.local, requires_grad=self.requires_grad)
        self.sharded._fullshard_local = local  # type: ignore[attr-defined]

    def add_grad(self, g: torch.Tensor) -> None:
        """Set (or accumulate into) the sharded ``.grad`` from this rank's local rows ``g``."""
        grad = self.sharded.grad
        if grad is None:
            self.sharded.grad = as_dtensor(g, self.sharded)
        elif isinstance(grad, DTensor):
            grad._local_tensor += g  # type: ignore[attr-defined]
        else:  # a plain tensor someone assigned: keep its type
            grad += g

    def adopt_module_param(self) -> bool:
        """Take over the parameter a module holds now, if ``_apply`` or ``load_state_dict(...,
        assign=True)`` replaced ours; every tied reference is pointed at it. Whether it did."""
        ours = (None, self.sharded, self.unsharded)  # any name: assign=True sets each tied one
        held = (m._parameters[n] for m, n in self.refs)
        current = next((t for t in held if all(t is not o for o in ours)), None)
        if current is None:
            return False
        self.sharded = current
        if isinstance(current, DTensor):
            self._attach_local()
        for m, n in self.refs:
            m._parameters[n] = current
        return True

    def on_grad_accumulated(self, hook: Callable[[torch.Tensor], None]) -> None:
        """``hook`` runs after each accumulation into the gathered parameter (also a later one)."""
        self.grad_hooks.append(hook)
        if self._hooked is self.unsharded is not None:  # hooked already: add this one
            self.unsharded.register_post_accumulate_grad_hook(hook)  # type: ignore[union-attr]
        self._hook_unsharded()

    def _hook_unsharded(self) -> None:
        """``grad_hooks`` on the gathered parameter, once it requires grad (torch insists)."""
        u = self.unsharded
        if u is None or not u.requires_grad or self._hooked is u:
            return
        for hook in self.grad_hooks:
            u.register_post_accumulate_grad_hook(hook)
        self._hooked = u

    def set_unsharded(self, param: nn.Parameter) -> None:
        """Adopt a gathered parameter made elsewhere (NOTE [All-gather extensions])."""
        self.unsharded = param
        self._hook_unsharded()

    def set_requires_grad(self, want: bool) -> None:
        """NOTE [Freezing after fully_shard]: ``want`` on every object of this parameter (the
        sharded one, its local rows, the gathered one), whichever of them the user changed;
        a newly trainable gathered parameter gets the post-backward hooks."""
        self.requires_grad = want
        for t in (self.sharded, getattr(self.sharded, "_fullshard_local", None), self.unsharded):
            if t is not None and t.requires_grad is not want:
                t.requires_grad_(want)
        self._hook_unsharded()

    def make_unsharded(self, view: torch.Tensor) -> nn.Parameter:
        """Create (or re-point) the gathered parameter on ``view``.

        See NOTE [Gather writes do not bump versions]. An existing object is kept (only its data
        moves) because its post-accumulate-grad hook is registered on it.
        """
        same = self.unsharded is not None and self.unsharded.device == view.device
        if self.tp is None:
            if same:
                self.unsharded.data = view.data  # type: ignore[union-attr]
            else:
                self.unsharded = nn.Parameter(view.data, requires_grad=self.requires_grad)
        elif same and self.unsharded.dtype == view.dtype:  # type: ignore[union-attr]
            self.unsharded._local_tensor = view.data  # type: ignore[union-attr]
        else:  # what TP's module hooks expect (NOTE [Tensor parallel parameters])
            with torch.no_grad():
                dt = DTensor.from_local(
                    view.data,
                    self.tp.mesh,
                    list(self.tp.placements),
                    run_check=False,
                    shape=self.tp.shape,
                    stride=self.tp.stride,
                )
            self.unsharded = nn.Parameter(dt, requires_grad=self.requires_grad)
        self._hook_unsharded()  # a new object (meta -> a device) needs the hooks again
        return self.unsharded  # type: ignore[return-value]

    def pop_grad(self) -> torch.Tensor | None:
        """Take the gathered parameter's gradient off it, as a plain TP-local tensor."""
        u = self.unsharded
        if u is None or u.grad is None:
            return None
        grad, u.grad = u.grad, None
        if isinstance(grad, DTensor):
            assert self.tp is not None
            want = self.tp.grad_placements(grad.placements)
            if tuple(grad.placements) != want:  # e.g. Partial: settle it on TP
                grad = grad.redistribute(grad.device_mesh, list(want))
            grad = grad.to_local()
        return grad

    def expose(self, unsharded: bool) -> None:
        """Make every owning module see the gathered (``True``) or the sharded parameter."""
        param = self.unsharded if unsharded else self.sharded
        assert param is not None
        for module, name in self.refs:
            module._parameters[name] = param


# Bytes each group's shard is padded to, so that groups of different dtypes concatenated in one
# byte buffer keep every group's elements aligned.
GROUP_ALIGN_BYTES = 16


class ShardGroup:
    """The parameters of one unit that share a dtype, and their buffers."""

    extension = False  # an ExtensionGroup (NOTE [All-gather extensions])
    host_shards = False  # the shards live in host memory (CPU offload): set by the unit

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
        # the storage and its regions the gather's copy-out writes (``FlatLayout.copy_targets``)
        self._targets: tuple[GatheredStorage, list[torch.Tensor] | None] | None = None
        # (flat, its tag slot, ``phase_seq_rows`` of the wire's device and dtype)
        self._phase_seq: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

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

    def _adopt(self, unit: object) -> bool | None:
        """Adopt parameters ``_apply`` replaced: True when the group must be rebuilt, False when
        it cannot be yet, None when the shards themselves need a look."""
        adopted = [p.adopt_module_param() for p in self.params]
        for p in self.params:
            p.sharded._fullshard_unit = unit  # type: ignore[attr-defined]
            if p.sharded.dtype != self.dtype:
                return True  # cast after fully_shard: the unit rebuilds its groups
        if any(p.sharded.is_meta for p in self.params):
            return False  # nothing to copy yet; the meta check at first forward explains
        return True if any(adopted) else None

    def detached(self, unit: object) -> bool:
        """Adopt parameters ``_apply`` replaced; whether the shards left the flat buffer."""
        verdict = self._adopt(unit)
        if verdict is not None:
            return verdict
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
        flat = self.flat
        # sent as it is where ``.to`` would return it; decided from the unit's offload, not
        # from ``flat.device``: under the CUDA emulation host and device share ``cpu``, and
        # an offloaded shard must still be copied to the device
        if flat.dtype == self.compute_dtype and not self.host_shards:
            return flat
        return flat.to(self.mesh.device, self.compute_dtype, non_blocking=True)

    def phase_seq_slot(self, part: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Where ``write_phase_seq`` writes in ``part`` (this group's send part that ends in the
        tag: its last two elements) and the table it copies from. Both are kept per flat buffer:
        its slot (sent as it is unless cast) and the table of the wire's dtype and device, which
        a group's flat buffer keeps (a cast part's slot is its own each gather)."""
        kept = self._phase_seq
        if kept is None or kept[0] is not self.flat or kept[2].dtype is not part.dtype:
            rows = phase_seq_rows(part.device, part.dtype)
            kept = self._phase_seq = (self.flat, self.flat[-2:], rows)
        return (kept[1] if part is self.flat else part[-2:]), kept[2]

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
        storage = self.storage
        storage.alloc()
        if cols.dtype != self.compute_dtype:
            cols = cols.view(self.compute_dtype)
        targets = self._targets
        if targets is None or targets[0] is not storage:  # a storage built since: new views
            targets = self._targets = (storage, self.layout.copy_targets(storage.flat))
        # no tensor here requires grad: no ``no_grad`` block (4 us a gather)
        self.layout.copy_out(
            cols, storage.flat, tails if self.layout.tail else None, targets=targets[1]
        )

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
