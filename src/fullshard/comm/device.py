"""Which device a process group's tensors live on (layer 2). One helper decides it.

NOTE [Device discipline]
NCCL moves CUDA tensors only; gloo moves CPU tensors (and, for tests that share one GPU between
ranks, CUDA tensors through host copies). A CPU tensor handed to NCCL fails deep inside c10d
("No backend type associated with device type cpu"), after other ranks may already be waiting.
So:

- bookkeeping tensors (barriers, votes, metrics, checkpoint agreement) are created on
  ``comm_device(group)`` and nowhere else;
- parameter and gradient buffers live on the unit's compute device, which ``fully_shard``
  checks against the group's backend once (``check_device``);
- every collective fullshard issues passes ``check_tensor`` first, which turns a wrong device
  into an error that names the collective and the fix, on the rank that made the mistake.

Outside ``fullshard.comm`` no code calls a ``torch.distributed`` collective directly
(``tests/test_device.py`` checks the source): the helpers in ``fullshard.comm.control`` do it.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from fullshard.comm.runtime import runtime
from fullshard.policies import FullshardError

__all__ = [
    "accepted_devices",
    "as_host",
    "backend_name",
    "check_device",
    "check_tensor",
    "comm_device",
    "cuda_semantics",
    "cuda_usable",
    "current_stream",
    "in_host_memory",
    "name_tensor",
    "new_event",
    "new_stream",
    "same_bits",
    "synchronize",
    "use_stream",
]


# A group's backend name, looked up once per group: ``dist.get_backend`` costs a microsecond,
# and every collective of a step asks (the device check, how to wait, whether data moves).
# By ``id`` with a weak reference that must still be the group (a plain dict lookup; a
# ``WeakKeyDictionary`` makes a weak reference per lookup), dropped with the group (the
# default group changes between init_process_group calls; ``None`` is the group of the moment).
_BACKENDS: dict[int, tuple[weakref.ref[Any], str]] = {}


def backend_name(group: dist.ProcessGroup | None) -> str:
    """The lower-case backend name of ``group`` (``None``: the default group)."""
    key = group if group is not None else dist.group.WORLD
    if key is None:
        return str(dist.get_backend(group)).lower()  # raises: no process group
    found = _BACKENDS.get(id(key))
    if found is not None and found[0]() is key:
        return found[1]
    name = str(dist.get_backend(group)).lower()
    i = id(key)
    _BACKENDS[i] = (weakref.ref(key, lambda _, i=i: _BACKENDS.pop(i, None)), name)  # type: ignore[misc]
    return name


def accepted_devices(group: dist.ProcessGroup | None = None) -> frozenset[str]:
    """Device types whose tensors the group's backend moves.

    A plain ``"nccl"`` group moves CUDA tensors only; ``"gloo"`` moves CPU tensors and CUDA
    tensors; a per-device backend string such as ``"cpu:gloo,cuda:nccl"`` moves both.
    """
    return _accepted(backend_name(group))


@functools.lru_cache(maxsize=64)
def _accepted(backend: str) -> frozenset[str]:
    if ":" in backend:  # "cpu:gloo,cuda:nccl"
        return frozenset(part.split(":")[0] for part in backend.split(","))
    if backend == "nccl":
        return frozenset({"cuda"})
    return frozenset({"cpu", "cuda"})


def comm_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device for small bookkeeping tensors handed to collectives on ``group``.

    The CPU where the backend moves CPU tensors (gloo: no device round trip for a flag), else
    the current CUDA device (NCCL).
    """
    if "cpu" in accepted_devices(group):
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def check_device(device: torch.device, group: dist.ProcessGroup | None, what: str) -> None:
    """Raise a clear error if the group's backend cannot move tensors on ``device``
    (NOTE [Device discipline]); ``what`` names the collective or the unit."""
    accepted = accepted_devices(group)
    if device.type in accepted:
        return
    rank = dist.get_rank() if dist.is_initialized() else 0
    raise FullshardError(
        f"rank {rank}: {what} got a {device.type} tensor, but the process group's backend "
        f"({backend_name(group)}) moves only {'/'.join(sorted(accepted))} tensors. Put the model "
        "and its inputs on the GPU (model.to('cuda')) before fully_shard, or train on CPU "
        "with the gloo backend."
    )


