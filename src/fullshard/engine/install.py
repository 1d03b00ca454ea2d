"""``fullshard.install()`` (layer 8): route torch's public FSDP2 names to fullshard, so that code
which calls ``torch.distributed.fsdp.fully_shard`` for its users (accelerate, transformers'
Trainer, torchtitan, Lightning) shards with fullshard unchanged.

NOTE [Routing torch's FSDP2 names]
A framework reaches FSDP2 in two ways: ``from torch.distributed.fsdp import fully_shard`` inside
a function, run after the user's script started (accelerate, the Trainer), or the same import
at the top of one of its modules, run once when it was imported (torchtitan, Lightning, parts of
transformers). ``install()`` therefore does two things, both recorded so that ``uninstall()``
puts back exactly what it changed:
- it sets fullshard's objects under the public names of torch's FSDP2 modules
  (``torch.distributed.fsdp``, its ``_fully_shard`` package and the older
  ``torch.distributed._composable.fsdp``), which serves every import made from then on;
- it rebinds, in modules already imported, every global that *is* one of torch's FSDP2 objects
  (an earlier ``from torch.distributed.fsdp import fully_shard``, under any name). torch's own
  modules are left alone: their code keeps using torch's FSDP2 internally.
Other names stay torch's: the private modules, and ``DataParallelMeshDims`` (fullshard's
``fully_shard`` reads torch's as its own). fullshard's ``fully_shard`` also takes torch's policy
objects (a framework may have built a ``MixedPrecisionPolicy`` before ``install()``), so the
order rarely matters; still, call ``install()`` first thing in the script every rank runs. ``install()`` while installed
changes nothing, so nested ``with fullshard.install():`` blocks restore only at the outermost.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType, TracebackType
from typing import Any

# torch's public FSDP2 modules whose names are routed (those that exist in this torch)
_TORCH_MODULES = (
    "torch.distributed.fsdp",
    "torch.distributed.fsdp._fully_shard",
    "torch.distributed._composable.fsdp",
    "torch.distributed._composable.fsdp.fully_shard",
)
_NAMES = (
    "fully_shard",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "CPUOffloadPolicy",
    "OffloadPolicy",
    "register_fsdp_forward_method",
    "UnshardHandle",
    "share_comm_ctx",
)


def _ours() -> dict[str, Any]:
    from fullshard.engine import api
    from fullshard.policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

    return {
        "fully_shard": api.fully_shard,
        "FSDPModule": api.FSDPModule,
        "MixedPrecisionPolicy": MixedPrecisionPolicy,
        "CPUOffloadPolicy": CPUOffloadPolicy,
        "OffloadPolicy": OffloadPolicy,
        "register_fsdp_forward_method": api.register_fsdp_forward_method,
        "UnshardHandle": api.UnshardHandle,
        "share_comm_ctx": api.share_comm_ctx,
    }


def _torch_modules() -> list[ModuleType]:
    out = []
    for name in _TORCH_MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue  # an older or newer torch without this path
        if isinstance(mod, ModuleType):  # (a name that is a function, not a module: skip)
            out.append(mod)
    return out


class Installed:
    """What one ``install()`` changed; ``uninstall()`` (or leaving its ``with`` block) puts
    it back. Changes someone else made since are left alone."""

    def __init__(self, changes: list[tuple[ModuleType, str, Any, Any]]) -> None:
        self._changes = changes  # (module, name, torch's object, fullshard's object)

    @property
    def active(self) -> bool:
        """Whether this call's changes are still in place."""
        return bool(self._changes)

    def uninstall(self) -> None:
        """Put torch's FSDP2 objects back where this ``install()`` routed them to fullshard."""
        for mod, name, theirs, ours in reversed(self._changes):
            if mod.__dict__.get(name) is ours:
                setattr(mod, name, theirs)
        self._changes = []

    def __enter__(self) -> Installed:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.uninstall()


def install() -> Installed:
    """Make torch's public FSDP2 names (``torch.distributed.fsdp.fully_shard``, ``FSDPModule``,
    ``MixedPrecisionPolicy``, ``CPUOffloadPolicy``, ``OffloadPolicy``,
    ``register_fsdp_forward_method``, ``UnshardHandle``, ``share_comm_ctx``) fullshard's, in
    torch's modules and wherever an imported module holds them (NOTE [Routing torch's FSDP2
    names]).

    Call it first in the script every rank runs; frameworks that call FSDP2 for you (accelerate,
    transformers' Trainer, torchtitan, Lightning) then shard with fullshard. Returns a handle:
    ``handle.uninstall()`` restores torch's objects, and ``with fullshard.install(): ...``
    routes them only inside the block.
    """
    ours = _ours()
    theirs: dict[int, tuple[str, Any]] = {}  # id(torch's object) -> (its name, the object)
    changes: list[tuple[ModuleType, str, Any, Any]] = []
    for mod in _torch_modules():
        for name in _NAMES:
            current = mod.__dict__.get(name)
            if current is None or current is ours[name]:
                continue  # absent in this torch, or routed already
            theirs[id(current)] = (name, current)
            setattr(mod, name, ours[name])
            changes.append((mod, name, current, ours[name]))
    for mod in list(sys.modules.values()):
        modname = getattr(mod, "__name__", "")
        if not isinstance(mod, ModuleType) or modname.split(".")[0] in ("torch", "fullshard"):
            continue  # torch's own modules keep torch's FSDP2 for their own code
        try:
            items = list(vars(mod).items())
        except TypeError:
            continue
        for attr, value in items:
            hit = theirs.get(id(value))
            if hit is not None and hit[1] is value:
                setattr(mod, attr, ours[hit[0]])
                changes.append((mod, attr, value, ours[hit[0]]))
    return Installed(changes)


__all__ = ["Installed", "install"]
