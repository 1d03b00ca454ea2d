"""Testing aids for fullshard (layer 1: they import nothing else from fullshard, so every layer
may use them).

``fullshard.testing.cuda_emulation()`` runs code written for CUDA streams on CPU tensors and
checks CUDA's ordering rules, and counts host synchronisations (``emulation.py``). Under it
the engine takes its CUDA path (NOTE [The CUDA path on CPU] in ``comm/device.py``);
``FULLSHARD_CUDA_EMULATION=1`` does the same for ``fullshard train``.
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
