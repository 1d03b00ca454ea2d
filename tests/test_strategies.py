"""Every sharding strategy, mixed precision, offload, activation checkpointing and clipping.

The tests of one world size share one launch (``_at_4_ranks``, ``_at_2_ranks``: a launch costs
seconds, most cases a fraction of one); each case builds its own model from its own seed in a
rank reset to a fresh process's default dtype, and a case that raises fails its own test only.
"""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from commcount import RS, C10dCounter
from harness import case_results, run_cases, run_ranks
from torch.distributed.device_mesh import init_device_mesh
from toy import Block, ToyLM, batches, full_params, loss_of

import fullshard
from fullshard import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    ShardingStrategy,
    clip_grad_norm_,
    parallelize,
)

STRATEGIES = [s.value for s in ShardingStrategy]


def _mesh(strategy: str, world: int):  # hybrid at 4 ranks: 2 replicas x 2 shards
    if strategy.startswith("hybrid"):
        return init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    return None


@functools.cache
def _at_4_ranks() -> list[dict]:
    cases: dict[Any, tuple[Callable[..., Any], tuple]] = {}
    for strategy in STRATEGIES:
        cases["parity", strategy] = (_parity, (strategy, 2, {}))
        cases["comm", strategy] = (_comm, (strategy,))
    return run_ranks(run_cases, 4, cases, timeout_s=600)


@functools.cache
def _at_2_ranks() -> list[dict]:
    cases: dict[Any, tuple[Callable[..., Any], tuple]] = {
        "offload_ac": (_parity, ("full_shard", 1, {"offload": True, "ac": True})),
        "mixed": (_mixed, (50,)),
        "scaler": (_scaler, ()),
        "saved_activations": (_saved_activation_bytes, ()),
    }
    return run_ranks(run_cases, 2, cases, timeout_s=600)


def _parity(rank: int, world: int, strategy: str, accum: int, opts: dict) -> dict:
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    ref = ToyLM()
    model = parallelize(
        copy.deepcopy(ref),
        strategy=strategy,
        unit_types=(Block,),
        mesh=_mesh(strategy, world),
        offload_policy=CPUOffloadPolicy() if opts.get("offload") else None,
        activation_checkpointing=opts.get("ac", False),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    steps = 3
    data = batches(steps * accum, world)
    norms = []
    for step in range(steps):
        for i in range(accum):
            model.set_requires_gradient_sync(i == accum - 1)
            loss_of(model, data[step * accum + i][rank]).backward()
            for r in range(world):
                loss_of(ref, data[step * accum + i][r]).backward()
        for p in ref.parameters():
            if p.grad is not None:
                p.grad.div_(world)
        norms.append(
            (
                clip_grad_norm_(model.parameters(), 0.5).item(),
                torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5).item(),
            )
        )
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    got, want = full_params(model), ref.state_dict()
    return {
        "param_diff": max((got[k] - want[k]).abs().max().item() for k in want),
        "norm_diff": max(abs(a - b) for a, b in norms),
        "norms": norms,
        "shard_devices": sorted({str(p.device) for p in model.parameters()}),
    }


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_strategy_matches_reference_at_4_ranks(strategy: str) -> None:
    # two micro-batches per step (sync off on the first) and clipping on every step
    for res in case_results(_at_4_ranks(), ("parity", strategy)):
        assert res["param_diff"] <= 1e-12, res
        assert res["norm_diff"] <= 1e-12, res
        assert res["norms"][0][1] > 0.5  # the clip really clipped


def test_cpu_offload_and_activation_checkpointing_keep_parity() -> None:
    for res in case_results(_at_2_ranks(), "offload_ac"):
        assert res["param_diff"] <= 1e-12, res
        assert res["shard_devices"] == ["cpu"]


