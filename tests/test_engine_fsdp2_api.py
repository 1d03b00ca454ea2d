"""FSDP2's API beyond the basics: module lists, ignored_params, an int reshard_after_forward,
the gradient controls, accumulation in the reduce dtype, and the errors for bad input."""

from __future__ import annotations

import copy

import pytest
import torch
from commcount import C10dCounter
from harness import run_ranks
from torch import nn
from torch.distributed.tensor import DTensor
from toy import ToyLM, batches, full_params, loss_of

import fullshard
from fullshard import FullshardError, MixedPrecisionPolicy, fully_shard


def _ref_grads(ref: nn.Module, data: list[torch.Tensor], world: int) -> dict[str, torch.Tensor]:
    for r in range(world):
        loss_of(ref, data[r]).backward()
    return {k: p.grad / world for k, p in ref.named_parameters() if p.grad is not None}


def _grad_diff(model: nn.Module, want: dict[str, torch.Tensor]) -> float:
    got = {k: p.grad.full_tensor() for k, p in model.named_parameters() if p.grad is not None}
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    return max(float((got[k] - want[k]).abs().max()) for k in want)


def _pair() -> tuple[ToyLM, ToyLM]:
    """A float64 toy model and its copy (the one-process reference, the one to shard)."""
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    ref = ToyLM(tie=False)
    return ref, copy.deepcopy(ref)


def _list_unit(rank: int, world: int) -> dict:
    ref, model = _pair()
    for b in model.blocks:
        fully_shard(b)
    group = fully_shard([model.norm, model.head])  # one unit of two modules (chunked-loss style)
    fully_shard(model)
    data = batches(1, world)[0]
    with C10dCounter() as c10d:
        loss_of(model, data[rank]).backward()
    return {
        "returns_list": group == [model.norm, model.head],
        "diff": _grad_diff(model, _ref_grads(ref, data, world)),
        # 3 blocks and the pair gathered twice, the root once (kept for backward)
        "gathers": c10d.calls["all_gather"],
        "dtensor": isinstance(model.head.weight, DTensor),
    }


def test_a_list_of_modules_is_one_unit() -> None:
    for r in run_ranks(_list_unit, 2):
        assert r["returns_list"] and r["dtensor"], r
        assert r["diff"] <= 1e-12, r
        assert r["gathers"] == 2 * 3 + 2 + 1, r


def _ignored(rank: int, world: int) -> dict:
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    model = ToyLM(tie=False)
    ignored = model.blocks[0].gate
    fully_shard(model.blocks[0], ignored_params={ignored})
    fully_shard(model)
    idx = batches(1, world)[0][rank]
    loss_of(model, idx).backward()
    return {
        "plain": not isinstance(ignored, DTensor) and ignored.shape == (1,),
        "same_object": model.blocks[0].gate is ignored,
        "local_grad": float(ignored.grad),  # this rank's own: not reduced
    }


def test_ignored_params_are_left_alone() -> None:
    res = run_ranks(_ignored, 2)
    assert all(r["plain"] and r["same_object"] for r in res), res
    assert res[0]["local_grad"] != res[1]["local_grad"]  # different data, no reduction


def _reshard_to_pairs(rank: int, world: int) -> dict:
    import fullshard.comm.collectives as coll

    sizes: list[tuple[str, int]] = []
    original = coll.Comm.all_gather  # every all-gather of a unit, whichever way it is issued

    def spy(self: coll.Comm, out: torch.Tensor, send: torch.Tensor, pos: object) -> object:
        sizes.append(("ag", torch.distributed.get_world_size(self.group)))
        return original(self, out, send, pos)  # type: ignore[arg-type]

    coll.Comm.all_gather = spy  # type: ignore[method-assign]
    ref, model = _pair()
    for b in model.blocks:
        fully_shard(b, reshard_after_forward=2)
    fully_shard(model)
    data = batches(1, world)[0]
    loss_of(model, data[rank]).backward()
    coll.Comm.all_gather = original  # type: ignore[method-assign]
    unit = fullshard.units(model.blocks[0])[0].unit
    return {
        "diff": _grad_diff(model, _ref_grads(ref, data, world)),
        "group_sizes": [n for _, n in sizes],
        "kept": unit.post_forward is not None,
    }


def test_int_reshard_after_forward_gathers_within_the_smaller_group() -> None:
    for r in run_ranks(_reshard_to_pairs, 4):
        assert r["diff"] <= 1e-12 and r["kept"], r
        # forward: root + 3 blocks over 4 ranks; backward: the 3 blocks over pairs only
        assert r["group_sizes"] == [4, 4, 4, 4, 2, 2, 2], r


