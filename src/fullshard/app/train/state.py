"""What ``fullshard train`` saves to resume exactly, and how it resumes.

A checkpoint holds the model and optimizer shards (DTensors, resharded by DCP on load), and one
opaque ``RunState`` object with everything else a resumed run needs to continue *the same* run:
the step, the LR scheduler, every rank's data-sampler position and RNG state. ``RunState`` is
the same object on every rank (gathered before saving), so DCP stores it once.

On the same world size each rank continues exactly where it stopped, so N steps + resume + M
steps equals N + M uninterrupted steps. On another world size the data is split differently
anyway; each rank's sampler is fast-forwarded by the number of batches already drawn.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fullshard import get_state_dict, set_state_dict
from fullshard.app.data.corpus import RankBatches
from fullshard.app.errors import ConfigError
from fullshard.checkpoint import CheckpointManager, latest_checkpoint
from fullshard.checkpoint.store import MANIFEST, CheckpointCorrupt
from fullshard.comm import control

__all__ = ["RunState", "TrainCheckpoints"]


@dataclass
class RunState:
    """Everything besides the model and optimizer that a resumed run needs."""

    step: int
    world_size: int
    scheduler: dict[str, Any]
    samplers: list[dict[str, Any]] = field(default_factory=list)
    rng: list[torch.Tensor] = field(default_factory=list)


class TrainCheckpoints:
    """Saving and resuming one training run (call every method on every rank)."""

    def __init__(
        self,
        root: str,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        sampler: RankBatches,
        *,
        keep: int,
        async_save: bool,
    ) -> None:
        self.root = root
        self.model, self.optimizer, self.scheduler, self.sampler = (
            model,
            optimizer,
            scheduler,
            sampler,
        )
        self.manager = CheckpointManager(root, keep=keep, async_save=async_save)
        self.last_saved = -1

    def _state(self, step: int) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        run = RunState(
            step=step,
            world_size=control.world_size(),
            scheduler=self.scheduler.state_dict(),
            samplers=control.all_gather_objects(self.sampler.state_dict()),
            rng=control.all_gather_objects(torch.get_rng_state()),
        )
        return {"model": model_sd, "optim": optim_sd, "run": run}

    def save(self, step: int) -> str:
        """Checkpoint after ``step`` optimizer steps (committed atomically)."""
        self.last_saved = step
        return self.manager.save(step, self._state(step), meta={"world_size": control.world_size()})

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
        state = self._state(0)  # the template DCP loads into (shards in place)
        try:
            self.manager.load(state, folder)
        except CheckpointCorrupt as exc:
            # bad input, the same verdict on every rank (NOTE [Input errors on the ranks])
            raise ConfigError(
                f"--resume {resume}: {exc}. Nothing was changed: resume from an earlier "
                "checkpoint (--resume PATH), or drop --resume"
            ) from None
        run: RunState = state["run"]
        saved = bool(run.samplers[0].get("world_independent", False))
        if saved != self.sampler.world_independent:  # every rank reads the same, and refuses
            how = "with" if saved else "without"
            raise ConfigError(
                f"--resume {resume}: {folder} was written {how} the global sampler (--deterministic "
                f"or --elastic), whose data position is {'one for all ranks' if saved else 'per rank'}"
                f": resume it {how} --deterministic or --elastic"
            )
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
        )
        self.scheduler.load_state_dict(run.scheduler)
        rank = control.rank()
        if self.sampler.world_independent:  # the global sampler: one position for every rank
            self.sampler.load_state_dict(run.samplers[0])
        elif run.world_size == control.world_size():
            self.sampler.load_state_dict(run.samplers[rank])
            torch.set_rng_state(run.rng[rank])
        else:
            for _ in range(run.samplers[0]["batches_drawn"]):
                self.sampler.next_batch()
        self.last_saved = run.step
        return run.step
