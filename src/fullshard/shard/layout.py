"""Sharding arithmetic (layer 3): chunk, pad and offset math. Pure tensor code, no collectives.

Every parameter is split along dim 0 into ``world`` chunks of ``ceil(dim0 / world)`` rows, exactly
like ``torch.chunk`` and DTensor's ``Shard(0)``: the last ranks may hold fewer rows, or none.

NOTE [Flat unit layout]
A unit keeps all of its rank's shards in ONE flat buffer so that one collective per phase carries
the whole unit. Inside it, parameter ``i`` owns a region of ``padded_i = chunk_rows_i * row_numel_i``
elements at ``offset_i``; the rank's real rows fill the front of that region and the rest stays zero
(padding). Every rank's flat buffer has the same size ``S = sum(padded_i)``, which is what
``all_gather_into_tensor`` and ``reduce_scatter_tensor`` need.

The all-gather output is therefore *rank-major*: ``out.view(world, S)[r]`` is rank r's flat shard.
A gathered parameter must be *parameter-major* (its rows in order), so the gathered storage holds
parameter ``i`` at ``world * offset_i`` as ``world * padded_i`` elements, i.e. its padded full
tensor ``(world * chunk_rows_i, *rest)``, of which the first ``dim0`` rows are the parameter. Moving
from one layout to the other is a single ``split_with_sizes_copy`` (gather) or ``cat`` (reduce).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

_chunk_cat = getattr(torch, "_chunk_cat", None)


def chunk_rows(dim0: int, world: int) -> int:
    """Rows per rank for a tensor with ``dim0`` rows: ceil division, as in ``torch.chunk``."""
    return -(-dim0 // world)


def local_rows(dim0: int, world: int, rank: int) -> int:
    """Rows rank ``rank`` actually holds (the last ranks may hold fewer, or zero)."""
    chunk = chunk_rows(dim0, world)
    return max(0, min(chunk, dim0 - rank * chunk))


def local_shape(shape: Sequence[int], world: int, rank: int) -> torch.Size:
    """Shape of rank ``rank``'s dim-0 shard of a tensor of ``shape``."""
    return torch.Size([local_rows(shape[0], world, rank), *shape[1:]])


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major strides of ``shape`` (the global stride a DTensor reports)."""
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(stride))


def chunk_of(full: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s dim-0 rows of ``full`` (a view, possibly empty)."""
    chunk = chunk_rows(full.shape[0], world)
    start = min(rank * chunk, full.shape[0])
    return full[start : start + local_rows(full.shape[0], world, rank)]


