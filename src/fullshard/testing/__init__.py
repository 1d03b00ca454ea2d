"""Testing aids for fullshard (layer 1: they import nothing else from fullshard, so every layer
may use them).

``fullshard.testing.cuda_emulation()`` runs code written for CUDA streams on CPU tensors and
checks CUDA's ordering rules, and counts host synchronisations (``emulation.py``). The engine
does not take its CUDA path under it yet (issue 17): today it checks code that uses its virtual
streams and events directly.
"""

from fullshard.testing.emulation import (
    StreamOrderError,
    VirtualEvent,
    VirtualStream,
    cuda_emulation,
    enabled_from_env,
    sync_counts,
)

__all__ = [
    "StreamOrderError",
    "VirtualEvent",
    "VirtualStream",
    "cuda_emulation",
    "enabled_from_env",
    "sync_counts",
]