def check_tensor(t: torch.Tensor, group: dist.ProcessGroup | None, what: str) -> None:
    """``check_device`` for the tensor about to be handed to a collective."""
    check_device(t.device, group, what)


def cuda_usable(index: int) -> str:
    """Why CUDA device ``index`` cannot be used by this process ("" when it can).

    Catches a CPU-only torch or a missing driver, an index beyond the visible devices, and a
    device that another process holds exclusively ("busy or unavailable").
    """
    if not torch.cuda.is_available():
        return (
            "no CUDA device is visible (torch.cuda.is_available() is False: a CPU build of "
            "torch, no driver, or CUDA_VISIBLE_DEVICES is empty); use --device cpu"
        )
    count = torch.cuda.device_count()
    if index >= count:
        return (
            f"this rank needs CUDA device {index}, but only {count} are visible; launch at most "
            f"{count} ranks per machine with NCCL, or share the GPUs over gloo (--backend gloo)"
        )
    try:
        torch.empty(1, device=torch.device("cuda", index))
    except RuntimeError as exc:  # "all CUDA-capable devices are busy or unavailable"
        first = str(exc).splitlines()[0][:200]
        return (
            f"CUDA device {index} cannot be used ({first}); another process may hold it in "
            "exclusive mode: free it, or pick another with CUDA_VISIBLE_DEVICES"
        )
    return ""


# -- the CUDA code path, on a GPU or under the CUDA emulation -------------------------------------
# NOTE [The CUDA path on CPU] (comm/runtime.py): these delegate to the device runtime in use.


def cuda_semantics(device: torch.device) -> bool:
    """Whether code on ``device`` follows CUDA's stream semantics: a CUDA device, or any device
    while the CUDA emulation is in use."""
    return runtime().cuda_semantics(device)


def new_stream(device: torch.device, name: str) -> Any:
    """A side stream (high priority, as FSDP2's) on ``device``; a virtual one under emulation."""
    return runtime().new_stream(device, name)


def current_stream(device: torch.device) -> Any:
    """The stream current on ``device`` (compute, unless a ``use_stream`` block changed it)."""
    return runtime().current_stream(device)


def use_stream(stream: Any) -> contextlib.AbstractContextManager[Any]:
    """``torch.cuda.stream(stream)``: make ``stream`` current in a ``with`` block."""
    return runtime().use_stream(stream)


def synchronize(device: torch.device) -> None:
    """The host waits for everything queued on ``device`` (outside the steady state only)."""
    runtime().synchronize(device)


def new_event() -> Any:
    """An unrecorded event (``torch.cuda.Event``, or a virtual one under emulation)."""
    return runtime().new_event()


def same_bits(what: str) -> contextlib.AbstractContextManager[Any]:
    """A block whose results must have the same bits whatever the shapes of its device tensors
    (the rows a rank holds, at any world size): under the CUDA emulation a reduction there
    raises, because a CUDA reduction's order follows its launch shape (NOTE [Kernel contracts]
    in ``fullshard.testing``); elsewhere it does nothing."""
    return runtime().same_bits(what)


def name_tensor(t: torch.Tensor, name: str | Callable[[], str]) -> torch.Tensor:
    """Name ``t`` in the CUDA emulation's messages (a function ``name`` is called only there)."""
    return runtime().name_tensor(t, name)


def as_host(t: torch.Tensor) -> torch.Tensor:
    """Mark the CPU tensor ``t`` as the host's own memory (a gloo buffer, bytes from
    ``frombuffer``), which the emulation's all-device mode would take for device memory."""
    return runtime().as_host(t)


def in_host_memory(t: torch.Tensor) -> bool:
    """Whether ``t`` lives in host memory (pinned or pageable)."""
    return runtime().in_host_memory(t)