@dataclass(frozen=True)
class Slot:
    """Where one parameter lives in a unit's flat layout (see NOTE [Flat unit layout])."""

    shape: torch.Size
    chunk_rows: int
    row_numel: int
    offset: int

    @property
    def padded_numel(self) -> int:
        """Elements of this parameter's region in each rank's flat shard."""
        return self.chunk_rows * self.row_numel

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class FlatLayout:
    """The flat layout of a list of parameter shapes for one world size.

    ``tail`` extra elements end each rank's flat shard: room for the all-gather's position tags
    (NOTE [Collective positions]); they are not part of any parameter. ``pad_to`` rounds each
    rank's shard up to a multiple of that many elements (a gap before the tail), so that shards
    of several dtypes can share one byte buffer aligned (engine/shards.py).
    """

    def __init__(
        self, shapes: Sequence[torch.Size], world: int, tail: int = 0, pad_to: int = 1
    ) -> None:
        self.world = world
        self.tail = tail
        slots = []
        offset = 0
        for shape in shapes:
            row_numel = math.prod(shape[1:])
            rows = chunk_rows(shape[0], world)
            slots.append(Slot(torch.Size(shape), rows, row_numel, offset))
            offset += rows * row_numel
        self.slots: list[Slot] = slots
        self.gap = -(offset + tail) % pad_to
        self.shard_numel = (
            offset + self.gap + tail
        )  # S: one rank's shard, padding and tail included
        self.split_sizes = [s.padded_numel for s in slots] + [n for n in (self.gap, tail) if n]

    @property
    def total_numel(self) -> int:
        """Elements of the gathered unit, padding included (world * S)."""
        return self.world * self.shard_numel

    def shard_view(self, flat_shard: torch.Tensor, i: int, rank: int) -> torch.Tensor:
        """Rank ``rank``'s real rows of parameter ``i`` as a view into its flat shard."""
        slot = self.slots[i]
        shape = local_shape(slot.shape, self.world, rank)
        return flat_shard[slot.offset : slot.offset + math.prod(shape)].view(shape)

    def gathered_view(self, flat_gathered: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter ``i`` (full shape) as a view into the parameter-major gathered storage."""
        slot = self.slots[i]
        start = self.world * slot.offset
        padded = flat_gathered[start : start + self.world * slot.padded_numel]
        return padded.view(self.world * slot.chunk_rows, *slot.shape[1:])[: slot.shape[0]]

    def pack_shard(self, tensors: Sequence[torch.Tensor], rank: int, out: torch.Tensor) -> None:
        """Copy rank ``rank``'s rows of each full tensor into ``out`` (zeroing the padding)."""
        out.zero_()
        for i, full in enumerate(tensors):
            self.shard_view(out, i, rank).copy_(chunk_of(full, self.world, rank))

    def copy_out(
        self,
        gathered: torch.Tensor,
        flat_gathered: torch.Tensor,
        tails: torch.Tensor | None = None,
        dest: FlatLayout | None = None,
    ) -> None:
        """Rank-major all-gather output -> parameter-major gathered storage, in one kernel.

        Each rank's tail lands in row r of ``tails`` (``(world, tail)``; a scratch buffer when
        not given). ``dest``: the layout of ``flat_gathered`` when it differs from this one (a
        unit gathered over a smaller group after forward, NOTE [Resharding to a smaller group]):
        parameter ``i``'s padded rows then fill the front of its region there, which is at least
        as large because the group size divides ``dest``'s.
        """
        w, d = self.world, dest or self
        outs = [
            flat_gathered[d.world * ds.offset : d.world * ds.offset + w * s.padded_numel].view(
                w, s.padded_numel
            )
            for s, ds in zip(self.slots, d.slots, strict=True)
        ]
        dtype, device = gathered.dtype, gathered.device
        if self.gap:
            outs.append(torch.empty(w, self.gap, dtype=dtype, device=device))  # scratch
        if self.tail:
            if tails is None:
                tails = torch.empty(w, self.tail, dtype=dtype, device=device)
            outs.append(tails)
        # a (world, S) view is taken as it is: a dtype group's columns of a shared buffer
        rows = gathered if gathered.dim() == 2 else gathered.view(w, self.shard_numel)
        torch.split_with_sizes_copy(rows, self.split_sizes, 1, out=outs)

    def pack_for_reduce(
        self,
        grads: Sequence[torch.Tensor | None],
        *,
        dtype: torch.dtype,
        device: torch.device,
        extra: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Full gradients -> rank-major reduce-scatter input of shape ``(world, S [+ extra])``.

        A missing gradient is sent as zeros. ``extra`` (shape ``(world, k)``) is appended to every
        rank's block; the reduce-scatter then sums it like the gradients. Padding, the cast to
        ``dtype`` and the rank-major interleave are one kernel (``torch._chunk_cat``, as FSDP2's
        copy-in) where torch has it.
        """
        w = self.world
        # one input dtype (the gradients'); the kernel casts to ``dtype`` on the way out
        present = {g.dtype for g in grads if g is not None}
        src = present.pop() if len(present) == 1 else dtype
        parts = [
            torch.zeros(slot.shape, dtype=src, device=device) if g is None else g.to(src)
            for slot, g in zip(self.slots, grads, strict=True)
        ]
        if extra is not None:
            parts.append(extra.to(src))
        width = self.shard_numel + (extra.shape[1] if extra is not None else 0)
        out = torch.empty(w, width, dtype=dtype, device=device)
        if _chunk_cat is not None:
            _chunk_cat(parts, dim=0, num_chunks=w, out=out)
            return out
        cols = []  # torch < 2.4: pad, cast and cat by hand
        for slot, part in zip(self.slots, parts, strict=False):
            g = part.reshape(slot.shape[0], slot.row_numel).to(dtype)
            rows = w * slot.chunk_rows
            if rows != slot.shape[0]:
                g = torch.nn.functional.pad(g, (0, 0, 0, rows - slot.shape[0]))
            cols.append(g.view(w, slot.padded_numel))
        if extra is not None:
            cols.append(extra.to(dtype))
        torch.cat(cols, dim=1, out=out)
        return out
