"""All-gather extensions whose shard is a tensor of its own (NOTE [Shards of their own] in
``engine/copy_in.py``): subclasses the flat buffer cannot hold, and hooks attached to the local
tensor after ``fully_shard``. Two ranks as two threads of this process (torch's threaded process
group), under both imports, each against one process in float64 (under fullshard its full state
dict too, of the subclass's type).

- torch's ``TwoTensor`` (two inner tensors, ``a`` and ``b``) with class hooks of both arities;
- a ``TwoTensor`` without hooks, sharded on the meta device, materialised with ``to_empty``, the
  hooks attached to each ``param._local_tensor`` afterwards (FSDP2's monkey-patch pattern);
- a wrapper whose ``__tensor_unflatten__`` returns its plain inner tensor, over an uneven row
  split whose padding its pre hook does.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.utils._pytree as pytree
from fsdp2_programs import fully_shard_of
from torch import nn
from torch.testing._internal.common_distributed import spawn_threads_and_init_comms
from torch.testing._internal.two_tensor import TwoTensor

WORLD = 2
STEPS = 3


def _pre_v1(self: TwoTensor, mesh: Any) -> tuple[tuple[torch.Tensor, ...], Any]:
    return (self.a, self.b), None


def _pre_v2(
    self: TwoTensor, mesh: Any, size: Any, stride: Any, module: Any, mp: Any
) -> tuple[tuple[torch.Tensor, ...], Any]:
    assert mesh.ndim == 1 and tuple(size) == tuple(module.weight.shape), (mesh, size)
    return (self.a, self.b), None


def _post(
    self: torch.Tensor, outputs: Any, metadata: Any, dtype: torch.dtype, *, out: Any = None
) -> Any:
    a, b = outputs
    if out is not None:  # the same storages as the first time: nothing to copy
        assert out.a.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
        return None
    return TwoTensor(a, b), (a, b)


@pytest.fixture
def two_tensor_hooks() -> Iterator[Callable[[Any], None]]:
    """Give ``TwoTensor`` class hooks (a pre hook of the given arity); removed after the test."""

    def patch(pre: Any) -> None:
        TwoTensor.fsdp_pre_all_gather = pre  # type: ignore[attr-defined]
        TwoTensor.fsdp_post_all_gather = _post  # type: ignore[attr-defined]

    try:
        yield patch
    finally:
        for name in ("fsdp_pre_all_gather", "fsdp_post_all_gather"):
            if hasattr(TwoTensor, name):
                delattr(TwoTensor, name)


class Wrapped(torch.Tensor):
    """A wrapper subclass whose ``__tensor_unflatten__`` returns its plain inner tensor; its pre
    hook pads this rank's rows to ``ceil(rows / world)`` itself (FSDP2's rule)."""

    _data: torch.Tensor

    @staticmethod
    def __new__(cls, data: torch.Tensor) -> Wrapped:  # noqa: PYI034
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined,no-any-return]
            cls,
            data.shape,
            data.stride(),
            data.storage_offset(),
            dtype=data.dtype,
            device=data.device,
        )

    def __init__(self, data: torch.Tensor) -> None:
        self._data = data

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(
            *pytree.tree_map_only(cls, lambda x: x._data, (args, kwargs or {}))[0],
            **pytree.tree_map_only(cls, lambda x: x._data, kwargs or {}),
        )
        return pytree.tree_map_only(torch.Tensor, cls, out)

    def __tensor_flatten__(self) -> tuple[list[str], None]:
        return ["_data"], None

    @staticmethod
    def __tensor_unflatten__(inner: dict, ctx: Any, size: Any, stride: Any) -> torch.Tensor:
        return inner["_data"]  # type: ignore[no-any-return]

    def fsdp_pre_all_gather(
        self, mesh: Any, size: Any, stride: Any, module: Any, mp: Any
    ) -> tuple[tuple[torch.Tensor, ...], Any]:
        padded = self._data.new_zeros(math.ceil(size[0] / mesh.size()), *size[1:])
        padded[: self._data.shape[0]] = self._data
        return (padded,), None

    def fsdp_post_all_gather(
        self, outputs: Any, metadata: Any, dtype: torch.dtype, *, out: Any = None
    ) -> Any:
        (t,) = outputs
        if out is not None:
            return None
        return t, (t,)


class Mlp(nn.Module):
    def __init__(self, rows: int = 8) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, rows, bias=False)
        self.fc2 = nn.Linear(rows, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def _model(kind: str) -> nn.Sequential:
    torch.manual_seed(0)
    # FSDP2 leaves padding a short rank's rows to the hook: TwoTensor's do not pad, Wrapped's do
    model = nn.Sequential(Mlp(), Mlp(rows=5 if kind == "wrapped" else 6))  # 5 rows: 3 and 2
    for mlp in model:
        for lin in (mlp.fc1, mlp.fc2):
            w = lin.weight.detach()
            sub = TwoTensor(w, w.clone()) if kind == "two" else Wrapped(w.clone())
            lin.weight = nn.Parameter(sub)
    return model


def _rows(t: torch.Tensor, rank: int) -> torch.Tensor:
    n = math.ceil(t.shape[0] / WORLD)
    return t[rank * n : (rank + 1) * n]


def _inner(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors a subclass keeps its values in (both of a TwoTensor's)."""
    if isinstance(t, TwoTensor):
        return [t.a, t.b]
    return [t._data if isinstance(t, Wrapped) else t]


