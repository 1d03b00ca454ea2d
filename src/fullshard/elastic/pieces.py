"""A step boundary's state in pieces (layer 9): each rank's blocks of the model and optimizer
state on the host, where they sit in the global tensors, which boundary survivors can rebuild
in full, and the full state rebuilt from them at any world size.

NOTE [Ring copies]
At a step boundary every rank copies its own shards (parameters, optimizer state) with the
loop's small state to host memory, and at the next boundary sends that copy to the rank
``ring_step`` ahead (the next node's rank with the same local rank, when there are several
nodes: a lost node's copies live on another), which keeps it. Under HSDP the other replicas
already hold the same shards, so no copy is sent: a boundary's pieces are named by their *shard
key* (``generation:rank``, or ``generation:rank % shard_size`` under HSDP) and any holder of a
key can stand in for its lost owner. Each rank keeps its two newest copies of each kind.

On the CUDA path (``comm.device.cuda_semantics``) the device-to-host copies run on a side
stream into pinned buffers behind an event, and nothing waits for them until the next boundary
sends them, a step later, when they are long done: no host synchronisation per tensor or per
step. The optimizer's next update, which overwrites the parameters, waits for the event on the
device. Recovery takes the newest boundary the participants hold in full and replays the steps
since (with ``fullshard.deterministic``, the same bits). A boundary before the first update (the
optimizer holds no state yet) copies no tensors: the weights are what every membership's build
makes (one seed, or the same files), and recovering to it keeps them; only the loop's state
travels.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from fullshard.comm import device as comm_device
from fullshard.elastic.membership import Lost
from fullshard.policies import FullshardError

__all__ = [
    "REPLICATED",
    "Copies",
    "HostCopy",
    "Unrecoverable",
    "choose_boundary",
    "from_bytes",
    "pieces_of",
    "to_bytes",
    "unpacked",
    "update_after_copies",
]


class Unrecoverable(Lost):
    """The lost state is not held by any survivor (two ring neighbours at once, say)."""


@dataclass
class HostCopy:
    """One boundary's pieces of this rank (:func:`pieces_of`): their tensors are views of one
    flat host buffer (``flat``; ``slots``: each view's byte offset, dtype and shape, in the
    order the pieces name them), filled after ``event`` (``None``: filled already)."""

    generation: int
    key: str  # the shard key this rank's pieces cover (NOTE [Ring copies])
    pieces: dict[str, Any]
    event: Any = None
    flat: torch.Tensor | None = None

    def ready(self) -> dict[str, Any]:
        """The pieces, once the copies are done (waits for them if they are not)."""
        if self.event is not None:
            if not self.event.query():
                self.event.synchronize()
            self.event = None
        return self.pieces

    def packed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(meta, flat)`` to send: the pieces' structure with their tensors as slots of the
        flat buffer (pickled, small), and the buffer itself (no copy). :func:`unpacked` undoes
        it on the other side."""
        pieces = self.ready()
        flat = self.flat if self.flat is not None else torch.empty(0, dtype=torch.uint8)
        return to_bytes(_slotted(pieces, flat)), flat


_ALIGN = 64  # each view's byte offset in a flat buffer (any dtype's alignment)
REPLICATED = "*"  # the shard key of a boundary that holds no shard: everyone's is everyone's


@dataclass(frozen=True)
class _Slot:
    """A tensor of a packed boundary: ``flat[offset:offset + nbytes]`` as ``dtype``, ``shape``."""

    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def _view(flat: torch.Tensor, slot: _Slot) -> torch.Tensor:
    n = int(torch.Size(slot.shape).numel()) * slot.dtype.itemsize
    return flat[slot.offset : slot.offset + n].view(slot.dtype).view(slot.shape)


def _slotted(pieces: dict[str, Any], flat: torch.Tensor) -> dict[str, Any]:
    """``pieces`` with each tensor (a view of ``flat``) replaced by its :class:`_Slot`."""
    base = flat.data_ptr()

    def slot(t: torch.Tensor) -> _Slot:
        return _Slot(t.data_ptr() - base, t.dtype, tuple(t.shape))

    return {
        "chunks": {p: (sh, off, slot(t)) for p, (sh, off, t) in pieces["chunks"].items()},
        "fulls": {p: slot(t) for p, t in pieces["fulls"].items()},
        "objects": pieces["objects"],
    }


