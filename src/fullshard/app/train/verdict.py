"""The step's verdict: its loss, gradient norm, non-finite and stop votes (``agree_step``, the
one all-reduce every rank votes in), read on the host; the non-finite step policy
(``--on-nonfinite``: skip, or stop with :class:`NonFiniteError`).

NOTE [The step's verdict on the device]
Every step ends in four device values: the loss, the global gradient norm, the non-finite vote
and the stop vote (``agree_step``). The host needs them to skip a non-finite step, to stop
after a signal, and to log. On CPU reading them is free, so the trainer reads each step's row
at once, before the optimizer step, and decides there (``StepVerdicts(lag=0)``).

On a GPU that read would synchronise the host every step: the device would idle while the host
issues the optimizer step. So on the CUDA path (a GPU, or the CUDA emulation) the decisions
that change the weights are taken on the device, and the host reads the rows one step late:

- the optimizer is torch's fused AdamW; ``found_inf`` (the non-finite vote) makes it skip the
  step on the device, its step counts included;
- the learning rate is a device tensor, set each step from a device count of applied steps
  (``DeviceSchedule``), so a skipped step leaves the schedule where it was;
- each row is copied to pinned host memory behind an event; at the end of step k the host takes
  step k-1's row (``lag=1``), which the device has long finished: no wait. Every rank takes the
  same rows at the same steps, so the ranks agree on what they do with them;
- a step that logs, saves, stops or ends the run reads its own row (and any before) at once, and
  so does every step under ``--on-nonfinite stop``: those steps may synchronise once.

The effects: a non-finite step is reported (printed, logged) one step later, with its own step
number; a stop signal stops the run one step later than on CPU, after a complete step and its
checkpoint.

Not with CPU offload: there the optimizer's parameters live on the host, and a host kernel
given a device learning rate or ``found_inf`` would read them before their copies land (NOTE
[Kernel contracts] in ``fullshard.testing``). The host must wait for the offloaded gradients at
the end of backward anyway; it reads the step's row at once, as on CPU, and clips with the norm
it read (two synchronisations per step).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from fullshard.app.config import TrainingConfig
from fullshard.comm import control
from fullshard.comm.device import new_event
from fullshard.policies import FullshardError

__all__ = [
    "DeviceSchedule",
    "NonFiniteError",
    "StepBook",
    "StepVerdicts",
    "Verdict",
    "agree_step",
    "fused_adamw_available",
]


class NonFiniteError(FullshardError):
    """A step produced a non-finite loss or gradient and ``--on-nonfinite stop`` was asked."""


def agree_step(loss: torch.Tensor, grad_norm: torch.Tensor, stop: torch.Tensor) -> torch.Tensor:
    """``[non-finite, stop]``, the same on every rank: 1.0 in the first if any rank's loss or
    the global gradient norm is not finite; in the second the largest of the ranks' ``stop``
    flags (this rank's: 0, or the number of the stop signal it got; NOTE [Preemption]).

    One MAX all-reduce for both verdicts, on the device (no host read here): every rank skips
    the same step and stops after the same step, and the caller reads the votes together with
    the step's other figures in the step's one synchronisation. The gradient norm is already
    global (``clip_grad_norm_`` all-reduces it); voting on it too costs nothing. ``stop`` must
    already be on the device (filled there, not copied from the host).
    """
    finite = torch.isfinite(loss.detach()).all() & torch.isfinite(grad_norm.detach()).all()
    votes = torch.cat([(~finite).to(torch.float64).reshape(1), stop.to(torch.float64).reshape(1)])
    return control.all_reduce_values(votes, "max", what="step vote all-reduce")


@dataclass
class Verdict:
    """One step's row, on the host."""

    step: int
    loss: float
    grad_norm: float
    nonfinite: bool
    stop: float


class StepVerdicts:
    """Rows of device values (``[loss, grad norm, non-finite vote, stop vote]``), read ``lag``
    steps after they were made (NOTE [The step's verdict on the device])."""

    def __init__(self, lag: int) -> None:
        self.lag = lag
        self._pending: list[tuple[int, torch.Tensor, Any]] = []  # (step, host row, event)

    def push(self, step: int, row: torch.Tensor, now: bool) -> list[Verdict]:
        """Queue step ``step``'s row; return the rows to act on at this point: every pending
        one when ``now`` (or ``lag`` is 0), else those at least ``lag`` steps old."""
        if self.lag == 0:
            self._pending.append((step, row, None))
        else:
            host = torch.empty(row.shape, dtype=row.dtype, pin_memory=True)
            host.copy_(row, non_blocking=True)
            event = new_event()
            event.record()
            self._pending.append((step, host, event))
        return self.take(step if now or self.lag == 0 else step - self.lag)

    def take(self, upto: int) -> list[Verdict]:
        """The pending rows of steps ``<= upto``, read on the host (waiting where not landed)."""
        out = []
        while self._pending and self._pending[0][0] <= upto:
            step, host, event = self._pending.pop(0)
            if event is not None and not event.query():
                event.synchronize()
            loss, norm, nonfinite, stop = host.tolist()
            out.append(Verdict(step, loss, norm, nonfinite > 0, stop))
        return out

    def flush(self) -> list[Verdict]:
        return self.take(1 << 62)


class StepBook:
    """What the host does with each step's verdict: count its loss, or record (and report)
    the skipped step; note a stop vote."""

    def __init__(
        self,
        training: TrainingConfig,
        rank: int,
        skips_itself: bool,
        log: Any,
        losses: list[float],
        skipped: list[int],
    ) -> None:
        self.training, self.rank, self.skips_itself, self.log = training, rank, skips_itself, log
        self.losses, self.skipped = losses, skipped
        self.preempted, self.stop, self.grad_norm = False, 0.0, float("nan")

    def act(self, verdicts: list[Verdict]) -> bool:
        """Take ``verdicts`` in step order; whether the last one was a skipped step."""
        bad = False
        for v in verdicts:
            # fp16: the scaler decides skipping itself (it skips and rescales)
            bad = self.skips_itself and v.nonfinite
            self.grad_norm = v.grad_norm
            # a signal after the last step's vote changes nothing: the run is complete
            if v.stop > 0 and v.step < self.training.max_steps:
                self.preempted, self.stop = True, v.stop
            if not bad:
                self.losses.append(v.loss)
                continue
            # every rank reached the same verdict: no rank's parameters change that step
            self.skipped.append(v.step)
            if self.training.on_nonfinite == "stop":
                raise NonFiniteError(
                    f"rank {self.rank}: step {v.step} produced a non-finite loss or gradient "
                    f"(loss {v.loss}, gradient norm {v.grad_norm}); stopping "
                    "(--on-nonfinite stop). Lower --lr, check the data, or use "
                    "--on-nonfinite skip."
                )
            if self.log is not None:
                self.log.write({"step": v.step, "skipped": "non-finite loss or gradient"})
            if self.rank == 0:
                print(
                    f"step {v.step}: non-finite loss or gradient, optimizer step skipped",
                    flush=True,
                )
        return bad


def fused_adamw_available(device: torch.device) -> bool:
    """Whether torch has a fused AdamW for ``device`` (CUDA; CPU since torch 2.4)."""
    try:
        p = torch.nn.Parameter(torch.zeros(1, device="cuda" if device.type == "cuda" else "cpu"))
        p.grad = torch.zeros_like(p)
        torch.optim.AdamW([p], lr=0.0, fused=True).step()
    except (RuntimeError, ValueError, TypeError):
        return False
    return True


class DeviceSchedule:
    """A ``LambdaLR``'s schedule driven on the device: each group's learning rate is a device
    tensor, set every step from the device count of applied steps (a skipped step does not
    count). ``sched`` stays the state that checkpoints save (``as_floats`` writes the count
    there).

    The schedule's own function gives the multipliers, once, for steps ``0 .. total`` (a table
    on the device, indexed by the count; later steps keep the last value, as the function
    does): one formula, so the device's learning rates are the host's, rounded to float32."""

    def __init__(
        self,
        opt: torch.optim.Optimizer,
        sched: torch.optim.lr_scheduler.LambdaLR,
        multiplier: Callable[[int], float],
        total: int,
        device: torch.device,
    ) -> None:
        self.opt, self.sched = opt, sched
        self.base = [float(b) for b in sched.base_lrs]
        self.table = torch.tensor(
            [multiplier(s) for s in range(total + 1)], dtype=torch.float64, device=device
        )
        # the count of applied steps stays float64 (exact to 2**53); the learning rates are
        # float32, because CUDA's fused AdamW reads a tensor lr through a float pointer
        # (NOTE [Kernel contracts] in fullshard.testing: a float64 one stops the first step)
        self.applied = torch.full((), float(sched.last_epoch), dtype=torch.float64, device=device)
        self.lrs = []
        for group in opt.param_groups:
            lr = torch.full((), float(group["lr"]), dtype=torch.float32, device=device)
            group["lr"] = lr
            self.lrs.append(lr)

    def _set(self) -> None:
        """The learning rates at the current count (an index on the device: no host read)."""
        at = self.applied.clamp(max=len(self.table) - 1).long().reshape(1)
        m = self.table.gather(0, at).reshape(())
        for lr, base in zip(self.lrs, self.base, strict=True):
            lr.copy_(m * base)

    def step(self, ok: torch.Tensor) -> None:
        """After an optimizer step: count it when ``ok`` (1.0; 0.0 for a skipped step) and set
        the next step's learning rates; no host read."""
        self.applied += ok
        self._set()

    @contextlib.contextmanager
    def as_floats(self) -> Iterator[None]:
        """For a checkpoint: ``sched`` holds the applied-step count and the optimizer float
        learning rates, as without this class (a host read), then the device tensors again."""
        n = int(self.applied.item())
        self.sched.last_epoch = n
        self.sched._last_lr = [float(lr) for lr in self.lrs]  # type: ignore[attr-defined]
        for group, lr in zip(self.opt.param_groups, self.lrs, strict=True):
            group["lr"] = float(lr)
        try:
            yield
        finally:
            self._install()

    def reload(self) -> None:
        """After ``sched`` and the optimizer were loaded from a checkpoint: continue from its
        count, with device learning rates."""
        self.applied.fill_(float(self.sched.last_epoch))
        self._set()
        self._install()

    def _install(self) -> None:
        for group, lr in zip(self.opt.param_groups, self.lrs, strict=True):
            group["lr"] = lr
