"""A frozen quantized base weight that implements only what torch FSDP2's contract asks of a
tensor-subclass parameter, as torchao's ``NF4Tensor`` does (issue 41).

``RowQuant`` keeps a weight as int8 rows (``qdata``) and one float scale per row (``scale``):
no inner tensor has the weight's shape and dtype, so its shard cannot live in a unit's flat
buffer and is a tensor of its own (NOTE [Shards of their own] in ``engine/copy_in.py``). Like
``NF4Tensor`` it answers only the aten ops FSDP2 applies to a parameter (``_fsdp_param.py``):

- at ``fully_shard``: ``torch.chunk`` (``aten.split``) of the full tensor, ``new_zeros`` of the
  shard's size, ``copy_`` of the chunk into it, and ``narrow(0, 0, rows)`` of it, which reaches
  the subclass as a ``slice`` that keeps every row (the only slice it accepts: like
  ``NF4Tensor``'s, one that starts past row 0 raises ``NotImplementedError``); ``view(-1)`` of
  it; ``detach`` (``nn.Parameter``, ``DTensor``);
- at every gather: ``fsdp_pre_all_gather`` (this rank's ``qdata`` and ``scale``) and
  ``fsdp_post_all_gather`` (a ``RowQuant`` around the gathered ones, refilled in place later),
  whose result is viewed at the parameter's shape with ``as_strided`` (contiguous, offset 0);
- ``is_pinned`` / ``_pin_memory`` for ``CPUOffloadPolicy``, ``_to_copy`` to move a shard.

Every other op raises ``NotImplementedError`` naming it. Each op the subclass answers is
recorded in ``OPS_SEEN`` (per process), so a test can compare what each implementation of
``fully_shard`` asked of it. ``linear`` computes with it as torchao's ``linear_nf4`` does:
the weight dequantized in forward, and saved for backward as it is.
"""

from __future__ import annotations

from typing import Any

import torch

aten = torch.ops.aten
OPS_SEEN: set[str] = set()


def quantize(w: torch.Tensor) -> RowQuant:
    """``w`` (2-D) as int8 rows with a float32 scale per row."""
    scale = (w.detach().abs().amax(dim=1) / 127.0).clamp(min=1e-12).to(torch.float32)
    q = (w.detach().to(torch.float32) / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
    return RowQuant(q, scale, w.dtype)


class RowQuant(torch.Tensor):
    """int8 rows and a scale per row; its shape and dtype are the weight's (NOTE above)."""

    qdata: torch.Tensor
    scale: torch.Tensor

    @staticmethod
    def __new__(cls, qdata: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> RowQuant:  # noqa: PYI034
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined,no-any-return]
            cls, qdata.shape, dtype=dtype, device=qdata.device, requires_grad=False
        )

    def __init__(self, qdata: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> None:
        self.qdata, self.scale = qdata, scale

    def __repr__(self) -> str:  # type: ignore[override]
        return f"RowQuant(shape={tuple(self.shape)}, dtype={self.dtype})"

    # the traceable-subclass protocol torchao's subclasses follow: not FSDP2's contract, read by
    # fullshard only to see that no inner tensor holds the values in the weight's dtype (so the
    # shard is a tensor of its own), and by the CUDA emulation to model a device move
    def __tensor_flatten__(self) -> tuple[list[str], torch.dtype]:
        return ["qdata", "scale"], self.dtype

    @staticmethod
    def __tensor_unflatten__(inner: dict, dtype: torch.dtype, size: Any, stride: Any) -> RowQuant:
        return RowQuant(inner["qdata"], inner["scale"], dtype)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.qdata.to(torch.float32) * self.scale[:, None]).to(dtype)

    def _like(self, qdata: torch.Tensor, scale: torch.Tensor) -> RowQuant:
        return RowQuant(qdata, scale, self.dtype)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        handler = _OPS.get(func)
        if handler is None:
            raise NotImplementedError(f"RowQuant does not implement {func}")
        OPS_SEEN.add(str(func))
        return handler(*args, **kwargs)

    # -- FSDP2's all-gather extension ---------------------------------------------------------
    def fsdp_pre_all_gather(self, mesh: Any) -> tuple[tuple[torch.Tensor, ...], Any]:
        return (self.qdata, self.scale), self.dtype

    def fsdp_post_all_gather(
        self,
        outputs: tuple[torch.Tensor, ...],
        metadata: Any,
        param_dtype: torch.dtype,
        *,
        out: torch.Tensor | None = None,
    ) -> Any:
        qdata, scale = outputs
        if out is not None:  # refilled in place: the outputs are the storages it was built on
            assert isinstance(out, RowQuant)
            assert out.qdata.untyped_storage().data_ptr() == qdata.untyped_storage().data_ptr()
            return None
        return RowQuant(qdata, scale, metadata), (qdata, scale)


