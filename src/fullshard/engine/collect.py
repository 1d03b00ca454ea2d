"""Which parameters one ``fully_shard`` call manages, and the checks on them (layer 8).

A call covers one module or a list of modules (one unit, FSDP2's grouping). It manages every
parameter under them except those of nested units and ``ignored_params``; a parameter reached
under several names (tied inside the unit) is managed once, with all its names.

NOTE [Unit membership]
A parameter belongs to the innermost unit module that holds it: ``fully_shard`` leaves out the
parameters of children that are already units (``parallelize`` wraps the innermost units
first). Inside a unit, a parameter reached twice (tied) is one parameter with every name, the
first in module order as ``named_parameters()`` reports it. :func:`collect` is the rule: the
engine applies it at wrap time, and the sharding plan (``sharding.unit_members``) applies the
same function to an unwrapped (or meta) model, its unit modules standing in for the nested
units; there a parameter tied across units goes to the first unit of the plan (the root, then
module order), where the engine would refuse the tie.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable.contract import REGISTRY_KEY, RegistryItem, _get_registry
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from fullshard.comm.mesh import MeshInfo
from fullshard.engine.extension import extension_problem, is_tensor_subclass
from fullshard.engine.fsdp_module import FSDPModule
from fullshard.engine.param import TPSpec, local_of
from fullshard.policies import (
    FullshardAssertionError,
    FullshardError,
    FullshardValueError,
    fsdp2_words,
)

if TYPE_CHECKING:
    from fullshard.engine.hooks import FSDPState


@dataclass
class Found:
    """One managed parameter: its names, each relative to the module of the call it is reached
    under (``owners``, parallel to ``fqns``: a parameter tied between modules of a list has one
    name under each), and the ``(module, attribute)`` pairs that hold it. ``owner`` is the
    first module that reaches it."""

    param: nn.Parameter
    owner: int
    fqns: list[str] = field(default_factory=list)
    owners: list[int] = field(default_factory=list)
    refs: list[tuple[nn.Module, str]] = field(default_factory=list)


def is_sharded(module: nn.Module) -> bool:
    """Whether ``module`` is already a unit (passed to ``fully_shard``)."""
    return isinstance(module, FSDPModule)


def replicated(module: nn.Module) -> bool:
    """Whether torch's composable ``replicate()`` (DDP) manages ``module``: its parameters are
    DDP's, so a ``fully_shard`` call above it leaves them alone, as FSDP2 does."""
    registry = _get_registry(module)
    return registry is not None and "replicate" in registry


def register_with_torch(module: nn.Module) -> None:
    """Mark ``module`` as ``fully_shard``'s in torch's registry of composable APIs, where
    torch's own ``replicate()`` looks before taking a module's parameters (it skips those of
    fully sharded submodules, and refuses a module that is fully sharded itself)."""
    registry = module.__dict__.setdefault(REGISTRY_KEY, OrderedDict())
    registry.setdefault("fully_shard", RegistryItem())


def collect(
    modules: list[nn.Module],
    ignored: Iterable[torch.Tensor] = (),
    is_unit: Callable[[nn.Module], bool] = is_sharded,
) -> tuple[list[Found], list[nn.Module]]:
    """NOTE [Unit membership]: the parameters the call manages (in registration order), and
    the nested unit modules (``is_unit``) it stops at, in module order, each once.

    A parameter tied between modules of the list (``fully_shard([tok_embeddings, output])``
    with a shared weight, FSDP2's recommended form) is one parameter of the unit with a name
    under each module."""
    skip = {id(p) for p in ignored}
    found: dict[int, Found] = {}
    children: list[nn.Module] = []
    seen: set[tuple[int, str, int]] = set()  # (module, attribute, list module) visited
    held: set[tuple[int, str]] = set()  # (module, attribute) pairs already in some refs

    def visit(mod: nn.Module, prefix: str, owner: int) -> None:
        for name, p in mod._parameters.items():
            if p is None or id(p) in skip:
                continue
            if (id(mod), name, owner) in seen:
                continue  # a submodule reached again under the same list module
            seen.add((id(mod), name, owner))
            entry = found.get(id(p))
            if entry is None:
                entry = found[id(p)] = Found(p, owner)
            entry.fqns.append(prefix + name)
            entry.owners.append(owner)
            if (id(mod), name) not in held:
                held.add((id(mod), name))
                entry.refs.append((mod, name))
        for cname, child in mod._modules.items():
            if child is None:
                continue
            if is_unit(child):
                if all(c is not child for c in children):
                    children.append(child)
                continue
            if replicated(child):
                continue  # DDP's (torch's replicate())
            visit(child, f"{prefix}{cname}.", owner)

    for i, module in enumerate(modules):
        visit(module, "", i)
    return list(found.values()), children


