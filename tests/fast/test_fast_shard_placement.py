"""``shard_placement_fn`` in one process: the Shard(k) layout's arithmetic (no process group), and
over the fake group (rank r of N, no data moves) the placements, the bad inputs and the count of
collectives per unit and phase. The numbers are ``tests/test_shard_placement.py``'s job."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from commcount import C10dCounter
from placement_models import Block, Net, dim1, largest_dim, shard_net
from quant_toy import QuantWeight
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, ShardPlacementResult
from torch.distributed.tensor import DTensor, Replicate, Shard
from toy import batches, loss_of

import fullshard.shard.layout as layout_mod
from fullshard import FSDPModule, apply_plan, fully_shard, plan_sharding
from fullshard.policies import FullshardError
from fullshard.shard.layout import FlatLayout, chunk_of

pytestmark = pytest.mark.fast

# (shape, dim): Shard(k) slots with elements before and after dim k, between uneven dim-0 ones
SLOTS = [((12, 8), 1), ((13,), 0), ((2, 8, 3), 1), ((2, 3, 4), 2), ((37, 12), 0), ((4, 8), 1)]


def _fulls() -> tuple[list[torch.Size], list[int], list[torch.Tensor]]:
    shapes = [torch.Size(s) for s, _ in SLOTS]
    return shapes, [d for _, d in SLOTS], [torch.randn(s, dtype=torch.float64) for s in shapes]


def _gather(layout: FlatLayout, fulls: list[torch.Tensor]) -> torch.Tensor:
    """What all_gather_into_tensor produces from every rank's packed shard: rank-major."""
    shards = []
    for r in range(layout.world):
        flat = torch.full((layout.shard_numel,), float("nan"), dtype=torch.float64)
        layout.pack_shard(fulls, r, flat)
        shards.append(flat)
    return torch.cat(shards)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_shard_k_layout_round_trip_is_contiguous(world: int) -> None:
    shapes, dims, fulls = _fulls()
    layout = FlatLayout(shapes, world, tail=5, dims=dims)
    gathered = _gather(layout, fulls)
    for r in range(world):
        flat = gathered.view(world, -1)[r]
        for i, (full, d) in enumerate(zip(fulls, dims, strict=True)):
            view = layout.shard_view(flat, i, r)
            assert view.is_contiguous() and torch.equal(view, chunk_of(full, world, r, d))
    storage = torch.empty(layout.total_numel, dtype=torch.float64)
    layout.copy_out(gathered, storage, torch.empty(world, 5, dtype=torch.float64))
    for i, full in enumerate(fulls):
        got = layout.gathered_view(storage, i)
        assert got.is_contiguous() and torch.equal(got, full), (i, SLOTS[i])
    # Shard(k) regions carry no padding: numel / world each
    assert all(s.padded_numel * world == s.numel for s in layout.slots if s.dim)


def test_shard_k_copy_out_into_a_larger_groups_layout() -> None:
    # NOTE [Resharding to a smaller group]: gathered over 2 ranks into the 4-rank storage
    shapes, dims, fulls = _fulls()
    big, small = FlatLayout(shapes, 4, tail=5, dims=dims), FlatLayout(shapes, 2, tail=5, dims=dims)
    storage = torch.empty(big.total_numel, dtype=torch.float64)
    small.copy_out(_gather(small, fulls), storage, dest=big)
    for i, full in enumerate(fulls):
        assert torch.equal(big.gathered_view(storage, i), full)


