"""Model and optimizer state dicts for checkpoints (layer 9).

Same call shapes and the same format as ``torch.distributed.checkpoint.state_dict`` with FSDP2:

- model: ``{fqn: DTensor}`` (``module.state_dict()``, each parameter ``Shard(0)``, or the
  ``Shard(k)`` of its ``shard_placement_fn``, over the rank's shard, no copy) plus plain buffers;
- optimizer: ``{"state": {fqn: {name: DTensor | tensor}}, "param_groups": [{..., "params":
  [fqn, ...]}]}``; every state tensor shaped like its parameter's shard becomes a DTensor with
  the parameter's placements and global shape, so DCP reshards it like the parameter; scalars
  (``step``) stay plain tensors.

That sameness is what lets a DCP checkpoint written by torch's FSDP2 load into fullshard and the
other way round.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from fullshard.comm.control import broadcast_tensor
from fullshard.engine.param import as_dtensor
from fullshard.engine.unit import CommUnit
from fullshard.engine.view import units
from fullshard.policies import FullshardError

_Optimizers = torch.optim.Optimizer | Iterable[torch.optim.Optimizer]


def _optimizers(optimizers: _Optimizers) -> list[torch.optim.Optimizer]:
    if isinstance(optimizers, torch.optim.Optimizer):
        return [optimizers]
    return list(optimizers)


def _param_index(model: nn.Module) -> dict[int, tuple[str, CommUnit | None, int]]:
    """id(sharded parameter) -> (fqn, its unit or None, its index in the unit).

    Built from the units, not from ``named_parameters()``, so it is right even while a unit is
    gathered; a tied parameter is named by its first name, like torch does.
    """
    out: dict[int, tuple[str, CommUnit | None, int]] = {}
    for view in units(model):
        for i, (sp, fqn) in enumerate(zip(view.unit.params, view.param_names, strict=True)):
            out[id(sp.sharded)] = (fqn, view.unit, i)
    for fqn, param in model.named_parameters():  # parameters no unit manages
        out.setdefault(id(param), (fqn, None, -1))
    return out


def _init_optim_state(opt: torch.optim.Optimizer) -> None:
    """Create the optimizer's state (zero gradients, lr 0) so a loader has tensors to fill.

    A fresh optimizer has no state until its first step, and DCP loads only into keys that
    exist; torch's ``get_state_dict`` does the same. Loading then overwrites all of it.
    """
    params = [p for g in opt.param_groups for p in g["params"] if p.requires_grad]
    if not params or all(p in opt.state for p in params):
        return
    lrs = [g.get("lr") for g in opt.param_groups]
    for g in opt.param_groups:
        if "lr" in g:
            g["lr"] = torch.zeros_like(g["lr"]) if isinstance(g["lr"], torch.Tensor) else 0.0
    grads = [p.grad for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    for g, lr in zip(opt.param_groups, lrs, strict=True):
        if lr is not None:
            g["lr"] = lr


def get_state_dict(
    model: nn.Module, optimizers: _Optimizers = ()
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(model_state_dict, optimizer_state_dict)`` as DTensor shards keyed by FQN.

    No communication and no copies: every DTensor wraps this rank's own tensor, so
    ``torch.distributed.checkpoint.save`` writes each rank's shard and nobody gathers the model.
    """
    model_sd = model.state_dict()
    index = _param_index(model)
    optim_sd: dict[str, Any] = {"state": {}, "param_groups": []}
    for opt in _optimizers(optimizers):
        _init_optim_state(opt)
        native = opt.state_dict()
        for group, native_group in zip(opt.param_groups, native["param_groups"], strict=True):
            fqns = []
            for p, pid in zip(group["params"], native_group["params"], strict=True):
                if id(p) not in index:
                    raise FullshardError(
                        "the optimizer holds a parameter that is not in the model; build the "
                        "optimizer after fully_shard, from model.parameters()."
                    )
                fqn, unit, i = index[id(p)]
                fqns.append(fqn)
                state = native["state"].get(pid)
                if state is None:
                    continue
                if unit is not None:
                    state = {k: unit.params[i].state_as_dtensor(v) for k, v in state.items()}
                optim_sd["state"][fqn] = state
            optim_sd["param_groups"].append(
                {**{k: v for k, v in native_group.items() if k != "params"}, "params": fqns}
            )
    return model_sd, optim_sd


