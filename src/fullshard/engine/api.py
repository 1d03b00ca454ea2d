"""``fully_shard`` (layer 8): the public entry point of the engine; the class it mixes in,
``FSDPModule``, is in ``fsdp_module.py`` (re-exported here).

Mirrors ``torch.distributed.fsdp.fully_shard`` (FSDP2) so that swapping the import works.
``reshard_after_forward`` is decided here, once, into ``CommUnit.reshard_after_forward`` (and the
post-forward group of an int); only the root's default (None) waits for its lazy init.
"""

from __future__ import annotations

from typing import Any, cast

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fullshard.comm.mesh import MeshInfo, mesh_info
from fullshard.engine.collect import (
    check_modules,
    check_params,
    check_tensor_parallel,
    collect,
    original_uid,
    owned_ignored,
    param_device,
    register_with_torch,
)
from fullshard.engine.consistency import OPTIMIZER_GUARD, check_same_model, signature
from fullshard.engine.cpu_rng import install_cpu_shard_rng
from fullshard.engine.fsdp2_interop import register_state_with_torch
from fullshard.engine.fsdp_module import (
    FSDPModule,
    GradientReductionHandle,
    UnshardHandle,
    fsdp_class,
    register_fsdp_forward_method,
    share_comm_ctx,
)
from fullshard.engine.hooks import FSDPState
from fullshard.engine.local_step import LOCAL_STEPS
from fullshard.engine.param import ShardedParam, local_of
from fullshard.engine.placement import ShardPlacementFn, shard_dims
from fullshard.engine.spmd import SpmdMesh
from fullshard.engine.state_dict_hooks import install_state_dict_hooks
from fullshard.engine.unit import CommUnit
from fullshard.policies import (
    CPUOffloadPolicy,
    FullshardError,
    FullshardValueError,
    MixedPrecisionPolicy,
    OffloadPolicy,
)