def _comm(rank: int, world: int, strategy: str) -> dict:
    torch.manual_seed(0)
    ref = ToyLM(n_blocks=4)
    for p in ref.parameters():
        p.requires_grad_(True)
    numel = sum(p.numel() for p in ref.parameters())
    model = parallelize(ref, strategy=strategy, unit_types=(Block,), mesh=_mesh(strategy, world))
    data = batches(2, world)
    loss_of(model, data[0][rank]).backward()
    with C10dCounter() as c:
        loss_of(model, data[1][rank]).backward()
    return {"calls": dict(c.calls), "bytes": dict(c.bytes), "model_bytes": numel * 4}


def test_collectives_per_strategy() -> None:
    units = 5  # 4 blocks + root
    expect_calls = {
        "full_shard": {"all_gather": 9, RS: units},  # root kept after forward
        "shard_grad_op": {"all_gather": units, RS: units},
        "no_shard": {"all_reduce": units},
        "hybrid_shard": {"all_gather": 9, RS: units, "all_reduce": units},
        "hybrid_shard_zero2": {"all_gather": units, RS: units, "all_reduce": units},
    }
    for strategy, calls in expect_calls.items():
        res = case_results(_at_4_ranks(), ("comm", strategy))[0]
        assert res["calls"] == calls, (strategy, res)
        in_model = {k: v / res["model_bytes"] for k, v in res["bytes"].items()}
        if strategy == "no_shard":
            assert 1.0 <= in_model["all_reduce"] < 1.05  # the whole model, plus indicators
        if strategy.startswith("hybrid"):
            # the all-reduce across replicas carries only this rank's shard (half the model)
            assert 0.5 <= in_model["all_reduce"] < 0.6, in_model


# the bf16 run's weights against one process after this many of its 50 steps (a wrong cast,
# reduction or update shows in the first; the reference's steps cost time)
BF16_PARITY_STEPS = 10


def _bf16_reference(
    base: ToyLM, data: list[list[torch.Tensor]], world: int
) -> dict[str, torch.Tensor]:
    """One process doing what bf16 mixed precision means: each rank's batch through a bf16
    copy of the float32 weights, the bf16 gradients summed in float32 and divided by the
    world, AdamW on the float32 weights. Its weights after ``len(data)`` steps."""
    ref, low = copy.deepcopy(base), copy.deepcopy(base).to(torch.bfloat16)
    opt = torch.optim.AdamW(ref.parameters(), lr=3e-3)
    pairs = list(zip(ref.parameters(), low.parameters(), strict=True))
    for step in data:
        with torch.no_grad():
            for p, q in pairs:
                q.copy_(p)  # the cast, as .to(torch.bfloat16) rounds
        for batch in step:
            loss_of(low, batch).backward()
            for p, q in pairs:
                if q.grad is not None:
                    g = q.grad.float() / world
                    p.grad = g if p.grad is None else p.grad + g
            low.zero_grad()
        opt.step()
        opt.zero_grad()
    return ref.state_dict()


def _mixed(rank: int, world: int, steps: int) -> dict:
    torch.manual_seed(0)
    base = ToyLM()
    losses: dict[str, Any] = {}
    for name, mp in {
        "fp32": MixedPrecisionPolicy(),
        "bf16": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    }.items():
        model = parallelize(
            copy.deepcopy(base), strategy="full_shard", unit_types=(Block,), mp_policy=mp
        )
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        seen_dtypes = set()
        model.blocks[0].fc1.register_forward_hook(
            lambda m, i, o, seen=seen_dtypes: seen.add(m.weight.dtype)
        )
        data = batches(steps, world, batch=4, seq=9)
        out = []
        for step in range(steps):
            loss = loss_of(model, data[step][rank])
            loss.backward()
            grad_dtypes = {p.grad.dtype for p in model.parameters() if p.grad is not None}
            opt.step()
            opt.zero_grad()
            out.append(loss.float().item())
            if name == "bf16" and step + 1 == BF16_PARITY_STEPS:
                got = full_params(model)
                want = _bf16_reference(base, data[:BF16_PARITY_STEPS], world)
                assert got.keys() == want.keys()
                losses["bf16_differ"] = [k for k in want if not torch.equal(got[k], want[k])]
        losses[name] = out
        losses[name + "_compute"] = sorted(str(d) for d in seen_dtypes)
        losses[name + "_master"] = sorted({str(p.dtype) for p in model.parameters()})
        losses[name + "_grads"] = sorted(str(d) for d in grad_dtypes)
    return losses


