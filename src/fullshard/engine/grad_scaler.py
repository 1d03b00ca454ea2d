"""A gradient scaler for fp16 over sharded gradients (layer 8).

``torch.amp.GradScaler`` checks this rank's gradients for inf/NaN. With sharded gradients each
rank sees only its slice, so one rank could skip the step while the others take it, and the
shards would silently diverge. ``ShardedGradScaler`` all-reduces the finding (MAX) so every rank
makes the same decision: all step, or all skip and lower the scale.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from fullshard.dist.collectives import all_reduce
from fullshard.dist.mesh import default_timeout


class ShardedGradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` whose inf/NaN decision is the same on every rank."""

    def __init__(
        self,
        device: str = "cuda",
        *,
        process_group: dist.ProcessGroup | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(device, **kwargs)
        self.process_group = process_group

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        super().unscale_(optimizer)
        if not self._enabled:
            return
        state = self._per_optimizer_states[id(optimizer)]
        found: dict[torch.device, torch.Tensor] = state["found_inf_per_device"]
        if not found:  # a rank whose shards are all empty still takes part in the decision
            assert self._scale is not None
            found[self._scale.device] = torch.zeros(1, device=self._scale.device)
        total = torch.stack([v.reshape(()).float() for v in found.values()]).max().reshape(1)
        all_reduce(
            total,
            self.process_group,
            op=dist.ReduceOp.MAX,
            what="ShardedGradScaler inf/NaN all-reduce",
            timeout=default_timeout(),
        ).wait()
        for v in found.values():
            v.copy_(total.to(v.device).reshape(v.shape))
