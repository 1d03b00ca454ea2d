"""Testing aids for fullshard (layer 2: they implement ``fullshard.comm.runtime``'s device
runtime, and no production module imports them).

``fullshard.testing.cuda_emulation()`` runs code written for CUDA streams on CPU tensors and
checks CUDA's ordering rules and kernel contracts, and counts host synchronisations
(``emulation.py``). Under it the engine takes its CUDA path, the emulation being the device
runtime in use (NOTE [The CUDA path on CPU] in ``comm/runtime.py``);
``FULLSHARD_CUDA_EMULATION=1`` does the same for ``fullshard train``.
"""

# Names load on first use (PEP 562), like the other package ``__init__`` files: importing a
# package runs no more than the submodules a caller asks for.

from __future__ import annotations

from typing import TYPE_CHECKING

from fullshard._lazy import lazy_exports

if TYPE_CHECKING:  # the real imports, for type checkers and IDEs
    from fullshard.testing.emulation import (
        KernelContractError,
        StreamOrderError,
        VirtualEvent,
        VirtualStream,
        cuda_emulation,
        enabled_from_env,
        fill_counts,
        same_bits,
        sync_counts,
    )

__all__ = [
    "KernelContractError",
    "StreamOrderError",
    "VirtualEvent",
    "VirtualStream",
    "cuda_emulation",
    "enabled_from_env",
    "fill_counts",
    "same_bits",
    "sync_counts",
]


__getattr__, __dir__ = lazy_exports(
    __name__, globals(), dict.fromkeys(__all__, "fullshard.testing.emulation")
)
