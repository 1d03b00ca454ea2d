"""Sharding arithmetic (layer 3): chunk, pad and offset math. Pure tensor code, no collectives.

By default every parameter is split along dim 0 into ``world`` chunks of ``ceil(dim0 / world)``
rows, exactly like ``torch.chunk`` and DTensor's ``Shard(0)``: the last ranks may hold fewer rows,
or none. A parameter may instead be sharded on another dim ``k`` (FSDP2's ``shard_placement_fn``,
DTensor's ``Shard(k)``); that dim's size must then be a multiple of ``world`` (even chunks only).

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

Shard(k), k > 0 (``Slot.dim``): a rank's region holds its chunk ``narrow(k, r * c, c)`` (``c =
size_k / world``) *contiguous in the chunk's shape*, so the sharded DTensor's local tensor and its
gradient are plain contiguous tensors, with no padding. Its gathered region is the full parameter,
contiguous; rank r's chunk is then the strided box ``full.view(pre, world, c, post)[:, r]``
(``pre``/``post``: the elements before/after dim k). Such slots come FIRST in the flat shard, before
every dim-0 slot, so that the dim-0 slots, the gap and the tail stay one run of columns for the
single ``split_with_sizes_copy`` (and the gradients of the dim-0 slots one ``_chunk_cat``); each
Shard(k) slot is one more strided copy, from the rank-major output straight into its gathered
region and from the box ``[:, r]`` of its full gradient straight into rank r's reduce-scatter
columns: no scratch buffer, every element still copied once (docs/design.md measures the cost).
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


def check_even(shape: Sequence[int], dim: int, world: int) -> None:
    """Shard(dim) with dim > 0 needs equal chunks (``ValueError`` otherwise; the engine raises a
    clearer error first)."""
    if dim and shape[dim] % world:
        raise ValueError(f"Shard({dim}) of shape {tuple(shape)} over {world} ranks is uneven")


def local_shape(shape: Sequence[int], world: int, rank: int, dim: int = 0) -> torch.Size:
    """Shape of rank ``rank``'s ``Shard(dim)`` shard of a tensor of ``shape``."""
    if dim == 0:
        return torch.Size([local_rows(shape[0], world, rank), *shape[1:]])
    check_even(shape, dim, world)
    return torch.Size([*shape[:dim], shape[dim] // world, *shape[dim + 1 :]])


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major strides of ``shape`` (the global stride a DTensor reports)."""
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(stride))


def chunk_of(full: torch.Tensor, world: int, rank: int, dim: int = 0) -> torch.Tensor:
    """Rank ``rank``'s ``Shard(dim)`` chunk of ``full`` (a view, possibly empty; strided when
    ``dim > 0``).

    NOTE [Chunks as FSDP2 cuts them]
    Dim 0 is cut with ``torch.chunk`` (``aten.split``), the op FSDP2 shards a parameter with,
    never by slicing: a tensor subclass that works under FSDP2 implements exactly what FSDP2
    asks of it, and torchao's ``NF4Tensor`` implements ``split`` but refuses a ``slice`` that
    starts past row 0. A rank past the last chunk (fewer rows than ranks) gets an empty tensor
    from ``new_zeros``, as FSDP2's ``new_empty``; for a plain tensor the chunk is the same view
    slicing gives. ``engine/copy_in.py`` makes a subclass's shard of its own from it with the
    rest of FSDP2's ops (``new_zeros``, ``copy_``)."""
    if dim:
        check_even(full.shape, dim, world)
        c = full.shape[dim] // world
        return full.narrow(dim, rank * c, c)
    chunks = torch.chunk(full, world, dim=0)
    if rank < len(chunks):
        return chunks[rank]
    return full.new_zeros((0, *full.shape[1:]))


@dataclass(frozen=True)
class Slot:
    """Where one parameter lives in a unit's flat layout (see NOTE [Flat unit layout]).

    For ``dim > 0`` a "row" is one index along ``dim``: ``chunk_rows`` of them per rank, each of
    ``row_numel`` elements."""

    shape: torch.Size
    chunk_rows: int
    row_numel: int
    offset: int
    dim: int = 0

    @property
    def padded_numel(self) -> int:
        """Elements of this parameter's region in each rank's flat shard."""
        return self.chunk_rows * self.row_numel

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def pre(self) -> int:
        """Elements of the dims before ``dim`` (Shard(k) slots)."""
        return math.prod(self.shape[: self.dim])

    @property
    def post(self) -> int:
        """Elements of the dims after ``dim`` (Shard(k) slots)."""
        return math.prod(self.shape[self.dim + 1 :])


def _make_slot(shape: torch.Size, dim: int, world: int, offset: int) -> Slot:
    if dim == 0:
        return Slot(shape, chunk_rows(shape[0], world), math.prod(shape[1:]), offset)
    check_even(shape, dim, world)
    row_numel = math.prod(shape[:dim]) * math.prod(shape[dim + 1 :])
    return Slot(shape, shape[dim] // world, row_numel, offset, dim)


class FlatLayout:
    """The flat layout of a list of parameter shapes for one world size.

    ``dims``: each parameter's shard dim (default all 0; NOTE [Flat unit layout] for the rest).
    ``tail`` extra elements end each rank's flat shard: room for the all-gather's position tags
    (NOTE [Collective positions]); they are not part of any parameter. ``pad_to`` rounds each
    rank's shard up to a multiple of that many elements (a gap before the tail), so that shards
    of several dtypes can share one byte buffer aligned (engine/param.py).
    """

    def __init__(
        self,
        shapes: Sequence[torch.Size],
        world: int,
        tail: int = 0,
        pad_to: int = 1,
        dims: Sequence[int] | None = None,
    ) -> None:
        self.world = world
        self.tail = tail
        dims = list(dims) if dims is not None else [0] * len(shapes)
        # Shard(k) slots first, then the dim-0 ones: the order of regions in the flat shard
        self.order = [i for i, d in enumerate(dims) if d] + [i for i, d in enumerate(dims) if not d]
        slots: list[Slot | None] = [None] * len(shapes)
        offset = 0
        for i in self.order:
            slot = _make_slot(torch.Size(shapes[i]), dims[i], world, offset)
            slots[i] = slot
            offset += slot.padded_numel
        self.slots: list[Slot] = slots  # type: ignore[assignment]  # every one is set
        self.strided = [s for s in self.slots if s.dim]
        self.dim0 = [i for i in self.order if not dims[i]]  # the dim-0 slots, in flat order
        self.lead = sum(s.padded_numel for s in self.strided)  # columns of the Shard(k) slots
        self.gap = -(offset + tail) % pad_to
        self.shard_numel = (
            offset + self.gap + tail
        )  # S: one rank's shard, padding and tail included
        self.split_sizes = [self.slots[i].padded_numel for i in self.order if not dims[i]] + [
            n for n in (self.gap, tail) if n
        ]

    @property
    def total_numel(self) -> int:
        """Elements of the gathered unit, padding included (world * S)."""
        return self.world * self.shard_numel

    def shard_view(self, flat_shard: torch.Tensor, i: int, rank: int) -> torch.Tensor:
        """Rank ``rank``'s real rows of parameter ``i`` as a (contiguous) view into its flat
        shard."""
        slot = self.slots[i]
        shape = local_shape(slot.shape, self.world, rank, slot.dim)
        return flat_shard[slot.offset : slot.offset + math.prod(shape)].view(shape)

    def gathered_view(self, flat_gathered: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter ``i`` (full shape, contiguous) as a view into the parameter-major gathered
        storage."""
        slot = self.slots[i]
        start = self.world * slot.offset
        padded = flat_gathered[start : start + self.world * slot.padded_numel]
        if slot.dim:
            return padded.view(slot.shape)
        return padded.view(self.world * slot.chunk_rows, *slot.shape[1:])[: slot.shape[0]]

    def pack_shard(self, tensors: Sequence[torch.Tensor], rank: int, out: torch.Tensor) -> None:
        """Copy rank ``rank``'s rows of each full tensor into ``out`` (zeroing the padding)."""
        out.zero_()
        for i, full in enumerate(tensors):
            chunk = chunk_of(full, self.world, rank, self.slots[i].dim)
            self.shard_view(out, i, rank).copy_(chunk)

    def copy_targets(self, flat_gathered: torch.Tensor) -> list[torch.Tensor] | None:
        """What ``copy_out``'s one kernel writes in ``flat_gathered`` (this layout's gathered
        storage): each dim-0 slot's region, then a scratch row block for the gap, without the
        tail. Views of a storage stay valid while its memory comes and goes (NOTE [Freeing
        while autograd holds a view] in engine/param.py), so a unit makes them once per
        storage instead of at every gather. ``None`` for a layout with Shard(k) slots (their
        strided copies are made at each gather)."""
        if self.strided:
            return None
        w = self.world
        outs = [
            flat_gathered[w * s.offset : w * (s.offset + s.padded_numel)].view(w, -1)
            for s in (self.slots[i] for i in self.order)
        ]
        if self.gap:
            outs.append(
                torch.empty(w, self.gap, dtype=flat_gathered.dtype, device=flat_gathered.device)
            )
        return outs

    def copy_out(
        self,
        gathered: torch.Tensor,
        flat_gathered: torch.Tensor,
        tails: torch.Tensor | None = None,
        dest: FlatLayout | None = None,
        targets: list[torch.Tensor] | None = None,
    ) -> None:
        """Rank-major all-gather output -> parameter-major gathered storage: one kernel for the
        dim-0 slots, the gap and the tail, one strided copy per Shard(k) slot.

        Each rank's tail lands in row r of ``tails`` (``(world, tail)``; a scratch buffer when
        not given). ``dest``: the layout of ``flat_gathered`` when it differs from this one (a
        unit gathered over a smaller group after forward, NOTE [Resharding to a smaller group]):
        parameter ``i``'s padded rows then fill the front of its region there, which is at least
        as large because the group size divides ``dest``'s (a Shard(k) region is exactly the
        parameter in both).
        """
        w, d = self.world, dest or self
        # a (world, S) view is taken as it is: a dtype group's columns of a shared buffer
        rows = gathered if gathered.dim() == 2 else gathered.view(w, self.shard_numel)
        if targets is not None and dest is None:  # ``copy_targets`` of ``flat_gathered``
            if self.tail:
                if tails is None:
                    tails = torch.empty(w, self.tail, dtype=rows.dtype, device=rows.device)
                targets = [*targets, tails]
            if targets:
                torch.split_with_sizes_copy(rows, self.split_sizes, 1, out=targets)
            return
        outs = []
        for s, ds in zip(self.slots, d.slots, strict=True):
            start = d.world * ds.offset
            if s.dim:  # NOTE [Flat unit layout]: rank r's chunk is the box [:, r] of the full
                full = flat_gathered[start : start + s.numel].view(s.pre, w, s.chunk_rows, s.post)
                src = rows[:, s.offset : s.offset + s.padded_numel]
                full.permute(1, 0, 2, 3).copy_(src.view(w, s.pre, s.chunk_rows, s.post))
        for i in self.order:
            s, ds = self.slots[i], d.slots[i]
            if not s.dim:
                start = d.world * ds.offset
                outs.append(flat_gathered[start : start + w * s.padded_numel].view(w, -1))
        dtype, device = gathered.dtype, gathered.device
        if self.gap:
            outs.append(torch.empty(w, self.gap, dtype=dtype, device=device))  # scratch
        if self.tail:
            if tails is None:
                tails = torch.empty(w, self.tail, dtype=dtype, device=device)
            outs.append(tails)
        if outs:
            rest = rows[:, self.lead :] if self.lead else rows
            torch.split_with_sizes_copy(rest, self.split_sizes, 1, out=outs)

    def pack_for_reduce(
        self,
        grads: Sequence[torch.Tensor | None],
        *,
        dtype: torch.dtype,
        device: torch.device,
        extra: torch.Tensor | Sequence[torch.Tensor] | None = None,
        cast_in_kernel: bool = True,
    ) -> torch.Tensor:
        """Full gradients -> rank-major reduce-scatter input of shape ``(world, S [+ extra])``.

        A missing gradient is sent as zeros. ``extra`` (shape ``(world, k)``, or several such
        parts side by side) is appended to every rank's block; the reduce-scatter then sums it
        like the gradients. For the dim-0 slots,
        padding, the cast to ``dtype`` and the rank-major interleave are one kernel
        (``torch._chunk_cat``, as FSDP2's copy-in) where torch has it; each Shard(k) gradient is
        one strided copy (and cast) into its columns (NOTE [Flat unit layout]).

        ``cast_in_kernel=False`` (CPU): gradients of another dtype are interleaved in their own
        dtype and cast in one copy after. CPU's ``_chunk_cat`` casts chunk by chunk, element by
        element: bf16 to fp32 took 14.4 us for a unit of 8,320 elements at 8 ranks, the copy and
        the cast 6.7 (issue 45); CUDA's kernel casts on the way at no cost, so the engine keeps it
        there (and under the CUDA emulation). The values are the same: both casts are exact.
        """
        w = self.world
        extras = [extra] if isinstance(extra, torch.Tensor) else list(extra or [])
        width = self.shard_numel + sum([e.shape[1] for e in extras])
        out = torch.empty(w, width, dtype=dtype, device=device)
        for s, g in zip(self.slots, grads, strict=True):
            if s.dim and self.strided:
                region = out[:, s.offset : s.offset + s.padded_numel]
                if g is None:
                    region.zero_()
                else:  # rank r's chunk is the box [:, r] of the full gradient
                    src = g.reshape(s.pre, w, s.chunk_rows, s.post).transpose(0, 1)
                    region.view(w, s.pre, s.chunk_rows, s.post).copy_(src)
        zero = self.dim0
        if not zero and not extras:
            return out
        rest = out[:, self.lead :] if self.lead else out  # a column slice: strided, fine
        # one input dtype (the gradients'); the kernel casts to ``dtype`` on the way out
        present = {grads[i].dtype for i in zero if grads[i] is not None}  # type: ignore[union-attr]
        src_dtype = present.pop() if len(present) == 1 else dtype
        parts = [
            torch.zeros(self.slots[i].shape, dtype=src_dtype, device=device)
            if (g := grads[i]) is None
            else g
            if g.dtype == src_dtype
            else g.to(src_dtype)
            for i in zero
        ]
        parts += [e if e.dtype == src_dtype else e.to(src_dtype) for e in extras]
        if _chunk_cat is not None:
            if cast_in_kernel or src_dtype == dtype:
                _chunk_cat(parts, dim=0, num_chunks=w, out=rest)
            else:
                same = torch.empty(rest.shape, dtype=src_dtype, device=device)
                _chunk_cat(parts, dim=0, num_chunks=w, out=same)
                rest.copy_(same)
            return out
        cols = []  # torch < 2.4: pad, cast and cat by hand
        for i, part in zip(zero, parts, strict=False):
            slot = self.slots[i]
            g = part.reshape(slot.shape[0], slot.row_numel).to(dtype)
            rows = w * slot.chunk_rows
            if rows != slot.shape[0]:
                g = torch.nn.functional.pad(g, (0, 0, 0, rows - slot.shape[0]))
            cols.append(g.view(w, slot.padded_numel))
        cols += [e.to(dtype) for e in extras]
        if self.lead:
            rest.copy_(torch.cat(cols, dim=1))
        else:
            torch.cat(cols, dim=1, out=out)
        return out
