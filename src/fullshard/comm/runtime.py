"""The device runtime the CUDA code path talks to (layer 2): CUDA itself, or a checker's.

NOTE [The CUDA path on CPU]
Code written for CUDA streams (the engine's gather and reduce streams, the deferred desync
verdicts, pinned offload copies, stream-ordered collective waits) runs on a GPU, or on CPU
tensors under the CUDA emulation (``fullshard.testing.cuda_emulation``), where virtual streams
and events check CUDA's ordering rules and count host synchronisations. Every such branch asks
``cuda_semantics(device)`` and takes its streams and events from one handle, the
:class:`DeviceRuntime` in use (``comm.device``'s helpers delegate to it), so one code path is
both what runs on the GPU and what the emulation checks on CPU.

The handle is chosen once, for a process or a block: :class:`DeviceRuntime` is CUDA (and the
plain CPU, where nothing asks for streams); a checker installs its own with
:func:`use_runtime` for the block it watches. Production code never names the checker: a run
asks for one through the environment (:func:`runtime_from_env`), by the name of a factory
(``FULLSHARD_DEVICE_RUNTIME=module:function``; ``FULLSHARD_CUDA_EMULATION=1`` is the CUDA
emulation's short name), which is imported only then.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

__all__ = [
    "EMULATION_ENV",
    "RUNTIME_ENV",
    "DeviceRuntime",
    "runtime",
    "runtime_from_env",
    "use_runtime",
]

RUNTIME_ENV = "FULLSHARD_DEVICE_RUNTIME"  # "module:factory" of a runtime to run under
EMULATION_ENV = "FULLSHARD_CUDA_EMULATION"  # "1": the CUDA emulation (fullshard.testing)
_EMULATION = "fullshard.testing.emulation:emulated_runtime"


class DeviceRuntime:
    """CUDA as the CUDA code path sees it: streams, events, synchronisation, and what a checker
    would want to know besides (tensor names, host buffers, collectives, counts), which CUDA
    ignores. A checker subclasses it (``fullshard.testing``'s emulation)."""

    checked = False  # whether a checker watches: then every collective is modelled as NCCL's

    def __init__(self) -> None:
        # objects the code keeps per runtime (the engine's gather and reduce streams)
        self.owned: dict[Any, Any] = {}

    def cuda_semantics(self, device: torch.device) -> bool:
        """Whether code on ``device`` follows CUDA's stream semantics."""
        return device.type == "cuda"

    def new_stream(self, device: torch.device, name: str) -> Any:
        """A side stream, high priority as FSDP2's."""
        return torch.cuda.Stream(device, priority=-1)

    def current_stream(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    def use_stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(stream)

    def synchronize(self, device: torch.device) -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def new_event(self) -> Any:
        return torch.cuda.Event()

    def same_bits(self, what: str) -> contextlib.AbstractContextManager[Any]:
        """A block whose results must not depend on its tensors' shapes (a checker refuses
        reductions there: NOTE [Kernel contracts] in ``fullshard.testing``)."""
        return contextlib.nullcontext()

    def name_tensor(self, t: torch.Tensor, name: str | Callable[[], str]) -> torch.Tensor:
        """Name ``t`` in a checker's messages (``name`` may be a function: called only
        there)."""
        return t

    def as_host(self, t: torch.Tensor) -> torch.Tensor:
        """Say that the CPU tensor ``t`` is the host's own memory (a gloo buffer, bytes from
        ``frombuffer``), for a checker that takes unmarked tensors for device memory."""
        return t

    def in_host_memory(self, t: torch.Tensor) -> bool:
        return t.device.type == "cpu"

    def collective(
        self,
        outputs: Sequence[torch.Tensor],
        inputs: Sequence[torch.Tensor],
        *,
        name: str,
        work: Any,
        abandon: Callable[[], None] | None,
    ) -> Any:
        """The work handle the code waits on for a collective just issued (``work``); a checker
        models it (``abandon``: the wait's way out, NOTE [Interrupts])."""
        return work

    # -- a checker's figures (none here) -------------------------------------------------------
    def host_syncs(self) -> int | None:
        """Host synchronisations counted since the last reset (``None``: not counted)."""
        return None

    def reset_host_syncs(self) -> None:
        """Start the count of host synchronisations afresh."""

    def filled_bytes(self) -> int | None:
        """Bytes torch filled in new tensors (deterministic mode), if counted."""
        return None


_IN_USE: list[DeviceRuntime] = [DeviceRuntime()]


def runtime() -> DeviceRuntime:
    """The runtime in use (CUDA, unless a block installed another)."""
    return _IN_USE[-1]


@contextlib.contextmanager
def use_runtime(rt: DeviceRuntime) -> Iterator[DeviceRuntime]:
    """``rt`` is the runtime in use inside the block."""
    _IN_USE.append(rt)
    try:
        yield rt
    finally:
        _IN_USE.remove(rt)


def runtime_from_env() -> contextlib.AbstractContextManager[DeviceRuntime]:
    """The runtime the environment names for a run, in use inside the block: a factory's
    ``module:function`` in ``FULLSHARD_DEVICE_RUNTIME``, or ``FULLSHARD_CUDA_EMULATION=1``
    (the CUDA emulation over every tensor); none: the runtime in use now. A factory returns a
    context manager that installs its runtime and yields it."""
    spec = os.environ.get(RUNTIME_ENV, "")
    if not spec and os.environ.get(EMULATION_ENV, "").strip().lower() in ("1", "true", "yes"):
        spec = _EMULATION
    if not spec:
        return contextlib.nullcontext(runtime())
    module, _, factory = spec.partition(":")
    make = getattr(importlib.import_module(module), factory)
    return make()  # type: ignore[no-any-return]
