"""torch.compile over sharded models (NOTE [Hooks run outside torch.compile] in
``engine/hooks.py``): each block compiled, or the whole model, trains like the eager
single-process reference.

Float64, against the eager single-process reference of ``test_engine_parity`` (which the eager
sharded model matches exactly, 0.0): Inductor writes its own kernels (fused layer norm, GELU,
reductions in its own order), so compiled and eager differ at rounding level, ~1e-16 relative
in the gradients. AdamW divides each update by sqrt(v), which turns that into ~1e-14 absolute
in the parameters after three steps at lr 1e-2 (measured: 1.04e-14, both modes); a wrong gather
or a stale gradient moves values by ~1e-3. The brief's 1e-12 separates the two with room.
"""

from __future__ import annotations

import copy

import pytest
import torch
from harness import run_ranks
from torch.distributed.tensor import DTensor
from toy import ToyLM, batches, full_params, loss_of, reference_step, shard_toy

STEPS = 3


def _train(rank: int, world: int, mode: str) -> dict:
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
            block.compile()
    elif mode == "whole":
        run = torch.compile(model)  # the default dynamic setting
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


@pytest.mark.parametrize("mode", ["blocks", "whole"])
def test_compiled_training_matches_eager_reference(mode: str) -> None:
    results = run_ranks(_train, 2, mode, timeout_s=600)
    for res in results:
        assert res["loss_diff"] <= 1e-12, res
        assert res["param_diff"] <= 1e-12, res
        assert res["moved"] > 1e-3, res  # it did train
        # the blocks' computation was compiled (one graph per block forward, shared code)
        assert res["graphs"] >= 1, res
        # the hooks run between graphs, not inside them: nothing left for Dynamo to break on
        assert res["graph_breaks"] == 0, res
        assert res["resharded"], res


def _compiled_autograd(rank: int, world: int) -> str:
    from torch._dynamo import compiled_autograd

    from fullshard.policies import FullshardError

    torch.manual_seed(0)
    model = torch.compile(shard_toy(ToyLM(n_blocks=2)))
    loss = loss_of(model, batches(1, world)[0][rank])
    try:
        with compiled_autograd._enable(torch.compile):
            loss.backward()
    except FullshardError as e:
        return str(e)
    return ""


def test_compiled_autograd_is_refused_not_silently_wrong() -> None:
    # it ran, with the toy's loss 1e-2 off eager at the second step, before the refusal
    for message in run_ranks(_compiled_autograd, 2, timeout_s=600):
        assert "compiled autograd" in message and "Compile the forward only" in message