_UIDS = itertools.count()


def original_uid(param: torch.Tensor) -> int:
    """A number that names one original parameter for good (stamped on it at first sight, as
    FSDP2 does): ties between units are found by it, not by ``id()``, since an original is gone
    once both units hold shards and an ``id`` may be reused after GC."""
    uid = getattr(param, "_fullshard_uid", None)
    if uid is None:
        uid = next(_UIDS)
        param._fullshard_uid = uid  # type: ignore[attr-defined]
    return uid  # type: ignore[no-any-return]


def check_tensor_parallel(
    found: list[Found], info: MeshInfo, unit_name: str
) -> list[TPSpec | None]:
    """The TP spec of each parameter that already is a DTensor (None for the others), after the
    checks that say what fullshard cannot shard (NOTE [Tensor parallel parameters])."""
    specs = []
    for f in found:
        spec = TPSpec.of(f.param)
        specs.append(spec)
        if spec is None:
            continue
        where = f"parameter '{f.fqns[0]}' of {unit_name} (rank {info.rank})"
        if spec.mesh.device_type != info.device.type:
            raise FullshardValueError(
                f"{where} is a DTensor on a '{spec.mesh.device_type}' mesh, but the unit shards "
                f"over a '{info.device.type}' mesh; build both from one init_device_mesh, e.g. "
                "mesh['dp'] and mesh['tp'] of init_device_mesh(device, (dp, tp), "
                "mesh_dim_names=('dp', 'tp'))."
            )
        if (
            spec.mesh.size() > 1
            and any(
                info.device_mesh.get_group(d) is spec.mesh.get_group(0)
                for d in range(info.device_mesh.ndim)
            )
            or spec.mesh.ndim != 1
        ):
            raise FullshardError(
                f"{where} is a DTensor on the mesh fullshard shards over (or on a "
                f"{spec.mesh.ndim}-D mesh); its mesh must be a separate 1-D tensor-parallel mesh: "
                "pass fully_shard(mesh=mesh['dp']) with the parameters on mesh['tp']."
            )
        bad = [p for p in spec.placements if not isinstance(p, (Shard, Replicate))]
        if bad or any(isinstance(p, _StridedShard) for p in spec.placements):
            raise FullshardError(
                f"{where} has tensor-parallel placements {list(spec.placements)}; fullshard "
                "shards parameters placed Shard(d) or Replicate() on their TP mesh. Apply "
                "the TP plan (parallelize_module) first, and sharding once."
            )
    return specs


def check_modules(modules: list[nn.Module]) -> None:
    """The modules of one call: not wrapped yet, and none inside another."""
    if not modules:
        raise FullshardError("fully_shard got an empty list of modules.")
    for m in modules:
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)) and type(m).forward is nn.Module.forward:
            raise FullshardValueError(  # a container: nothing would ever run its hooks
                fsdp2_words(
                    f"fully_shard got a {type(m).__name__}, which has no forward of its own, so "
                    "its parameters would never be gathered; pass the modules it holds (one "
                    "call each, or as one list: fully_shard(list(container))), or its parent.",
                    "fully_shard does not support containers that do not implement forward: "
                    f"{type(m).__name__}",
                )
            )
        if isinstance(m, FSDPModule):
            raise FullshardAssertionError(
                fsdp2_words(
                    f"module {type(m).__name__} was already passed to fully_shard; wrap each "
                    "module once.",
                    "Each distinct composable distributed API can only be applied to a module "
                    "once.",
                )
            )
    for i, a in enumerate(modules):
        for j, b in enumerate(modules):
            if i != j and any(sub is b for sub in a.modules()):
                raise FullshardError(
                    f"fully_shard got module {j} ({type(b).__name__}) inside module {i} "
                    f"({type(a).__name__}) of the same list; list modules that do not contain "
                    "each other."
                )


