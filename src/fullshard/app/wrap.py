"""The one place the application touches the sharding API: wrap, sync control, clipping.

Everything the trainer needs from ``fullshard`` goes through these functions, so the whole
application can be pointed at another FSDP implementation (e.g. torch's FSDP2 for a comparison)
by editing this file alone.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from fullshard import FSDPModule, MixedPrecisionPolicy, clip_grad_norm_, fully_shard

__all__ = ["RESHARD_AFTER_FORWARD", "clip_gradients", "set_gradient_sync", "shard_model"]

# Strategy name -> reshard_after_forward for the block units. full_shard frees each block's
# gathered parameters after its forward and gathers them again for backward (least memory);
# shard_grad_op keeps them until backward (one all-gather per unit per step, more memory).
RESHARD_AFTER_FORWARD = {"full_shard": True, "shard_grad_op": False}

MIXED_PRECISION_DTYPES = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def shard_model(
    model: nn.Module,
    strategy: str,
    unit_types: Iterable[type[nn.Module]],
    *,
    mixed_precision: str = "none",
) -> nn.Module:
    """Shard ``model``: every submodule of a type in ``unit_types`` becomes one unit, then the root.

    Units are wrapped bottom-up (blocks before the root) because a unit owns exactly the
    parameters not already owned by a unit below it; the root keeps the rest (embeddings, final
    norm, head) and its default ``reshard_after_forward`` (it is needed again at once by backward).
    """
    if strategy not in RESHARD_AFTER_FORWARD:
        raise ValueError(
            f"unknown strategy {strategy!r}: choose one of {', '.join(RESHARD_AFTER_FORWARD)}"
        )
    dtype = MIXED_PRECISION_DTYPES[mixed_precision]
    # Gradients are reduced in float32 even when computing in bf16/fp16: summing N ranks' low
    # precision gradients loses bits that the float32 master weights would keep.
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None)
    types = tuple(unit_types)
    units = [m for m in model.modules() if isinstance(m, types) and m is not model]
    if not units:
        raise ValueError(f"model {type(model).__name__} has no submodule of type {types}")
    for unit in units:
        fully_shard(unit, reshard_after_forward=RESHARD_AFTER_FORWARD[strategy], mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return model


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Turn gradient reduce-scatter on/off (off for all but the last accumulation micro-batch)."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)


def clip_gradients(parameters: Iterable[torch.Tensor], max_norm: float) -> float:
    """Clip the global gradient norm across all ranks' shards; returns the norm before clipping.

    With ``max_norm <= 0`` only measures (clipping to infinity). Call on every rank: the norm is
    a collective over the shards.
    """
    limit = max_norm if max_norm > 0 else float("inf")
    norm = clip_grad_norm_(list(parameters), limit)
    return float(norm)
