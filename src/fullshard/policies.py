"""Policies and small types: the vocabulary every other layer speaks (layer 1).

Everything here is a frozen dataclass or an enum; nothing imports from the rest of fullshard.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class FullshardError(RuntimeError):
    """An error fullshard raises on every rank: what is wrong, where, and what to do."""


# Where FSDP2 raises a builtin exception, fullshard raises a ``FullshardError`` that is also an
# instance of that type, so code written against FSDP2 (``except ValueError``) still catches it.


class FullshardValueError(FullshardError, ValueError):
    """A bad argument or input, where FSDP2 raises ``ValueError``."""


class FullshardAssertionError(FullshardError, AssertionError):
    """A refused use, where FSDP2 raises ``AssertionError`` (deep copy, a module wrapped twice,
    a shard dim the parameter lacks)."""


class FullshardNotImplementedError(FullshardError, NotImplementedError):
    """What neither FSDP2 nor fullshard supports, where FSDP2 raises ``NotImplementedError``."""


class SharedParameterError(FullshardValueError):
    """A parameter is tied across two units (a ``ValueError`` too, as FSDP2 raises)."""


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes for gathering/computing, reducing gradients and casting outputs.

    Mirrors ``torch.distributed.fsdp.MixedPrecisionPolicy``. ``None`` everywhere means "train in
    the parameters' own dtype". When ``param_dtype`` is set and ``reduce_dtype`` is not, gradients
    are reduced in the parameters' own (master) dtype.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


@dataclass(frozen=True)
class OffloadPolicy:
    """Base offload policy: no offloading (parameters, gradients and optimizer stay on device)."""


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Keep sharded parameters, gradients and the optimizer step on CPU.

    Parameters are copied to the compute device when gathered. ``pin_memory`` pins the CPU shards
    so host-to-device copies can overlap with compute (ignored where CUDA is absent).
    """

    pin_memory: bool = True


class ShardingStrategy(enum.Enum):
    """FSDP1 vocabulary, mapped onto ``fully_shard`` arguments by :func:`fullshard.parallelize`."""

    # Shard parameters, gradients and optimizer state; free gathered parameters after forward.
    FULL_SHARD = "full_shard"
    # Like FULL_SHARD but keep gathered parameters from forward through backward (ZeRO-2).
    SHARD_GRAD_OP = "shard_grad_op"
    # Replicate everything and all-reduce gradients (plain data parallel).
    NO_SHARD = "no_shard"
    # 2-D mesh: shard inside a group, replicate across groups (FULL_SHARD inside).
    HYBRID_SHARD = "hybrid_shard"
    # 2-D mesh: shard inside a group, replicate across groups (SHARD_GRAD_OP inside).
    HYBRID_SHARD_ZERO2 = "hybrid_shard_zero2"

    @property
    def hybrid(self) -> bool:
        """Shards inside groups of ranks and replicates across them (a 2-D mesh)."""
        return self in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy.HYBRID_SHARD_ZERO2)

    @property
    def reshard_after_forward(self) -> bool:
        """Non-root units free their gathered parameters after forward (ZeRO-3) or keep them
        for backward (ZeRO-2; replication keeps everything anyway)."""
        return self in (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD)


# The strategy names every command accepts (``--strategy``), in the enum's order.
STRATEGY_NAMES = tuple(s.value for s in ShardingStrategy)

# Where a training step's memory goes: the one vocabulary of the memory tracker
# (``fullshard.observe.memory``), the planner (``fullshard.plan``) and their reports.
MEMORY_CATEGORIES = (
    "sharded_params",  # this rank's shards of every parameter (the fp32 master weights)
    "gradients",  # sharded gradients, plus unsharded ones until they are reduced
    "optimizer_state",  # the optimizer's per-parameter state (Adam: exp_avg, exp_avg_sq)
    "gathered_window",  # gathered (unsharded) parameters of the units in the window
    "activations",  # tensors autograd saved for backward
    "comm_buffers",  # all-gather outputs and reduce-scatter inputs/outputs in flight
)


class Phase(enum.Enum):
    """What a rank is doing in a step: the one vocabulary of the engine's gathers and
    prefetches, the schedule's points, the collective positions (desync tags), the memory
    tracker and the planner (FSDP2's ``TrainingState``)."""

    # A unit's forward: its gather, a forward prefetch, the points up to its free.
    FORWARD = "forward"
    # A unit's backward: its gather again (also for activation recomputation), a backward
    # prefetch, its reduce-scatter.
    BACKWARD = "backward"
    # The optimizer step (memory is sampled around it; no collective of the engine runs).
    OPTIMIZER = "optimizer"
    # Outside a step's forward and backward: ``FSDPModule.unshard()``, the root's lazy init, a
    # ``reshard()`` that must land a gather first.
    IDLE = "idle"


# The passes a step's peaks are reported for, in order (keys of the tracker's and planner's
# per-phase tables).
STEP_PHASES = tuple(p.value for p in (Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER))