def owned_ignored(modules: list[nn.Module], ignored: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The ignored parameters that belong to the call's modules. As in FSDP2 one set may be
    given to every call of a model (``fully_shard(m, ignored_params=all_ignored)`` on each
    module, bottom up): each call leaves alone the ones it holds, and the rest are not its."""
    own = {id(p) for m in modules for p in m.parameters()}
    return [p for p in ignored if id(p) in own]


def param_device(found: list[Found]) -> torch.device | None:
    """Where the unit's parameters are now (None: none, or on the meta device)."""
    for f in found:
        return None if f.param.is_meta else f.param.device
    return None


def check_params(
    found: list[Found], children: list[FSDPState], unit_name: str, modules: list[nn.Module]
) -> None:
    """Parameters a unit cannot manage: sharded elsewhere, tied across units, 0-dim, integer,
    tensor subclasses whose all-gather hooks are unusable (NOTE [All-gather extensions])."""
    child_path = {
        id(m): name
        for module in modules
        for name, m in module.named_modules()
        if isinstance(m, FSDPModule)
    }
    for f in found:
        p, fqn = f.param, f.fqns[0]
        owner = getattr(p, "_fullshard_unit", None)
        if owner is not None:
            raise FullshardError(
                f"parameter '{fqn}' of {unit_name} is already sharded by unit "
                f"'{owner.name}'. Call fully_shard on inner modules first, then on the "
                "outer ones, and on each module once."
            )
        for child in children:
            other = child.original_uids.get(original_uid(p))
            if other is not None:
                path = child_path.get(id(child.module), type(child.module).__name__)
                raise FullshardError(
                    f"parameter '{fqn}' of {unit_name} is tied to '{path}.{other}' of the "
                    f"nested unit '{path}'; tied parameters must live in one unit. Do not call "
                    f"fully_shard on '{path}' on its own (its parent's unit will hold both), or "
                    "untie the weights."
                )
        check_subclass(p, fqn, unit_name)  # first: a lazy parameter has no dim()
        if p.dim() == 0:
            raise FullshardValueError(
                fsdp2_words(
                    f"parameter '{fqn}' of {unit_name} is 0-dim; fullshard shards along dim 0. "
                    "Make it shape (1,) (e.g. nn.Parameter(t.reshape(1))) before fully_shard.",
                    "fully_shard doesn't support scalar parameters. "
                    f"Change {fqn} to a 1D tensor with numel equal to 1.",
                )
            )
        if not (p.is_floating_point() or p.is_complex()):
            raise FullshardError(
                f"parameter '{fqn}' of {unit_name} has dtype {p.dtype}; only floating-point "
                "parameters can be sharded and trained. Register it as a buffer instead."
            )


def check_subclass(p: torch.Tensor, fqn: str, unit_name: str) -> None:
    """A tensor-subclass parameter is sharded only through FSDP2's all-gather extension hooks
    (NOTE [All-gather extensions]); anything else would silently lose what the subclass does."""
    local = local_of(p)
    where = f"rank {dist.get_rank()}: parameter '{fqn}' of {unit_name}"
    problem = extension_problem(local)
    if problem is not None:
        raise FullshardError(f"{where} {problem}")
    if local is not p and is_tensor_subclass(local):
        raise FullshardError(
            f"{where} is a tensor-parallel DTensor whose local tensor is a "
            f"{type(local).__name__} (all-gather extension hooks); fullshard does not shard "
            "those yet. Use the subclass without tensor parallelism (e.g. float8 all-gather "
            "with FSDP only), or torch's FSDP2 for FSDP x TP with it."
        )
