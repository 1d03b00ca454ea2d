"""The sharding plan is what the engine does: the same units, the same parameters, one default.

``plan_sharding`` applies NOTE [Unit membership] to an unwrapped (or meta) model; the engine
applies it at wrap time. Here both run on the same models and must agree unit by unit.
"""

from __future__ import annotations

import pytest
import torch
from harness import run_ranks
from torch import nn
from toy import Block, ToyLM

import fullshard
from fullshard import FullshardError, ShardingStrategy, parallelize, plan_sharding
from fullshard.app.models import build_model, unit_types_of
from fullshard.engine.sharding import hybrid_shard_size


class Nested(nn.Module):
    """A unit inside a unit (its parameters are not the outer unit's) and a frozen parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.outer = nn.ModuleDict({"inner": Block(), "own": nn.Linear(12, 12)})
        self.outer["own"].bias.requires_grad_(False)
        self.head = nn.Linear(12, 5)


def _models() -> dict[str, tuple[nn.Module, tuple[type[nn.Module], ...]]]:
    tiny = build_model("tiny", 64, seed=0)
    nested = Nested()
    return {
        "toy (tied root)": (ToyLM(), (Block,)),
        "tiny gpt": (tiny, unit_types_of(tiny)),
        "nested units": (nested, (Block, nn.ModuleDict)),
    }


def _compare(rank: int, world: int) -> dict:
    out = {}
    for name, (model, types) in _models().items():
        planned = plan_sharding(model, "full_shard", types, world)
        parallelize(model, strategy="full_shard", unit_types=types)
        wrapped = {v.name: v.param_names for v in fullshard.units(model)}
        out[name] = (
            {u.name: list(u.params) for u in planned.units},
            wrapped,
            [u.numel for u in planned.units],
            [sum(sp.shape.numel() for sp in v.unit.params) for v in fullshard.units(model)],
        )
    return out


def test_plan_units_are_the_units_fully_shard_makes() -> None:
    for name, (planned, wrapped, numel_p, numel_w) in run_ranks(_compare, 2)[0].items():
        assert planned == wrapped, name
        assert sorted(numel_p) == sorted(numel_w), name
        assert planned[""], f"{name}: the root owns what no unit module holds"


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
