"""Fixed-order training (layer 8): the same bits whatever the number of ranks (``fullshard.deterministic``).

For a fixed global batch, seed, model and data, the weights after any number of steps are
bitwise the same at 1, 2, 4, 8, ... ranks, for every strategy, in fp32 and with bf16 compute,
when a training loop does four things:

1. **Splits each step's global batch into micro-batches of one fixed size**
   (:class:`MicroBatches`). Micro-batch ``i`` runs on rank ``i % world``, so rank ``r`` runs
   ``r, r + world, r + 2 * world, ...``, one per micro-step, every micro-step reducing its
   gradients (``set_requires_gradient_sync(True)``, the default).
2. **Reduces in a fixed order**: :func:`enable` makes every unit's reduce-scatter (and HSDP
   all-reduce) a plain sum over ranks in a balanced tree, in rank order (NOTE [Sums in a fixed
   order], ``fullshard.comm.collectives``), and never divides it: the loss is divided by the
   number of micro-batches instead, which is the same at every world size.
3. **Adds the micro-steps in the same tree** (:class:`GradientTree`): one micro-step's reduce
   is a subtree over ``world`` consecutive micro-batches; the tree pushes them pairwise, so
   that every gradient is one sum over all micro-batches in one fixed tree, whatever the split.
4. **Reduces the loss, the gradient norm and metrics in a fixed order**
   (:func:`sum_over_micro_batches`, :func:`clip_grad_norm_`), and draws any randomness
   (dropout) per micro-batch (:func:`seed_micro_batch`).

The tree over a step's ``K`` micro-batches: ``K = c * 2**k`` (``c`` odd) is cut into ``c``
consecutive chunks of ``2**k``; each chunk is summed as a balanced binary tree and the chunks
are added left to right. A world size works when every micro-step is a subtree: a power of two
that divides ``2**k`` (:meth:`MicroBatches.world_sizes`).

Elementwise work (the optimizer, casts, clipping's multiply) gives the same bits on any slice
of a tensor, and the forward and backward of one micro-batch see the same gathered parameters
at every world size; so nothing else depends on how the parameters are sharded. On GPUs, also
call ``torch.use_deterministic_algorithms(True)`` (``fullshard train --deterministic`` does):
the kernels themselves must not choose their order at run time.

Costs: one reduce-scatter per micro-batch of a rank (no accumulation without sync), received
as all-to-all and summed by the rank; up to ``log2(steps) + 1`` gradient shards held by the
tree; HSDP's all-reduce gathers every replica's shard.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from fullshard.comm import control
from fullshard.comm.device import same_bits
from fullshard.policies import FullshardError

# DTensor and the engine are imported where they are used: ``fullshard train --deterministic``
# checks MicroBatches before launch, in the launcher, which does not import them (seconds).

__all__ = [
    "GradientTree",
    "MicroBatches",
    "clip_grad_norm_",
    "enable",
    "seed_micro_batch",
    "sum_over_micro_batches",
    "total_norm",
]


@dataclass(frozen=True)
class MicroBatches:
    """A step's global batch of ``global_batch`` rows as micro-batches of ``micro_batch`` rows,
    and which of them a rank runs (micro-batch ``i`` on rank ``i % world``)."""

    global_batch: int
    micro_batch: int

    def __post_init__(self) -> None:
        if self.micro_batch < 1 or self.global_batch < 1:
            raise ValueError(
                f"global batch {self.global_batch} and micro-batch {self.micro_batch} must be "
                "at least 1"
            )
        if self.global_batch % self.micro_batch:
            raise ValueError(
                f"a global batch of {self.global_batch} does not split into micro-batches of "
                f"{self.micro_batch}"
            )

    @property
    def count(self) -> int:
        """Micro-batches per step (``K``): what each micro-batch's loss is divided by."""
        return self.global_batch // self.micro_batch

    @property
    def chunk(self) -> int:
        """The largest power of two dividing :attr:`count` (the tree's balanced chunks)."""
        return self.count & -self.count

    def world_sizes(self) -> list[int]:
        """The world sizes that give the same bits: the powers of two dividing :attr:`chunk`."""
        return [1 << j for j in range(self.chunk.bit_length())]

    def check_world(self, world: int) -> None:
        """Raise ``ValueError`` naming the world sizes that work when ``world`` is not one."""
        if world not in self.world_sizes():
            sizes = ", ".join(map(str, self.world_sizes()))
            raise ValueError(
                f"a global batch of {self.global_batch} in micro-batches of {self.micro_batch} "
                f"is {self.count} micro-batches, which give the same bits on {sizes} ranks "
                f"(powers of two that divide {self.chunk}), not on {world}"
            )

    def steps(self, world: int) -> int:
        """Micro-steps (micro-batches per rank) per step at ``world`` ranks."""
        self.check_world(world)
        return self.count // world

    def indices(self, rank: int, world: int) -> range:
        """The micro-batches rank ``rank`` runs, in order: ``rank, rank + world, ...``."""
        self.check_world(world)
        return range(rank, self.count, world)

    def rows(self, index: int) -> slice:
        """The global batch's rows of micro-batch ``index``."""
        return slice(index * self.micro_batch, (index + 1) * self.micro_batch)


