"""Communication per step, counted at the c10d level, and the gathered-memory window."""

from __future__ import annotations

import pytest
import torch
from commcount import RS, C10dCounter
from harness import run_ranks
from toy import ToyLM, batches, loss_of, shard_toy

import fullshard
from fullshard import FSDPModule
from fullshard.comm.desync import TAG_BITS, TAG_LEN


def _padded_numel(shapes: list[torch.Size], world: int) -> int:
    total = 0
    for s in shapes:
        rows = -(-s[0] // world) * world
        total += rows * (s.numel() // s[0])
    return total


def _count(rank: int, world: int, strategy: str) -> dict:
    torch.manual_seed(0)
    ref = ToyLM(n_blocks=4)
    for p in ref.parameters():
        p.requires_grad_(True)  # every parameter trainable: reduce-scatter covers the model
    shapes = [p.shape for p in ref.parameters()]  # unique parameters (the tie counts once)
    raf = strategy == "full_shard"
    model = shard_toy(ref, reshard_root=raf, reshard_blocks=raf)
    data = batches(3, world)
    loss_of(model, data[0][rank]).backward()  # step 1 records the order prefetch uses
    with C10dCounter() as c:
        loss_of(model, data[1][rank]).backward()
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    return {
        "calls": dict(c.calls),
        "bytes": dict(c.bytes),
        "units": len(units),
        "n_params": len(shapes),
        "true_bytes": sum(s.numel() for s in shapes) * 4,
        "padded_bytes": _padded_numel(shapes, world) * 4,
    }


@pytest.mark.parametrize("world", [2, 4])
def test_full_shard_moves_three_model_sizes(world: int) -> None:
    res = run_ranks(_count, world, "full_shard")[0]
    units = res["units"]
    assert res["calls"] == {"all_gather": 2 * units, RS: units}
    # bytes: the exact padded model size (+ each rank's position tag per gather, NOTE
    # [Collective positions]); padding is small against the model
    tags = units * world * TAG_LEN * 4
    assert res["bytes"]["all_gather"] == 2 * (res["padded_bytes"] + tags)
    indicator = world * res["n_params"] * 4  # NOTE [Which gradients exist]: one column per param
    bits = units * world * TAG_BITS * 4  # the same tag as bits in every RS block
    assert res["bytes"][RS] == res["padded_bytes"] + indicator + bits
    # 3 units of the model, exactly, once padding, indicator columns and tags are taken out
    moved = res["bytes"]["all_gather"] + res["bytes"][RS] - indicator - 2 * tags - bits
    assert moved == 3 * res["padded_bytes"]
    assert res["padded_bytes"] < 1.1 * res["true_bytes"]  # the toy's odd shapes pad by < 10%


def test_shard_grad_op_moves_two_model_sizes() -> None:
    res = run_ranks(_count, 2, "shard_grad_op")[0]
    units = res["units"]
    assert res["calls"] == {"all_gather": units, RS: units}
    indicator = 2 * res["n_params"] * 4
    tags = units * 2 * (TAG_LEN + TAG_BITS) * 4
    moved = res["bytes"]["all_gather"] + res["bytes"][RS] - indicator - tags
    assert moved == 2 * res["padded_bytes"]


def _window(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = shard_toy(ToyLM(n_blocks=5), reshard_root=None)
    blocks = [fullshard.units(b)[0].unit for b in model.blocks]
    seen = {"forward": [], "backward": []}

    def gathered() -> int:
        return sum(u.gathered for u in blocks)

    for mod in model.modules():
        if isinstance(mod, torch.nn.Linear):
            mod.register_forward_pre_hook(lambda *_: seen["forward"].append(gathered()))
            mod.register_full_backward_pre_hook(lambda *_: seen["backward"].append(gathered()))
    data = batches(3, world)
    after_forward = []
    for step in range(3):
        seen["forward"].clear()
        seen["backward"].clear()
        loss = loss_of(model, data[step][rank])
        after_forward.append(
            [u.gathered or u.storage.flat.untyped_storage().size() > 0 for u in blocks]
        )
        loss.backward()
    after_backward = [u.gathered for u in blocks] + [fullshard.units(model)[0].unit.gathered]
    return {
        "forward_max": max(seen["forward"]),
        "backward_max": max(seen["backward"]),
        "after_forward": after_forward,
        "after_backward": after_backward,
    }


def test_gathered_window_is_bounded() -> None:
    for res in run_ranks(_window, 2):
        # no block holds gathered storage once forward is over
        assert not any(any(step) for step in res["after_forward"])
        # the one computing plus the one prefetched; prefetch really happens (== 2, not 1)
        assert res["forward_max"] == 2
        assert res["backward_max"] == 2
        assert not any(res["after_backward"])
