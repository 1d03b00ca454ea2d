"""torch.compile over sharded models (NOTE [Hooks run outside torch.compile] in
``engine/hooks.py``): each block compiled, or the whole model, trains like the eager
single-process reference.

Float64, against the eager single-process reference of ``test_engine_parity`` (which the eager
sharded model matches exactly, 0.0). What these tests check is ours: the hooks run between
graphs (no graph break), the gathered parameters the graphs read are the right ones, every
unit is freed after the step. That is Dynamo and AOTAutograd's part of ``torch.compile``, so
most cases compile with ``backend="aot_eager"``: the graphs Inductor would get, run op by op by
the same aten kernels as eager, without Inductor's C++ code generation (seconds per graph on a
CPU). Such a run must match the eager reference exactly (0.0), stronger than any tolerance.

One case keeps the default backend, Inductor, so that the real path stays covered: it writes
its own kernels (fused layer norm, GELU, reductions in its own order), so compiled and eager
differ at rounding level, ~1e-16 relative in the gradients. AdamW divides each update by
sqrt(v), which turns that into ~1e-14 absolute in the parameters after three steps at lr 1e-2
(measured: 1.0e-14 for the whole model); a wrong gather or a stale gradient moves values by ~1e-3.
The brief's 1e-12 separates the two with room.

Every case runs in one launch (``_everything``: a rank imports Dynamo and Inductor once, not
once per case), each after ``torch._dynamo.reset()`` on a model of its own.
"""

from __future__ import annotations

import copy
import functools
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch
from harness import run_ranks
from torch.distributed.tensor import DTensor
from toy import ToyLM, batches, full_params, loss_of, reference_step, shard_toy

STEPS = 3
INDUCTOR = "inductor"  # torch.compile's default backend
# (mode, backend): what is compiled, and by which backend
TRAIN_CASES = [("blocks", "aot_eager"), ("whole", "aot_eager"), ("whole", INDUCTOR)]


def _train(rank: int, world: int, mode: str, backend: str) -> dict:
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    ref = ToyLM(n_blocks=2).to(torch.float64)
    init = copy.deepcopy(ref.state_dict())
    model = shard_toy(copy.deepcopy(ref))
    run: torch.nn.Module = model
    if mode == "blocks":
        for block in model.blocks:
            block.compile(backend=backend)
    elif mode == "whole":
        run = torch.compile(model, backend=backend)  # the default dynamic setting
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    data = batches(STEPS, world)
    loss_diff = 0.0
    for step in range(STEPS):
        loss = loss_of(run, data[step][rank])
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_losses = reference_step(ref, ref_opt, [data[step][r] for r in range(world)])
        loss_diff = max(loss_diff, abs(loss.item() - ref_losses[rank]))
    got, want = full_params(model), ref.state_dict()
    return {
        "loss_diff": loss_diff,
        "param_diff": max((got[k] - want[k]).abs().max().item() for k in want),
        "moved": max((want[k] - init[k]).abs().max().item() for k in want),
        "graphs": counters["stats"]["unique_graphs"],
        "graph_breaks": sum(counters["graph_break"].values()),
        # every unit freed after the step, as in eager: the modules hold the DTensor shards
        "resharded": all(isinstance(p, DTensor) for p in model.parameters()),
    }


def _compiled_autograd(rank: int, world: int) -> str:
    import torch._dynamo
    from torch._dynamo import compiled_autograd

    from fullshard.policies import FullshardError

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.compile(shard_toy(ToyLM(n_blocks=2)), backend="aot_eager")
    loss = loss_of(model, batches(1, world)[0][rank])
    try:
        # the refusal comes from our backward hook running inside compiled autograd's graph,
        # whichever compiler that graph is given: here none, it runs as captured
        with compiled_autograd._enable(lambda graph: graph):
            loss.backward()
    except FullshardError as e:
        return str(e)
    return ""


def _case(fn: Callable[..., Any], *args: Any) -> dict:
    """``fn(*args)``'s result, or the traceback it raised: one case failing fails its test only."""
    try:
        return {"result": fn(*args)}
    except Exception:
        return {"raised": traceback.format_exc()}


def _everything(rank: int, world: int) -> dict:
    out = {case: _case(_train, rank, world, *case) for case in TRAIN_CASES}
    # last: the refused backward leaves its model mid-step
    out["compiled_autograd"] = _case(_compiled_autograd, rank, world)
    return out


@functools.cache
def _results() -> list[dict]:
    return run_ranks(_everything, 2, timeout_s=600)


def _of(case: object) -> list[Any]:
    per_rank = [r[case] for r in _results()]
    for r in per_rank:
        assert "raised" not in r, r.get("raised")
    return [r["result"] for r in per_rank]


@pytest.mark.parametrize(("mode", "backend"), TRAIN_CASES)
def test_compiled_training_matches_eager_reference(mode: str, backend: str) -> None:
    # aot_eager runs eager's own kernels: exactly eager's numbers. Inductor: see the docstring.
    tolerance = 1e-12 if backend == INDUCTOR else 0.0
    for res in _of((mode, backend)):
        assert res["loss_diff"] <= tolerance, res
        assert res["param_diff"] <= tolerance, res
        assert res["moved"] > 1e-3, res  # it did train
        # the blocks' computation was compiled (one graph per block forward, shared code)
        assert res["graphs"] >= 1, res
        # the hooks run between graphs, not inside them: nothing left for Dynamo to break on
        assert res["graph_breaks"] == 0, res
        assert res["resharded"], res


def test_compiled_autograd_is_refused_not_silently_wrong() -> None:
    # it ran, with the toy's loss 1e-2 off eager at the second step, before the refusal
    for message in _of("compiled_autograd"):
        assert "compiled autograd" in message and "Compile the forward only" in message
