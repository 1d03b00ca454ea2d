"""``fullshard train --deterministic`` (and ``--elastic``): a step's micro-batches, validation and
figures in a fixed order (``fullshard.deterministic``), so that the weights are the same bits at
any power-of-two world size and after a resume on another one.

``--elastic`` without ``--deterministic`` (``fixed_order=False``) keeps the global sampler and the
micro-batches, which a changed membership needs, and sums the gradients as the default does: a
rank adds its micro-batches up and one reduce-scatter sums the ranks' (so any world dividing the
number of micro-batches works, and the weights differ in the last bits between world sizes).

The sampler is the global one: every rank draws the step's whole global batch from the whole
training stream (``RankBatches`` over the unsplit stream, with ``world_independent``), so its
position does not depend on the world size and a checkpoint's is valid at any. Micro-batch ``i``
of the step (rows ``i * m .. (i + 1) * m`` of the global batch) runs on rank ``i % world``.
Validation reads the same global micro-batches at every world size; a rank with fewer than the
others runs a copy of the first as padding (every forward is a collective), not counted.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils.deterministic
from torch import nn

from fullshard.app.data.corpus import eval_batches
from fullshard.app.models.gpt import lm_loss
from fullshard.app.train.steps import to_device
from fullshard.comm.device import cuda_semantics
from fullshard.deterministic import (
    GradientTree,
    MicroBatches,
    enable,
    seed_micro_batch,
    sum_over_micro_batches,
)
from fullshard.engine.fsdp_module import FSDPModule

__all__ = ["GlobalBatches"]

Batch = tuple[torch.Tensor, torch.Tensor]


class GlobalBatches:
    """One rank's share of the step's global batch (the trainer's :class:`Batches` for
    ``--deterministic`` and ``--elastic``), and validation in the global order.

    ``model`` is sharded already; ``sampler`` draws the step's whole global batch (the global
    sampler). ``fixed_order``: sums in a fixed tree, the same bits at any world size
    (``--deterministic``); else plain sums (``--elastic`` alone): each rank adds its
    micro-batches up and one reduce-scatter sums the ranks'."""

    def __init__(
        self,
        model: nn.Module,
        sampler: Any,
        *,
        global_batch: int,
        micro_batch: int,
        seed: int,
        rank: int,
        world: int,
        device: torch.device,
        fixed_order: bool,
        val_tokens: Any,
        seq_len: int,
        eval_batches: int,
    ) -> None:
        self.plan = MicroBatches(global_batch, micro_batch)
        self.sampler, self.rank, self.world, self.seed = sampler, rank, world, seed
        self.device, self.fixed_order, self.seq_len = device, fixed_order, seq_len
        self.tree: GradientTree | None = None
        self.val, self.val_count = self._val_batches(val_tokens, eval_batches)
        if not fixed_order:  # plain sums: each rank's micro-batches, then one reduce-scatter
            if self.plan.count % world:
                raise ValueError(f"{self.plan.count} micro-batches do not split over {world} ranks")
            self.mine = list(range(rank, self.plan.count, world))
            for m in model.modules():
                if isinstance(m, FSDPModule):
                    m.set_gradient_divide_factor(1.0)  # each loss is divided by the count
            return
        self.mine = list(self.plan.indices(rank, world))
        enable(model)
        self.tree = GradientTree(model.parameters(), self.plan, world)
        if cuda_semantics(device):
            # the kernels must not pick their reduction order at run time either (cuBLAS needs
            # a fixed workspace for that: CUBLAS_WORKSPACE_CONFIG, set by train() before CUDA)
            torch.use_deterministic_algorithms(True)
            # which would also fill every new tensor (torch.empty: the flat gather and reduce
            # buffers, --elastic's pinned copies), though each is written whole before it is
            # read; no value read depends on uninitialised memory (the fill counter of
            # NOTE [Kernel contracts] checks the first, the same bits at every world size the
            # second)
            torch.utils.deterministic.fill_uninitialized_memory = False  # type: ignore[attr-defined]

    def describe(self) -> str:
        """The run line's words for the micro-batches."""
        how = "sums in a fixed order (--deterministic)" if self.fixed_order else "plain sums"
        return (
            f"{self.plan.count} micro-batches of {self.plan.micro_batch} x {self.seq_len} per "
            f"step, {len(self.mine)} per rank, {how}"
        )

    def run(self, model: nn.Module, step: int, poison: bool) -> torch.Tensor:
        """Forward and backward of this rank's micro-batches of the step's global batch; the
        step's mean loss (float64, the same on every rank)."""
        x, y = self.sampler.next_batch()
        values = []
        for k, i in enumerate(self.mine):
            rows = self.plan.rows(i)
            seed_micro_batch(self.seed, step, i)
            xb, yb = to_device(x[rows], self.device), to_device(y[rows], self.device)
            if self.tree is None:  # plain sums: reduce once, after the last micro-batch
                model.set_requires_gradient_sync(k == len(self.mine) - 1)  # type: ignore[operator]
            loss = lm_loss(model, xb, yb) / self.plan.count
            if poison:
                loss = loss * float("nan")
            loss.backward()
            if self.tree is not None:
                self.tree.push()
            values.append(loss.detach().double())
        if self.tree is not None:
            self.tree.finish()
        return sum_over_micro_batches(values)

    def _val_batches(self, val_tokens: Any, count: int) -> tuple[list[Batch], int]:
        """This rank's validation micro-batches (padded to the same number on every rank) and
        how many there are in all: up to ``count`` consecutive ones of the validation stream."""
        every = eval_batches(val_tokens, self.seq_len, self.plan.micro_batch, count)
        if not every:
            return [], 0
        per_rank = -(-len(every) // self.world)
        mine = [s * self.world + self.rank for s in range(per_rank)]
        return [every[i] if i < len(every) else every[0] for i in mine], len(every)

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> float | None:
        """The mean validation loss over the global validation micro-batches, in fixed order."""
        if not self.val_count:
            return None
        model.eval()
        values = [
            lm_loss(model, to_device(x, self.device), to_device(y, self.device)).detach().double()
            for x, y in self.val
        ]
        model.train()
        total = sum_over_micro_batches(values, count=self.val_count)
        return float(total) / self.val_count

    def mean_loss(self, losses: list[float]) -> float:
        """Each step's loss is the same global figure on every rank already."""
        return sum(losses) / len(losses) if losses else float("nan")
