"""How the application shards a built model: from a strategy name to a sharding plan, applied.

The trainer, trace, bench and ``plan --check`` shard through :func:`shard_model`, so they all read
one :class:`~fullshard.engine.sharding.ShardingPlan` (the same units, the same hybrid default).
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from fullshard import FSDPModule, MixedPrecisionPolicy, clip_grad_norm_
from fullshard.engine.parallelize import apply_plan, mesh_device_type
from fullshard.engine.sharding import ShardingPlan, plan_sharding

__all__ = [
    "MIXED_PRECISION_DTYPES",
    "clip_gradients",
    "set_gradient_sync",
    "shard_model",
]

MIXED_PRECISION_DTYPES = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def shard_model(
    model: nn.Module,
    strategy: str,
    unit_types: Iterable[type[nn.Module]],
    *,
    mixed_precision: str = "none",
    shard_size: int = 0,
    activation_checkpointing: bool = False,
    tp: int = 1,
) -> ShardingPlan:
    """Shard ``model``: every submodule of a type in ``unit_types`` becomes one unit, then the root.

    ``strategy`` is a ``ShardingStrategy`` name; the hybrid ones shard inside groups of
    ``shard_size`` ranks (0: :func:`~fullshard.engine.sharding.hybrid_shard_size`) and replicate
    across the groups. ``tp`` > 1: tensor parallel over that many consecutive ranks inside each
    block first (``fullshard.app.tensor_parallel``), the strategy over the rest. Returns the plan
    that was applied.
    """
    dtype = MIXED_PRECISION_DTYPES[mixed_precision]
    # Gradients are reduced in float32 even when computing in bf16/fp16: summing N ranks' low
    # precision gradients loses bits that the float32 master weights would keep.
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None)
    types = tuple(unit_types)
    if not any(isinstance(m, types) and m is not model for m in model.modules()):
        raise ValueError(f"model {type(model).__name__} has no submodule of type {types}")
    world = dist.get_world_size()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world)) // tp
    plan = plan_sharding(
        model, strategy, types, world // tp, shard_size=shard_size, local_world_size=max(local, 1)
    )
    mesh = None
    if tp > 1:
        from fullshard.app.tensor_parallel import apply_tensor_parallel, meshes

        mesh, tp_mesh = meshes(plan, tp, mesh_device_type(model))
        apply_tensor_parallel(model, plan.unit_modules(model), tp_mesh)
    # the engine puts the units where the model is (a GPU shared over gloo included), or on
    # the GPU when the backend moves only CUDA tensors
    apply_plan(
        model, plan, mesh=mesh, mp_policy=mp, activation_checkpointing=activation_checkpointing
    )
    return plan


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Turn gradient reduce-scatter on/off (off for all but the last accumulation micro-batch)."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)


def clip_gradients(parameters: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Clip the global gradient norm across all ranks' shards; returns the norm before clipping.

    With ``max_norm <= 0`` only measures (clipping to infinity). Call on every rank: the norm is
    a collective over the shards. The norm stays a tensor on the gradients' device: reading it
    is the caller's one synchronisation of the step.
    """
    limit = max_norm if max_norm > 0 else float("inf")
    return clip_grad_norm_(list(parameters), limit)
