"""The FSDPModule API: state dicts, gradient accumulation without sync, unshard/reshard,
explicit prefetch, meta-device init, and the errors fully_shard raises on every rank.

The tests of one world size share one launch (``_at``: a launch costs seconds, a case a
fraction of one); each case builds its own models from its own seed in a rank reset to a fresh
process's default dtype, and a case that raises fails its own test only.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

import torch
from commcount import RS, C10dCounter
from harness import case_results, run_cases, run_ranks
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from toy import ToyLM, batches, full_params, loss_of, shard_toy

from fullshard import FSDPModule, FullshardError, fully_shard


def _state_dict(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    ref = ToyLM()
    model = shard_toy(copy.deepcopy(ref))
    sd = model.state_dict()
    own = dict(model.named_parameters())
    checks = {}
    for key, value in sd.items():
        assert isinstance(value, DTensor), key
        assert tuple(value.placements) == (Shard(0),)
        assert value.shape == ref.state_dict()[key].shape
        # the DTensor wraps the shard itself: no copy, no communication
        if key in own:
            # parameters are DTensors too (NOTE [Sharded parameters are DTensors])
            assert isinstance(own[key], DTensor), key
            checks[key] = value.to_local().data_ptr() == own[key].to_local().data_ptr()
    full = full_params(model)
    equal = all(torch.equal(full[k], v) for k, v in ref.state_dict().items())
    # load: a fresh sharded model (other init) takes DTensors, then full tensors
    torch.manual_seed(1)
    other = shard_toy(ToyLM())
    other.load_state_dict(sd)
    from_dtensor = all(torch.equal(full_params(other)[k], v) for k, v in full.items())
    torch.manual_seed(2)
    third = shard_toy(ToyLM())
    third.load_state_dict(ref.state_dict())
    from_full = all(torch.equal(full_params(third)[k], v) for k, v in full.items())
    return {"no_copy": all(checks.values()), "equal": equal, "dt": from_dtensor, "full": from_full}


def test_state_dict_is_dtensor_shards_and_loads_back() -> None:
    for res in _of(3, "state_dict"):
        assert res == {"no_copy": True, "equal": True, "dt": True, "full": True}


def _accumulate(rank: int, world: int, k: int, sync_every: bool = False) -> dict:
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    ref = ToyLM()
    model = shard_toy(copy.deepcopy(ref))
    data = batches(k, world)
    reduces_before_last = []
    for i in range(k):
        model.set_requires_gradient_sync(sync_every or i == k - 1)
        with C10dCounter() as c:
            loss_of(model, data[i][rank]).backward()
        if i < k - 1:
            reduces_before_last.append(c.calls.get(RS, 0))
    # reference: one big batch = all k x world micro-batches, summed, divided by world
    for i in range(k):
        for r in range(world):
            loss_of(ref, data[i][r]).backward()
    diff = 0.0
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        if q.grad is None:
            assert p.grad is None, name
            continue
        assert isinstance(p.grad, DTensor), name  # gradients are DTensors like their parameters
        full_grad = p.grad.full_tensor()
        diff = max(diff, (full_grad - q.grad / world).abs().max().item())
    return {"diff": diff, "reduces_before_last": reduces_before_last}


def test_gradient_accumulation_without_sync_equals_one_big_batch() -> None:
    for res in _of(2, "accumulate"):
        assert res["diff"] <= 1e-12, res
        assert res["reduces_before_last"] == [0, 0]


def test_sharded_gradients_accumulate_across_backward_calls() -> None:
    # sync on every backward: each reduce-scatter adds into .grad, like plain PyTorch
    for res in _of(3, "accumulate_sync_every"):
        assert res["diff"] <= 1e-12, res
        assert res["reduces_before_last"] == [4]  # one per unit, every backward


def _manual(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    ref = ToyLM(n_blocks=3)
    model = shard_toy(copy.deepcopy(ref))
    block = model.blocks[0]
    shard_shape = tuple(block.fc1.weight.to_local().shape)  # a DTensor: the rank's rows
    handle = block.unshard(async_op=True)
    assert handle is not None
    handle.wait()
    gathered_ok = torch.equal(block.fc1.weight, ref.blocks[0].fc1.weight)
    block.reshard()
    back_shape = tuple(block.fc1.weight.to_local().shape)
    # explicit prefetch lists: training still matches the implicit schedule bit for bit
    blocks = list(model.blocks)
    for i, b in enumerate(blocks):
        b.set_modules_to_forward_prefetch(blocks[i + 1 : i + 3])
        b.set_modules_to_backward_prefetch(blocks[max(0, i - 1) : i][::-1])
    implicit = shard_toy(copy.deepcopy(ref))
    data = batches(3, world)
    same = True
    for step in range(3):
        a = loss_of(model, data[step][rank])
        b = loss_of(implicit, data[step][rank])
        a.backward()
        b.backward()
        same &= a.item() == b.item()
        for p, q in zip(model.parameters(), implicit.parameters(), strict=True):
            same &= (p.grad is None and q.grad is None) or torch.equal(p.grad, q.grad)
        model.zero_grad()
        implicit.zero_grad()
    return {
        "shard_shape": shard_shape,
        "gathered_ok": gathered_ok,
        "back_shape": back_shape,
        "same": same,
        "is_fsdp": isinstance(block, FSDPModule) and isinstance(block, nn.Module),
    }


def test_unshard_reshard_and_explicit_prefetch() -> None:
    for rank, res in enumerate(_of(2, "manual")):
        assert res["gathered_ok"] and res["same"] and res["is_fsdp"]
        assert res["shard_shape"] == ((7, 12) if rank == 0 else (6, 12))  # 13 rows over 2 ranks
        assert res["back_shape"] == res["shard_shape"]


def _meta_init(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    ref = ToyLM()
    with torch.device("meta"):
        model = ToyLM()
    shard_toy(model)
    try:
        loss_of(model, batches(1, world)[0][rank])
        meta_error = ""
    except FullshardError as e:
        meta_error = str(e)
    model.to_empty(device="cpu")
    model.load_state_dict(ref.state_dict())  # any init: here the reference's weights
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = batches(2, world)
    loss_of(model, data[0][rank]).backward()
    opt.step()
    ref_full = full_params(model)
    return {
        "meta_error": meta_error,
        "trained": not torch.equal(ref_full["norm.weight"], ref.norm.weight),
    }


def test_meta_device_init_then_to_empty() -> None:
    for res in _of(2, "meta_init"):
        assert "meta device" in res["meta_error"] and "to_empty" in res["meta_error"]
        assert "blocks.0.fc1.weight" in res["meta_error"] or "fc1.weight" in res["meta_error"]
        assert res["trained"]


class _Scalar(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(2.0))


def _errors(rank: int, world: int) -> dict:
    out = {}

    def catch(name: str, fn: object) -> None:
        try:
            fn()  # type: ignore[operator]
            out[name] = ""
        except FullshardError as e:
            out[name] = str(e)

    def tied_across_units() -> None:
        model = ToyLM(tie=True)
        fully_shard(model.embed)  # the head's weight is the embedding's: two units
        fully_shard(model)

    def zero_dim() -> None:
        fully_shard(_Scalar())

    def child_before_root() -> None:
        model = shard_toy(ToyLM())
        model.blocks[0](torch.randn(2, 3, 12))

    def twice() -> None:
        block = fully_shard(nn.Linear(3, 3))
        fully_shard(block)

    def integer() -> None:
        m = nn.Linear(2, 2)
        m.register_parameter(
            "steps", nn.Parameter(torch.zeros(3, dtype=torch.int64), requires_grad=False)
        )
        fully_shard(m)

    catch("tied", tied_across_units)
    catch("zero_dim", zero_dim)
    catch("child_before_root", child_before_root)
    catch("twice", twice)
    catch("integer", integer)
    return out


def test_errors_say_what_and_where_on_every_rank() -> None:
    for res in _of(2, "errors"):
        assert "head.weight" in res["tied"] and "embed.weight" in res["tied"], res["tied"]
        assert "one unit" in res["tied"]
        assert "'scale'" in res["zero_dim"] and "(1,)" in res["zero_dim"]
        assert "before its root" in res["child_before_root"]
        assert "already" in res["twice"]
        assert "'steps'" in res["integer"] and "int64" in res["integer"]


def _local_steps(rank: int, world: int) -> dict:
    class MyAdamW(torch.optim.AdamW):  # not in the elementwise list: steps over DTensors
        pass

    torch.set_default_dtype(torch.float64)
    out = {}
    for name, cls in (("local", torch.optim.AdamW), ("dtensor", MyAdamW)):
        torch.manual_seed(0)
        model = shard_toy(ToyLM())
        opt = cls(model.parameters(), lr=1e-2)
        seen: list[bool] = []  # per step: did the step itself see DTensor parameters?

        def look(o: torch.optim.Optimizer, *_: object, seen: list[bool] = seen) -> None:
            # a per-optimizer pre-hook runs after the global one that swaps in local shards
            ps = [p for g in o.param_groups for p in g["params"]]
            seen.append(all(isinstance(p, DTensor) for p in ps))

        opt.register_step_pre_hook(look)
        for step in range(2):
            loss_of(model, batches(2, world)[step][rank]).backward()
            opt.step()
            opt.zero_grad()
        params = [p for g in opt.param_groups for p in g["params"]]
        states = [s for s in opt.state.values()]
        out[name] = {
            "params_are_model_dtensors": all(
                isinstance(p, DTensor) and any(p is q for q in model.parameters()) for p in params
            ),
            "state_keys_are_params": all(any(k is p for p in params) for k in opt.state),
            "states_dtensor": all(isinstance(s["exp_avg"], DTensor) for s in states),
            "stepped_dtensors": seen,
            "full": full_params(model),
        }
    same = all(torch.equal(out["local"]["full"][k], v) for k, v in out["dtensor"]["full"].items())
    for v in out.values():
        del v["full"]
    return {**out, "same": same}


def test_elementwise_optimizers_step_local_shards_and_leave_dtensors_behind() -> None:
    # NOTE [Local optimizer steps]: AdamW steps over plain local views, a subclass over the
    # DTensors themselves; both leave DTensor parameters and state behind and agree bitwise
    for res in _of(2, "local_steps"):
        assert res["same"], res
        for name in ("local", "dtensor"):
            r = res[name]
            assert r["params_are_model_dtensors"] and r["state_keys_are_params"], (name, r)
            assert r["states_dtensor"], (name, r)
        # the elementwise AdamW stepped over plain local shards, the subclass over DTensors
        assert res["local"]["stepped_dtensors"] == [False, False], res
        assert res["dtensor"]["stepped_dtensors"] == [True, True], res


# world size -> case -> (fn, args): each test's ``fn(rank, world, *args)``
CASES: dict[int, dict[str, tuple[Callable[..., Any], tuple]]] = {
    2: {
        "accumulate": (_accumulate, (3,)),
        "manual": (_manual, ()),
        "meta_init": (_meta_init, ()),
        "errors": (_errors, ()),
        "local_steps": (_local_steps, ()),
    },
    3: {
        "state_dict": (_state_dict, ()),
        "accumulate_sync_every": (_accumulate, (2, True)),
    },
}


@functools.cache
def _at(world: int) -> list[dict[str, dict]]:
    return run_ranks(run_cases, world, CASES[world], timeout_s=300)


def _of(world: int, name: str) -> list[Any]:
    """One case's result on every rank (its traceback, if it raised)."""
    return case_results(_at(world), name)
