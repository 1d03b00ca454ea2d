"""A toy of torchao's float8 weight: a tensor subclass that all-gathers itself quantized.

``QuantWeight`` wraps a high-precision tensor (its values; the optimizer updates them) and
implements FSDP2's all-gather extension contract:

- ``fsdp_pre_all_gather`` quantizes this rank's rows to ``wire`` (``torch.float8_e4m3fn`` or
  ``torch.int8``) with one scale for the tensor. ``scale="shard"``: the scale is this rank's
  own, sent in the all-gather beside the data (two inputs of different dtypes); ``"global"``:
  the ranks agree on one scale with an all-reduce of the amax inside the hook (as torchao's
  dynamic scaling does), and the scale travels as metadata.
- ``fsdp_post_all_gather`` dequantizes the gathered rows to ``param_dtype``: the gathered
  parameter the module computes with is a plain tensor.

``pad``: whether the hook pads a short rank's rows to ``ceil(rows / world)`` itself (FSDP2
requires it) or leaves that to fullshard. ``fake_quant`` is the same quantization done in one
process on the same row chunks: the parity reference.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn

WIRE_MAX = {torch.float8_e4m3fn: 448.0, torch.int8: 127.0}

# ops whose results stay a QuantWeight (views, copies, detach: what sharding and optimizers do)
_KEEP = {
    torch.ops.aten.detach.default,
    torch.ops.aten.alias.default,
    torch.ops.aten.view.default,
    torch.ops.aten.slice.Tensor,
    torch.ops.aten.as_strided.default,
    torch.ops.aten._to_copy.default,
    torch.ops.aten.clone.default,
    torch.ops.aten.empty_like.default,
    torch.ops.aten.new_zeros.default,
    torch.ops.aten.copy_.default,
    torch.ops.aten.split.Tensor,
}


def quantize(x: torch.Tensor, wire: torch.dtype, scale: torch.Tensor | None = None) -> Any:
    """``x`` as ``wire`` values and the float32 scale they are multiplied by."""
    if scale is None:
        amax = x.detach().abs().max() if x.numel() else torch.zeros((), dtype=x.dtype)
        scale = (amax.to(torch.float32) / WIRE_MAX[wire]).clamp(min=1e-12)
    q = x.detach().to(torch.float32) / scale
    if wire == torch.int8:
        q = q.round().clamp(-127, 127)
    return q.to(wire), scale.reshape(1)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.to(torch.float32) * scale).to(dtype)


def fake_quant(
    w: torch.Tensor, world: int, wire: torch.dtype, scale: str, dtype: torch.dtype
) -> torch.Tensor:
    """What the module sees after a gather, computed in one process from the full ``w``."""
    if scale == "global":
        q, s = quantize(w, wire)
        return dequantize(q, s, dtype)
    parts = [dequantize(*quantize(c, wire), dtype) for c in torch.chunk(w.detach(), world)]
    return torch.cat(parts) if parts else w.detach().to(dtype)


class QuantWeight(torch.Tensor):
    """High-precision values that travel quantized (see the module docstring)."""

    _data: torch.Tensor

    @staticmethod
    def __new__(
        cls,
        data: torch.Tensor,
        wire: torch.dtype = torch.float8_e4m3fn,
        scale: str = "shard",
        pad: bool = True,
    ) -> QuantWeight:
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined,no-any-return]
            cls,
            data.shape,
            strides=data.stride(),
            storage_offset=data.storage_offset(),
            dtype=data.dtype,
            device=data.device,
            requires_grad=data.requires_grad,
        )

    def __init__(
        self,
        data: torch.Tensor,
        wire: torch.dtype = torch.float8_e4m3fn,
        scale: str = "shard",
        pad: bool = True,
    ) -> None:
        self._data = data
        self.wire = wire
        self.scale_mode = scale
        self.pad = pad
        self.gathers = 0  # how often fsdp_pre_all_gather ran on this object

    def _ctx(self) -> tuple[torch.dtype, str, bool]:
        return (self.wire, self.scale_mode, self.pad)

    def __repr__(self) -> str:  # type: ignore[override]
        return f"QuantWeight({self._data!r}, wire={self.wire})"

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        ctx: tuple[torch.dtype, str, bool] | None = None

        def unwrap(t: QuantWeight) -> torch.Tensor:
            nonlocal ctx
            ctx = ctx or t._ctx()
            return t._data

        args, kwargs = pytree.tree_map_only(QuantWeight, unwrap, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in _KEEP:
            return out
        assert ctx is not None
        return pytree.tree_map_only(torch.Tensor, lambda t: cls(t, *ctx), out)

    def __tensor_flatten__(self) -> tuple[list[str], tuple[Any, ...]]:
        return ["_data"], (type(self), *self._ctx())

    @staticmethod
    def __tensor_unflatten__(
        inner: dict[str, torch.Tensor], ctx: tuple[Any, ...], size: Any, stride: Any
    ) -> QuantWeight:
        return ctx[0](inner["_data"], *ctx[1:])  # type: ignore[no-any-return]

    # -- FSDP2's all-gather extension contract ----------------------------------------------
    def fsdp_pre_all_gather(
        self,
        mesh: Any,
        outer_size: torch.Size,
        outer_stride: tuple[int, ...],
        module: nn.Module,
        mp_policy: Any,
    ) -> tuple[tuple[torch.Tensor, ...], Any]:
        self.gathers += 1
        x = self._data
        world = mesh.size()
        rows = -(-outer_size[0] // world)
        if self.pad and x.shape[0] < rows:  # FSDP2's rule: same size on every rank
            padded = x.new_zeros((rows, *x.shape[1:]))
            padded[: x.shape[0]] = x
            x = padded
        if self.scale_mode == "global":
            amax = x.detach().abs().max().reshape(1).to(torch.float32)
            if not x.numel():
                amax = torch.zeros(1, dtype=torch.float32, device=x.device)
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=mesh.get_group())
            scale = (amax / WIRE_MAX[self.wire]).clamp(min=1e-12)
            q, s = quantize(x, self.wire, scale.reshape(()))
            return (q,), s
        q, s = quantize(x, self.wire)
        return (q, s), None

    def fsdp_post_all_gather(
        self,
        outputs: tuple[torch.Tensor, ...],
        metadata: Any,
        param_dtype: torch.dtype,
        *,
        out: torch.Tensor | None = None,
    ) -> Any:
        if self.scale_mode == "global":
            (q,) = outputs
            scale = metadata
        else:
            q, scale = outputs  # (world * rows, ...) and (world,): one scale per rank's block
            world = scale.numel()
            scale = scale.reshape(world, *([1] * q.dim())) if q.numel() else scale
            q = q.reshape(world, -1, *q.shape[1:]) if q.numel() else q
        full = dequantize(q, scale, param_dtype).reshape(-1, *outputs[0].shape[1:])
        if out is not None:  # the gathered parameter: the parameter's rows, padding cut off
            out.copy_(full.reshape(-1)[: out.numel()].view(out.shape))
            return None
        return full, (full,)


def quantize_linears(model: nn.Module, **kwargs: Any) -> list[str]:
    """Make every ``nn.Linear`` weight of ``model`` a ``QuantWeight``; returns their names."""
    names = []
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear):
            w = mod.weight
            mod.weight = nn.Parameter(
                QuantWeight(w.detach(), **kwargs), requires_grad=w.requires_grad
            )
            names.append(f"{name}.weight")
    return names


def wire_numel(shape: torch.Size, world: int) -> int:
    """Elements of one rank's quantized rows (padded) of a parameter of ``shape``."""
    return -(-shape[0] // world) * math.prod(shape[1:])
