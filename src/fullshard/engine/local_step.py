"""Optimizer steps over local shards (layer 8): DTensor semantics between steps, plain-tensor
speed during them.

NOTE [Local optimizer steps]
A torch optimizer over DTensor parameters dispatches every op of its step through DTensor:
on the bench model (101 parameters) AdamW's foreach step took 8% longer than over plain
tensors viewing the same shards (``benchmarks/bench_optim.py``), as FSDP2's does. For optimizers
whose update is elementwise (SGD, Adam, AdamW, ...), the rows a rank holds are updated exactly
as the whole tensor would be (one exception: torch's CPU ``fused=True`` kernels compute the
elements past a tensor's last full vector in double precision, so there the bits depend on the
shard's length, which ``fullshard train --deterministic`` refuses), so the step itself needs no
DTensor: a global step pre-hook swaps,
for the duration of ``step()``, each fullshard parameter in the optimizer's groups for a plain
parameter over the same local tensor (its gradient and state likewise), and the post-hook swaps
them back, wrapping any state the step created as DTensors of the parameter's layout. Outside
``step()`` everything is as FSDP2 promises: parameters, gradients and optimizer state are
DTensors, so DCP state dicts and ``full_tensor()`` work. Optimizers that are not elementwise
(LBFGS, Muon, anything not listed) step over the DTensors, untouched. ``torch.optim.Muon``
works so, every rank running every matrix's Newton–Schulz through DTensor, and says once, in
a warning, that ``fullshard.optim.Muon`` splits that work over the ranks (NOTE [Matrices on
owners]).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from fullshard.engine.param import as_dtensor

# Exact classes whose update of an element depends only on that element's own history.
ELEMENTWISE = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adagrad,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Adadelta,
)


class _LocalSteps:
    """The pre/post hooks of NOTE [Local optimizer steps] (registered once per process)."""

    def __init__(self) -> None:
        # per optimizer in a step: (DTensor parameter, its local parameter, its DTensor state)
        self._swapped: dict[int, list[tuple[torch.Tensor, nn.Parameter, dict[str, Any]]]] = {}
        self.enabled = True
        self._handles: list[Any] = []
        self._told_muon = False

    def install(self) -> None:
        if not self._handles:
            self._handles = [
                register_optimizer_step_pre_hook(self._pre),
                register_optimizer_step_post_hook(self._post),
            ]

    def _pre(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if type(opt) is getattr(torch.optim, "Muon", None) and not self._told_muon:
            self._tell_muon(opt)
        if not self.enabled or type(opt) not in ELEMENTWISE:
            return
        swapped = []
        state = opt.state
        for group in opt.param_groups:
            params = group["params"]
            for i, p in enumerate(params):
                # the plain parameter over the same local tensor (ShardedParam keeps it)
                q = getattr(p, "_fullshard_local", None)
                if q is None:
                    continue
                grad = p.grad
                # ``local_of`` of the gradient and of each state value, inline: a step
                # visits every parameter
                q.grad = grad._local_tensor if isinstance(grad, DTensor) else grad
                before = state.pop(p, None) or {}
                if before:
                    local = {}  # a loop, not a comprehension: no call per parameter
                    for k, v in before.items():
                        local[k] = v._local_tensor if isinstance(v, DTensor) else v
                    state[q] = local
                params[i] = q
                swapped.append((p, q, before))
        if swapped:
            self._swapped[id(opt)] = swapped

    def _tell_muon(self, opt: torch.optim.Optimizer) -> None:
        """Once per process, when ``torch.optim.Muon`` holds fullshard's parameters."""
        if any(hasattr(p, "_fullshard_local") for g in opt.param_groups for p in g["params"]):
            self._told_muon = True
            warnings.warn(
                "torch.optim.Muon over fullshard's sharded parameters runs every matrix's "
                "Newton-Schulz through DTensor on every rank. fullshard.optim.Muon takes the "
                "same arguments (and AdamW groups: fullshard.optim.matrix_groups(model)) and "
                "runs each matrix's on one rank, with the same result.",
                UserWarning,
                stacklevel=4,
            )

    def _post(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        swapped = self._swapped.pop(id(opt), None)
        if swapped is None:
            return
        back = {id(q): p for p, q, _ in swapped}
        for group in opt.param_groups:
            params = group["params"]
            for i, q in enumerate(params):
                p = back.get(id(q))
                if p is not None:
                    params[i] = p
        state = opt.state
        for p, q, before in swapped:
            q.grad = None
            now = state.pop(q, None)
            if now is not None:
                # the usual case inline (a loop, no call per parameter): the state the step
                # updated in place is the one it was, a DTensor over it or a 0-dim tensor (a
                # step count) itself; ``_wrap`` decides the rest
                kept = {}
                for k, v in now.items():
                    was = before.get(k)
                    if was is not None and (
                        getattr(was, "_local_tensor", None) is v
                        or (was is v and isinstance(v, torch.Tensor) and v.dim() == 0)
                    ):
                        kept[k] = was
                    else:
                        kept[k] = _wrap(v, was, q, p)
                state[p] = kept


def _wrap(value: Any, before: Any, local: torch.Tensor, param: torch.Tensor) -> Any:
    """State shaped like the local shard is a DTensor of the parameter's layout: the one it was
    before the step when the step updated it in place (the usual case), else a new wrapper."""
    if before is not None and getattr(before, "_local_tensor", None) is value:
        return before
    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == local.shape:
        return as_dtensor(value, param)
    return value


LOCAL_STEPS = _LocalSteps()
