"""The ways a training step can run, each one small interface chosen once per build.

A step is: this rank's micro-batches forward and backward, the gradient norm, the ranks' votes
on it, and the optimizer step decided. Two choices vary:

- :class:`Batches`, which micro-batches run and how their gradients add up: :class:`Accumulate`
  (the default: ``--grad-accum`` micro-batches of this rank's sampler, reduced once) or
  :class:`~fullshard.app.train.fixed_order.GlobalBatches` (``--deterministic`` and
  ``--elastic``: the global batch's micro-batches, in a fixed order or plain sums);
- :class:`Decider`, who decides the optimizer step: :class:`HostStep` (the host reads the
  step's verdict at once and steps; on CPU, and with ``--cpu-offload``) or :class:`DeviceStep`
  (the CUDA path: the device skips a non-finite step and the host reads verdicts a step late,
  NOTE [The step's verdict on the device]).

``build.py`` picks one of each; the trainer's loop calls them without asking which.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from fullshard import ShardedGradScaler
from fullshard.app.models.gpt import lm_loss
from fullshard.app.models.wrap import clip_gradients, set_gradient_sync
from fullshard.app.train.state import TrainState
from fullshard.app.train.verdict import DeviceSchedule, StepBook, StepVerdicts
from fullshard.comm import control
from fullshard.comm.device import cuda_semantics

__all__ = ["Accumulate", "Batches", "Decider", "DeviceStep", "HostStep", "to_device"]


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device`` without waiting for the device: a pageable host-to-GPU copy blocks
    the host until the GPU has finished everything queued before it, so batches go through
    pinned memory, asynchronously (the caching host allocator keeps the pinned buffer alive
    until the copy has run)."""
    if not cuda_semantics(device):
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class Batches(Protocol):
    """A step's micro-batches, and validation."""

    fixed_order: bool  # the gradient norm of fullshard.deterministic (the same bits anywhere)

    def run(self, model: nn.Module, step: int, poison: bool) -> torch.Tensor:
        """Forward and backward of this rank's micro-batches of step ``step``; the step's loss
        on the device (``poison``: make it NaN, a fault drill)."""
        ...

    def evaluate(self, model: nn.Module) -> float | None:
        """The mean validation loss over every rank's batches (a collective)."""
        ...

    def mean_loss(self, losses: list[float]) -> float:
        """The mean of the logged steps' losses over the ranks (a collective, or none)."""
        ...

    def describe(self) -> str:
        """The run line's words for the batches."""
        ...


