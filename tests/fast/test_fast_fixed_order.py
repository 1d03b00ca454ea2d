"""Fixed-order reductions switched on through ``FSDPModule``'s public method (what
``fullshard.deterministic.enable`` calls), and refused where the fixed order cannot hold: a
custom reduce-scatter, before or after, or a reduce dtype narrower than the parameters (also
one a thaw brings); and ``GradientTree`` following a parameter thawed after it was built."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fullshard import FSDPModule, MixedPrecisionPolicy, deterministic, fully_shard
from fullshard.policies import FullshardError

pytestmark = pytest.mark.fast


class _Comm:  # FSDP2's ReduceScatter interface, never called here
    def allocate(
        self, size: tuple[int, ...], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, *args: object, **kwargs: object) -> None:
        raise AssertionError("not reached")


def _model(mp: MixedPrecisionPolicy | None = None) -> nn.Module:
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    fully_shard(model[0], **({"mp_policy": mp} if mp else {}))
    fully_shard(model, **({"mp_policy": mp} if mp else {}))
    return model


def test_enable_turns_every_unit_to_plain_fixed_order_sums(fake_pg: tuple[int, int]) -> None:
    model = _model()
    deterministic.enable(model)
    units = [
        u for m in model.modules() if isinstance(m, FSDPModule) for u in [m._fullshard_state.unit]
    ]
    assert len(units) == 2 and all(u.comm.fixed_order and u.divide_factor == 1.0 for u in units)
    with pytest.raises(FullshardError, match="fixed-order mode sums the ranks' blocks itself"):
        model.set_custom_reduce_scatter(_Comm())  # would silently drop the fixed order


def test_a_custom_reduce_scatter_or_a_narrow_reduce_dtype_is_refused(
    fake_pg: tuple[int, int],
) -> None:
    model = _model()
    model[0].set_custom_reduce_scatter(_Comm())
    with pytest.raises(FullshardError, match="unit 'Linear' has a custom reduce-scatter"):
        deterministic.enable(model)
    narrow = _model(MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16))
    with pytest.raises(FullshardError, match="narrower than the parameter"):
        deterministic.enable(narrow)


def test_a_thaw_that_would_reduce_in_a_narrow_dtype_is_refused(fake_pg: tuple[int, int]) -> None:
    # NOTE [Freezing after fully_shard]: frozen when enabled, nothing is reduced, so bf16
    # compute without a reduce dtype passes; thawed, the unit would reduce fp32 weights in bf16
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4)).requires_grad_(False)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    fully_shard(model[0], mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    deterministic.enable(model)
    model(torch.randn(2, 8))
    model[0].weight.requires_grad_(True)
    with pytest.raises(FullshardError, match="reduces weight in torch.bfloat16, narrower"):
        model(torch.randn(2, 8))


def test_the_tree_sums_a_parameter_frozen_when_it_was_built() -> None:
    thawed, kept = nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(3))
    thawed.requires_grad_(False)
    tree = deterministic.GradientTree(
        [thawed, kept], deterministic.MicroBatches(global_batch=2, micro_batch=1), world=1
    )
    thawed.requires_grad_(True)
    for value in (1.0, 2.0):
        for p in (thawed, kept):
            p.grad = torch.full((3,), value)
        tree.push()
        assert thawed.grad is None and kept.grad is None  # taken into the tree
    tree.finish()
    assert torch.equal(thawed.grad, torch.full((3,), 3.0)) and torch.equal(thawed.grad, kept.grad)
