"""Whole matrices on owner ranks: who owns each matrix, where each rank's piece of it lies, and
the two all-to-alls that carry the pieces to their owners and the results back.

NOTE [Matrices on owners]
A whole-matrix update (Muon's Newton–Schulz) needs every element of a matrix in one place, and
each rank holds only its piece (``Shard(0)`` rows; with tensor parallel, a block or a strided
set of rows and columns). Each matrix therefore gets one *owner* rank, the same on every rank:
the matrices, in the optimizer's order, go to ranks by longest-processing-time first (largest
cost first, each to the least-loaded rank, ties to the lowest rank; :func:`assign_owners`), so
the work splits ``N`` ways wherever matrices are many and alike. A step then is:

1. every rank computes its pieces' input elementwise (Muon: its rows of the momentum and the
   Nesterov update, as one process would on the whole, bit for bit);
2. **to the owners**: one ``all_to_all_single`` over the group, rank ``r``'s block for rank
   ``o`` being ``r``'s pieces of the matrices ``o`` owns, in order; the owner places them
   into whole matrices (no sum, no arithmetic: the same bits as one process's);
3. the owner runs the whole-matrix function (torch's own Newton–Schulz);
4. **back**: one ``all_to_all_single`` again, each rank receiving its piece of every result;
5. every rank applies its pieces elementwise (Muon: weight decay and the scaled update).

Bytes: a rank sends ``(N-1)/N`` of its pieces and receives as much back, in the wire dtype
(bf16 for torch's Newton–Schulz, which casts its input to bf16 first), so for ``E`` matrix
elements both all-to-alls together move ``2 E (N-1)/N`` elements over all ranks, where one
reduce-scatter plus one all-gather of the same parameters move ``2 E (N-1)`` (``N`` times
more, and in fp32; :meth:`Exchange.sent` counts a rank's own).

Replicated placements (HSDP's replicate dim, a TP-replicated parameter) hold the same piece
on several ranks: only the one at coordinate 0 of those mesh dims sends it, every holder gets
the result back. Which matrices take part is decided per step (those with a gradient, the same
on every rank: NOTE [Which gradients exist]); a plan is built once per set of matrices, with
one ``all_gather_object`` of every rank's pieces, which also checks that the ranks agree on the
matrices and that the senders' pieces tile each matrix exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from fullshard.comm.collectives import all_to_all
from fullshard.comm.control import all_gather_objects
from fullshard.comm.device import comm_device
from fullshard.comm.mesh import default_timeout
from fullshard.engine.param import local_of
from fullshard.policies import FullshardError

__all__ = ["Exchange", "Piece", "assign_owners", "exchange_group", "ns_flops"]


def ns_flops(shape: Sequence[int], steps: int) -> int:
    """Floating-point operations of ``steps`` Newton–Schulz iterations on a ``shape`` matrix
    (torch's quintic: per iteration ``X X^T``, ``b A + c A A`` and ``a X + B X`` on the short
    side ``s`` by the long side ``l``: ``2 s^2 l + 2 s^3 + 2 s^2 l``)."""
    s, long = sorted(int(d) for d in shape[:2])
    return steps * (4 * s * s * long + 2 * s**3)


def assign_owners(costs: Sequence[float], world: int) -> list[int]:
    """The owner rank of each matrix (NOTE [Matrices on owners]): longest processing time
    first, ties by position and by rank, so every rank computes the same list."""
    load = [0.0] * world
    owner = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        o = min(range(world), key=lambda r: (load[r], r))
        owner[i] = o
        load[o] += costs[i]
    return owner


@dataclass(frozen=True)
class Piece:
    """Where a rank's local tensor of a matrix lies in the whole: the block of rows
    ``r0:r0+h`` and columns ``c0:c0+w``, or (a ``_StridedShard`` layout, not a block) the flat
    indices of its elements in the whole, in the local tensor's order."""

    r0: int
    c0: int
    h: int
    w: int
    index: torch.Tensor | None = None

    @property
    def numel(self) -> int:
        return self.h * self.w

    def place(self, whole: torch.Tensor, values: torch.Tensor) -> None:
        """Write ``values`` (flat) into ``whole`` where this piece lies."""
        if self.index is not None:
            whole.view(-1).index_copy_(0, self.index, values)
        else:
            whole[self.r0 : self.r0 + self.h, self.c0 : self.c0 + self.w].copy_(
                values.view(self.h, self.w)
            )

    def take(self, whole: torch.Tensor) -> torch.Tensor:
        """This piece of ``whole`` (contiguous), flat, in the local tensor's order."""
        if self.index is not None:
            return whole.reshape(-1).index_select(0, self.index)
        return whole[self.r0 : self.r0 + self.h, self.c0 : self.c0 + self.w].reshape(-1)


