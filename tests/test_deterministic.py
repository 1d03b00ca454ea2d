"""``fullshard.deterministic`` and ``fullshard train --deterministic``: the same bits at 1, 2 and
4 ranks, for every strategy, in fp32 and bf16, and after a resume on another world size.

The tree's arithmetic is checked in this process; the engine's fixed-order reduce-scatter, HSDP
all-reduce and norm in one launch per world size (the library loop of the module docstring on
the toy's uneven shards); the trainer (global sampler, checkpoint at 4 ranks, resume at 2)
through its ranks on the harness.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from harness import run_ranks
from test_app_cli import converted, records, train_on_ranks
from toy import VOCAB, ToyLM, loss_of

from fullshard.comm.collectives import pairwise_sum
from fullshard.deterministic import GradientTree, MicroBatches


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a float tensor (equal bits, not equal values: -0.0 != 0.0, NaN == NaN)."""
    return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def test_micro_batches_name_the_world_sizes_that_work() -> None:
    plan = MicroBatches(global_batch=24, micro_batch=2)  # 12 micro-batches = 3 chunks of 4
    assert (plan.count, plan.chunk, plan.world_sizes()) == (12, 4, [1, 2, 4])
    assert list(plan.indices(1, 4)) == [1, 5, 9] and plan.rows(5) == slice(10, 12)
    for world in (3, 8):
        with pytest.raises(ValueError, match=f"1, 2, 4 ranks .*not on {world}"):
            plan.check_world(world)
    with pytest.raises(ValueError, match="does not split"):
        MicroBatches(global_batch=10, micro_batch=4)


def test_pairwise_sum_pairs_neighbours_first() -> None:
    rows = torch.tensor([[1e8], [1.0], [-1e8], [1.0]], dtype=torch.float32)
    # (1e8 + 1) + (-1e8 + 1) rounds both 1s away; a chain ((1e8 + 1) - 1e8) + 1 keeps one
    assert pairwise_sum(rows).item() == 0.0
    assert (((rows[0] + rows[1]) + rows[2]) + rows[3]).item() == 1.0
    with pytest.raises(ValueError, match="power-of-two"):
        pairwise_sum(torch.ones(3, 2))


def _tree_sum(leaves: list[torch.Tensor], plan: MicroBatches, world: int) -> torch.Tensor:
    """The step's sum through GradientTree, each micro-step the fixed-order reduce of ``world``
    consecutive leaves (what one reduce-scatter gives at ``world`` ranks)."""
    p = torch.zeros_like(leaves[0], requires_grad=True)
    tree = GradientTree([p], plan, world)
    for s in range(plan.steps(world)):
        p.grad = pairwise_sum(torch.stack(leaves[s * world : (s + 1) * world]))
        tree.push()
    tree.finish()
    assert p.grad is not None
    return p.grad


def test_gradient_tree_gives_the_one_rank_sum_at_every_world_size() -> None:
    gen = torch.Generator().manual_seed(0)
    leaves = [torch.randn(4096, generator=gen) * 10 ** (i % 5) for i in range(12)]
    plan = MicroBatches(global_batch=12, micro_batch=1)
    one = _tree_sum(leaves, plan, 1)
    for world in (2, 4):
        assert torch.equal(_bits(_tree_sum(leaves, plan, world)), _bits(one)), world
    # the order matters here, so the equality above is not a given: a chain differs
    chain = leaves[0].clone()
    for leaf in leaves[1:]:
        chain += leaf
    assert not torch.equal(_bits(chain), _bits(one))
    p = torch.zeros(3, requires_grad=True)
    with pytest.raises(Exception, match="push once per micro-step"):
        GradientTree([p], plan, 4).finish()


# One launch per world size runs every case: (strategy, mixed precision) -> final weights.
CASES = [("full_shard", False), ("full_shard", True), ("shard_grad_op", False), ("hybrid", False)]


