"""Gradients over shards (layer 8): global-norm clipping and the fp16 gradient scaler.

Each rank holds a disjoint slice of every sharded gradient, so anything that looks at "the
gradient" as a whole (its norm, whether it has an inf/NaN) must combine the ranks' views with
one small collective, and every rank must reach the same answer.

Clipping: the global ``p``-norm is the ``p``-th root of the all-reduced sum of local ``|g|^p``
(a max for the inf-norm). Gradients of parameters fullshard does not manage are replicated: they
are added once, after the reduce, so they are not counted ``world`` times.

Scaling: ``torch.amp.GradScaler`` checks this rank's gradients for inf/NaN. With sharded
gradients one rank could skip the step while the others take it, and the shards would silently
diverge; ``ShardedGradScaler`` all-reduces the finding (MAX) so every rank makes the same
decision: all step, or all skip and lower the scale.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from fullshard.comm.collectives import all_reduce
from fullshard.comm.mesh import default_timeout
from fullshard.engine.param import local_of

_Key = tuple[dist.ProcessGroup, "dist.ProcessGroup | None"]


def _groups(
    params: list[torch.Tensor],
) -> dict[_Key, tuple[torch.device, list[torch.Tensor]]]:
    """Sharded parameters by (shard group, TP group), with the device they communicate on.

    The TP group is set for a tensor-parallel parameter that TP shards (NOTE [Tensor parallel
    parameters]): its TP ranks hold different pieces, so their sums add up too. A parameter TP
    replicates holds the same values on every TP rank and is counted once (no TP group).
    """
    out: dict[_Key, tuple[torch.device, list[torch.Tensor]]] = {}
    for p in params:
        unit = getattr(p, "_fullshard_unit", None)
        if unit is None:
            continue
        tp_group = None
        dp_dims = unit.mesh.device_mesh.ndim
        if isinstance(p, DTensor) and any(isinstance(x, Shard) for x in p.placements[dp_dims:]):
            tp_group = p.device_mesh.get_group(dp_dims)
        out.setdefault((unit.mesh.group, tp_group), (unit.mesh.device, []))[1].append(p)
    return out


def _local(grads: list[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    """This rank's contribution: max |g| for the inf-norm, else sum of |g|^p (in float64).

    One foreach norm per device and dtype (as torch's ``clip_grad_norm_``), not a few kernels
    per parameter."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    for ts in _by_device_and_dtype(grads).values():
        if math.isinf(norm_type):
            norms = torch._foreach_norm(ts, math.inf)
            total = torch.maximum(total, _onto(torch.stack(norms).max().double(), ts, device))
        else:
            norms = torch._foreach_norm(ts, norm_type, dtype=torch.float64)
            total += _onto(torch.stack(norms).pow(norm_type).sum(), ts, device)
    return total


def _onto(part: torch.Tensor, grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """``part`` (computed where ``grads`` live) on ``device``. From offloaded gradients in
    pinned memory it goes through a pinned buffer, asynchronously: a pageable host-to-GPU copy
    would make the host wait for the device (a synchronisation every step)."""
    if grads[0].is_pinned():
        return part.pin_memory().to(device, non_blocking=True)
    return part.to(device)


def _by_device_and_dtype(grads: list[torch.Tensor]) -> dict[Any, list[torch.Tensor]]:
    """The local (detached) gradients by (device, dtype); empty shards (more ranks than rows)
    contribute nothing and are left out."""
    out: dict[Any, list[torch.Tensor]] = {}
    for g in map(local_of, grads):
        if g.numel():
            out.setdefault((g.device, g.dtype), []).append(g.detach())
    return out


def total_norm(
    parameters: torch.Tensor | Iterable[torch.Tensor], norm_type: float = 2.0
) -> torch.Tensor:
    """The global ``norm_type``-norm of the (sharded) parameters' gradients, float64 on the
    device its collectives run on; the gradients are left as they are. Call it on every rank with the same
    parameters: it communicates once per process group."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    with_grad = [p for p in params if p.grad is not None]
    norm_type = float(norm_type)
    inf = math.isinf(norm_type)
    groups = _groups(with_grad)
    # the norm stays where the collectives run: with gradients offloaded to the host, putting
    # it on their device would copy it back to the host (blocking) every step
    device = (
        next(iter(groups.values()))[0]
        if groups
        else with_grad[0].device
        if with_grad
        else torch.device("cpu")
    )
    total = torch.zeros((), dtype=torch.float64, device=device)
    sharded_ids: set[int] = set()
    for (group, tp_group), (comm_device, ps) in groups.items():
        sharded_ids.update(id(p) for p in ps)
        part = _local([p.grad for p in ps if p.grad is not None], norm_type, comm_device)
        op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
        for g in (group, tp_group):
            if g is not None:
                all_reduce(
                    part, g, op=op, what="clip_grad_norm_ all-reduce", timeout=default_timeout()
                ).wait()
        part = part.to(device)
        total = torch.maximum(total, part) if inf else total + part
    rest = [p.grad for p in with_grad if id(p) not in sharded_ids and p.grad is not None]
    if rest:
        # not ours: replicated tensors count once; other DTensors (tensor parallel) are whole
        part = _local(
            [g.full_tensor() if isinstance(g, DTensor) else g for g in rest], norm_type, device
        )
        total = torch.maximum(total, part) if inf else total + part
    return total if inf else total ** (1.0 / norm_type)


def scale_(parameters: Iterable[torch.Tensor], max_norm: float, norm: torch.Tensor | float) -> None:
    """Multiply the parameters' gradients by ``min(1, max_norm / (norm + 1e-6))``: one foreach
    multiply per device and dtype. ``norm``: a device tensor (nothing is read on the host), or
    a float the host has read already; with gradients on the host (CPU offload) the latter
    avoids copying the coefficient from the device, which would make the host wait for it."""
    on_device = isinstance(norm, torch.Tensor)
    if isinstance(norm, torch.Tensor):
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    else:  # the same float64 arithmetic, on the host
        coef = torch.tensor(min(max_norm / (norm + 1e-6), 1.0), dtype=torch.float64)
    grads = [p.grad for p in parameters if p.grad is not None]
    for (dev, dtype), ts in _by_device_and_dtype(grads).items():
        if on_device and ts[0].is_pinned():
            # offloaded gradients: the host kernel needs the value (a blocking copy, as FSDP2's)
            torch._foreach_mul_(ts, coef.cpu().to(dtype))
        else:  # on one device already: a cast only (to(dev) would be read as a copy there)
            torch._foreach_mul_(ts, coef.to(dtype) if coef.device == dev else coef.to(dev, dtype))


def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """Clip gradients of (sharded) parameters by their global norm; returns that norm.

    Call it on every rank with the same parameters: it communicates once per process group.
    """
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    with_grad = [p for p in params if p.grad is not None]
    norm = total_norm(with_grad, norm_type)
    if error_if_nonfinite and not torch.isfinite(norm):
        raise RuntimeError(f"the total norm of gradients is non-finite ({norm.item()})")
    scale_(with_grad, max_norm, norm)
    return norm.to(
        with_grad[0].grad.dtype if with_grad and with_grad[0].grad is not None else torch.float32
    )


class ShardedGradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` whose inf/NaN decision is the same on every rank."""

    def __init__(
        self,
        device: str = "cuda",
        *,
        process_group: dist.ProcessGroup | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(device, **kwargs)
        self.process_group = process_group

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        super().unscale_(optimizer)
        if not self._enabled:
            return
        state = self._per_optimizer_states[id(optimizer)]
        found: dict[torch.device, torch.Tensor] = state["found_inf_per_device"]
        if not found:  # a rank whose shards are all empty still takes part in the decision
            assert self._scale is not None
            found[self._scale.device] = torch.zeros(1, device=self._scale.device)
        total = torch.stack([v.reshape(()).float() for v in found.values()]).max().reshape(1)
        all_reduce(
            total,
            self.process_group,
            op=dist.ReduceOp.MAX,
            what="ShardedGradScaler inf/NaN all-reduce",
            timeout=default_timeout(),
        ).wait()
        for v in found.values():
            v.copy_(total.to(v.device).reshape(v.shape))
