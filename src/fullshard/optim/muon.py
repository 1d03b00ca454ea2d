"""Muon over sharded parameters: ``torch.optim.Muon``'s arguments, its arithmetic bit for bit,
each matrix's Newton–Schulz on one owner rank (NOTE [Matrices on owners]).

Per matrix, as ``torch.optim.Muon`` on one process: ``buf.lerp_(grad, 1 - momentum)``, the
Nesterov blend ``grad.lerp(buf, momentum)`` (or ``buf``), torch's own
``_zeropower_via_newtonschulz`` on the whole of it, then ``p.mul_(1 - lr * weight_decay)`` and
``p.add_(update, alpha=-adjusted_lr)`` with torch's ``_adjust_lr`` of the global shape. The
elementwise steps run on each rank's rows (the same bits on any slice), Newton–Schulz on the
owner over the assembled matrix, so the result is one process's, bit for bit, given the same
gradients. Torch's Newton–Schulz casts its input to bf16 first; the rows are cast before they
travel (the same bits, half the bytes) unless the function was replaced (a test's fp64 one).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.optim import _muon
from torch.optim.optimizer import _to_scalar

from fullshard.optim.exchange import ns_flops
from fullshard.optim.matrix import MatrixOptimizer

__all__ = ["Muon"]


def _is_torchs(fn: Any) -> bool:
    """Is ``fn`` torch's own Newton–Schulz (not a replacement, e.g. a test's fp64 one)?"""
    return getattr(fn, "__module__", None) == "torch.optim._muon" and (
        getattr(fn, "__qualname__", None) == "_zeropower_via_newtonschulz"
    )


class Muon(MatrixOptimizer):
    """``torch.optim.Muon`` for fullshard's sharded parameters: the same arguments and
    defaults, and param groups with ``use_muon=False`` stepping AdamW (embeddings, the head,
    norms, biases; ``lr`` and ``weight_decay`` as Muon's unless the group sets them, AdamW's
    defaults for ``betas``, ``eps`` and the rest);
    :func:`fullshard.optim.matrix_groups` makes both groups from a model). Each 2-D
    parameter's Newton–Schulz runs on one rank (NOTE [Matrices on owners]); its momentum
    stays in rows beside the parameter's shard, so the state is ``1/N`` per rank and DCP
    saves and reshards it as AdamW's."""

    flag = "use_muon"

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = (
            _muon.DEFAULT_A,
            _muon.DEFAULT_B,
            _muon.DEFAULT_C,
        ),
        eps: float = _muon.EPS,
        ns_steps: int = _muon.DEFAULT_NS_STEPS,
        adjust_lr_fn: str | None = None,
    ) -> None:
        # torch.optim.Muon's checks and messages
        for what, value in (
            ("Learning rate", lr),
            ("momentum", momentum),
            ("weight decay", weight_decay),
        ):
            if not value >= 0.0:
                raise ValueError(f"{what} should be >= 0 but is: {value}")
        if adjust_lr_fn is not None and adjust_lr_fn not in ("original", "match_rms_adamw"):
            raise ValueError(f"Adjust learning rate function {adjust_lr_fn} is not supported")
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": ns_coefficients,
            "eps": eps,
            "ns_steps": ns_steps,
            "adjust_lr_fn": adjust_lr_fn,
        }
        super().__init__(params, defaults)

    def rows(self, group: dict[str, Any], p: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        buf = self.state_of(p, "momentum_buffer", grad)
        buf.lerp_(grad, 1 - group["momentum"])
        return grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf

    def whole(self, group: dict[str, Any], matrix: torch.Tensor) -> torch.Tensor:
        # looked up at each call: torch's function, or whatever replaced it
        return _muon._zeropower_via_newtonschulz(  # type: ignore[no-any-return]
            matrix, group["ns_coefficients"], group["ns_steps"], group["eps"]
        )

    def apply(
        self, group: dict[str, Any], p: torch.Tensor, shape: torch.Size, result: torch.Tensor
    ) -> None:
        lr = _to_scalar(group["lr"])
        adjusted = _muon._adjust_lr(lr, group["adjust_lr_fn"], shape)
        p.mul_(1 - lr * group["weight_decay"])
        p.add_(result, alpha=-adjusted)

    def cost(self, group: dict[str, Any], shape: Sequence[int]) -> float:
        return float(ns_flops(shape, group["ns_steps"]))

    def wire_dtype(self, group: dict[str, Any], dtype: torch.dtype) -> torch.dtype:
        # torch's function starts with ``grad.bfloat16()`` of the whole: the rows' casts are
        # the same bits
        return torch.bfloat16 if _is_torchs(_muon._zeropower_via_newtonschulz) else dtype