def exchange_group(p: DTensor) -> tuple[tuple[int, ...], dist.ProcessGroup | None]:
    """The ranks a matrix's pieces are spread over (a key) and the group its exchange runs in:
    a 1-D mesh's own group, the whole world for a mesh of several dims that covers it."""
    mesh = p.device_mesh
    ranks = tuple(sorted(int(r) for r in mesh.mesh.reshape(-1).tolist()))
    if mesh.ndim == 1:
        return ranks, mesh.get_group(0)
    if len(ranks) == dist.get_world_size():
        return ranks, None
    raise FullshardError(
        f"rank {dist.get_rank()}: a whole-matrix optimizer got a parameter of shape "
        f"{tuple(p.shape)} on a {mesh.ndim}-D mesh of {len(ranks)} of the "
        f"{dist.get_world_size()} ranks; matrices on a mesh of several dims must span the whole "
        "world (or a 1-D mesh its own group). Give this parameter to an AdamW group instead."
    )


def _describe(p: DTensor) -> tuple[Any, ...]:
    """This rank's piece of ``p`` as plain data for the plan's all-gather: (global shape, sends
    it?, its elements, its shape, its block's offset or None for a strided layout)."""
    placements = tuple(p.placements)
    if any(not isinstance(x, (Shard, _StridedShard, Replicate)) for x in placements):
        raise FullshardError(
            f"rank {dist.get_rank()}: a whole-matrix optimizer cannot place a parameter of shape "
            f"{tuple(p.shape)} with placements {placements} (only Shard, _StridedShard and "
            "Replicate)."
        )
    coord = p.device_mesh.get_coordinate()
    assert coord is not None
    # of the ranks holding the same piece (Replicate dims), the one at coordinate 0 sends it
    sender = all(c == 0 for c, x in zip(coord, placements, strict=True) if isinstance(x, Replicate))
    local = local_of(p)
    if any(isinstance(x, _StridedShard) for x in placements):
        return (tuple(p.shape), sender, local.numel(), tuple(local.shape), None)
    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, placements)
    if tuple(shape) != tuple(local.shape):
        raise FullshardError(
            f"rank {dist.get_rank()}: a parameter of shape {tuple(p.shape)} holds a local tensor "
            f"of shape {tuple(local.shape)} where its placements {placements} say {tuple(shape)}"
        )
    return (tuple(p.shape), sender, local.numel(), tuple(shape), tuple(offset))


def _strided_index(p: DTensor) -> torch.Tensor:
    """The flat indices in the whole of this rank's local elements of ``p``, computed as DTensor
    splits (``src_data_rank=None``: each rank its own, no communication)."""
    whole = torch.arange(p.numel(), dtype=torch.int64, device=local_of(p).device)
    mine = distribute_tensor(whole.view(p.shape), p.device_mesh, p.placements, src_data_rank=None)
    return mine.to_local().reshape(-1)