def test_bf16_trains_as_one_process_computing_in_bf16_over_50_steps() -> None:
    res = case_results(_at_2_ranks(), "mixed")[0]
    assert res["bf16_compute"] == ["torch.bfloat16"] and res["fp32_compute"] == ["torch.float32"]
    assert res["bf16_master"] == ["torch.float32"] and res["bf16_grads"] == ["torch.float32"]
    # Bit for bit: each rank runs the reference's bf16 kernels on the same rows and weights (a
    # float32 shard cast to bf16 is the full weight cast, row by row), the reduce-scatter adds
    # two ranks' float32 gradients (one addition: the same bits in either order) and halves
    # them (exact), and AdamW is elementwise. Against the float32 run it could only be close,
    # by a margin bf16's rounding decides, and that rounding is the CPU's (AMX, AVX-512 BF16
    # or a float32 emulation): no tolerance would hold on all of them.
    assert res["bf16_differ"] == [], res["bf16_differ"]  # after BF16_PARITY_STEPS steps
    fp32, bf16 = res["fp32"], res["bf16"]
    assert fp32[-1] < 0.5 * fp32[0] and bf16[-1] < 0.5 * bf16[0]  # both train
    gap = max(abs(a - b) / a for a, b in zip(fp32[-10:], bf16[-10:], strict=True))
    print(f"\nbf16 against fp32, 50 steps: largest relative loss gap over the last 10 {gap:.2e}")


def _scaler(rank: int, world: int) -> dict:
    from fullshard import ShardedGradScaler

    torch.manual_seed(0)
    model = parallelize(ToyLM(), strategy="full_shard", unit_types=(Block,))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ShardedGradScaler("cpu", init_scale=1024.0)
    before = {k: v.clone() for k, v in full_params(model).items()}
    loss = loss_of(model, batches(1, world)[0][rank])
    if rank == 1:
        loss = loss * math.inf  # only rank 1 sees a non-finite loss
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    after = full_params(model)
    return {
        "unchanged": all(torch.equal(before[k], after[k]) for k in before),
        "scale": scaler.get_scale(),
    }


def test_sharded_grad_scaler_skips_on_every_rank() -> None:
    for res in case_results(_at_2_ranks(), "scaler"):
        assert res["unchanged"]
        assert res["scale"] == 512.0


def _saved_activation_bytes(rank: int, world: int) -> dict:
    out = {}
    for ac in (False, True):
        torch.manual_seed(0)
        model = parallelize(
            ToyLM(n_blocks=4),
            strategy="full_shard",
            unit_types=(Block,),
            activation_checkpointing=ac,
        )
        params = {
            view.unit.storage.flat.untyped_storage()._cdata for view in fullshard.units(model)
        }
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor, seen: dict = seen, params: set = params) -> torch.Tensor:
            storage = t.untyped_storage()
            if storage._cdata not in params:  # activations only, not gathered parameters
                seen[storage._cdata] = storage.nbytes()
            return t

        idx = batches(1, world, batch=16, seq=33)[0][rank]
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = loss_of(model, idx)
        loss.backward()
        out["ac" if ac else "plain"] = sum(seen.values())
    return out


def test_activation_checkpointing_saves_less_for_backward() -> None:
    res = case_results(_at_2_ranks(), "saved_activations")[0]
    assert res["ac"] < 0.5 * res["plain"], res