def _library_rank(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from fullshard import MixedPrecisionPolicy, deterministic, fully_shard

    torch.set_num_threads(1)
    data = torch.randint(VOCAB, (3, 16, 9), generator=torch.Generator().manual_seed(1))
    out: dict[str, Any] = {}
    for strategy, bf16 in CASES:
        if strategy == "hybrid" and world < 4:
            continue
        torch.manual_seed(0)
        model = ToyLM()
        kwargs: dict[str, Any] = {"reshard_after_forward": strategy != "shard_grad_op"}
        if strategy == "hybrid":
            kwargs["mesh"] = init_device_mesh("cpu", (2, world // 2))
        if bf16:
            kwargs["mp_policy"] = MixedPrecisionPolicy(torch.bfloat16, torch.float32)
        for block in model.blocks:
            fully_shard(block, **kwargs)
        fully_shard(model, **kwargs)
        deterministic.enable(model)
        plan = deterministic.MicroBatches(global_batch=16, micro_batch=2)
        tree = deterministic.GradientTree(model.parameters(), plan, world)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        figures = []
        for step in range(3):
            values = []
            for i in plan.indices(rank, world):
                loss = loss_of(model, data[step][plan.rows(i)]) / plan.count
                loss.backward()
                tree.push()
                values.append(loss.detach().double())
            tree.finish()
            total = deterministic.sum_over_micro_batches(values)
            norm = deterministic.clip_grad_norm_(model.parameters(), 0.05)  # clips: < the norm
            figures.append((total, norm))
            opt.step()
            opt.zero_grad()
        weights = {
            k: (v.full_tensor() if isinstance(v, DTensor) else v).detach()
            for k, v in model.state_dict().items()
        }
        out[f"{strategy}{'-bf16' if bf16 else ''}"] = {"weights": weights, "figures": figures}
    return out


@pytest.fixture(scope="module")
def library_runs() -> dict[int, dict[str, Any]]:
    # 1 and 4 ranks (2 ranks' one pair sums alike in any order: scripts/same_bits.py runs them)
    return {world: run_ranks(_library_rank, world)[0] for world in (1, 4)}


def test_library_loop_gives_the_one_rank_bits(library_runs: dict[int, dict[str, Any]]) -> None:
    one = library_runs[1]
    for case, run in library_runs[4].items():
        # every strategy does the same arithmetic: all equal one rank's full_shard
        ref = one["full_shard-bf16" if case.endswith("bf16") else "full_shard"]
        for name, t in run["weights"].items():
            assert torch.equal(_bits(t), _bits(ref["weights"][name])), (case, name)
        for (loss, norm), (ref_loss, ref_norm) in zip(run["figures"], ref["figures"], strict=True):
            assert loss.item() == ref_loss.item() and norm.item() == ref_norm.item(), case
        assert norm.item() > 0.05  # the clip was active in the last step


def test_train_stopped_at_4_ranks_resumed_at_2_equals_one_rank(tmp_path: Path) -> None:
    common = [
        *["--deterministic", "--model", "tiny", "--max-steps", "4"],
        *["--batch-size", "8", "--micro-batch-size", "2", "--seq-len", "32"],
        *["--sample-tokens", "0", "--log-every", "1", "--eval-every", "2"],
        *["--eval-batches", "3", "--no-progress", "--runs-dir"],
        str(tmp_path),
    ]
    ok = [{"status": 0}] * 4
    assert [r["status"] for r in train_on_ranks([*common, "--name", "one"], world=1)] == [0]
    stop = [*common, "--name", "moved", "--save-every", "2", "--stop-after", "2"]
    assert [{"status": r["status"]} for r in train_on_ranks(stop, world=4)] == ok
    resumed = train_on_ranks([*common, "--name", "moved", "--resume", "latest"], world=2)
    assert [r["status"] for r in resumed] == [0, 0], resumed[0]["stderr"]
    one, moved = (
        converted(tmp_path / n / "checkpoints" / "step_00000004", tmp_path / f"{n}.safetensors")
        for n in ("one", "moved")
    )
    for name, t in one.items():
        assert torch.equal(_bits(moved[name]), _bits(t)), name
    # the figures too: losses, norms and validation, reduced in fixed order at 1, 4 and 2 ranks
    keys = ("step", "loss", "grad_norm", "lr", "val_loss")
    figures = {
        n: [{k: r.get(k) for k in keys} for r in records(tmp_path / n)] for n in ("one", "moved")
    }
    assert figures["moved"] == figures["one"] and len(figures["one"]) == 4
    # its checkpoint holds one global data position: a resume without --deterministic is
    # refused on every rank, before anything is loaded
    plain = [a for a in common if a != "--deterministic"] + ["--max-steps", "6"]
    refused = train_on_ranks([*plain, "--name", "moved", "--resume", "latest"], world=2)
    assert [r["status"] for r in refused] == [2, 2]
    assert all("was written with the global sampler" in r["stderr"] for r in refused), refused
