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
            total = torch.maximum(total, torch.stack(norms).max().double().to(device))
        else:
            norms = torch._foreach_norm(ts, norm_type, dtype=torch.float64)
            total += torch.stack(norms).pow(norm_type).sum().to(device)
    return total


def _by_device_and_dtype(grads: list[torch.Tensor]) -> dict[Any, list[torch.Tensor]]:
    """The local (detached) gradients by (device, dtype); empty shards (more ranks than rows)
    contribute nothing and are left out."""
    out: dict[Any, list[torch.Tensor]] = {}
    for g in map(local_of, grads):
        if g.numel():
            out.setdefault((g.device, g.dtype), []).append(g.detach())
    return out


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
    norm_type = float(norm_type)
    inf = math.isinf(norm_type)
    device = with_grad[0].device if with_grad else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float64, device=device)
    sharded_ids: set[int] = set()
    for (group, tp_group), (comm_device, ps) in _groups(with_grad).items():
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
    norm = total if inf else total ** (1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(norm):
        raise RuntimeError(f"the total norm of gradients is non-finite ({norm.item()})")
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for (dev, dtype), ts in _by_device_and_dtype([p.grad for p in with_grad]).items():  # type: ignore[misc]
        torch._foreach_mul_(ts, coef.to(dev, dtype))
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
