"""Tensor-subclass parameters at ``fully_shard`` (NOTE [All-gather extensions]): what cannot be
sharded is refused with what is wrong, where (parameter, unit, rank) and what to do; a subclass
with FSDP2's all-gather hooks is gathered through them (one all-gather per unit)."""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch
from commcount import C10dCounter
from quant_toy import QuantWeight, quantize_linears
from torch import nn

from fullshard import fully_shard
from fullshard.policies import FullshardError

pytestmark = pytest.mark.fast


class Tagged(torch.Tensor):
    """A subclass with its own storage and no hooks (``as_subclass``)."""


class TaggedWithHooks(Tagged):
    """Hooks, but no ``__tensor_flatten__``: its shard is a tensor of its own (copy_in.py)."""

    def fsdp_pre_all_gather(self, mesh: Any) -> Any:
        return (self.as_subclass(torch.Tensor),), None

    def fsdp_post_all_gather(self, outputs: Any, metadata: Any, dtype: Any, *, out: Any = None):  # type: ignore[no-untyped-def]
        return outputs[0], ()


class OnlyPre(QuantWeight):
    fsdp_post_all_gather = property()  # type: ignore[assignment]

    def __getattribute__(self, name: str) -> Any:
        if name == "fsdp_post_all_gather":
            raise AttributeError(name)
        return super().__getattribute__(name)


class ThreeArgs(QuantWeight):
    def fsdp_pre_all_gather(self, mesh: Any, outer_size: Any) -> Any:  # type: ignore[override]
        raise AssertionError("never called")


def _linear(cls: type | None) -> nn.Module:
    lin = nn.Linear(4, 6)
    if cls is not None:
        w = lin.weight.detach()
        data = w.as_subclass(cls) if issubclass(cls, Tagged) else cls(w)
        lin.weight = nn.Parameter(data)
    return lin


def _error(module: nn.Module, **kwargs: Any) -> str:
    with pytest.raises(FullshardError) as info:
        fully_shard(module, **kwargs)
    return str(info.value)


def test_subclass_without_hooks_is_refused_at_its_first_gather_with_the_fix(
    fake_pg: tuple[int, int],
) -> None:
    """FSDP2 lets hooks be attached to the local tensor after fully_shard: the first gather
    still without them refuses (a plain gather would lose what the subclass does)."""
    lin = _linear(Tagged)
    fully_shard(lin)
    assert type(lin.weight._local_tensor) is Tagged
    with pytest.raises(FullshardError) as info:
        lin(torch.randn(2, 4))
    msg = str(info.value)
    assert "rank 1:" in msg and "'weight' on ranks [0, 1, 2, 3]" in msg, msg
    assert "unit 'root'" in msg, msg
    assert "Tagged" in msg and "fsdp_pre_all_gather" in msg and "as_subclass" in msg, msg
    assert "_local_tensor" in msg, msg


def test_subclass_without_flatten_keeps_a_shard_of_its_own(fake_pg: tuple[int, int]) -> None:
    """NOTE [Shards of their own]: no __tensor_flatten__, so no flat-buffer view to wrap."""
    lin = _linear(TaggedWithHooks)
    fully_shard(lin)
    local = lin.weight._local_tensor
    assert type(local) is TaggedWithHooks and local.shape == (2, 4)  # rank 1's rows of 6
    lin(torch.randn(2, 4)).sum().backward()
    assert lin.weight.grad is not None and lin.weight.grad._local_tensor.shape == (2, 4)
    torch.optim.SGD(lin.parameters(), lr=0.1).step()
    assert lin.weight._local_tensor is local  # stepped in place


@pytest.mark.parametrize(
    "cls,says",
    [
        (OnlyPre, "add fsdp_post_all_gather"),
        (ThreeArgs, "takes 2 arguments"),
    ],
)
def test_unusable_hooks_are_refused(fake_pg: tuple[int, int], cls: type, says: str) -> None:
    msg = _error(_linear(cls))
    assert "'weight'" in msg and says in msg, msg


def test_lazy_parameters_are_refused(fake_pg: tuple[int, int]) -> None:
    assert "run one forward" in _error(nn.LazyLinear(3))


def test_extension_with_an_int_reshard_is_refused(fake_pg: tuple[int, int]) -> None:
    msg = _error(_linear(QuantWeight), reshard_after_forward=2)
    assert "extension hooks" in msg and "True or False" in msg, msg


def test_extension_units_still_gather_once(fake_pg: tuple[int, int]) -> None:
    model = nn.Sequential(nn.Linear(12, 13), nn.LayerNorm(13), nn.Linear(13, 5))
    quantize_linears(model)
    fully_shard(model[0])
    fully_shard(model)
    x = torch.randn(2, 12)
    model(x).sum().backward()  # the first gathers agree on the inputs' shapes
    with C10dCounter() as c:
        model(x).sum().backward()
    # the root keeps its parameters for backward; the child gathers in forward and backward
    assert c.calls["all_gather"] == 3, dict(c.calls)
    assert isinstance(model[2].weight._local_tensor, QuantWeight)
    assert model[2].weight._local_tensor.gathers == 2


def test_meta_init_then_to_empty_keeps_the_subclass(fake_pg: tuple[int, int]) -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(12, 13), nn.Linear(13, 5))
    quantize_linears(model)
    fully_shard(model[0])
    fully_shard(model)
    model.to_empty(device="cpu")
    for p in model.parameters():
        nn.init.normal_(p)
    local = model[0].weight._local_tensor
    assert isinstance(local, QuantWeight) and not local.is_meta
    model(torch.randn(2, 12)).sum().backward()
    assert model[0].weight.grad is not None
    # the optimizer's update lands in the values the next gather quantizes
    before = local._data.clone()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    assert not torch.equal(model[0].weight._local_tensor._data, before)


def test_float8_option_without_torchao_fails_at_wrap_time(
    fake_pg: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    from toy import Block, ToyLM

    from fullshard.app.config import ParallelismConfig
    from fullshard.app.models.wrap import shard_model

    monkeypatch.setitem(sys.modules, "torchao", None)  # as if not installed (it is, in dev)

    with pytest.raises(FullshardError, match=r"rank 1: .*pip install torchao"):
        shard_model(ToyLM(), ParallelismConfig(float8=True), [Block])