class Exchange:
    """The plan of NOTE [Matrices on owners] for one set of matrices in one group, and its two
    all-to-alls. Built collectively (every rank of ``group``, the same ``params`` in the same
    order); ``costs`` balance the owners."""

    def __init__(
        self, params: Sequence[DTensor], costs: Sequence[float], group: dist.ProcessGroup | None
    ) -> None:
        self.group = group
        self.world = world = dist.get_world_size(group)
        self.rank = me = dist.get_rank(group)
        self.device = comm_device(group)
        self.shapes = [tuple(int(d) for d in p.shape) for p in params]
        n = len(params)
        mine = [_describe(p) for p in params]
        every = all_gather_objects(mine, group)
        _check_agreement(every)
        self.owner = assign_owners(costs, world)
        self.owned = [i for i in range(n) if self.owner[i] == me]
        owned_by = [[i for i in range(n) if self.owner[i] == o] for o in range(world)]
        # [rank][matrix]: that rank's piece's size; does it send it / get the result back
        numel = [[e[i][2] for i in range(n)] for e in every]
        sends = [[e[i][1] and e[i][2] > 0 for i in range(n)] for e in every]
        holds = [[e[i][2] > 0 for i in range(n)] for e in every]
        # the two routes, each a list of (rank, matrix) in the order of the all-to-all's blocks
        self.out_to = [(o, i) for o in range(world) for i in owned_by[o] if sends[me][i]]
        self.in_from = [(r, i) for r in range(world) for i in self.owned if sends[r][i]]
        self.back_to = [(r, i) for r in range(world) for i in self.owned if holds[r][i]]
        self.back_from = [(o, i) for o in range(world) for i in owned_by[o] if holds[me][i]]
        self._numel = numel
        self._in_sizes = [numel[r][i] for r, i in self.in_from]
        self._home_sizes = [numel[me][i] for _, i in self.back_from]
        strided = [i for i in range(n) if every[me][i][4] is None]
        index = self._strided_indices(params, strided, every)
        # on the owner: every holder's piece of each owned matrix
        self.pieces: dict[tuple[int, int], Piece] = {}
        for r in range(world):
            for i in self.owned:
                if not holds[r][i]:
                    continue
                shape, offset = every[r][i][3], every[r][i][4]
                if offset is None:
                    self.pieces[(r, i)] = Piece(0, 0, 1, numel[r][i], index=index[(r, i)])
                else:
                    self.pieces[(r, i)] = Piece(offset[0], offset[1], shape[0], shape[1])
        for i in self.owned:
            covered = sum(numel[r][i] for r in range(world) if sends[r][i])
            if covered != self.shapes[i][0] * self.shapes[i][1]:
                raise FullshardError(
                    f"rank {dist.get_rank()}: the senders' pieces of a matrix of shape "
                    f"{self.shapes[i]} hold {covered} elements, not the whole: its placements "
                    "do not tile it"
                )

    def _strided_indices(
        self, params: Sequence[DTensor], strided: list[int], every: list[list[tuple[Any, ...]]]
    ) -> dict[tuple[int, int], torch.Tensor]:
        """(rank, owned matrix) -> the flat indices of that rank's piece, for the layouts that
        are not blocks: every rank computes its own, and they travel to the owners once."""
        world, me = self.world, self.rank
        todo = [
            [every[r][i][4] is None and every[r][i][2] > 0 for i in range(len(params))]
            for r in range(world)
        ]
        if not any(any(t) for t in todo):
            return {}
        out = [
            (self.owner[i], i)
            for i in sorted(strided, key=lambda i: (self.owner[i], i))
            if todo[me][i]
        ]
        into = [(r, i) for r in range(world) for i in self.owned if todo[r][i]]
        got = self._route(
            [_strided_index(params[i]) for _, i in out],
            out,
            into,
            [every[r][i][2] for r, i in into],
            torch.int64,
            "the flat indices of strided pieces",
        )
        return dict(zip(into, got, strict=True))

    def _route(
        self,
        values: Sequence[torch.Tensor],
        out: list[tuple[int, int]],
        into: list[tuple[int, int]],
        sizes: list[int],
        dtype: torch.dtype,
        what: str,
    ) -> list[torch.Tensor]:
        """One all-to-all: ``values[k]`` (flat) to rank ``out[k][0]``; returns the flat blocks
        ``into`` names (rank, matrix), of ``sizes`` elements, in its order. Both lists run in rank order, so rank
        ``r``'s block for this rank holds exactly the pieces ``into`` expects from ``r``."""
        send_splits = [0] * self.world
        for (r, _), v in zip(out, values, strict=True):
            send_splits[r] += v.numel()
        recv_splits = [0] * self.world
        for (r, _), k in zip(into, sizes, strict=True):
            recv_splits[r] += k
        parts = [v.reshape(-1).to(self.device, dtype) for v in values]
        send = torch.cat(parts) if parts else torch.empty(0, dtype=dtype, device=self.device)
        recv = torch.empty(sum(recv_splits), dtype=dtype, device=self.device)
        if self.world == 1:
            recv.copy_(send)
        else:
            all_to_all(
                recv,
                send,
                recv_splits,
                send_splits,
                self.group,
                what=f"all-to-all of {what} (whole-matrix optimizer)",
                timeout=default_timeout(),
            ).wait()
        return list(recv.split(sizes))

    def sent(self) -> tuple[int, int]:
        """Elements this rank sends to other ranks in one step: towards the owners, and back."""
        me = self.rank
        out = sum(self._numel[me][i] for o, i in self.out_to if o != me)
        back = sum(self._numel[r][i] for r, i in self.back_to if r != me)
        return out, back

    def to_owners(
        self,
        local: Sequence[torch.Tensor],
        dtype: torch.dtype,
        dtypes: Sequence[torch.dtype],
    ) -> dict[int, torch.Tensor]:
        """The whole of every matrix this rank owns, assembled from every rank's ``local[i]``
        (its piece's values, sent in ``dtype``), as ``dtypes[i]`` (exact: ``dtype`` is as wide)."""
        values = [local[i] for _, i in self.out_to]
        got = self._route(
            values, self.out_to, self.in_from, self._in_sizes, dtype, "pieces to owners"
        )
        wholes = {
            i: torch.empty(self.shapes[i], dtype=dtype, device=self.device) for i in self.owned
        }
        for (r, i), chunk in zip(self.in_from, got, strict=True):
            self.pieces[(r, i)].place(wholes[i], chunk)
        return {i: w.to(dtypes[i]) for i, w in wholes.items()}

    def from_owners(
        self, results: dict[int, torch.Tensor], dtype: torch.dtype
    ) -> dict[int, torch.Tensor]:
        """This rank's piece (flat, in ``dtype``) of every result, from the owners'
        ``results`` (owned matrix -> whole result)."""
        values = [self.pieces[(r, i)].take(results[i]) for r, i in self.back_to]
        got = self._route(
            values, self.back_to, self.back_from, self._home_sizes, dtype, "results from owners"
        )
        return {i: chunk for (_, i), chunk in zip(self.back_from, got, strict=True)}


def _check_agreement(every: list[list[tuple[Any, ...]]]) -> None:
    """The same matrices, in the same order, on every rank (raised alike on every rank)."""
    shapes = [[d[0] for d in e] for e in every]
    for r, s in enumerate(shapes):
        if s != shapes[0]:
            raise FullshardError(
                f"rank {dist.get_rank()}: the ranks disagree on the matrices of this optimizer "
                f"step: rank 0 has {len(shapes[0])} with gradients, rank {r} has {len(s)} "
                f"(first shapes {shapes[0][:3]} against {s[:3]}). Every rank must build the "
                "optimizer from the same parameters and give them the same gradients (None on "
                "every rank or on none)."
            )