def _run(impl: str, kind: str, attach_after: bool = False) -> dict[int, dict[str, Any]]:
    """``STEPS`` Adam steps of the sharded model and of one process (the mean of both ranks'
    gradients); each rank's largest difference of its rows (every inner tensor) and losses."""
    torch.set_default_dtype(torch.float64)
    ref0 = _model(kind)
    xs = torch.randn(STEPS, WORLD, 3, 8)
    out: dict[int, dict[str, Any]] = {}

    @spawn_threads_and_init_comms(world_size=WORLD)
    def train(_: object) -> None:
        rank = torch.distributed.get_rank()
        fully_shard = fully_shard_of(impl)
        ref = copy.deepcopy(ref0)
        if attach_after:
            with torch.device("meta"):
                model = _model(kind)
        else:
            model = copy.deepcopy(ref0)
        for mlp in model:
            fully_shard(mlp)
        fully_shard(model)
        calls = [0]
        if attach_after:
            model.to_empty(device="cpu")
            for (_, p), r in zip(model.named_parameters(), ref.parameters(), strict=True):
                local = p._local_tensor
                with torch.no_grad():
                    for mine, want in zip(_inner(local), _inner(r), strict=True):
                        mine.copy_(_rows(want, rank))

                def pre(self: Any, mesh: Any, size: Any, stride: Any, module: Any, mp: Any) -> Any:
                    calls[0] += 1
                    return _pre_v2(self, mesh, size, stride, module, mp)

                local.fsdp_pre_all_gather = pre.__get__(local)
                local.fsdp_post_all_gather = _post.__get__(local)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
        losses, ref_losses = [], []
        for step in range(STEPS):
            loss = model(xs[step, rank]).sum()
            loss.backward()
            losses.append(torch.stack([t.detach() for t in _inner(loss)]))
            ref_loss = sum(ref(xs[step, r]).sum() for r in range(WORLD)) / WORLD
            ref_loss.backward()  # type: ignore[union-attr]
            ref_losses.append(ref(xs[step, rank]).sum().detach())
            for o in (opt, ref_opt):
                o.step()
                o.zero_grad()
        diff = 0.0
        for p, r in zip(model.parameters(), ref.parameters(), strict=True):
            for mine, want in zip(_inner(p._local_tensor), _inner(r), strict=True):
                diff = max(diff, float((mine - _rows(want, rank)).abs().max()))
        full_diff = 0.0  # fullshard's full state dict: DTensor's full_tensor() of each shard
        if impl == "fullshard":
            from fullshard.checkpoint.export import full_state_dict

            want = dict(ref.named_parameters())
            for k, v in full_state_dict(model, rank0_only=False).items():
                assert type(v) is type(want[k]), (k, type(v))
                both = zip(_inner(v), _inner(want[k]), strict=True)
                full_diff = max([full_diff, *(float((a - b).abs().max()) for a, b in both)])
        local_types = {type(p._local_tensor).__name__ for p in model.parameters()}
        loss_diff = max(
            float((a - torch.stack(_inner(b))).abs().max())
            for a, b in zip(losses, ref_losses, strict=True)
        )
        out[rank] = {
            "diff": max(diff, full_diff),
            "loss_diff": loss_diff,
            "types": local_types,
            "calls": calls[0],
        }

    try:
        train(object())
    finally:
        torch.set_default_dtype(torch.float32)
    assert sorted(out) == list(range(WORLD))
    return out


@pytest.mark.parametrize("impl", ["torch", "fullshard"])
@pytest.mark.parametrize("pre", [_pre_v1, _pre_v2], ids=["mesh", "mesh_size_stride_module_mp"])
def test_two_tensor_shards_train_as_one_process(
    two_tensor_hooks: Callable[[Any], None], impl: str, pre: Any
) -> None:
    two_tensor_hooks(pre)
    for rank, res in _run(impl, "two").items():
        print(f"\n{impl} TwoTensor rank {rank}: {res}")
        assert res["types"] == {"TwoTensor"}, res  # both inner tensors' rows, stepped in place
        assert res["diff"] <= 1e-12 and res["loss_diff"] <= 1e-12, res


@pytest.mark.parametrize("impl", ["torch", "fullshard"])
def test_hooks_attached_to_local_tensors_after_to_empty(impl: str) -> None:
    assert not hasattr(TwoTensor, "fsdp_pre_all_gather")  # sharded without any hooks
    for rank, res in _run(impl, "two", attach_after=True).items():
        print(f"\n{impl} hooks attached after fully_shard, rank {rank}: {res}")
        # each of the 4 weights (the blocks'), gathered in forward and again in backward
        assert res["calls"] == 2 * 4 * STEPS, res
        assert res["diff"] <= 1e-12 and res["loss_diff"] <= 1e-12, res


@pytest.mark.parametrize("impl", ["torch", "fullshard"])
def test_wrapper_unflattening_to_a_plain_tensor_keeps_its_type(impl: str) -> None:
    for rank, res in _run(impl, "wrapped").items():
        print(f"\n{impl} Wrapped rank {rank}: {res}")
        assert res["types"] == {"Wrapped"}, res
        assert res["diff"] <= 1e-12 and res["loss_diff"] <= 1e-12, res