def unpacked(meta: torch.Tensor, flat: torch.Tensor) -> dict[str, Any]:
    """The pieces :meth:`HostCopy.packed` sent, their tensors views of ``flat`` (host memory:
    what a gloo receive or an unpickled object gives)."""
    meta, flat = comm_device.as_host(meta), comm_device.as_host(flat)
    pieces = from_bytes(meta)
    return {
        "chunks": {p: (sh, o, _view(flat, s)) for p, (sh, o, s) in pieces["chunks"].items()},
        "fulls": {p: _view(flat, s) for p, s in pieces["fulls"].items()},
        "objects": pieces["objects"],
    }


@dataclass(frozen=True)
class _Ref:
    """A tensor that sat inside a boundary's objects (a device learning rate in a parameter
    group, a device step count in the loop state): copied like the others, to ``fulls[path]``."""

    path: str


def _lift(value: Any, path: str, put: Any) -> Any:
    """``value`` with every tensor in it (in dicts, lists, tuples) handed to ``put`` and
    replaced by a :class:`_Ref`: nothing pickled later reads a device tensor."""
    if isinstance(value, torch.Tensor):
        put(path, value)
        return _Ref(path)
    if isinstance(value, dict):
        return {k: _lift(v, f"{path}\0{k}", put) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_lift(v, f"{path}\0{i}", put) for i, v in enumerate(value))
    return value


def _lower(value: Any, fulls: dict[str, torch.Tensor]) -> Any:
    """:func:`_lift` undone, with the copies."""
    if isinstance(value, _Ref):
        return fulls[value.path]
    if isinstance(value, dict):
        return {k: _lower(v, fulls) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_lower(v, fulls) for v in value)
    return value


