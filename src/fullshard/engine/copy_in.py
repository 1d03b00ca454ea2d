"""Tensor-subclass parameters whose shard is a tensor of its own (layer 5): FSDP2's copy-in
layout, for the subclasses the flat buffer cannot hold.

NOTE [Shards of their own]
``ExtensionGroup`` (NOTE [All-gather extensions] in extension.py) keeps a subclass's values in
the unit's flat buffer and wraps a view of it as the subclass. That needs exactly one inner
tensor of the parameter's shape and an ``__tensor_unflatten__`` that rebuilds the subclass
around it. Some subclasses do not fit: torch's ``TwoTensor`` keeps its values in two inner
tensors (``a`` and ``b``, both of the parameter's shape); a wrapper may unflatten to its plain
inner tensor; an ``as_subclass`` subclass has no ``__tensor_flatten__`` at all. And FSDP2 lets
the hooks be attached to the sharded parameter's local tensor after ``fully_shard`` (and after
``to_empty``, which makes new local tensors), so a subclass without hooks at ``fully_shard``
may still get them. Such a parameter keeps this rank's rows as a tensor of its own, cut from
the full tensor through the subclass's dispatch with the ops FSDP2 shards it with and no
others (``torch.chunk``, ``new_zeros``, ``copy_``: NOTE [Chunks as FSDP2 cuts them] in
``shard/layout.py``; a ``TwoTensor``'s shard is a ``TwoTensor`` of both inner tensors' rows,
torchao's ``NF4Tensor``'s an ``NF4Tensor`` of its blocks' bytes and scales). That tensor is:

- the sharded DTensor's local tensor, the object the hooks are looked up on at every gather,
  so hooks attached to ``param._local_tensor`` later are found; ``to_empty`` / ``.to()`` make
  a new one, which is adopted as it is (moved only when it is not on the shard device);
- what the optimizer updates in place, through the subclass's dispatch;
- gathered exactly like an ``ExtensionGroup``'s (the hooks' inputs as bytes in the unit's one
  all-gather, the post hook making the gathered parameter). A parameter that still has no
  hooks at the unit's first gather fails there on every rank: the exchange of input shapes
  that gather does anyway says which ranks lack them.

Gradients are the unit's: the gathered parameter's gradient (a subclass too, e.g. a
``TwoTensor``) is packed into the reduce-scatter input through its dispatch (``_chunk_cat``
into a plain buffer, as FSDP2's copy-in), so the sharded gradient is a plain tensor, which the
optimizer applies to the subclass shard. Full state dicts gather such a parameter with
DTensor's ``full_tensor()``. The group's flat buffer is empty; units without such parameters
are untouched (their groups are the plain and flat-buffer ones).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import cast

import torch
from torch.distributed.tensor import DTensor

from fullshard.comm.desync import UNREGISTERED
from fullshard.engine.extension import (
    ExtensionGroup,
    data_name,
    has_extension_hooks,
    is_tensor_subclass,
)
from fullshard.engine.param import ShardedParam
from fullshard.policies import FullshardError
from fullshard.shard.layout import chunk_of, local_shape


def in_flat_buffer(t: torch.Tensor) -> bool:
    """Whether a tensor subclass ``t`` with the hooks can keep its values in the unit's flat
    buffer (``ExtensionGroup``): one inner tensor of its shape and dtype, and
    ``__tensor_unflatten__`` rebuilding its type around it. Others keep their own shard
    (``CopyInGroup``, NOTE [Shards of their own] in copy_in.py)."""
    if not has_extension_hooks(t) or data_name(t) is None:
        return False
    names, ctx = t.__tensor_flatten__()  # type: ignore[attr-defined]
    inner = {n: getattr(t, n) for n in names}
    try:  # a plain tensor (or anything else) back means the subclass is lost
        rebuilt = type(t).__tensor_unflatten__(inner, ctx, t.shape, t.stride())  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - an unflatten that needs more than we give it
        return False
    return type(rebuilt) is type(t)


def gather_kind(t: torch.Tensor) -> str:
    """How a parameter (its local tensor ``t``) is sharded and gathered: ``"plain"`` (the flat
    layout), ``"flat"`` (``ExtensionGroup``) or ``"own"`` (``CopyInGroup``)."""
    if not is_tensor_subclass(t):
        return "flat" if has_extension_hooks(t) else "plain"
    return "flat" if in_flat_buffer(t) else "own"


class CopyInGroup(ExtensionGroup):
    """Parameters of one dtype whose shards are subclass tensors of their own (NOTE above)."""

    own_shards = True

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        # the local tensors this group installed: another object means _apply replaced it
        self._locals: list[torch.Tensor | None] = [None] * len(self.params)

    def values(self, p: ShardedParam) -> torch.Tensor:
        return p.local

    def _install(self, i: int, local: torch.Tensor) -> None:
        if self.pin_memory and not local.is_meta and not local.is_pinned():
            local = local.pin_memory()  # offload: the gather's host-to-device copy is async
        p = self.params[i]
        p.set_sharded_data(local)
        if p.local is not local:  # DTensor.from_local unwraps a __torch_function__ subclass
            p.sharded._local_tensor = local  # type: ignore[attr-defined]
            p._attach_local()
        self._locals[i] = p.local

    def _empty_flat(self, device: torch.device) -> None:
        self.flat = torch.zeros(0, dtype=self.dtype, device=device)
        self.build_storage()

    def load(self, fulls: list[torch.Tensor]) -> None:
        """Each parameter's rows, cut from its full tensor by the subclass's own dispatch."""
        world, rank = self.mesh.world_size, self.mesh.rank
        device = fulls[0].device if fulls and fulls[0].is_meta else self.shard_device
        with torch.no_grad():
            for i, full in enumerate(fulls):
                full = full.detach()
                # NOTE [Chunks as FSDP2 cuts them]: chunk, new_zeros, copy_ (FSDP2's own ops)
                rows = chunk_of(full, world, rank, 0)
                shard = full.new_zeros(rows.shape)  # its own memory, not the full's
                shard.copy_(rows)
                if shard.device != device:  # CPU offload of a full tensor on the GPU
                    shard = shard.to(device)
                self._install(i, shard)
        self._empty_flat(device)
        self.write_static_tag(UNREGISTERED)

    def detached(self, unit: object) -> bool:
        """Whether ``_apply`` or an assigning ``load_state_dict`` replaced a local tensor."""
        verdict = self._adopt(unit)
        if verdict is not None:
            return verdict
        return any(p.local is not t for p, t in zip(self.params, self._locals, strict=True))

    def reattach(self) -> None:
        """Adopt the new local tensors as the shards (moved to the shard device if needed)."""
        world, rank = self.mesh.world_size, self.mesh.rank
        with torch.no_grad():
            for i, p in enumerate(self.params):
                local, want = p.local, local_shape(p.shape, world, rank, 0)
                if local.shape != want:
                    raise FullshardError(
                        f"rank {rank}: sharded parameter '{p.fqn}' of unit '{self.unit_name}' "
                        f"has shape {tuple(local.shape)}, expected {tuple(want)} ({world} "
                        "ranks). Do not replace sharded parameters with tensors of another shape."
                    )
                if local.device != self.shard_device:
                    local = local.to(self.shard_device)
                self._install(i, local)
        self._empty_flat(self.shard_device)

    def full_parameters(self) -> Iterator[tuple[ShardedParam, torch.Tensor]]:
        """Each parameter whole (a collective over the unit's mesh), for full state dicts."""
        for p in self.params:
            yield p, cast(DTensor, p.sharded.detach()).full_tensor()

    @property
    def nbytes(self) -> int:
        return sum(p.local.numel() * p.local.element_size() for p in self.params)


__all__ = ["CopyInGroup", "gather_kind", "in_flat_buffer"]
