"""What torch's pipelining reads from an FSDP2 module (``engine/fsdp2_interop.py``, NOTE [What
pipelining reads from an FSDP2 module]), and backwards restricted to inputs (NOTE [Backwards
restricted to inputs], ``engine/hooks.py``), over the fake group: which collectives a step
issues, by unit. ``tests/test_pipeline.py`` runs torch's schedules over real ranks."""

from __future__ import annotations

import pytest
import torch
from recorder import REDUCE, StepRecorder, kinds
from torch import nn
from torch.distributed.fsdp._fully_shard import _fully_shard as torch_fsdp2
from toy import DIM, Block

import fullshard
from fullshard import FSDPModule, fully_shard

pytestmark = pytest.mark.fast

# what pipelining calls on a stage's FSDP modules (stage.py, schedules.py of torch 2.13)
PIPELINING_CALLS = (
    "unshard",
    "reshard",
    "set_is_last_backward",
    "set_reshard_after_backward",
    "set_requires_gradient_sync",
)


class _Stage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)
        self.blocks = nn.ModuleList([Block() for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x)
        for block in self.blocks:
            x = block(x)
        return x


def _stage() -> _Stage:
    model = _Stage()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def _reduced(events: list) -> list[str]:
    return [unit for _, unit in kinds(events, REDUCE)]


def test_torchs_fsdp2_names_recognise_a_sharded_module(fake_pg: tuple) -> None:
    model = _stage()
    sharded = [m for m in model.modules() if isinstance(m, FSDPModule)]
    assert sharded == [model, *model.blocks]
    for m, cls in zip(sharded, (_Stage, Block, Block), strict=True):
        # torch's class recognises it, torch's fully_shard.state finds fullshard's state
        assert isinstance(m, torch_fsdp2.FSDPModule)
        assert torch_fsdp2.fully_shard.state(m) is fully_shard.state(m) is not None
        assert type(m).__mro__[2] is cls  # where torch's code looks for the original class
        for name in PIPELINING_CALLS:  # fullshard's methods, not torch's
            assert getattr(type(m), name) is getattr(FSDPModule, name), name
    # a module fully_shard was not called on stays unrecognised
    assert not isinstance(model.blocks[0].fc1, torch_fsdp2.FSDPModule)
    assert torch_fsdp2.fully_shard.state(model.blocks[0].fc1) is None
    # FSDP2's state context: every state of the root's tree, in named_modules order
    model(torch.randn(2, DIM)).sum().backward()
    for m in sharded:
        state = fully_shard.state(m)
        assert state._state_ctx.all_states == [fully_shard.state(s) for s in sharded]
        assert len(state._fsdp_param_groups) == 1


def test_pipelinings_reduce_grad_reduces_each_unit_once_after_the_microbatches(
    fake_pg: tuple,
) -> None:
    """What a pipeline stage does in a step: microbatches without sync (nothing reduced, the
    units kept), then REDUCE_GRAD by hand: each unit reduced once, everything freed."""
    model = _stage()
    rec = StepRecorder(model)
    names = ["blocks.0", "blocks.1", "root"]
    for _ in range(2):
        for _ in range(3):
            model.set_is_last_backward(False)
            model.set_reshard_after_backward(False)
            model.set_requires_gradient_sync(False)
            x = torch.randn(2, DIM, requires_grad=True)
            events = rec.record(lambda x=x: model(x).sum().backward())
            assert _reduced(events) == []
        model.set_is_last_backward(True)
        model.set_reshard_after_backward(True)
        model.set_requires_gradient_sync(True)
        state = torch_fsdp2.fully_shard.state(model)

        def reduce_grad(state: object = state) -> None:
            for s in state._state_ctx.all_states:  # type: ignore[attr-defined]
                for group in s._fsdp_param_groups:
                    group.post_backward()
            state._root_post_backward_final_callback()  # type: ignore[attr-defined]

        events = rec.record(reduce_grad)
        assert sorted(_reduced(events)) == names
        assert not any(v.unit.gathered for v in fullshard.units(model))
        assert all(p.grad is not None for p in model.parameters())
        model.zero_grad()


def test_a_backward_restricted_to_inputs_reduces_only_units_it_gives_gradients(
    fake_pg: tuple,
) -> None:
    """NOTE [Backwards restricted to inputs]: ``torch.autograd.grad`` with respect to the
    input (pipelining's metadata inference) reduces nothing; ``backward(inputs=...)`` reduces
    the units whose parameters it reaches; a plain backward reduces every unit."""
    model = _stage()
    rec = StepRecorder(model)
    x = torch.randn(2, DIM, requires_grad=True)
    events = rec.record(lambda: torch.autograd.grad(model(x).sum(), [x]))
    assert _reduced(events) == []
    assert all(p.grad is None for p in model.parameters())

    def backward_to_root() -> None:
        out = model(x).sum()
        # the root keeps its gathered parameters after forward: those are what autograd saw
        out.backward(inputs=[x, model.proj.weight])

    assert _reduced(rec.record(backward_to_root)) == ["root"]
    assert model.proj.weight.grad is not None and model.blocks[0].fc1.weight.grad is None
    events = rec.record(lambda: model(x).sum().backward())
    assert sorted(_reduced(events)) == sorted(v.unit.name for v in fullshard.units(model))
