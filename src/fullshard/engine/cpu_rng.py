"""Random initialisation of sharded parameters on CPU (layer 8).

NOTE [Init after sharding]
A model built on the meta device, sharded, materialised with ``to_empty`` and then initialised
(``reset_parameters()``, ``nn.init.normal_``) runs its random ops on DTensor parameters. On
CUDA-like devices DTensor's offset-based generator gives each rank its slice of *one* full
random tensor, for the same seed: fullshard's parameters are DTensors, so they get exactly what
FSDP2 gets. On CPU DTensor has no such generator (the CPU generator cannot be offset), and every
rank would draw the *same* shard from the same seed: FSDP2's result on CPU, and a model whose
rows repeat every 1/N. fullshard installs, for CPU-only processes, a small tracker that draws
each shard from its own seed (one draw of the shared generator, mixed with the shard's index),
so the shards are independent with the right distribution, replicas (HSDP) stay identical, and
the result is the same for the same seed. It is not bitwise equal to a one-process init.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

_GOLDEN = 0x9E3779B97F4A7C15  # odd constant: spreads the shard index over the seed space


class CPUShardRNG:
    """DTensor's RNG-tracker interface (``_distribute_region``) for CPU meshes."""

    def __init__(self) -> None:
        self._use_distribute_region = True

    @property
    def distribute_region_enabled(self) -> bool:
        return self._use_distribute_region

    @distribute_region_enabled.setter
    def distribute_region_enabled(self, value: bool) -> None:
        self._use_distribute_region = value

    @contextlib.contextmanager
    def _distribute_region(
        self, spec: Any, generator: torch.Generator | None = None
    ) -> Iterator[None]:
        gen = generator if generator is not None else torch.default_generator
        # one draw from the shared generator keeps every rank's generator in step
        base = int(torch.randint(0, 2**62, (1,), generator=gen).item())
        coords = spec.mesh.get_coordinate() or [0] * spec.mesh.ndim
        shard = 0
        for dim, placement in enumerate(spec.placements):
            if placement.is_shard():  # replicas of a shard draw the same values
                shard = shard * spec.mesh.size(dim) + coords[dim]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed((base + _GOLDEN * (shard + 1)) % (1 << 63))
            yield

    def _manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)


def install_cpu_shard_rng() -> None:
    """Use :class:`CPUShardRNG` for DTensor random ops when this process has no CUDA and no
    tracker was set up by someone else (NOTE [Init after sharding])."""
    if torch.cuda.is_available():
        return
    try:
        from torch.distributed.tensor import _random
    except ImportError:  # pragma: no cover - torch without the module
        return
    if getattr(_random, "_rng_tracker", None) is None:
        _random._rng_tracker = CPUShardRNG()  # type: ignore[assignment]
