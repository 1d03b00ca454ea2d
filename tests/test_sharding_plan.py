"""The sharding plan: its units by NOTE [Unit membership] (the engine's own rule), each
strategy's mesh and reshard policy, and the one hybrid default.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from toy import Block, ToyLM

from fullshard import FullshardError, ShardingStrategy, plan_sharding
from fullshard.engine.sharding import hybrid_shard_size


class Nested(nn.Module):
    """A unit inside a unit (its parameters are not the outer unit's) and a frozen parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.outer = nn.ModuleDict({"inner": Block(), "own": nn.Linear(12, 12)})
        self.outer["own"].bias.requires_grad_(False)
        self.head = nn.Linear(12, 5)


BLOCK = [
    *["gate", "norm.weight", "norm.bias", "fc1.weight", "fc1.bias"],
    *["fc2.weight", "fc2.bias", "proj.weight"],
]


@pytest.mark.fast
def test_plan_units_follow_the_unit_membership_rule() -> None:
    # NOTE [Unit membership]: the innermost unit module owns a parameter, a tie inside a unit is
    # one parameter under its first name, the root owns what no unit module holds; the plan
    # applies the engine's own rule (``collect``), so nothing else has to agree with it
    nested = Nested()
    plan = plan_sharding(nested, "full_shard", (Block, nn.ModuleDict), 2)
    assert {u.name: list(u.params) for u in plan.units} == {
        "": ["head.weight", "head.bias"],
        "outer": ["outer.own.weight", "outer.own.bias"],
        "outer.inner": [f"outer.inner.{n}" for n in BLOCK],
    }
    own = {u.name: (u.numel, u.trainable_numel) for u in plan.units}
    assert own["outer"] == (12 * 12 + 12, 12 * 12)  # the frozen bias is not trainable
    toy = ToyLM()
    plan = plan_sharding(toy, "full_shard", (Block,), 2)
    assert [u.name for u in plan.units] == ["", "blocks.0", "blocks.1", "blocks.2"]
    assert list(plan.units[0].params) == ["embed.weight", "norm.weight", "norm.bias"]  # tied once
    assert sum(u.numel for u in plan.units) == sum(p.numel() for p in toy.parameters())


@pytest.mark.fast
def test_plan_describes_each_strategy() -> None:
    model = ToyLM()
    shapes = {}
    for strategy in ShardingStrategy:
        plan = plan_sharding(model, strategy, (Block,), 8, local_world_size=8)
        shapes[strategy] = (plan.mesh_shape, plan.reshard_after_forward)
        assert plan.world_size == plan.replicas * plan.shard_size
    assert shapes == {
        ShardingStrategy.FULL_SHARD: ((8,), True),
        ShardingStrategy.SHARD_GRAD_OP: ((8,), False),
        ShardingStrategy.NO_SHARD: ((8, 1), False),
        ShardingStrategy.HYBRID_SHARD: ((2, 4), True),
        ShardingStrategy.HYBRID_SHARD_ZERO2: ((2, 4), False),
    }
    # the root keeps its parameters for backward unless it is the only unit
    assert plan_sharding(model, "full_shard", (Block,), 2).root_reshard_after_forward is None
    assert plan_sharding(model, "full_shard", (), 2).root_reshard_after_forward is True


@pytest.mark.fast
def test_plan_needs_no_process_group_and_no_memory() -> None:
    with torch.device("meta"):
        model = ToyLM(n_blocks=64)
    plan = plan_sharding(model, "hybrid_shard", (Block,), 1024, local_world_size=8)
    assert plan.mesh_shape == (128, 8) and len(plan.units) == 65


@pytest.mark.fast
@pytest.mark.parametrize(
    ("world", "requested", "local", "size"),
    [(8, 0, 4, 4), (8, 0, 8, 4), (4, 0, 4, 2), (6, 3, 6, 3), (16, 0, 8, 8)],
)
def test_one_hybrid_default(world: int, requested: int, local: int, size: int) -> None:
    assert hybrid_shard_size(world, requested, local) == size


@pytest.mark.fast
@pytest.mark.parametrize(("world", "requested"), [(2, 0), (3, 0), (4, 3), (4, 4)])
def test_hybrid_sizes_that_cannot_work_say_what_to_do(world: int, requested: int) -> None:
    with pytest.raises(FullshardError, match="shard group size") as err:
        hybrid_shard_size(world, requested, world)
    assert "--shard-size" in str(err.value) and "full_shard" in str(err.value)