def enable(module: nn.Module) -> None:
    """Fixed-order reductions in every ``fully_shard`` unit of ``module`` (call after
    ``fully_shard``, before the first backward): sums in a balanced tree over the ranks
    (NOTE [Sums in a fixed order]) and no division (divide each loss by
    :attr:`MicroBatches.count` instead). Raises :class:`FullshardError` for a unit whose
    reduction cannot be fixed: a custom reduce-scatter, or a reduce dtype narrower than its
    parameters (the tree's partial sums would be rounded differently at each world size)."""
    from fullshard.engine.fsdp_module import FSDPModule

    fsdp = [m for m in module.modules() if isinstance(m, FSDPModule)]
    if not fsdp:
        raise FullshardError("fullshard.deterministic.enable: no fully_shard unit in the module")
    for m in fsdp:
        m.set_fixed_order_reduction()
        m.set_gradient_divide_factor(1.0)


def seed_micro_batch(seed: int, step: int, index: int) -> None:
    """Seed torch's generators (CPU and every GPU) for micro-batch ``index`` of ``step``, so
    dropout and any other sampling in forward draw the same numbers at every world size."""
    torch.manual_seed((seed * 1_000_003 + step) * 1_000_033 + index)


class GradientTree:
    """A step's gradients summed over micro-steps in the fixed tree (module docstring).

    Call :meth:`push` after each micro-step's backward (it takes the parameters' ``.grad``) and
    :meth:`finish` after the last (it sets ``.grad`` to the step's sum). A parameter without a
    gradient in one micro-step adds nothing there (``x + 0`` is ``x``). Every parameter given
    is followed, frozen ones too, so one thawed between steps (NOTE [Freezing after
    fully_shard]) sums in the tree like the rest.
    """

    def __init__(self, parameters: Iterable[torch.Tensor], plan: MicroBatches, world: int):
        plan.check_world(world)
        self.params = list(parameters)
        self.per_chunk = plan.chunk // world  # micro-steps per balanced chunk
        self._stack: list[tuple[int, list[torch.Tensor | None]]] = []
        self._total: list[torch.Tensor | None] | None = None
        self._in_chunk = 0

    @staticmethod
    def _add(
        a: list[torch.Tensor | None], b: list[torch.Tensor | None]
    ) -> list[torch.Tensor | None]:
        return [x if y is None else y if x is None else x + y for x, y in zip(a, b, strict=True)]

    def push(self) -> None:
        """Take this micro-step's gradients into the tree (``.grad`` becomes ``None``)."""
        grads: list[torch.Tensor | None] = []
        for p in self.params:
            grads.append(p.grad)
            p.grad = None
        level = 0
        while self._stack and self._stack[-1][0] == level:  # merge equal subtrees pairwise
            grads = self._add(self._stack.pop()[1], grads)
            level += 1
        self._stack.append((level, grads))
        self._in_chunk += 1
        if self._in_chunk == self.per_chunk:  # a balanced chunk is complete: add it on
            (_, chunk), self._stack, self._in_chunk = self._stack[0], [], 0
            self._total = chunk if self._total is None else self._add(self._total, chunk)

    def finish(self) -> None:
        """Set every parameter's ``.grad`` to the step's sum and start the next step."""
        if self._in_chunk or self._total is None:
            raise FullshardError(
                f"GradientTree.finish after {self._in_chunk} micro-steps of a chunk of "
                f"{self.per_chunk}: push once per micro-step of MicroBatches.steps(world)"
            )
        for p, g in zip(self.params, self._total, strict=True):
            p.grad = g
        self._total = None


def sum_over_micro_batches(
    values: torch.Tensor | Sequence[torch.Tensor],
    group: dist.ProcessGroup | None = None,
    count: int | None = None,
) -> torch.Tensor:
    """The sum over all ranks' micro-batches of one value each (a loss), in micro-batch order:
    ``values`` are this rank's, in the order of :meth:`MicroBatches.indices`; ``count``: only
    the first ``count`` micro-batches (ranks may run padding beyond them). float64, the same on
    every rank and at every world size (one all-gather)."""
    mine = values if isinstance(values, torch.Tensor) else torch.stack(list(values))
    rows = control.all_gather_values(mine, group, what="fixed-order sum of micro-batch values")
    ordered = rows.t().reshape(-1)  # micro-batch i = s * world + r: column-major order
    return ordered[: ordered.numel() if count is None else count].sum()