class _Linear(torch.autograd.Function):
    """``x @ w.T`` saving the ``RowQuant`` itself for backward, as torchao's ``LinearNF4``: the
    backward reads the gathered weight after the adapters beside it have their gradients."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: RowQuant) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(w)
        return x @ w.dequantize(x.dtype).t()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        (w,) = ctx.saved_tensors
        return grad @ w.dequantize(grad.dtype), None


def linear(x: torch.Tensor, w: RowQuant) -> torch.Tensor:
    return _Linear.apply(x, w)  # type: ignore[no-any-return]


def _split(t: RowQuant, size: int, dim: int = 0) -> list[RowQuant]:
    if dim != 0:
        raise NotImplementedError(f"aten.split(RowQuant) with dim={dim}")
    pairs = zip(t.qdata.split(size), t.scale.split(size), strict=True)
    return [t._like(q, s) for q, s in pairs]


def _new_zeros(t: RowQuant, size: Any, **kw: Any) -> RowQuant:
    if len(size) != 2 or size[1] != t.shape[1]:
        raise NotImplementedError(f"aten.new_zeros(RowQuant) with size={list(size)}")
    return t._like(t.qdata.new_zeros(size), t.scale.new_zeros(size[0]))


def _copy(dst: RowQuant, src: Any, non_blocking: bool = False) -> RowQuant:
    if not isinstance(src, RowQuant):
        raise NotImplementedError("aten.copy_(RowQuant) from a plain tensor")
    dst.qdata.copy_(src.qdata)
    dst.scale.copy_(src.scale)
    return dst


def _slice(t: RowQuant, dim: int = 0, start: Any = None, end: Any = None, step: int = 1) -> Any:
    rows = t.shape[0]
    if dim != 0 or step != 1 or (start or 0) != 0 or (end is not None and end < rows):
        raise NotImplementedError(f"aten.slice(RowQuant) with dim={dim} start={start} end={end}")
    return t._like(t.qdata, t.scale)


def _view(t: RowQuant, size: Any) -> Any:
    if list(size) not in ([-1], [t.numel()], list(t.shape)):
        raise NotImplementedError(f"aten.view(RowQuant) with size={list(size)}")
    return t._like(t.qdata, t.scale)  # FSDP2 keeps view(-1) only to compare storages


def _as_strided(t: RowQuant, size: Any, stride: Any, storage_offset: Any = None) -> Any:
    if list(size) != list(t.shape) or list(stride) != [t.shape[1], 1] or storage_offset:
        raise NotImplementedError(f"aten.as_strided(RowQuant) with size={list(size)}")
    return t._like(t.qdata, t.scale)  # the gathered parameter at its own shape


def _to_copy(t: RowQuant, **kw: Any) -> Any:
    if kw.get("dtype") not in (None, t.dtype):
        raise NotImplementedError("aten._to_copy(RowQuant) to another dtype")
    move = {k: v for k, v in kw.items() if k in ("device", "non_blocking")}
    return t._like(t.qdata.to(**move, copy=True), t.scale.to(**move, copy=True))


_OPS = {
    aten.split.Tensor: _split,
    aten.new_zeros.default: _new_zeros,
    aten.copy_.default: _copy,
    aten.slice.Tensor: _slice,
    aten.view.default: _view,
    aten.as_strided.default: _as_strided,
    aten.detach.default: lambda t: t._like(t.qdata.detach(), t.scale.detach()),
    aten.is_pinned.default: lambda t, device=None: t.qdata.is_pinned() and t.scale.is_pinned(),
    aten._pin_memory.default: lambda t, device=None: t._like(
        t.qdata.pin_memory(), t.scale.pin_memory()
    ),
    aten._to_copy.default: _to_copy,
}
