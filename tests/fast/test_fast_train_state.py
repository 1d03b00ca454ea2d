"""The train state's loop state: one schema for checkpoints and live-recovery copies, and the
checkpoints written before the app was split into folders still load."""

from __future__ import annotations

import pickle
import sys
import types
from dataclasses import dataclass, field

import pytest
import torch

from fullshard.app.train.state import LoopState

pytestmark = pytest.mark.fast


def test_a_live_recovery_copy_round_trips_as_a_dict() -> None:
    loop = LoopState(7, 4, {"last_epoch": 7}, [{"cursor": 3}], [], [5], torch.tensor(6.0))
    again = LoopState.from_saved(loop.to_dict())
    assert again.to_dict().keys() == loop.to_dict().keys()
    assert (again.step, again.skipped, float(again.applied)) == (7, [5], 6.0)  # type: ignore[arg-type]


def test_a_checkpoint_of_the_flat_app_still_loads() -> None:
    """Checkpoints before the split pickled ``fullshard.app.checkpointing.RunState``."""

    @dataclass
    class RunState:  # that class, as it was
        step: int
        world_size: int
        scheduler: dict
        samplers: list = field(default_factory=list)
        rng: list = field(default_factory=list)

    old = types.ModuleType("fullshard.app.checkpointing")
    RunState.__module__, RunState.__qualname__ = old.__name__, "RunState"
    old.RunState = RunState  # type: ignore[attr-defined]
    saved = sys.modules[old.__name__]
    sys.modules[old.__name__] = old
    try:
        blob = pickle.dumps(RunState(12, 2, {"last_epoch": 12}, [{"cursor": 1}, {"cursor": 2}]))
    finally:
        sys.modules[old.__name__] = saved  # what fullshard.app.train.state registered
    loop = LoopState.from_saved(pickle.loads(blob))
    assert (loop.step, loop.world_size, loop.samplers[1], loop.skipped, loop.applied) == (
        12,
        2,
        {"cursor": 2},
        [],
        None,
    )