def _controls(rank: int, world: int) -> dict:
    ref, model = _pair()
    for b in model.blocks:
        fully_shard(b)
    fully_shard(model.embed)
    fully_shard(model)
    model.set_gradient_divide_factor(1.0)  # the root only: a sum
    model.embed.set_unshard_in_backward(False)  # an embedding's backward needs no weight
    data = batches(1, world)[0]
    with C10dCounter() as c10d:
        loss_of(model, data[rank]).backward()
    want = _ref_grads(ref, data, world)
    for k in ("norm.weight", "norm.bias", "head.weight"):
        want[k] = want[k] * world  # summed, not averaged
    return {"diff": _grad_diff(model, want), "gathers": c10d.calls["all_gather"]}


def test_divide_factor_and_unshard_in_backward() -> None:
    for r in run_ranks(_controls, 2):
        assert r["diff"] <= 1e-12, r
        # blocks 2 x 3, embed once (not in backward), root once
        assert r["gathers"] == 3 * 2 + 1 + 1, r


def _unsynced(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = ToyLM(tie=False)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for b in model.blocks:
        fully_shard(b, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    data = batches(2, world)
    model.set_requires_gradient_sync(False)
    loss_of(model, data[0][rank]).backward()
    unit = fullshard.units(model.blocks[0])[0].unit
    kept = {str(t.dtype) for t in unit.accumulated.values()}
    model.set_requires_gradient_sync(True)
    loss_of(model, data[1][rank]).backward()
    return {"kept": kept, "left": len(unit.accumulated), "grad": str(model.head.weight.grad.dtype)}


def test_unsynchronised_gradients_accumulate_in_the_reduce_dtype() -> None:
    for r in run_ranks(_unsynced, 2):
        assert r["kept"] == {"torch.float32"} and r["left"] == 0, r
        assert r["grad"] == "torch.float32", r


def _bad(rank: int, world: int, case: str) -> str:
    torch.manual_seed(0)
    model = ToyLM(tie=False)
    try:
        if case == "int":
            fully_shard(model.blocks[0], reshard_after_forward=3)
        elif case == "dtypes":
            model.blocks[0].fc1.double()  # float64 and float32 trainable, no reduce dtype
            fully_shard(model.blocks[0])
    except FullshardError as exc:
        return str(exc)
    return ""


@pytest.mark.parametrize(
    "case, words",
    [
        ("int", ["reshard_after_forward=3", "must divide the shard group size 4", "[1, 2, 4]"]),
        ("dtypes", ["computed in", "reduce_dtype"]),
    ],
)
def test_bad_fsdp2_arguments_raise_on_every_rank(case: str, words: list[str]) -> None:
    for msg in run_ranks(_bad, 4, case):
        assert all(w in msg for w in words), msg


def test_full_params_helper_still_works_on_lists() -> None:
    res = run_ranks(_full_after_list, 2)
    assert res[0] == res[1]


def _full_after_list(rank: int, world: int) -> float:
    torch.manual_seed(0)
    model = ToyLM(tie=False)
    fully_shard([model.norm, model.head])
    fully_shard(model)
    return float(sum(v.double().sum() for v in full_params(model).values()))


class _MixedLinear(nn.Module):
    """A float32 weight and a float64 bias, both trained: one unit of two dtypes."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(rows, 4, dtype=torch.float32))
        self.scale = nn.Parameter(torch.randn(4, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.float() @ self.weight.t()).double().sum(-1, keepdim=True) * self.scale


def _mixed(rank: int, world: int, rows: int) -> dict:
    torch.manual_seed(0)
    ref = _MixedLinear(rows)
    model = copy.deepcopy(ref)
    fully_shard(model, mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float64))
    unit = fullshard.units(model)[0].unit
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(3, 4, generator=g, dtype=torch.float64) for _ in range(world)]
    out = model(xs[rank])
    same_forward = torch.equal(out, ref(xs[rank]))
    out.square().sum().backward()
    for x in xs:
        (ref(x).square().sum() / world).backward()
    # The same bits: each rank's gradients come from the same kernels on the same rows as the
    # reference's (its loss / 2 scales them by exactly 1/2). The sharded sum of two float32
    # gradients in float64 is exact (or off only far below float32's last bit), halved
    # exactly, then rounded to float32 once: the reference's float32 sum of the two halves.
    same_grads = [
        torch.equal(p.grad.full_tensor(), q.grad)
        for p, q in zip(model.parameters(), ref.parameters(), strict=True)
    ]
    return {"groups": len(unit.groups), "forward": same_forward, "grads": same_grads}


@pytest.mark.parametrize("rows", [8, 9])  # the float32 group's bytes aligned, and not
def test_a_unit_of_two_dtypes_gathers_both_exactly_in_one_collective(rows: int) -> None:
    for r in run_ranks(_mixed, 2, rows):
        assert r["groups"] == 2 and r["forward"], r
        assert r["grads"] == [True, True], r
