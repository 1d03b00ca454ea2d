"""Count collectives at the c10d level: every c10d op passes the dispatcher, whoever issued it."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

KINDS = {
    "_allgather_base_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "allgather_": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "broadcast_": "broadcast",
    "alltoall_base_": "all_to_all",
}


# What fullshard's reduce-scatter is at the c10d level on gloo: an all-to-all of the same bytes
# followed by a local sum (NOTE [Reduce-scatter on gloo]).
RS = "all_to_all"


class C10dCounter(TorchDispatchMode):
    """Records each c10d op with the size in bytes of its *full* buffer.

    All-gather: the gathered output; reduce-scatter: the full input; all-reduce: the tensor.
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[str, int] = defaultdict(int)
        self.bytes: dict[str, int] = defaultdict(int)
        self.log: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.namespace == "c10d":
            name = func._opname
            kind = KINDS.get(name, name)
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            for a in args:
                if isinstance(a, (list, tuple)):
                    tensors += [t for t in a if isinstance(t, torch.Tensor)]
            if tensors:
                nbytes = max(t.numel() * t.element_size() for t in tensors)
                self.calls[kind] += 1
                self.bytes[kind] += nbytes
                self.log.append((kind, nbytes))
        return func(*args, **(kwargs or {}))
