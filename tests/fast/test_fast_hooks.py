"""Module hooks (``engine/hooks.py``, NOTE [Post-backward events] and NOTE [End of backward]):
each unit's post-backward fires at the earliest correct moment (before the backward of the unit
that ran before it), also with frozen or unused parameters, outputs that never reach the loss,
and ``backward(inputs=...)``; whatever autograd never reaches is cleaned up by the root's
end-of-backward callback, and nothing stays gathered."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch
from recorder import REDUCE, StepRecorder, index_of, kinds, toy_steps
from torch import nn
from toy import DIM, VOCAB, Block, ToyLM, shard_toy

import fullshard
from fullshard import fully_shard

pytestmark = pytest.mark.fast


def _ends_in_order(events: list, units: list[str]) -> None:
    """``units`` (reverse forward order) end their backward in that order, each before the next
    one's backward starts: fired by the hooks, not left to the end-of-backward callback."""
    assert kinds(events, "BACKWARD_END")[: len(units)] == [("BACKWARD_END", u) for u in units]
    for unit, following in pairwise(units):
        assert index_of(events, "BACKWARD_END", unit) < index_of(
            events, "BACKWARD_START", following
        ), unit


def test_frozen_weights_do_not_delay_post_backward(fake_pg: tuple) -> None:
    # block 1 holds a frozen weight beside trainable ones (toy.py)
    model = shard_toy(ToyLM())
    for events in toy_steps(model, 2):
        _ends_in_order(events, ["blocks.2", "blocks.1", "blocks.0"])
    assert model.blocks[1].proj.weight.grad is None
    assert model.blocks[1].fc1.weight.grad is not None


def test_a_fully_frozen_unit_ends_on_its_input_gradient_and_reduces_nothing(
    fake_pg: tuple,
) -> None:
    model = ToyLM()
    model.blocks[1].requires_grad_(False)
    shard_toy(model)
    for events in toy_steps(model, 2):
        _ends_in_order(events, ["blocks.2", "blocks.1", "blocks.0"])
        assert kinds(events, REDUCE) == [(REDUCE, u) for u in ["blocks.2", "blocks.0", "root"]]
        assert events[-1].gathered == frozenset()
    assert all(p.grad is None for p in model.blocks[1].parameters())


class _WithUnused(Block):
    """A block with a parameter its forward never uses."""

    def __init__(self) -> None:
        super().__init__()
        self.spare = nn.Linear(DIM, DIM)


def test_an_unused_parameter_does_not_delay_post_backward(fake_pg: tuple) -> None:
    model = ToyLM()
    model.blocks[1] = _WithUnused()
    shard_toy(model)
    for events in toy_steps(model, 2):
        _ends_in_order(events, ["blocks.2", "blocks.1", "blocks.0"])
    assert model.blocks[1].spare.weight.grad is None
    assert model.blocks[1].fc1.weight.grad is not None


class _TwoHeads(nn.Module):
    """A trunk and two heads; the loss will use one head's output only."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk, self.used, self.unused = Block(), Block(), Block()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.trunk(x)
        return self.used(h), self.unused(h)


@pytest.mark.parametrize("keep", [True, False], ids=["kept_after_forward", "resharded"])
def test_a_unit_whose_output_misses_the_loss_is_cleaned_up(fake_pg: tuple, keep: bool) -> None:
    model = _TwoHeads()
    fully_shard(model.trunk)
    fully_shard(model.used)
    fully_shard(model.unused, reshard_after_forward=not keep)
    fully_shard(model)
    rec = StepRecorder(model)
    x = torch.randn(2, DIM)
    for _ in range(2):
        events = rec.record(lambda: model(x)[0].sum().backward())
        end_of_forward = events[index_of(events, "FORWARD_END", "root")]
        assert ("unused" in end_of_forward.gathered) is keep
        # its backward never starts; the others' run in order and reduce
        assert [u for k, u in kinds(events, "BACKWARD_START")] == ["used", "root", "trunk"]
        _ends_in_order(events, ["used", "trunk"])
        assert kinds(events, REDUCE) == [(REDUCE, "used"), (REDUCE, "trunk")]
        # the end-of-backward callback frees what was kept for a backward that never came,
        # and says so to observers
        assert events[-1].kind == "BACKWARD_DONE" and events[-1].gathered == frozenset()
        frees = [u for k, u in kinds(events, "FREE")]
        assert frees.count("unused") == 1
        if keep:
            assert events[-2].kind == "FREE" and events[-2].unit == "unused"
    assert all(p.grad is None for p in model.unused.parameters())
    assert all(p.grad is not None for p in model.used.parameters())


class _Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_backward_with_inputs_ends_every_unit_and_leaves_parameters_alone(
    fake_pg: tuple,
) -> None:
    # backward(inputs=[x]): no parameter's gradient is asked for, so each unit's backward is
    # over when its input gradient is computed (the only post-backward event the engine runs)
    model = _Stack()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    rec = StepRecorder(model)
    for _ in range(2):
        x = torch.randn(2, DIM, requires_grad=True)
        events = rec.record(lambda x=x: model(x).sum().backward(inputs=[x]))
        _ends_in_order(events, ["blocks.2", "blocks.1", "blocks.0"])
        assert events[-1].kind == "BACKWARD_DONE" and events[-1].gathered == frozenset()
        assert x.grad is not None
    assert all(p.grad is None for p in model.parameters())
    assert not any(v.unit.gathered for v in fullshard.units(model))


def test_reshard_after_forward_is_one_value_per_unit_decided_at_fully_shard(
    fake_pg: tuple,
) -> None:
    model = ToyLM()
    for i, block in enumerate(model.blocks):
        fully_shard(block, reshard_after_forward=False if i == 1 else None)
    fully_shard(model)
    unit = {v.name: v.unit for v in fullshard.units(model)}
    # sharding the parent settled its children's default; the root's waits for its lazy init
    assert [unit[f"blocks.{i}"].reshard_after_forward for i in range(3)] == [True, False, True]
    assert unit[""].reshard_after_forward is None
    idx = torch.randint(0, VOCAB, (2, 8))

    def gathered_after_forward() -> set[str]:
        loss = model(idx).sum()
        kept = {name for name, u in unit.items() if u.gathered}
        loss.backward()
        return kept

    # the root keeps its parameters for backward (FSDP2's default), as does the block asked to
    assert gathered_after_forward() == {"", "blocks.1"}
    assert unit[""].reshard_after_forward is False
    model.blocks[2].set_reshard_after_forward(False)  # changes that one value, nothing else
    assert gathered_after_forward() == {"", "blocks.1", "blocks.2"}
