"""Parameters gathered through FSDP2's all-gather extension hooks (layer 5): float8 weights.

NOTE [All-gather extensions]
torch FSDP2 lets a parameter's tensor subclass decide what its all-gather sends (torchao's
float8 training weights send float8 bytes instead of bf16/fp32 rows). The contract, kept
exactly so that the same subclasses work here:

- ``fsdp_pre_all_gather(mesh)`` or ``fsdp_pre_all_gather(mesh, outer_size, outer_stride,
  module, mp_policy)`` is called on the sharded parameter's local tensor (this rank's rows) at
  every gather and returns ``(inputs, metadata)``: the tensors to all-gather (e.g. float8 data
  and a scale) and anything the post hook needs. ``mesh`` is the 1-D shard mesh, ``outer_size``
  and ``outer_stride`` the parameter's full shape and contiguous stride, ``module`` the module
  holding it, ``mp_policy`` the unit's ``MixedPrecisionPolicy``.
- ``fsdp_post_all_gather(outputs, metadata, param_dtype, *, out=None)`` gets each input gathered
  from every rank (rank-major: ``(world * rows, *rest)``). The first time it returns
  ``(tensor, inner_tensors)``: the gathered parameter is ``tensor`` (viewed as the parameter's
  shape, so padding rows drop off) and ``inner_tensors`` are freed with it at reshard. Later
  gathers re-allocate those and call it with ``out=`` the gathered parameter, to refill it in
  place (autograd holds it; the write does not bump its version, as in NOTE [Gather writes do
  not bump versions]).

How fullshard carries it. The subclass's high-precision values still live in the unit's flat
shard buffer (``ExtensionGroup`` is a ``ShardGroup``): the sharded DTensor's local tensor is the
subclass wrapped around a view of that buffer (rebuilt with ``__tensor_flatten__`` /
``__tensor_unflatten__``), so the optimizer, state dicts, ``to_empty`` and the gradient
reduce-scatter (in the reduce dtype, like every parameter) are unchanged. Only the all-gather
differs: the group's part of the unit's send buffer is the hooks' inputs as bytes (then padding
to 16 bytes and, when it ends the unit, the position tag), concatenated with the other groups'
shards, so the unit still moves in ONE all-gather. The copy-out splits each input's bytes into
a persistent output tensor whose storage comes and goes like the gathered storage.
Parameters without the hooks pay nothing: their groups and send buffers are as before.

Shapes must agree across ranks (``all_gather_into_tensor``). FSDP2 requires an extension to pad
a short rank's rows itself; fullshard also accepts an input whose dim 0 is this rank's rows
where rank 0 (which always holds the full ``ceil(rows / N)``) sends that many, and pads it with
zero rows. The first gather of a unit exchanges every rank's input shapes once (one small
object all-gather per unit per process) and raises the same error on every rank when they
cannot be matched, instead of hanging; later gathers must keep those shapes.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parameter import is_lazy

from fullshard.comm.control import all_gather_objects
from fullshard.comm.desync import TAG_LEN, UNREGISTERED, write_static_tag
from fullshard.comm.mesh import MeshInfo
from fullshard.engine.param import GROUP_ALIGN_BYTES, GatheredStorage, ShardedParam, ShardGroup
from fullshard.policies import FullshardError, MixedPrecisionPolicy
from fullshard.shard.layout import chunk_rows, contiguous_stride, local_rows

PRE, POST = "fsdp_pre_all_gather", "fsdp_post_all_gather"


def is_tensor_subclass(t: torch.Tensor) -> bool:
    """A tensor subclass (not a plain tensor or ``nn.Parameter`` of one)."""
    return type(t) not in (torch.Tensor, nn.Parameter)


def has_extension_hooks(t: torch.Tensor) -> bool:
    return hasattr(t, PRE) or hasattr(t, POST)


def data_name(t: torch.Tensor) -> str | None:
    """The inner tensor of a traceable subclass that holds its values (its shape and dtype)."""
    flatten = getattr(t, "__tensor_flatten__", None)
    if flatten is None or not hasattr(type(t), "__tensor_unflatten__"):
        return None
    names, _ = flatten()
    hits = [n for n in names if getattr(t, n).shape == t.shape and getattr(t, n).dtype == t.dtype]
    return hits[0] if len(hits) == 1 else None


def values_of(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor holding a subclass's values (``t`` itself when plain)."""
    while is_tensor_subclass(t):
        name = data_name(t)
        assert name is not None  # checked by extension_problem at fully_shard
        t = getattr(t, name)
    return t