@pytest.mark.parametrize("chunk_cat", [True, False], ids=["chunk_cat", "torch<2.4"])
def test_shard_k_reduce_pack_puts_each_ranks_chunk_in_its_block(
    chunk_cat: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not chunk_cat:
        monkeypatch.setattr(layout_mod, "_chunk_cat", None)
    shapes, dims, grads = _fulls()
    world = 4
    grads[2] = None  # type: ignore[call-overload]  # no gradient: zeros
    layout = FlatLayout(shapes, world, dims=dims)
    extra = torch.ones(world, 2, dtype=torch.float64)
    cpu = torch.device("cpu")
    packed = layout.pack_for_reduce(grads, dtype=torch.float64, device=cpu, extra=extra)
    for r in range(world):
        block = packed[r, : layout.shard_numel]
        for i, (g, d) in enumerate(zip(grads, dims, strict=True)):
            got = layout.shard_view(block, i, r)
            want = torch.zeros_like(got) if g is None else chunk_of(g, world, r, d)
            assert torch.equal(got, want), (r, SLOTS[i])
        assert torch.equal(packed[r, layout.shard_numel :], extra[r])


def test_an_uneven_shard_k_layout_is_refused() -> None:
    with pytest.raises(ValueError, match="uneven"):
        FlatLayout([torch.Size((4, 6))], 4, dims=[1])


# -- over the fake group --------------------------------------------------------------------
def _error(module: nn.Module, fn: Any, **kwargs: Any) -> str:
    with pytest.raises(FullshardError) as info:
        fully_shard(module, shard_placement_fn=fn, **kwargs)
    return str(info.value)


def test_placements_local_shapes_and_contiguity(fake_pg: tuple[int, int]) -> None:
    rank, world = fake_pg
    torch.manual_seed(0)
    model = shard_net(Net())
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor)
        want = Shard(1) if p.dim() >= 2 else Shard(0)
        assert tuple(p.placements) == (want,), name
        local = p.to_local()
        assert local.is_contiguous(), name
        if p.dim() >= 2:
            shape = list(p.shape)
            shape[1] //= world
            assert tuple(local.shape) == tuple(shape), name
    assert model.blocks[0].mix.to_local().shape == (2, 8 // world, 3)  # 3-D: dim 1 chunked


def test_largest_dim_and_negative_dims(fake_pg: tuple[int, int]) -> None:
    model = shard_net(Net(), largest_dim)
    placed = {k: p.placements[0] for k, p in model.named_parameters()}
    assert placed["blocks.0.fc2.weight"] == Shard(1) and placed["blocks.0.mix"] == Shard(1)
    assert placed["embed.weight"] == Shard(0) and placed["blocks.0.fc1.weight"] == Shard(0)
    lin = fully_shard(nn.Linear(8, 4), shard_placement_fn=lambda p: Shard(-1))
    assert lin.weight.placements == (Shard(1),) and lin.bias.placements == (Shard(0),)


def test_apply_plan_gives_fully_shards_options_to_every_unit_and_the_root(
    fake_pg: tuple[int, int],
) -> None:
    """``apply_plan`` forwards the ``fully_shard`` keywords it does not set itself (here
    ``shard_placement_fn``) to each unit of the plan and to the root, ``None`` meaning
    ``fully_shard``'s default (``parallelize``'s ``mp_policy=None``); a keyword ``fully_shard``
    does not take is refused before any unit is sharded."""
    _, world = fake_pg
    model = Net()
    plan = plan_sharding(model, "full_shard", [Block], world)
    with pytest.raises(TypeError, match="shard_placment_fn, which fully_shard does not take"):
        apply_plan(model, plan, shard_placment_fn=dim1)
    assert not any(isinstance(m, FSDPModule) for m in model.modules())
    apply_plan(model, plan, shard_placement_fn=dim1, mp_policy=None)
    assert all(isinstance(m, FSDPModule) for m in (model, *model.blocks))
    placed = {k: p.placements for k, p in model.named_parameters()}
    assert placed["blocks.1.fc1.weight"] == placed["embed.weight"] == (Shard(1),)  # unit, root
    assert placed["blocks.1.fc1.bias"] == (Shard(0),)


def test_hsdp_placements(fake_pg: tuple[int, int]) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = shard_net(Net(), mesh=mesh)
    assert model.head.weight.placements == (Replicate(), Shard(1))
    assert model.head.weight.to_local().shape == (37, 4)
    assert model.norm.weight.placements == (Replicate(), Shard(0))


def test_shard_placement_result_on_the_units_mesh(fake_pg: tuple[int, int]) -> None:
    mesh = init_device_mesh("cpu", (fake_pg[1],))
    info = FSDPMeshInfo(mesh, shard_mesh_dim=0)
    lin = fully_shard(
        nn.Linear(8, 4, bias=False),
        mesh=mesh,
        shard_placement_fn=lambda p: ShardPlacementResult(Shard(1), info),
    )
    assert lin.weight.placements == (Shard(1),)
    none = fully_shard(
        nn.Linear(8, 4), shard_placement_fn=lambda p: ShardPlacementResult(None, info)
    )
    assert none.weight.placements == (Shard(0),)  # mesh=None: the same (world) group
    other = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))["b"]
    msg = _error(nn.Linear(8, 4), lambda p: ShardPlacementResult(Shard(0), FSDPMeshInfo(other, 0)))
    assert "per-parameter meshes are not supported" in msg and "'weight'" in msg, msg


