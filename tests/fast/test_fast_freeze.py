"""NOTE [Freezing after fully_shard], the mechanism on one process of the fake group (the
numbers, against one process and torch's FSDP2, are ``tests/test_freeze_schedule.py``'s): a
flag set on the gathered parameter of a unit left gathered is followed at the next forward, the
optimizer's parameter shows it too, and a change that would drop gradients kept without sync
is refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from toy import DIM, Block

from fullshard import fully_shard
from fullshard.policies import FullshardError

pytestmark = pytest.mark.fast


class _TwoBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = Block(), Block()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def _no_root() -> _TwoBlocks:
    """Each block its own unit and root, keeping its parameters after forward (FSDP2's
    default for a root)."""
    model = _TwoBlocks()
    fully_shard(model.a)
    fully_shard(model.b)
    return model


def test_a_thaw_on_a_unit_left_gathered_is_followed(fake_pg: tuple[int, int]) -> None:
    model = _no_root()
    held = dict(model.a.named_parameters())  # the sharded parameters (the optimizer's)
    for p in held.values():
        p.requires_grad_(False)
    x = torch.randn(2, DIM)  # needs no gradient: no backward reaches block a
    model(x).sum().backward()
    unit = model.a._fullshard_state.unit
    assert unit.trainable == [] and unit.gathered  # left gathered into the next step
    shown = dict(model.a.named_parameters())
    assert all(shown[n] is not held[n] for n in held)  # the modules show the gathered ones
    shown["fc1.weight"].requires_grad_(True)  # the user thaws what the module shows
    model(x).sum().backward()
    assert [p.fqn for p in unit.trainable] == ["fc1.weight"]
    assert held["fc1.weight"].requires_grad and held["fc1.weight"].grad is not None
    assert all(held[n].grad is None for n in held if n != "fc1.weight")
    assert not unit.gathered  # its backward came: resharded


def test_a_change_that_would_drop_unreduced_gradients_is_refused(fake_pg: tuple[int, int]) -> None:
    model = _no_root()
    x = torch.randn(2, DIM, requires_grad=True)
    model.a.set_requires_gradient_sync(False)  # accumulate without reducing
    model(x).sum().backward()
    model.a.fc1.weight.requires_grad_(False)  # before the backward that reduces
    with pytest.raises(FullshardError, match=r"requires_grad of fc1\.weight in unit 'root'"):
        model(x)
