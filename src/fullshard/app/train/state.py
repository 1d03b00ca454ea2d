"""The train state: what one rank trains with and continues from, for disk checkpoints and for
live recovery alike.

:class:`TrainState` holds the model, its optimizer and schedule (with the device schedule of
the device-decided step), the data sampler, the step and the skipped steps. It is a
``Stateful`` (``state_dict`` / ``load_state_dict``), which is what DCP saves and loads; its
:class:`LoopState` (everything besides the model and optimizer) is the one schema that a disk
checkpoint and a live-recovery copy hold.

A checkpoint's loop state is gathered from every rank (each sampler's position and CPU
generator), so DCP stores it once; a live-recovery copy is taken on every rank alike (the
global sampler's one position, valid at any world size). On resume at the same world size
each rank continues exactly where it stopped, so N steps + resume + M steps equals N + M
uninterrupted steps; at another world size (default sampler) each rank's sampler is
fast-forwarded by the batches already drawn.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch import nn

from fullshard import get_state_dict, set_state_dict
from fullshard.app.config import CheckpointConfig
from fullshard.app.data.corpus import RankBatches
from fullshard.app.errors import ConfigError
from fullshard.app.train.verdict import DeviceSchedule
from fullshard.checkpoint import CheckpointManager, latest_checkpoint
from fullshard.checkpoint.store import MANIFEST, CheckpointCorrupt
from fullshard.comm import control

__all__ = ["LoopState", "TrainCheckpoints", "TrainState"]


@dataclass
class LoopState:
    """Everything besides the model and optimizer that a run continues from."""

    step: int
    world_size: int
    scheduler: dict[str, Any]
    # every rank's position; one entry for the global sampler (the same on every rank)
    samplers: list[dict[str, Any]] = field(default_factory=list)
    rng: list[torch.Tensor] = field(default_factory=list)  # every rank's CPU generator, or none
    skipped: list[int] = field(default_factory=list)  # steps skipped as non-finite
    # the device schedule's count of applied steps (NOTE [The step's verdict on the device]):
    # a device tensor, copied with the shards and never read on the host in a step
    applied: torch.Tensor | None = None

    def to_dict(self) -> dict[str, Any]:
        """As a dict (what a live-recovery copy carries; tensors as they are)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_saved(cls, saved: Any) -> LoopState:
        """From :meth:`to_dict`'s form, or from the object a checkpoint pickled: this class,
        or the ``RunState`` of checkpoints written before the app was split (step, world size,
        schedule, samplers, rng)."""
        if isinstance(saved, dict):
            return cls(**saved)
        return cls(
            **{f.name: getattr(saved, f.name) for f in fields(cls) if hasattr(saved, f.name)}
        )


class _LegacyRunState:
    """What ``fullshard.app.checkpointing.RunState`` unpickles to (see
    :meth:`LoopState.from_saved`)."""


class _LegacyModule:
    RunState = _LegacyRunState


# checkpoints written before app/ was split into subpackages pickled that class by this name
sys.modules.setdefault("fullshard.app.checkpointing", _LegacyModule)  # type: ignore[arg-type]


