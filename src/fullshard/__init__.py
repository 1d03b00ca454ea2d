"""fullshard: fully sharded data parallel (FSDP) training for PyTorch, from first principles.

Swap ``from torch.distributed.fsdp import fully_shard`` for ``from fullshard import fully_shard``.
"""

from fullshard.checkpoint.state_dict import broadcast_from_rank0, get_state_dict, set_state_dict
from fullshard.engine.api import (
    FSDPModule,
    UnshardHandle,
    fully_shard,
    register_fsdp_forward_method,
)
from fullshard.engine.gradients import ShardedGradScaler, clip_grad_norm_
from fullshard.engine.parallelize import parallelize
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
    "ShardedGradScaler",
    "ShardingStrategy",
    "UnshardHandle",
    "broadcast_from_rank0",
    "clip_grad_norm_",
    "fully_shard",
    "get_state_dict",
    "set_state_dict",
    "parallelize",
    "register_fsdp_forward_method",
]
__version__ = "0.1.0"