class Accumulate:
    """The default step: ``grad_accum`` micro-batches of this rank's sampler, the gradients
    reduce-scattered only on the last (earlier ones accumulate into the unsharded gradients
    locally); validation over this rank's own batches, averaged over the ranks."""

    fixed_order = False

    def __init__(
        self,
        sampler: Any,
        grad_accum: int,
        device: torch.device,
        scaler: ShardedGradScaler | None,
        val: list,
        words: str,
    ) -> None:
        self.sampler, self.grad_accum, self.device, self.scaler = (
            sampler,
            grad_accum,
            device,
            scaler,
        )
        self.val, self.words = val, words

    def run(self, model: nn.Module, step: int, poison: bool) -> torch.Tensor:
        """The rank's mean loss, on the device: no per-micro-batch ``float(loss)`` stalls the
        host."""
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for k in range(self.grad_accum):
            set_gradient_sync(model, k == self.grad_accum - 1)
            x, y = self.sampler.next_batch()
            loss = lm_loss(model, to_device(x, self.device), to_device(y, self.device))
            loss = loss / self.grad_accum
            if poison:
                loss = loss * float("nan")
            (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
            loss_sum += loss.detach().double()
        return loss_sum

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> float | None:
        if not self.val:
            return None
        model.eval()
        total = torch.zeros(2, dtype=torch.float64, device=self.device)
        for x, y in self.val:
            loss = lm_loss(model, to_device(x, self.device), to_device(y, self.device))
            total[0] += loss.double()
            total[1] += 1
        model.train()
        loss_sum, count = control.all_reduce_values(
            total, what="validation loss all-reduce"
        ).tolist()
        return loss_sum / count

    def mean_loss(self, losses: list[float]) -> float:
        total = control.all_reduce_values([sum(losses), len(losses)], what="loss all-reduce")
        loss_sum, count = total.tolist()
        return float(loss_sum / count)

    def describe(self) -> str:
        return self.words


class Decider(Protocol):
    """Who decides a step's optimizer step, from its row ``[loss, norm, non-finite, stop]``."""

    verdicts: StepVerdicts  # the rows, read ``lag`` steps after they were made

    def lr(self) -> Any:
        """The learning rate this step uses (a float, or a device tensor: read when logged)."""
        ...

    def step(
        self,
        row: torch.Tensor,
        norm: torch.Tensor,
        votes: torch.Tensor,
        step: int,
        urgent: bool,
        book: StepBook,
    ) -> bool:
        """Clip, step the optimizer (or skip) and the schedule, and have ``book`` act on the
        verdicts read now (``urgent``: this step's own too). Whether this step is known now to
        have been skipped."""
        ...


class HostStep:
    """The host decides: it reads the step's row at once (free on CPU; with ``--cpu-offload``
    on CUDA the host has waited for the gradients anyway), clips with the norm it read, and
    steps unless a rank's loss or the norm was not finite."""

    def __init__(self, state: TrainState, scaler: ShardedGradScaler | None, clip: float) -> None:
        self.state, self.scaler, self.clip = state, scaler, clip
        self.verdicts = StepVerdicts(lag=0)

    def lr(self) -> Any:
        return self.state.scheduler.get_last_lr()[0]

    def step(
        self,
        row: torch.Tensor,
        norm: torch.Tensor,
        votes: torch.Tensor,
        step: int,
        urgent: bool,
        book: StepBook,
    ) -> bool:
        s = self.state
        bad = book.act(self.verdicts.push(step, row, now=urgent))
        if self.scaler is not None or not bad:
            clip_gradients(s.model.parameters(), self.clip, book.grad_norm)
        if self.scaler is not None:  # it decides skipping itself (it skips and rescales)
            self.scaler.step(s.optimizer)
            self.scaler.update()
        elif not bad:
            s.optimizer.step()
        s.optimizer.zero_grad(set_to_none=True)
        if not bad:  # a skipped step leaves the schedule where it was, too
            s.scheduler.step()
        return bad


class DeviceStep:
    """The device decides (NOTE [The step's verdict on the device]): fused AdamW skips a
    non-finite step through ``found_inf``, the device schedule counts applied steps only, and
    the host reads each row a step late (at once on urgent steps)."""

    def __init__(
        self,
        state: TrainState,
        schedule: DeviceSchedule,
        scaler: ShardedGradScaler | None,
        clip: float,
    ) -> None:
        self.state, self.schedule, self.scaler, self.clip = state, schedule, scaler, clip
        self.verdicts = StepVerdicts(lag=1)

    def lr(self) -> Any:
        return self.schedule.lrs[0].clone()

    def step(
        self,
        row: torch.Tensor,
        norm: torch.Tensor,
        votes: torch.Tensor,
        step: int,
        urgent: bool,
        book: StepBook,
    ) -> bool:
        s = self.state
        clip_gradients(s.model.parameters(), self.clip, norm)
        if self.scaler is not None:
            self.scaler.step(s.optimizer)
            self.scaler.update()
        else:
            s.optimizer.found_inf = votes[0].float()  # type: ignore[attr-defined]
            s.optimizer.step()
        s.optimizer.zero_grad(set_to_none=True)
        self.schedule.step(1.0 - votes[0] if self.scaler is None else torch.ones_like(votes[0]))
        # this step's own verdict is known now only on urgent steps
        return book.act(self.verdicts.push(step, row, now=urgent)) and urgent
