"""Policies and small types: the vocabulary every other layer speaks (layer 1).

Everything here is a frozen dataclass or an enum; nothing imports from the rest of fullshard.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class FullshardError(RuntimeError):
    """An error fullshard raises on every rank: what is wrong, where, and what to do."""


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