def _reshard_arg(value: bool | int | None, info: MeshInfo, unit: str) -> bool | int | None:
    """FSDP2's ``reshard_after_forward``: a bool, None, or the group size to reshard to after
    forward (an int dividing the shard group: 1 keeps the parameters, the group size is True)."""
    if value is None or isinstance(value, bool):
        return value
    if not isinstance(value, int):
        raise FullshardValueError(
            f"reshard_after_forward for {unit} must be a bool, None or an int, not {value!r}"
        )
    n = info.world_size
    if value < 1 or value > n or n % value:
        raise FullshardValueError(
            f"reshard_after_forward={value} for {unit} must divide the shard group size {n} "
            f"(rank {info.rank}): pass one of {[d for d in range(1, n + 1) if n % d == 0]}, "
            "e.g. the number of GPUs per node, or a bool."
        )
    if value == 1:
        return False  # resharding to one rank keeps the whole unit, as FSDP2 reads it
    if value == n:
        return True
    return value


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy | None = None,
    ignored_params: set[nn.Parameter] | None = None,
    shard_placement_fn: ShardPlacementFn | None = None,
    dp_mesh_dims: Any = None,
) -> Any:
    """Shard ``module``'s parameters over ``mesh`` and gather them around its forward/backward.

    Call it on each block first, then on the root model; build the optimizer afterwards.
    ``module.parameters()`` then yields DTensors (``Shard(0)``, or what ``shard_placement_fn``
    chose; ``(Replicate(), Shard(k))`` on a 2-D mesh) whose local tensors are this rank's rows;
    the module's class becomes a subclass of :class:`FSDPModule`.

    Args:
        module: the module, or a list of modules that form one unit (gathered and
            reduce-scattered together; FSDP2's grouping).
        mesh: ``DeviceMesh`` to shard over: 1-D (shard) or 2-D (replicate, shard) for hybrid
            sharding; ``None`` = the default process group.
        reshard_after_forward: free gathered parameters after forward (``True``, FULL_SHARD) or
            keep them for backward (``False``, SHARD_GRAD_OP); an ``int`` keeps a copy sharded
            over that many ranks, so backward gathers within that smaller group (e.g. a node).
            ``None``: ``True`` for every unit except the root, which backward needs first.
        mp_policy: dtypes for gather/compute, gradient reduction and outputs (FSDP2's).
        offload_policy: ``CPUOffloadPolicy()`` keeps shards and the optimizer step on CPU.
        ignored_params: parameters of the module(s) to leave alone: not sharded, not moved,
            their gradients not reduced.
        shard_placement_fn: ``fn(param) -> Shard(k) | None`` (FSDP2's): shard that parameter
            on dim ``k`` instead of 0 (``None``: dim 0). Dims other than 0 must divide by the
            shard group size (of the TP-local tensor for a tensor-parallel parameter);
            all-gather-extension parameters take dim 0.
            The unit still moves in one all-gather and one reduce-scatter.
        dp_mesh_dims: FSDP2's ``DataParallelMeshDims``: ``mesh`` is then the whole SPMD mesh
            the parameters are DTensors on (``Replicate()`` on its data-parallel dims), and
            the unit shards over the dim named ``shard`` (replicating over ``replicate``):
            NOTE [SPMD meshes] in spmd.py. One name each.

    Returns:
        ``module`` (the list, for a list), changed in place.
    """
    modules = list(module) if isinstance(module, list) else [module]
    check_modules(modules)
    unit_name = "unit " + "+".join(type(m).__name__ for m in modules)
    spmd = None  # NOTE [SPMD meshes]: the unit shards over the data-parallel submesh
    if dp_mesh_dims is not None:
        spmd = SpmdMesh.of(mesh, dp_mesh_dims, unit_name)
        mesh = spmd.dp_mesh
    mp_policy, offload_policy = _our_policies(mp_policy, offload_policy)
    ignored = owned_ignored(modules, ignored_params or ())
    found, nested = collect(modules, ignored)
    states = [cast(FSDPModule, m)._fullshard_state for m in nested]
    children = list({id(s): s for s in states}.values())  # a list unit's modules share one
    info = mesh_info(mesh, param_device(found), unit_name)
    if info.device.type == "cpu":
        install_cpu_shard_rng()  # NOTE [Init after sharding]
    raf = _reshard_arg(reshard_after_forward, info, unit_name)
    check_params(found, children, unit_name, modules)
    tp = _tensor_parallel_specs(found, info, unit_name, spmd, raf)
    names = [f.fqns[0] for f in found]
    dims = shard_dims(shard_placement_fn, [f.param for f in found], names, info, unit_name)
    entries = [(f.fqns, f.param, f.refs) for f in found]
    check_same_model(unit_name, signature(entries, dims), info)
    # a tensor-parallel parameter is sharded by its local tensor (NOTE [Tensor parallel
    # parameters]): the unit's layout and collectives see only TP-local tensors
    local = [local_of(f.param) for f in found]
    params = [
        ShardedParam(f.fqns, f.refs, i, t.shape, f.param.requires_grad, info, f.owners, spec, d)
        for i, (f, t, spec, d) in enumerate(zip(found, local, tp, dims, strict=True))
    ]
    if mp_policy.param_dtype_override_fn is not None:  # torch 2.15's, once per parameter
        for sp, f in zip(params, found, strict=True):
            own = mp_policy.for_param(f.param).param_dtype
            sp.keeps_dtype = own is not None and own != mp_policy.param_dtype
    unit = CommUnit(
        type(modules[0]).__name__,
        modules[0],
        params,
        local,
        info,
        mp_policy,
        offload_policy,
    )
    # the one post-forward value: an int reshards after forward too, to the smaller group
    if isinstance(raf, int) and not isinstance(raf, bool):
        unit.set_post_forward_group(raf)
        unit.reshard_after_forward = True
    else:
        unit.reshard_after_forward = raf  # None: settled below, or at the root's lazy init
    _attach(modules, unit, found, children)
    return module


