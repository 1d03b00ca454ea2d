"""fullshard: fully sharded data parallel (FSDP) training for PyTorch, from first principles.

Swap ``from torch.distributed.fsdp import fully_shard`` for ``from fullshard import fully_shard``.
"""

# The public names are loaded on first use (PEP 562): importing any submodule runs this file
# first, and the ``fullshard`` launcher (``fullshard.app.cli``) must not pay for the engine,
# DTensor and torch.distributed.checkpoint (seconds of import) that only its ranks need.
# ``from fullshard import fully_shard`` and ``fullshard.fully_shard`` still import them then.

from __future__ import annotations

from typing import TYPE_CHECKING

from fullshard._lazy import lazy_exports

if TYPE_CHECKING:  # the real imports, for type checkers and IDEs
    from fullshard.checkpoint.state_dict import (
        broadcast_from_rank0,
        get_state_dict,
        set_state_dict,
    )
    from fullshard.engine.api import (
        FSDPModule,
        GradientReductionHandle,
        UnshardHandle,
        fully_shard,
        register_fsdp_forward_method,
        share_comm_ctx,
    )
    from fullshard.engine.gradients import ShardedGradScaler, clip_grad_norm_
    from fullshard.engine.install import Installed, install
    from fullshard.engine.parallelize import apply_plan, parallelize
    from fullshard.engine.schedule import Point
    from fullshard.engine.sharding import (
        ShardingPlan,
        UnitView,
        plan_sharding,
        step_schedule,
        subscribe,
        units,
    )
    from fullshard.policies import (
        CPUOffloadPolicy,
        DataParallelMeshDims,
        FullshardError,
        MixedPrecisionPolicy,
        OffloadPolicy,
        ShardingStrategy,
    )

__all__ = [
    "CPUOffloadPolicy",
    "DataParallelMeshDims",
    "FSDPModule",
    "FullshardError",
    "GradientReductionHandle",
    "Installed",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "Point",
    "ShardingPlan",
    "ShardedGradScaler",
    "ShardingStrategy",
    "UnitView",
    "UnshardHandle",
    "apply_plan",
    "broadcast_from_rank0",
    "clip_grad_norm_",
    "fully_shard",
    "get_state_dict",
    "install",
    "set_state_dict",
    "share_comm_ctx",
    "parallelize",
    "plan_sharding",
    "register_fsdp_forward_method",
    "step_schedule",
    "subscribe",
    "units",
]
__version__ = "0.1.0"

# public name -> the module that defines it (the TYPE_CHECKING imports above, as data)
_SOURCES = {
    "broadcast_from_rank0": "fullshard.checkpoint.state_dict",
    "get_state_dict": "fullshard.checkpoint.state_dict",
    "set_state_dict": "fullshard.checkpoint.state_dict",
    "FSDPModule": "fullshard.engine.api",
    "GradientReductionHandle": "fullshard.engine.api",
    "UnshardHandle": "fullshard.engine.api",
    "fully_shard": "fullshard.engine.api",
    "register_fsdp_forward_method": "fullshard.engine.api",
    "share_comm_ctx": "fullshard.engine.api",
    "ShardedGradScaler": "fullshard.engine.gradients",
    "clip_grad_norm_": "fullshard.engine.gradients",
    "Installed": "fullshard.engine.install",
    "install": "fullshard.engine.install",
    "apply_plan": "fullshard.engine.parallelize",
    "parallelize": "fullshard.engine.parallelize",
    "Point": "fullshard.engine.schedule",
    "ShardingPlan": "fullshard.engine.sharding",
    "UnitView": "fullshard.engine.sharding",
    "plan_sharding": "fullshard.engine.sharding",
    "step_schedule": "fullshard.engine.sharding",
    "subscribe": "fullshard.engine.sharding",
    "units": "fullshard.engine.sharding",
    "CPUOffloadPolicy": "fullshard.policies",
    "DataParallelMeshDims": "fullshard.policies",
    "FullshardError": "fullshard.policies",
    "MixedPrecisionPolicy": "fullshard.policies",
    "OffloadPolicy": "fullshard.policies",
    "ShardingStrategy": "fullshard.policies",
}
# The eager file made these attributes as a side effect of its imports (``import fullshard;
# fullshard.engine.api``); keep that working for the subpackages and modules it loaded.
_SUBMODULES = frozenset({"checkpoint", "engine", "optim", "policies"})


__getattr__, __dir__ = lazy_exports(__name__, globals(), _SOURCES, submodules=_SUBMODULES)
