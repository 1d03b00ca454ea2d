"""fullshard: fully sharded data parallel (FSDP) training for PyTorch, from first principles.

Swap ``from torch.distributed.fsdp import fully_shard`` for ``from fullshard import fully_shard``.
"""

from fullshard.checkpoint.state_dict import broadcast_from_rank0, get_state_dict, set_state_dict
from fullshard.engine.api import (
    FSDPModule,
    UnshardHandle,
    fully_shard,
    register_fsdp_forward_method,
    share_comm_ctx,
)
from fullshard.engine.gradients import ShardedGradScaler, clip_grad_norm_
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
    FullshardError,
    MixedPrecisionPolicy,
    OffloadPolicy,
    ShardingStrategy,
)

__all__ = [
    "CPUOffloadPolicy",
    "FSDPModule",
    "FullshardError",
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
