"""How the application shards a built model: from a strategy name to a sharding plan, applied.

The trainer, trace, bench and ``plan --check`` shard through :func:`shard_model`, so they all read
one :class:`~fullshard.engine.sharding.ShardingPlan` (the same units, the same hybrid default).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from fullshard import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
)
from fullshard.app.config import ParallelismConfig, reshard_after_forward_arg
from fullshard.app.dims import ParallelDims
from fullshard.engine.gradients import scale_, total_norm
from fullshard.engine.parallelize import (
    apply_plan,
    mesh_device_type,
)
from fullshard.engine.sharding import ShardingPlan, plan_sharding
from fullshard.policies import FullshardError

__all__ = [
    "MIXED_PRECISION_DTYPES",
    "clip_gradients",
    "gradient_norm",
    "convert_float8",
    "float8_missing",
    "set_gradient_sync",
    "shard_model",
]

MIXED_PRECISION_DTYPES = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def shard_model(
    model: nn.Module,
    parallelism: ParallelismConfig,
    unit_types: Iterable[type[nn.Module]],
    *,
    dims: ParallelDims | None = None,
) -> ShardingPlan:
    """Shard ``model`` as ``parallelism`` (the ``[parallelism]`` section of ``fullshard train``'s
    config) says: every submodule of a type in ``unit_types`` becomes one unit, then the root.

    ``strategy`` is a ``ShardingStrategy`` name; the hybrid ones shard inside groups of
    ``shard_size`` ranks (0: :func:`~fullshard.engine.sharding.hybrid_shard_size`) and replicate
    across the groups. ``tp`` > 1: tensor parallel over that many consecutive ranks inside each
    block first (``fullshard.app.models.tensor_parallel``), the strategy over the rest. ``float8``:
    :func:`convert_float8` first. ``reshard_after_forward`` (``--reshard-after-forward``): what
    the blocks do after forward, ``fully_shard``'s argument (unset: the strategy's).
    ``cpu_offload``: shard with :class:`~fullshard.CPUOffloadPolicy`. ``dims``: the run's
    parallel dimensions, whose ``tp`` and ``shard_size`` then replace the section's (default:
    the process group's world and torchrun's environment). A model built with
    ``lazy_weights`` is materialised and loaded after sharding
    (:func:`fullshard.app.models.hf.load_pending`). Returns the plan that was applied.
    """
    p = parallelism
    dtype = MIXED_PRECISION_DTYPES[p.mixed_precision]
    # Gradients are reduced in float32 even when computing in bf16/fp16: summing N ranks' low
    # precision gradients loses bits that the float32 master weights would keep.
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None)
    types = tuple(unit_types)
    if not any(isinstance(m, types) and m is not model for m in model.modules()):
        raise ValueError(f"model {type(model).__name__} has no submodule of type {types}")
    if dims is None:
        dims = ParallelDims.from_env(
            dist.get_world_size(), tp=p.tp, strategy=p.strategy, shard_size=p.shard_size
        )
    tp = dims.tp
    if p.float8:
        if tp > 1:  # the engine refuses hooked TP-local tensors (FSDP2 supports them)
            raise FullshardError("--float8 with --tp is not supported yet; drop one of them")
        convert_float8(model, types)
    plan = plan_sharding(
        model,
        p.strategy,
        types,
        dims.dp,
        shard_size=dims.shard_size,
        local_world_size=dims.local_dp,
    )
    mesh = None
    if tp > 1:
        from fullshard.app.models.tensor_parallel import apply_tensor_parallel, meshes

        mesh, tp_mesh = meshes(plan, tp, mesh_device_type(model))
        apply_tensor_parallel(model, plan.unit_modules(model), tp_mesh)
    # the engine puts the units where the model is (a GPU shared over gloo included), or on
    # the GPU when the backend moves only CUDA tensors
    apply_plan(
        model,
        plan,
        mesh=mesh,
        mp_policy=mp,
        activation_checkpointing=p.activation_checkpointing,
        offload_policy=CPUOffloadPolicy() if p.cpu_offload else None,
        reshard_after_forward=reshard_after_forward_arg(p.reshard_after_forward),
    )
    from fullshard.app.models.hf import load_pending

    load_pending(model)  # a lazily built checkpoint: each rank reads its own rows now
    return plan


def float8_missing() -> str:
    """Why ``--float8`` cannot run here ('' when it can): torchao is an optional dependency."""
    if importlib.util.find_spec("torchao") is not None:
        return ""
    return (
        "--float8 trains linear layers with torchao's float8 training (Float8Linear, float8 "
        "all-gather), but torchao is not installed. Install it on every node: "
        "pip install torchao (or pip install 'fullshard[float8]'), or drop --float8."
    )


def convert_float8(model: nn.Module, unit_types: tuple[type[nn.Module], ...]) -> list[str]:
    """Swap the ``nn.Linear`` layers inside the units for torchao's ``Float8Linear`` whose
    weights all-gather as float8 (NOTE [All-gather extensions]); returns their names.

    Left in high precision, as torchtitan does: layers outside the units (e.g. the output head),
    layers whose sizes are not multiples of 16 (float8 matmul needs them) and weights tied to
    another module (swapping would untie them). Raises on every rank without torchao.
    """
    missing = float8_missing()
    if missing:
        raise FullshardError(f"rank {dist.get_rank()}: {missing}")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    inside = {id(m) for u in model.modules() if isinstance(u, unit_types) for m in u.modules()}
    seen: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        seen[id(p)] = seen.get(id(p), 0) + 1
    chosen: list[str] = []

    def keep(mod: nn.Module, fqn: str) -> bool:
        ok = (
            isinstance(mod, nn.Linear)
            and id(mod) in inside
            and mod.in_features % 16 == 0
            and mod.out_features % 16 == 0
            and seen.get(id(mod.weight), 0) == 1
        )
        if ok:
            chosen.append(fqn)
        return ok

    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    convert_to_float8_training(model, config=config, module_filter_fn=keep)
    for name in frozen:  # torchao's from_float makes frozen weights trainable (pytorch/ao#1871)
        model.get_parameter(name).requires_grad_(False)
    return chosen


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Turn gradient reduce-scatter on/off (off for all but the last accumulation micro-batch)."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)


def gradient_norm(parameters: Iterable[torch.Tensor], *, fixed_order: bool = False) -> torch.Tensor:
    """The global 2-norm of the gradients across all ranks' shards (float64, on the device the
    collectives run on); the gradients are left as they are. Call on every rank: the norm is a
    collective over the shards. ``fixed_order``: the norm of ``fullshard.deterministic`` (the
    same bits at every world size)."""
    if fixed_order:
        from fullshard.deterministic import total_norm as fixed_order_norm

        return fixed_order_norm(parameters)
    return total_norm(list(parameters))


def clip_gradients(
    parameters: Iterable[torch.Tensor], max_norm: float, norm: torch.Tensor | float
) -> None:
    """Scale the gradients to a global norm of at most ``max_norm`` (``<= 0``: no clipping),
    given their ``norm`` from :func:`gradient_norm`: the device tensor itself (nothing is read
    on the host), or the float the host has read (gradients on the host, CPU offload)."""
    if max_norm > 0:
        scale_(parameters, max_norm, norm)
