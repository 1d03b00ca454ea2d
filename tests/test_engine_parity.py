"""Parity: sharded training equals a single-process reference on the same data.

The reference runs every rank's micro-batch, sums the gradients and divides by the world size,
then takes the same AdamW step; it runs inside each rank, so thread count and kernels match.
"""

from __future__ import annotations

import copy

import pytest
import torch
from commcount import C10dCounter
from harness import run_ranks
from toy import ToyLM, batches, full_params, loss_of, reference_step, shard_toy


def _train(
    rank: int,
    world: int,
    dtype_name: str,
    steps: int,
    reshard_root: bool | None,
    checkpoint: str = "",
) -> dict:
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    ref = ToyLM(checkpoint=checkpoint).to(dtype)
    model = shard_toy(copy.deepcopy(ref), reshard_root=reshard_root)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    data = batches(steps, world)
    loss_diff = 0.0
    losses = []
    gathers = []
    for step in range(steps):
        with C10dCounter() as counter:
            loss = loss_of(model, data[step][rank])
            loss.backward()
        gathers.append(counter.calls["all_gather"])
        opt.step()
        opt.zero_grad()
        ref_losses = reference_step(ref, ref_opt, [data[step][r] for r in range(world)])
        loss_diff = max(loss_diff, abs(loss.item() - ref_losses[rank]))
        losses.append(loss.item())
    got = full_params(model)
    want = ref.state_dict()
    assert got.keys() == want.keys()
    param_diff = max((got[k] - want[k]).abs().max().item() for k in want)
    frozen = model.blocks[1].proj.weight
    return {
        "loss_diff": loss_diff,
        "param_diff": param_diff,
        "losses": losses,
        "gathers": gathers,
        "frozen_grad_is_none": frozen.grad is None,
        "frozen_unchanged": torch.equal(got["blocks.1.proj.weight"], want["blocks.1.proj.weight"]),
    }


@pytest.mark.parametrize("world", [2, 3, 4])
def test_float64_parity_within_1e12(world: int) -> None:
    results = run_ranks(_train, world, "float64", 5, None)
    for res in results:
        assert res["loss_diff"] <= 1e-12, res
        assert res["param_diff"] <= 1e-12, res
        assert res["frozen_grad_is_none"]
    # the model did train: parameters moved and losses changed
    assert results[0]["losses"][0] != results[0]["losses"][-1]


def test_float32_two_ranks_bitwise() -> None:
    for res in run_ranks(_train, 2, "float32", 5, True):
        assert res["loss_diff"] == 0.0, res
        assert res["param_diff"] == 0.0, res


@pytest.mark.parametrize("mode", ["nonreentrant", "reentrant"])
def test_parity_with_activation_checkpointing(mode: str) -> None:
    # recomputation runs each block's forward again inside backward: it must find the block
    # gathered, must not free it early, and must not prefetch as if it were a new forward
    for res in run_ranks(_train, 2, "float64", 3, None, mode):
        assert res["loss_diff"] <= 1e-12, res
        assert res["param_diff"] <= 1e-12, res
        # 3 blocks gathered twice, the root (kept after forward) once: no extra gathers
        assert res["gathers"][1:] == [7, 7], res["gathers"]