def _attach(
    modules: list[nn.Module], unit: CommUnit, found: list[Any], children: list[FSDPState]
) -> None:
    """The last step of :func:`fully_shard`: the modules show the sharded parameters, hold the
    unit's state and become FSDP modules; the units already sharded inside are its children."""
    for sp in unit.params:
        sp.sharded._fullshard_unit = unit  # type: ignore[attr-defined]
        sp.expose(unsharded=False)
    state = FSDPState(modules, unit)
    state.original_uids = {original_uid(f.param): f.fqns[0] for f in found}
    OPTIMIZER_GUARD.track([(f.fqns[0], f.param) for f in found])
    LOCAL_STEPS.install()  # NOTE [Local optimizer steps]
    for i, m in enumerate(modules):
        install_state_dict_hooks(m, unit, owner=i)
    for child in children:
        child.parent = state
        if child.unit.reshard_after_forward is None:
            child.unit.reshard_after_forward = True  # FSDP2's default below the root
    for m in modules:
        m._fullshard_state = state  # type: ignore[assignment]
        m.__class__ = fsdp_class(type(m))  # type: ignore[arg-type]
        register_with_torch(m)
        register_state_with_torch(m, state)  # NOTE [What pipelining reads from an FSDP2 module]


def _tensor_parallel_specs(
    found: list[Any], info: MeshInfo, unit_name: str, spmd: SpmdMesh | None, raf: bool | int | None
) -> list[Any]:
    """Each parameter's tensor-parallel spec (``None`` where it has none): NOTE [Tensor
    parallel parameters], or NOTE [SPMD meshes] when the mesh is the whole SPMD mesh."""
    if spmd is None:
        tp = check_tensor_parallel(found, info, unit_name)
    else:
        tp = list(spmd.specs([(f.fqns[0], f.param) for f in found], unit_name))
    if any(tp) and isinstance(raf, int) and not isinstance(raf, bool):
        raise FullshardError(
            f"{unit_name} (rank {info.rank}) holds tensor-parallel parameters; "
            f"reshard_after_forward={raf} (resharding to a smaller group) is not supported for "
            "them (nor by FSDP2): pass True or False."
        )
    return tp


def _our_policies(mp: Any, offload: Any) -> tuple[MixedPrecisionPolicy, OffloadPolicy | None]:
    """torch's own ``MixedPrecisionPolicy`` / ``CPUOffloadPolicy`` objects as fullshard's: a
    framework may have built them from ``torch.distributed.fsdp`` before ``fullshard.install()``
    routed those names here (an unrecognised offload policy would otherwise be ignored)."""
    if not isinstance(mp, MixedPrecisionPolicy):
        mp = MixedPrecisionPolicy(
            param_dtype=mp.param_dtype,
            reduce_dtype=mp.reduce_dtype,
            output_dtype=mp.output_dtype,
            cast_forward_inputs=mp.cast_forward_inputs,
            # torch 2.15's per-parameter override (torchtitan passes it on every call)
            param_dtype_override_fn=getattr(mp, "param_dtype_override_fn", None),
        )
    if offload is not None and not isinstance(offload, OffloadPolicy):
        if hasattr(offload, "pin_memory"):  # torch's CPUOffloadPolicy
            offload = CPUOffloadPolicy(pin_memory=offload.pin_memory)
        else:  # torch's OffloadPolicy(): no offloading
            offload = OffloadPolicy()
    return mp, offload


def _state_of(module: nn.Module) -> FSDPState | None:
    """``fully_shard.state(module)`` (FSDP2's accessor): the module's fullshard state (its unit,
    hooks and root), or None for a module ``fully_shard`` was not called on."""
    return getattr(module, "_fullshard_state", None)


fully_shard.state = _state_of  # type: ignore[attr-defined]

__all__ = [
    "FSDPModule",
    "GradientReductionHandle",
    "UnshardHandle",
    "fully_shard",
    "register_fsdp_forward_method",
    "share_comm_ctx",
]
