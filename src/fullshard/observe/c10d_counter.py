"""Counting collectives at the c10d level (layer 10): every c10d op passes the dispatcher,
whoever issued it (fullshard, torch's FSDP2, DDP). ``fullshard bench`` reports what it counts;
the tests count with the same table (``tests/commcount.py`` re-exports it), so what bench calls
an all-gather is what the tests check.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["KINDS", "C10dCounter"]

# c10d op name -> collective kind. Bytes are the *full* buffer each collective covers: the
# all-gather output, the reduce-scatter input, the all-reduce tensor (the model-unit convention).
KINDS = {
    "_allgather_base_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "allgather_": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    # fullshard's reduce-scatter on gloo (NOTE [Reduce-scatter on gloo]): same bytes
    "alltoall_base_": "all_to_all",
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "broadcast_": "broadcast",
}


class C10dCounter(TorchDispatchMode):
    """Calls and bytes of each c10d op dispatched while active, by :data:`KINDS` (an op not in
    the table under its own name, unless ``known_only``), and the ops in order (``log``).

    The bytes are those of the op's largest tensor argument: the full buffer (see :data:`KINDS`).
    """

    def __init__(self, *, known_only: bool = False) -> None:
        super().__init__()
        self.known_only = known_only
        self.calls: dict[str, int] = defaultdict(int)
        self.bytes: dict[str, int] = defaultdict(int)
        self.log: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func._opname if func.namespace == "c10d" else None
        if name is not None and (name in KINDS or not self.known_only):
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            for a in args:
                if isinstance(a, (list, tuple)):
                    tensors += [t for t in a if isinstance(t, torch.Tensor)]
            if tensors:
                kind = KINDS.get(name, name)
                nbytes = max(t.numel() * t.element_size() for t in tensors)
                self.calls[kind] += 1
                self.bytes[kind] += nbytes
                self.log.append((kind, nbytes))
        return func(*args, **(kwargs or {}))