def _pre_arity(t: torch.Tensor) -> int:
    return len(inspect.signature(getattr(t, PRE)).parameters)


def _arity_problem(t: torch.Tensor) -> str:
    return (
        f"is a {type(t).__name__} whose {PRE} takes {_pre_arity(t)} arguments; torch FSDP2's "
        f"contract is {PRE}(self, mesh) or {PRE}(self, mesh, outer_size, outer_stride, module, "
        "mp_policy)."
    )


def no_hooks_problem(t: torch.Tensor) -> str:
    """What to do about a tensor subclass gathered without the hooks."""
    return (
        f"is a {type(t).__name__}, a tensor subclass without FSDP2's all-gather extension hooks "
        f"({PRE} / {POST}) at its first all-gather; fullshard would gather it as a plain "
        "tensor and lose what the subclass does. Implement both hooks on the class, or attach "
        "them to the sharded parameter's local tensor (param._local_tensor, after fully_shard "
        "and to_empty) before the first forward (torch FSDP2's contract; docs/design.md, "
        "'All-gather extensions'), or make it a plain parameter before fully_shard: "
        "nn.Parameter(p.detach().as_subclass(torch.Tensor)) for a subclass with its own "
        "storage, or its inner tensor for a wrapper."
    )


def extension_problem(t: torch.Tensor) -> str | None:
    """What keeps fullshard from sharding the tensor subclass ``t`` (a parameter's local
    tensor), said so that the caller can prefix where it is; None when nothing does."""
    if not is_tensor_subclass(t):
        return None
    kind = type(t).__name__
    if is_lazy(t):
        return (
            "is uninitialized (a lazy module's); run one forward (or initialize the lazy "
            "modules) before fully_shard."
        )
    has_pre, has_post = hasattr(t, PRE), hasattr(t, POST)
    if not has_pre and not has_post:
        return None  # hooks may still be attached to the local tensor (copy_in.py)
    if has_pre != has_post:
        missing = POST if has_pre else PRE
        return f"is a {kind} that defines only one of the all-gather hooks: add {missing}."
    if _pre_arity(t) not in (1, 5):
        return _arity_problem(t)
    return None


class Rewrap:
    """``ShardedParam.wrap_local``: a view of the flat buffer as the parameter's subclass, built
    like the current local tensor (``template``: its type, context and other inner tensors)."""

    def __init__(self, template: torch.Tensor) -> None:
        self.template = template

    def __call__(self, view: torch.Tensor) -> torch.Tensor:
        t = self.template
        names, ctx = t.__tensor_flatten__()  # type: ignore[attr-defined]
        inner = {n: getattr(t, n) for n in names}
        inner[data_name(t) or names[0]] = view
        out = type(t).__tensor_unflatten__(  # type: ignore[attr-defined]
            inner, ctx, view.shape, view.stride()
        )
        self.template = out
        return out  # type: ignore[no-any-return]


def _plain(t: torch.Tensor) -> torch.Tensor:
    """An all-gather input as a plain tensor: a subclass (a hook may return the local tensor
    itself) is copied out through its own dispatch, as FSDP2's copy-in does."""
    if not is_tensor_subclass(t):
        return t
    out = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    with torch.no_grad():
        out.copy_(t)
    return out


def _alloc(t: torch.Tensor) -> None:
    need = int((t.storage_offset() + t.numel()) * t.element_size())
    if t.untyped_storage().size() < need:
        t.untyped_storage().resize_(need)


def _free(t: torch.Tensor) -> None:
    if t.untyped_storage().size() != 0:
        t.untyped_storage().resize_(0)