class Copies:
    """The boundaries one rank holds (NOTE [Ring copies]): its own pieces, and the copies of
    another rank's it keeps, the newest two of each; and what a membership decision needs to
    know of them (:meth:`held`)."""

    def __init__(self) -> None:
        self.own: dict[int, HostCopy] = {}  # boundary step -> this rank's pieces
        # step -> (its key, and what came in: meta and flat, :func:`unpacked`)
        self.kept: dict[int, tuple[str, torch.Tensor, torch.Tensor]] = {}
        self.keys: dict[int, int] = {}  # generation -> the shard keys of its layout
        self.boxes: dict[str, tuple[list[int], list[int]]] = {}  # local boxes, this layout
        self._sent: set[int] = set()
        self.received = 0  # bytes of the newest copy kept

    def spare(self) -> torch.Tensor | None:
        """The flat buffer of the own boundary the next one replaces (the oldest of two), let
        go now: it was sent a boundary ago, and the newer one is held on both sides."""
        if len(self.own) < 2:
            return None
        step = min(self.own)
        self._sent.discard(step)
        return self.own.pop(step).flat

    def spare_received(self) -> list[torch.Tensor]:
        """The receive buffers (meta, flat) of the copy the next one received replaces, let go
        now (the newer copy is held: a loss while the next one arrives recovers to that)."""
        if len(self.kept) < 2:
            return []
        _, meta, flat = self.kept.pop(min(self.kept))
        return [meta, flat]

    def add_own(self, step: int, copy: HostCopy, keys: int) -> None:
        self.own[step] = copy
        self.keys[copy.generation] = keys
        for old in sorted(self.own)[:-2]:
            del self.own[old]
        self._sent &= set(self.own)

    def take_unsent(self) -> int | None:
        """The newest own boundary not yet sent (now counted as sent), or ``None``."""
        unsent = [s for s in self.own if s not in self._sent]
        if not unsent:
            return None
        self._sent.add(max(unsent))
        return max(unsent)

    def keep(self, step: int, key: str, meta: torch.Tensor, flat: torch.Tensor) -> None:
        self.kept[step] = (key, meta, flat)
        for old in sorted(self.kept)[:-2]:
            del self.kept[old]
        self.received = meta.numel() + flat.numel()

    def newest_event(self) -> Any:
        return self.own[max(self.own)].event if self.own else None

    def held(self) -> dict[str, Any]:
        """``{"own": {step: key}, "copy": {step: key}, "layouts": {generation: keys}}``."""
        own = {s: c.key for s, c in self.own.items()}
        copy = {s: kept[0] for s, kept in self.kept.items()}
        gens = {int(k.split(":")[0]) for k in [*own.values(), *copy.values()]}
        return {"own": own, "copy": copy, "layouts": {str(g): self.keys[g] for g in gens}}

    def provide(self, step: int, keys: list[str]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The pieces of boundary ``step`` this rank holds for ``keys``, packed (``(meta,
        flat)``, :func:`unpacked`): pickling them whole would pickle the flat buffer once for
        every tensor that views it."""
        own, copy = self.own.get(step), self.kept.get(step)
        out = []
        for key in keys:
            if own is not None and own.key == key:  # (a replicated boundary's too: "g:*")
                out.append(own.packed())
            elif copy is not None and copy[0] == key:
                out.append((copy[1], copy[2]))
        return out

    def clear(self) -> None:
        """Forget every boundary (after a restore: another layout's)."""
        self.own.clear()
        self.kept.clear()
        self._sent.clear()
        self.boxes.clear()


def _local_box(dt: Any) -> tuple[list[int], list[int]]:
    """(shape, global offset) of a DTensor's local tensor, as DTensor's own sharding rule says."""
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except ImportError:  # torch 2.4
        from torch.distributed._tensor._utils import (  # type: ignore[no-redef]
            compute_local_shape_and_global_offset,
        )
    shape, offset = compute_local_shape_and_global_offset(dt.shape, dt.device_mesh, dt.placements)
    return list(shape), list(offset)


def pieces_of(
    model_sd: dict[str, Any],
    optim_sd: dict[str, Any],
    state: dict[str, Any],
    device: torch.device,
    stream: Any = None,
    boxes: dict[str, tuple[list[int], list[int]]] | None = None,
    spare: torch.Tensor | None = None,
) -> tuple[dict[str, Any], Any, torch.Tensor]:
    """This rank's part of a step boundary, on the host: every DTensor leaf as its local block
    with the block's place in the global tensor; plain tensors as they are, also those inside
    the objects (parameter groups, ``state``: the loop's), which are kept as they are.

    Returns the pieces, whose tensors are views of one flat host buffer, the event after which
    it is filled (``None``: filled already), and the buffer. With ``stream`` (the CUDA path) the
    buffer is pinned and filled on that stream, which first waits for the current one.
    ``boxes``: a cache of each DTensor's local box, kept while the layout stands (DTensor's
    rule reads the mesh, a few host reads per tensor). ``spare``: a buffer to fill again if it
    has the size (a dropped boundary's).
    """
    from torch.distributed.tensor import DTensor

    chunks: dict[str, tuple[list[int], list[int], Any]] = {}
    fulls: dict[str, Any] = {}
    sources: list[torch.Tensor] = []  # what to copy, in slot order

    def host(t: torch.Tensor) -> int:  # a placeholder until the buffer exists
        sources.append(t.detach())
        return len(sources) - 1

    def put(path: str, value: Any) -> None:
        if isinstance(value, DTensor):
            box = None if boxes is None else boxes.get(path)
            shape, offset = box or _local_box(value)
            if boxes is not None:
                boxes[path] = (shape, offset)
            local = value.to_local()
            if list(local.shape) != shape:
                raise FullshardError(f"{path}: local block {list(local.shape)} is not {shape}")
            chunks[path] = (list(value.shape), offset, host(local))
        elif isinstance(value, torch.Tensor):
            fulls[path] = host(value)

    for fqn, v in model_sd.items():
        put("model\0" + fqn, v)
    for fqn, entry in optim_sd.get("state", {}).items():
        for k, v in entry.items():
            put(f"optim\0{fqn}\0{k}", v)
    objects = {"param_groups": optim_sd.get("param_groups", []), "state": dict(state)}
    for fqn, entry in optim_sd.get("state", {}).items():  # non-tensor optimizer state
        for k, v in entry.items():
            if not isinstance(v, torch.Tensor):
                objects[f"optim\0{fqn}\0{k}"] = v
    objects = _lift(objects, "obj", put)
    # one host buffer for all of them (pinned on the CUDA path): sent as it is, no pickling
    slots, end = [], 0
    for t in sources:
        slots.append(_Slot(end, t.dtype, tuple(t.shape)))
        end += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    # a dropped boundary's buffer when it fits (``spare``; its copies ended with its sending):
    # no allocation, and on a GPU no new pinned memory, at every boundary
    pinned = stream is not None
    if spare is not None and spare.numel() == end and spare.is_pinned() == pinned:
        flat = spare
    else:
        flat = torch.empty(end, dtype=torch.uint8, pin_memory=pinned)
    views = [_view(flat, slot) for slot in slots]
    chunks = {p: (sh, off, views[i]) for p, (sh, off, i) in chunks.items()}
    fulls = {p: views[i] for p, i in fulls.items()}
    event = None
    if stream is None:
        with torch.no_grad():
            for src, view in zip(sources, views, strict=True):
                view.copy_(src)
    elif sources:
        on_device = []
        for src, view in zip(sources, views, strict=True):
            if comm_device.in_host_memory(src):  # a host tensor (AdamW's step count): at once,
                view.copy_(src)  # before the stream writes the rest of the buffer
            else:
                on_device.append((src, view))
        stream.wait_stream(comm_device.current_stream(device))
        with comm_device.use_stream(stream):
            for src, view in on_device:
                view.copy_(src, non_blocking=True)
                src.record_stream(stream)  # the state dict's own may die before the copy
        event = comm_device.new_event()
        event.record(stream)
    return {"chunks": chunks, "fulls": fulls, "objects": objects}, event, flat


def update_after_copies(
    optimizer: torch.optim.Optimizer, newest: Callable[[], Any], device: torch.device
) -> None:
    """On the CUDA path: each update of ``optimizer``, which overwrites the parameters and
    state a copy reads, first waits (on the device) for the event of the newest copy
    (``newest()``; ``None`` when none is in flight)."""

    def wait(*_: Any) -> None:
        event = newest()
        if event is not None:
            comm_device.current_stream(device).wait_event(event)

    optimizer.register_step_pre_hook(wait)


def choose_boundary(
    held: dict[int, dict[str, dict[int, str]]], layouts: dict[int, int]
) -> tuple[int, dict[str, int]] | None:
    """The newest step boundary whose every shard key some participant holds, and who provides
    each (key -> participant), or ``None``.

    ``held[participant] = {"own": {step: key}, "copy": {step: key}}``: the boundaries a
    participant holds of its own shards and of another rank's; a key is ``"g:k"``, shard ``k``
    of generation ``g``'s layout, which has ``layouts[g]`` keys (NOTE [Ring copies]). A
    participant's own copy is preferred, then the lowest participant: the same choice on every
    rank. A boundary before the first update holds no shard (:data:`REPLICATED`, key ``"g:*"``):
    every participant's copy is every rank's, and the lowest participant's is chosen.
    """
    boundaries = sorted(
        {
            (s, int(k.split(":")[0]))
            for h in held.values()
            for kind in ("own", "copy")
            for s, k in h[kind].items()
        },
        reverse=True,
    )
    for step, gen in boundaries:
        providers: dict[str, int] = {}
        for kind in ("own", "copy"):
            for p in sorted(held):
                key = held[p][kind].get(step)
                if key is not None and key.startswith(f"{gen}:"):
                    providers.setdefault(key, p)
        everyone = f"{gen}:{REPLICATED}"
        if everyone in providers:
            return step, {everyone: providers[everyone]}
        if all(f"{gen}:{k}" in providers for k in range(layouts.get(gen, 1 << 62))):
            return step, providers
    return None


def to_bytes(obj: Any) -> torch.Tensor:
    buf = io.BytesIO()
    torch.save(obj, buf)
    # host memory on a GPU machine too (the CUDA emulation cannot see frombuffer make it)
    return comm_device.as_host(torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8))


def from_bytes(t: torch.Tensor) -> Any:
    return torch.load(io.BytesIO(t.numpy().tobytes()), weights_only=False)
