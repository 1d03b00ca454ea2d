"""The parallel dimensions of a run: world, data parallel, tensor parallel, local ranks, the
shard group and the mesh shape, in one object.

:meth:`ParallelDims.from_env` is the one place the application reads torchrun's ``WORLD_SIZE``
and ``LOCAL_WORLD_SIZE``; the command line builds the object once and hands it to validation,
the launcher, the trainer and the sharding (``fullshard.app.models.wrap``), so no two of them can
disagree about ``world // tp`` or the hybrid default.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from fullshard.app.errors import ConfigError

__all__ = ["ParallelDims", "under_torchrun"]


def under_torchrun() -> bool:
    """True when a launcher already set this process's rank and world size."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


@dataclass(frozen=True)
class ParallelDims:
    """How a run's ranks split the work (see the module docstring).

    ``tp`` consecutive ranks split each block's matrices; the ``world // tp`` data-parallel
    ranks shard (and, for ``no_shard`` and the hybrid strategies, replicate) as ``strategy``
    says. ``shard_size`` is ``--shard-size`` as given (0: the engine's default for the hybrid
    strategies, :func:`fullshard.engine.sharding.hybrid_shard_size`).
    """

    world: int  # ranks in the job
    local_world: int  # ranks on this machine
    tp: int = 1
    strategy: str = "full_shard"
    shard_size: int = 0

    @classmethod
    def from_env(
        cls, default_world: int, *, tp: int = 1, strategy: str = "full_shard", shard_size: int = 0
    ) -> ParallelDims:
        """The dimensions of this job: torchrun's ``WORLD_SIZE`` and ``LOCAL_WORLD_SIZE`` under
        torchrun, else ``default_world`` ranks about to be launched on this machine."""
        if under_torchrun():
            world = int(os.environ["WORLD_SIZE"])
            local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        else:
            world = local = default_world
        return cls(world, local, tp, strategy, shard_size)

    @property
    def dp(self) -> int:
        """Data-parallel ranks: the ones that see different batches."""
        return self.world // self.tp

    @property
    def local_dp(self) -> int:
        """Data-parallel ranks on this machine (at least 1)."""
        return max(self.local_world // self.tp, 1)

    def dp_rank(self, rank: int) -> int:
        """The data-parallel rank of global ``rank`` (TP is innermost: consecutive ranks)."""
        return rank // self.tp

    @property
    def hybrid(self) -> bool:
        return self.strategy.startswith("hybrid")

    def shard_group(self) -> int:
        """Ranks one parameter is split over: 1 for ``no_shard``, the hybrid group, else every
        data-parallel rank. Raises :class:`~fullshard.policies.FullshardError` when a hybrid
        strategy has no valid group on these ranks."""
        if self.strategy == "no_shard":
            return 1
        if self.hybrid:
            from fullshard.engine.sharding import hybrid_shard_size

            return hybrid_shard_size(self.dp, self.shard_size, self.local_dp)
        return self.dp

    def checked_shard_group(self) -> int:
        """:meth:`shard_group`, its refusal an input error in the flags' words (validation
        asks it before launch, where the ranks' engine would refuse the group)."""
        from fullshard.policies import FullshardError

        try:
            return self.shard_group()
        except FullshardError as exc:
            raise ConfigError(f"--strategy {self.strategy}: {exc}") from None

    def mesh_shape(self) -> tuple[int, ...]:
        """``(dp,)``, or ``(replicas, shard)`` for ``no_shard`` and hybrid, with ``tp`` last
        when tensor parallel is on (the order ``fullshard.app.models.tensor_parallel`` builds)."""
        group = self.shard_group()
        shape: tuple[int, ...] = (
            (self.dp // group, group) if self.strategy == "no_shard" or self.hybrid else (self.dp,)
        )
        return (*shape, self.tp) if self.tp > 1 else shape