@dataclass
class _Input:
    """One all-gather input of a parameter as every rank sends it."""

    shape: tuple[int, ...]  # what is sent (rank 0's shape: short ranks' rows padded to it)
    dtype: torch.dtype
    mine: tuple[int, ...]  # what this rank's hook returns

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()


@dataclass
class _Hooked:
    """A parameter's extension state between its hooks."""

    module: nn.Module
    hook: Any = None  # the pre hook ``arity`` was read from (hooks may be attached later)
    arity: int = 0
    inputs: list[_Input] = field(default_factory=list)  # agreed at the first gather
    metadata: Any = None
    outputs: list[torch.Tensor] = field(default_factory=list)  # (world * numel,) each
    inner: tuple[torch.Tensor, ...] = ()  # freed with the gathered parameter


class ExtensionGroup(ShardGroup):
    """Parameters of one dtype gathered through their subclass's hooks (the NOTE above)."""

    extension = True
    own_shards = False  # a CopyInGroup's shards are tensors of their own (copy_in.py)

    def __init__(
        self,
        params: list[ShardedParam],
        dtype: torch.dtype,
        compute_dtype: torch.dtype,
        mesh: MeshInfo,
        shard_device: torch.device,
        pin_memory: bool,
        tail: int,
        originals: list[torch.Tensor],
        mp_policy: MixedPrecisionPolicy,
    ) -> None:
        super().__init__(
            params, dtype, compute_dtype, mesh, shard_device, pin_memory, tail=0, align=False
        )
        self.tag_len = tail  # the tag is written into the send buffer, not the flat shard
        self.mp_policy = mp_policy
        self.index = UNREGISTERED
        self.hooked = [_Hooked(p.refs[0][0]) for p in params]
        self.trailer: torch.Tensor | None = None  # padding to 16 bytes, then the tag
        self._mesh: DeviceMesh | None = None
        if not self.own_shards:
            for p, t in zip(params, originals, strict=True):
                p.wrap_local = Rewrap(t)

    # -- the shards: values in the flat buffer, the subclass around them ------------------
    @property
    def aliased(self) -> bool:
        return False  # the hooks run even on one rank

    def values(self, p: ShardedParam) -> torch.Tensor:
        return values_of(p.local)

    def load(self, fulls: list[torch.Tensor]) -> None:
        super().load([values_of(t) for t in fulls])

    def reattach(self) -> None:
        for p in self.params:  # what _apply made: its other inner tensors moved too
            assert isinstance(p.wrap_local, Rewrap)
            p.wrap_local.template = p.local
        super().reattach()

    def build_storage(self) -> None:
        # the gathered parameters are the post hook's; they are made at the first gather
        self.storage = GatheredStorage(0, self.compute_dtype, self.mesh.device)

    def write_static_tag(self, index: int) -> None:
        self.index = index
        if self.trailer is not None and self.tag_len:
            write_static_tag(self.trailer[-TAG_LEN:], index)

    @property
    def shard_mesh(self) -> DeviceMesh:
        """FSDP2's ``mesh`` argument: the 1-D mesh of the shard group."""
        if self._mesh is None:
            m = self.mesh.device_mesh
            if m.ndim > 1:
                names = m.mesh_dim_names
                m = m[names[-1]] if names else DeviceMesh.from_group(self.mesh.group, m.device_type)
            self._mesh = m
        return self._mesh

    # -- the all-gather -------------------------------------------------------------------
    def _pre(self, p: ShardedParam, h: _Hooked) -> tuple[torch.Tensor, ...] | None:
        """The pre hook's inputs on the gather device; None when the local tensor has no hooks
        (looked up at every gather: FSDP2 lets them be attached to it after fully_shard)."""
        local = p.local
        if not hasattr(local, PRE) or not hasattr(local, POST):
            return None
        if local.device != self.mesh.device or self.pin_memory:
            # CPU offload: the hook runs where it gathers; pinned shards are host memory even
            # where the device is the CPU too (the CUDA emulation): an asynchronous copy
            local = local.to(self.mesh.device, non_blocking=True)
        hook = getattr(local, PRE)
        fn = getattr(hook, "__func__", hook)
        if fn is not h.hook:  # a new hook: read its arity once
            h.hook, h.arity = fn, _pre_arity(local)
            if h.arity not in (1, 5):
                raise FullshardError(
                    f"rank {self.mesh.rank}: parameter '{p.fqn}' of unit '{self.unit_name}' "
                    f"{_arity_problem(local)}"
                )
        if h.arity == 1:
            inputs, h.metadata = hook(self.shard_mesh)
        else:
            shape = p.global_shape
            inputs, h.metadata = hook(
                self.shard_mesh, shape, contiguous_stride(shape), h.module, self.mp_policy
            )
        return tuple(_plain(t.to(self.mesh.device)) for t in inputs)

    def wire_parts(self) -> list[torch.Tensor]:
        """Every parameter's hook inputs as bytes (short ranks' rows padded), then the trailer."""
        got = [self._pre(p, h) for p, h in zip(self.params, self.hooked, strict=True)]
        if self.trailer is None:
            self._agree(got)
        parts = []
        for p, h, inputs in zip(self.params, self.hooked, got, strict=True):
            if inputs is None:  # hooks removed after the first gather
                raise FullshardError(
                    f"rank {self.mesh.rank}: parameter '{p.fqn}' of unit '{self.unit_name}' "
                    f"{no_hooks_problem(p.local)}"
                )
            mine = [tuple(t.shape) for t in inputs]
            if mine != [i.mine for i in h.inputs]:
                raise FullshardError(
                    f"rank {self.mesh.rank}: {PRE} of parameter '{p.fqn}' of unit "
                    f"'{self.unit_name}' returned inputs of shapes {mine}; its first gather "
                    f"sent {[i.mine for i in h.inputs]}. The hook must return the same shapes "
                    "at every gather."
                )
            for t, spec in zip(inputs, h.inputs, strict=True):
                if spec.mine != spec.shape:  # this rank holds fewer rows: pad them with zeros
                    padded = t.new_zeros(spec.shape)
                    padded[: t.shape[0]] = t
                    t = padded
                parts.append(t.reshape(-1).view(torch.uint8))
        assert self.trailer is not None
        parts.append(self.trailer)
        return parts

    def _agree(self, got: list[tuple[torch.Tensor, ...] | None]) -> None:
        """The first gather: every rank's input shapes, matched against rank 0's (None: the
        parameter has no hooks on that rank)."""
        mine = [
            None if inputs is None else [(tuple(t.shape), str(t.dtype)) for t in inputs]
            for inputs in got
        ]
        world = self.mesh.world_size
        every: list[Any] = all_gather_objects(mine, self.mesh.group) if world > 1 else [mine]
        missing = [
            (r, p)
            for r, theirs in enumerate(every)
            for p, t in zip(self.params, theirs, strict=True)
            if t is None
        ]
        if missing:
            ranks: dict[str, list[int]] = {}
            for r, q in missing:
                ranks.setdefault(q.fqn, []).append(r)
            where = "; ".join(f"'{n}' on ranks {rs}" for n, rs in list(ranks.items())[:6])
            p = missing[0][1]
            raise FullshardError(
                f"rank {self.mesh.rank}: parameters of unit '{self.unit_name}' have no "
                f"all-gather hooks at its first gather ({where}). Parameter '{p.fqn}' "
                f"{no_hooks_problem(p.local)}"
            )
        ref = every[0]
        problems = []
        for r, theirs in enumerate(every):
            for i, p in enumerate(self.params):
                rows, full = local_rows(p.shape[0], world, r), chunk_rows(p.shape[0], world)
                if len(theirs[i]) != len(ref[i]):
                    problems.append(
                        f"'{p.fqn}': rank {r} sends {len(theirs[i])} inputs, rank 0 {len(ref[i])}"
                    )
                    continue
                for (shape, dt), (shape0, dt0) in zip(theirs[i], ref[i], strict=True):
                    short = rows < full and shape[:1] == (rows,) and shape0[:1] == (full,)
                    if dt != dt0 or (shape != shape0 and not (short and shape[1:] == shape0[1:])):
                        problems.append(
                            f"'{p.fqn}': rank {r} sends {dt} {list(shape)} ({rows} rows), rank 0 "
                            f"sends {dt0} {list(shape0)} ({full} rows)"
                        )
        if problems:
            raise FullshardError(
                f"rank {self.mesh.rank}: the {PRE} inputs of unit '{self.unit_name}' differ "
                f"across ranks: {'; '.join(problems[:6])}. An all-gather needs the same shapes "
                "on every rank: return the same number of inputs of one dtype, and rows padded "
                "to ceil(rows / world) (FSDP2's rule; fullshard pads an input whose dim 0 is "
                "this rank's own rows)."
            )
        for h, inputs, ref_inputs in zip(self.hooked, got, ref, strict=True):
            assert inputs is not None
            h.inputs = [
                _Input(tuple(shape0), t.dtype, tuple(t.shape))
                for t, (shape0, _) in zip(inputs, ref_inputs, strict=True)
            ]
        data = sum(i.nbytes for h in self.hooked for i in h.inputs)
        gap = -(data + self.tag_len) % GROUP_ALIGN_BYTES
        self.trailer = torch.zeros(gap + self.tag_len, dtype=torch.uint8, device=self.mesh.device)
        self.write_static_tag(self.index)

    def wire_width(self, wire_dtype: torch.dtype) -> int:
        assert wire_dtype == torch.uint8 and self.trailer is not None
        return sum(i.nbytes for h in self.hooked for i in h.inputs) + self.trailer.numel()

    @property
    def tail_dtype(self) -> torch.dtype:
        return torch.uint8

    def copy_out(self, cols: torch.Tensor, tails: torch.Tensor | None) -> None:
        """Each input's bytes from every rank -> its output tensor; then the post hooks."""
        world, device = cols.shape[0], cols.device
        outs = []
        for h in self.hooked:
            if not h.outputs:
                h.outputs = [
                    torch.empty(world * i.nbytes // i.dtype.itemsize, dtype=i.dtype, device=device)
                    for i in h.inputs
                ]
            for o in h.outputs:
                _alloc(o)
                outs.append(o.view(world, -1).view(torch.uint8))
        assert self.trailer is not None
        rest = self.trailer.numel() - self.tag_len
        if rest:
            outs.append(torch.empty(world, rest, dtype=torch.uint8, device=device))  # padding
        if self.tag_len:
            if tails is None:
                tails = torch.empty(world, self.tag_len, dtype=torch.uint8, device=device)
            outs.append(tails)
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(tuple(outs)):
            torch.split_with_sizes_copy(cols, [o.shape[1] for o in outs], 1, out=outs)
        for p, h in zip(self.params, self.hooked, strict=True):
            self._post(p, h)

    def _post(self, p: ShardedParam, h: _Hooked) -> None:
        outputs = tuple(o.view(-1, *i.shape[1:]) for o, i in zip(h.outputs, h.inputs, strict=True))
        post = getattr(p.local, POST)
        metadata, h.metadata = h.metadata, None
        with torch.no_grad():
            if p.unsharded is None:
                full, inner = post(outputs, metadata, self.compute_dtype)
                h.inner = tuple(inner)
                shape = p.global_shape
                view = torch.as_strided(full, shape, contiguous_stride(shape), 0)
                p.set_unsharded(nn.Parameter(view, requires_grad=p.requires_grad))
                return
            for t in h.inner:
                _alloc(t)
            with torch.autograd._unsafe_preserve_version_counter(p.unsharded):
                post(outputs, metadata, self.compute_dtype, out=p.unsharded)

    def gather_locally(self) -> None:
        """One rank: the hooks still run; the inputs are the outputs."""
        cols = torch.cat(self.wire_parts()).view(1, -1)
        self.copy_out(cols, None)

    def free(self) -> None:
        for h in self.hooked:
            for t in (*h.outputs, *h.inner):
                _free(t)


__all__ = [
    "ExtensionGroup",
    "Rewrap",
    "extension_problem",
    "has_extension_hooks",
    "is_tensor_subclass",
    "values_of",
]