@pytest.mark.parametrize(
    "answer, says",
    [
        (Replicate(), "returned Replicate()"),
        (1, "return Shard(1), not 1"),
        (Shard(2), "which has no dim 2"),
        (Shard(-3), "which has no dim -3"),
    ],
    ids=["replicate", "int", "dim2", "dim-3"],
)
def test_bad_answers_are_refused(fake_pg: tuple[int, int], answer: Any, says: str) -> None:
    msg = _error(nn.Linear(8, 4), lambda p: answer)
    assert says in msg and "'weight'" in msg and "unit Linear" in msg, msg
    assert "Shard(dim)" in msg or "Shard(d)" in msg, msg  # what to return


def test_uneven_shard_k_is_refused_with_the_sizes(fake_pg: tuple[int, int]) -> None:
    msg = _error(nn.Linear(6, 4), lambda p: Shard(1) if p.dim() == 2 else None)
    assert "'weight'" in msg and "unit Linear" in msg and "Shard(1)" in msg, msg
    assert "size 6" in msg and "shard group size 4" in msg and "Shard(0)" in msg, msg
    assert "rank" not in msg.split(":")[0]  # the same words on every rank


def test_extension_parameters_take_dim_0(fake_pg: tuple[int, int]) -> None:
    quant = nn.Linear(8, 4, bias=False)
    quant.weight = nn.Parameter(QuantWeight(quant.weight.detach()))
    msg = _error(quant, lambda p: Shard(1))
    assert "extension hooks" in msg and "Shard(0)" in msg, msg


def _collectives(model: nn.Module) -> dict[str, int]:
    """Collectives of one step after a first one (the first gathers on demand)."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    data = batches(2, world)
    loss_of(model, data[0][rank]).backward()
    with C10dCounter() as c:
        loss_of(model, data[1][rank]).backward()
    calls = dict(c.calls)
    # a reduce-scatter, or on gloo the all-to-all that stands for one
    calls["reduce"] = calls.pop("reduce_scatter", 0) + calls.pop("all_to_all", 0)
    return calls


@pytest.mark.parametrize("raf", [None, 2], ids=["reshard", "reshard_after_forward=2"])
def test_one_collective_per_unit_per_phase(fake_pg: tuple[int, int], raf: int | None) -> None:
    torch.manual_seed(0)
    shard_k = _collectives(shard_net(Net(), reshard_after_forward=raf))
    shard_0 = _collectives(shard_net(Net(), None, reshard_after_forward=raf))
    # 3 units: forward gathers 3, backward 2 (the root keeps its parameters), 3 reductions
    assert shard_k == shard_0 == {"all_gather": 5, "reduce": 3}, (shard_k, shard_0)


def test_state_dict_is_the_shards_without_communication(fake_pg: tuple[int, int]) -> None:
    model = shard_net(Net())
    with C10dCounter() as c:
        sd = model.state_dict()
    assert not c.calls, dict(c.calls)
    for name, p in model.named_parameters():
        v = sd[name]
        assert isinstance(v, DTensor) and v.placements == p.placements, name
        assert v.to_local().data_ptr() == p.to_local().data_ptr(), name


def test_planner_and_memory_tracker_count_shard_k_bytes(fake_pg: tuple[int, int]) -> None:
    import copy

    import fullshard
    from fullshard.observe.memory import MemoryTracker
    from fullshard.plan.model import model_units

    rank, world = fake_pg
    torch.manual_seed(0)
    plain = Net()
    dims = {n: 1 for n, p in plain.named_parameters() if p.dim() >= 2}
    planned = model_units(plain, [Block], world, shard_dims=dims)
    model = shard_net(copy.deepcopy(plain))
    engine = [v.unit for v in fullshard.units(model)]  # root first, as the planner
    assert [u.shard_numel for u in planned] == [u.groups[0].layout.shard_numel for u in engine]
    assert [u.grad_shard_numel for u in planned] == [
        u.grad_layout.shard_numel + len(u.trainable) for u in engine
    ]
    # a Shard(1) parameter costs numel / world per rank: only dim-0 ones are padded
    for u in engine:
        for s in u.groups[0].layout.slots:
            assert s.padded_numel * world == s.numel or not s.dim
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    data = batches(2, world)
    loss_of(model, data[0][rank]).backward()  # the root sets up its schedule in this forward
    mem = MemoryTracker().attach(model, opt)
    loss_of(model, data[1][rank]).backward()
    opt.step()
    flat = sum(g.flat.numel() * g.flat.element_size() for u in engine for g in u.groups)
    assert mem.peaks["forward"]["sharded_params"] == flat
    # the gathered storages are the layouts' (no padding in the Shard(1) regions)
    sizes = [g.storage.nbytes for u in engine for g in u.groups]
    assert sizes == [u.groups[0].layout.total_numel * 4 for u in engine]  # float32
    assert max(sizes) <= mem.peaks["forward"]["gathered_window"] <= sum(sizes)
