"""Fixed-order reductions switched on through ``FSDPModule``'s public method (what
``fullshard.deterministic.enable`` calls), and refused where the fixed order cannot hold: a
custom reduce-scatter, before or after, or a reduce dtype narrower than the parameters."""

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