def _local(value: Any, unit: CommUnit | None, index: int, key: str) -> Any:
    """A saved state tensor in this rank's layout: a DTensor like the parameter for
    parameter-shaped state (any saved layout), as it is otherwise."""
    if not isinstance(value, torch.Tensor):
        return value
    if unit is None:
        return value.full_tensor() if isinstance(value, DTensor) else value
    sp = unit.params[index]
    if value.dim() == 0 or (not isinstance(value, DTensor) and value.shape != sp.global_shape):
        return value
    return as_dtensor(sp.shard_of(value, key).to(sp.local.device), sp.sharded)


def set_state_dict(
    model: nn.Module,
    optimizers: _Optimizers = (),
    *,
    model_state_dict: dict[str, Any] | None = None,
    optim_state_dict: dict[str, Any] | None = None,
) -> None:
    """Load what :func:`get_state_dict` (or torch's, for an FSDP2 model) produced.

    DTensors of any layout are accepted: the same layout is copied as is, any other one (another
    world size, FSDP2's ``Shard(0)``, a full tensor) is resharded to this rank's rows.
    """
    if model_state_dict is not None:
        model.load_state_dict(model_state_dict)
    if optim_state_dict is None:
        return
    index = _param_index(model)
    saved_state = optim_state_dict.get("state", {})
    saved_groups = optim_state_dict.get("param_groups", [])
    for opt in _optimizers(optimizers):
        native_state: dict[int, Any] = {}
        native_groups = []
        pid = 0
        for gi, group in enumerate(opt.param_groups):
            saved_group = _matching_group(group, saved_groups, index, gi)
            ids = []
            for p in group["params"]:
                fqn, unit, i = index[id(p)]
                if fqn in saved_state:
                    native_state[pid] = {
                        k: _local(v, unit, i, f"optimizer state {fqn}.{k}")
                        for k, v in saved_state[fqn].items()
                    }
                ids.append(pid)
                pid += 1
            native_groups.append(
                {**{k: v for k, v in saved_group.items() if k != "params"}, "params": ids}
            )
        opt.load_state_dict({"state": native_state, "param_groups": native_groups})


def _matching_group(
    group: dict[str, Any], saved: list[dict[str, Any]], index: dict[int, Any], gi: int
) -> dict[str, Any]:
    fqns = {index[id(p)][0] for p in group["params"]}
    for s in saved:
        if set(s.get("params", [])) & fqns:
            return s
    if gi < len(saved):
        return saved[gi]
    raise FullshardError(
        f"optimizer param group {gi} ({sorted(fqns)[:3]}...) has no match in the saved optimizer "
        "state; build the optimizer with the same parameter groups as the one that was saved."
    )


def broadcast_from_rank0(model: nn.Module, full_state_dict: dict[str, Any] | None = None) -> None:
    """Make every rank's model equal rank 0's: parameters and buffers, sharded or not.

    - Before ``fully_shard``: call ``broadcast_from_rank0(model)`` on every rank; each parameter
      and buffer is broadcast in place (like DDP's ``sync_module_states``).
    - After ``fully_shard``: rank 0 passes the full state dict it has (e.g. taken from the
      unwrapped model, or loaded from a file); the other ranks pass ``None`` and may have built
      the model on the meta device and called ``to_empty``. Every rank then keeps its own rows.

    A collective: one broadcast per tensor.
    """
    rank = dist.get_rank()
    managed: set[str] = set()
    for view in units(model):
        unit = view.unit
        unit.refresh_shards()  # adopt tensors that to_empty() replaced
        for sp in unit.params:
            names = view.names_of(sp)
            key = names[0]
            managed.update(names)
            if rank == 0:
                if full_state_dict is None or key not in full_state_dict:
                    raise FullshardError(
                        f"broadcast_from_rank0: rank 0 needs the full state dict of a sharded "
                        f"model, and it has no entry '{key}'."
                    )
                full = full_state_dict[key].detach().to(unit.mesh.device, sp.sharded.dtype)
            else:
                full = torch.empty(sp.global_shape, dtype=sp.sharded.dtype, device=unit.mesh.device)
            broadcast_tensor(full, 0, what=f"broadcast_from_rank0 of '{key}'")
            with torch.no_grad():
                sp.local.copy_(sp.shard_of(full, key))
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if name in managed or t.is_meta:
                continue
            if rank == 0 and full_state_dict is not None and name in full_state_dict:
                t.copy_(full_state_dict[name])
            broadcast_tensor(t.data, 0, what=f"broadcast_from_rank0 of '{name}'")