def _slice_squares(local: torch.Tensor, dim: int) -> torch.Tensor:
    """Sums of squares of ``local``'s slices along ``dim`` (float64, one per slice): a slice is
    never split between ranks, and each is summed in one elementwise tree fixed by the slice's
    length alone. A reduction kernel (``sum(dim=1)``) would not do: on CUDA its order follows
    its launch shape, which follows the number of slices this rank holds (NOTE [Kernel
    contracts] in ``fullshard.testing``)."""
    rows = local.detach().movedim(dim, 0)
    rows = rows.reshape(local.shape[dim], rows[0].numel() if len(rows) else 0).double().pow(2)
    while rows.shape[1] > 1:  # add the right half onto the left; an odd last column waits
        half = rows.shape[1] // 2
        pairs = rows[:, :half] + rows[:, half : 2 * half]
        rows = torch.cat([pairs, rows[:, 2 * half :]], dim=1) if rows.shape[1] % 2 else pairs
    return rows.reshape(-1) if rows.shape[1] else rows.new_zeros(rows.shape[0])


def _shard_dim(p: torch.Tensor) -> tuple[int, dist.ProcessGroup] | None:
    """``(tensor dim, shard group)`` of a fullshard-sharded parameter, ``None`` when replicated."""
    from torch.distributed.tensor import DTensor, Shard

    from fullshard.engine.view import param_shard

    where = param_shard(p)
    if where is None or not isinstance(p, DTensor):
        return None
    shards = [x for x in p.placements if isinstance(x, Shard)]
    if not shards:
        return None
    if len(shards) != 1 or len(p.placements) > where.dp_dims:
        raise FullshardError(
            f"fixed-order clip_grad_norm_: a parameter of unit '{where.unit}' has placements "
            f"{p.placements}; fixed-order mode supports one Shard(d) over the data "
            "parallel ranks (no tensor parallel)"
        )
    return shards[0].dim, where.group


def total_norm(parameters: Iterable[torch.Tensor]) -> torch.Tensor:
    """The gradients' global 2-norm (float64) with the same bits at every world size: each
    slice's sum of squares along the shard dimension is computed where it lives, gathered, and
    the full vector of them summed in one fixed order. The gradients are left as they are."""
    from torch.distributed.tensor import DTensor

    with_grad = [p for p in parameters if p.grad is not None]
    device = with_grad[0].grad.device if with_grad else torch.device("cpu")  # type: ignore[union-attr]
    pieces: list[torch.Tensor | None] = [None] * len(with_grad)
    by_group: dict[dist.ProcessGroup, list[tuple[int, torch.Tensor, int]]] = {}
    for j, p in enumerate(with_grad):
        g = p.grad
        assert g is not None
        where = _shard_dim(p)
        if where is None:
            full = g.full_tensor() if isinstance(g, DTensor) else g
            pieces[j] = _slice_squares(full, 0).to(device)
            continue
        dim, group = where
        size, world = p.shape[dim], dist.get_world_size(group)
        chunk = -(-size // world)
        local = g.to_local() if isinstance(g, DTensor) else g
        mine = max(0, min(chunk, size - dist.get_rank(group) * chunk))
        if local.shape[dim] != mine:
            raise FullshardError(
                f"fixed-order clip_grad_norm_: a shard of {size} rows over {world} ranks holds "
                f"{local.shape[dim]} here, not {mine}: not torch.chunk's split"
            )
        padded = torch.zeros(chunk, dtype=torch.float64, device=local.device)
        # the rows a rank holds depend on the world size: no reduction kernel over them
        with same_bits("the fixed-order gradient norm's sums of a rank's slices"):
            padded[:mine] = _slice_squares(local, dim)
        by_group.setdefault(group, []).append((j, padded, size))
    for group, items in by_group.items():
        rows = control.all_gather_values(
            torch.cat([v for _, v, _ in items]), group, what="fixed-order gradient norm"
        )
        at = 0
        for j, v, size in items:
            pieces[j] = rows[:, at : at + v.numel()].reshape(-1)[:size].to(device)
            at += v.numel()
    squares = [x for x in pieces if x is not None]
    total = torch.cat(squares).sum() if squares else torch.zeros((), dtype=torch.float64)
    return total.sqrt()


def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """``fullshard.clip_grad_norm_`` (2-norm) whose norm has the same bits at every world size
    (:func:`total_norm`); ``max_norm <= 0`` only measures. Returns the norm (float64)."""
    from fullshard.engine.gradients import scale_

    with_grad = [p for p in parameters if p.grad is not None]
    norm = total_norm(with_grad)
    scale_(with_grad, max_norm if max_norm > 0 else float("inf"), norm)
    return norm