class TrainState:
    """What one rank trains with: model, optimizer, schedule, sampler, step, skipped steps.

    ``device_schedule``: the device-decided step's learning rates (``None`` where the host
    decides). A ``Stateful``: :meth:`state_dict` is what a checkpoint saves (call on every
    rank: the loop state is gathered).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LambdaLR,
        sampler: RankBatches,
        device_schedule: DeviceSchedule | None = None,
    ) -> None:
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.sampler, self.device_schedule = sampler, device_schedule
        self.step = 0  # optimizer steps taken (or skipped) so far
        self.skipped: list[int] = []

    # -- the loop state -------------------------------------------------------------------------
    def loop_state(self, *, gather: bool) -> LoopState:
        """This run's loop state; ``gather``: every rank's sampler and generator (a
        collective: a checkpoint), else this rank's global sampler alone (a live-recovery copy,
        the same on every rank)."""
        applied = None
        if gather:  # (a checkpoint's schedule holds the count: TrainState.state_dict)
            samplers = control.all_gather_objects(self.sampler.state_dict())
            rng = control.all_gather_objects(torch.get_rng_state())
        else:
            samplers, rng = [self.sampler.state_dict()], []
            if self.device_schedule is not None:
                applied = self.device_schedule.applied
        return LoopState(
            self.step,
            control.world_size(),
            self.scheduler.state_dict(),
            samplers,
            rng,
            list(self.skipped),
            applied,
        )

    def apply(self, loop: LoopState) -> None:
        """Continue from ``loop``: step, schedule (on the device too), sampler position (and,
        at the same world size, this rank's generator), skipped steps."""
        self.step = loop.step
        self.skipped[:] = loop.skipped
        self.scheduler.load_state_dict(loop.scheduler)
        if self.sampler.world_independent:  # the global sampler: one position for every rank
            self.sampler.load_state_dict(loop.samplers[0])
        elif loop.world_size == control.world_size():
            self.sampler.load_state_dict(loop.samplers[control.rank()])
            torch.set_rng_state(loop.rng[control.rank()])
        else:
            for _ in range(loop.samplers[0]["batches_drawn"]):
                self.sampler.next_batch()
        if self.device_schedule is not None:
            if loop.applied is not None:  # (read once: a restore, not a step)
                self.scheduler.last_epoch = int(loop.applied.item())
            self.device_schedule.reload()

    # -- Stateful, for DCP ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Model and optimizer shards (DTensors) and the gathered loop state, one object that
        DCP pickles once (call on every rank). A device schedule is written as floats, as
        without one (one host read)."""
        ds = self.device_schedule
        with contextlib.nullcontext() if ds is None else ds.as_floats():
            model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
            return {"model": model_sd, "optim": optim_sd, "run": self.loop_state(gather=True)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
        )
        self.apply(LoopState.from_saved(state["run"]))


class TrainCheckpoints:
    """Saving and resuming one training run (call every method on every rank)."""

    def __init__(
        self,
        root: str,
        state: TrainState,
        checkpoint: CheckpointConfig,
        *,
        hook: Callable[[str, int], None] | None = None,
    ) -> None:
        """``checkpoint``: the ``[checkpoint]`` section (``--keep``, ``--async-save``);
        ``root``: the folder the run's checkpoints go to."""
        self.root, self.state = root, state
        keep, async_save = checkpoint.keep, checkpoint.async_save
        self.manager = CheckpointManager(root, keep=keep, async_save=async_save, hook=hook)
        self.last_saved = -1

    def save(self, step: int) -> str:
        """Checkpoint after ``step`` optimizer steps (committed atomically)."""
        self.last_saved = step
        # (--optimizer: a resume with the other one is refused before launch, commands/train.py)
        optimizer = type(self.state.optimizer).__name__.lower()
        meta = {"world_size": control.world_size(), "optimizer": optimizer}
        return self.manager.save(step, self.state.state_dict(), meta=meta)

    def wait(self) -> None:
        self.manager.wait()

    def resolve(self, resume: str) -> str | None:
        """The checkpoint folder ``--resume`` names (``latest``, a checkpoint, or a root)."""
        if resume == "latest":
            return latest_checkpoint(self.root)
        if os.path.isfile(os.path.join(resume, MANIFEST)):
            return resume
        return latest_checkpoint(resume)

    def resume(self, resume: str) -> int:
        """Load the checkpoint ``resume`` names; returns the step it was taken after."""
        folder = self.resolve(resume)
        template = self.state.state_dict()  # what DCP loads into (shards in place)
        try:
            self.manager.load(template, folder)
        except CheckpointCorrupt as exc:
            # bad input, the same verdict on every rank (NOTE [Input errors on the ranks])
            raise ConfigError(
                f"--resume {resume}: {exc}. Nothing was changed: resume from an earlier "
                "checkpoint (--resume PATH), or drop --resume"
            ) from None
        loop = LoopState.from_saved(template["run"])
        saved = bool(loop.samplers[0].get("world_independent", False))
        if saved != self.state.sampler.world_independent:  # every rank reads it, and refuses
            how = "with" if saved else "without"
            raise ConfigError(
                f"--resume {resume}: {folder} was written {how} the global sampler (--deterministic "
                f"or --elastic), whose data position is {'one for all ranks' if saved else 'per rank'}"
                f": resume it {how} --deterministic or --elastic"
            )
        self.state.load_state_dict(template)
        self.last_saved = loop.step
        return loop.step
