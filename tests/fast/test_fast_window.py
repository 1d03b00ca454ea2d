"""NOTE [Gathered window] (``engine/schedule.py``): how many units hold gathered storage at once.

Every event of a step (each all-gather as c10d sees it, each schedule point) records which
units were gathered at that moment, so the window is checked at every point, not sampled.
"""

from __future__ import annotations

import pytest
import torch
from recorder import GATHER, StepRecorder, gathers, index_of, toy_steps, window
from toy import Block, ToyLM, batches, loss_of, shard_toy

import fullshard

pytestmark = pytest.mark.fast

N_BLOCKS = 5  # deeper than the window: the bound must not grow with depth
BLOCKS = [f"blocks.{i}" for i in range(N_BLOCKS)]


def _forward(events: list) -> list:
    return events[: index_of(events, "FORWARD_END", "root") + 1]


def _backward(events: list) -> list:
    return events[index_of(events, "FORWARD_END", "root") + 1 :]


def test_full_shard_holds_the_computing_block_and_the_prefetched_one(fake_pg: tuple) -> None:
    _, events = toy_steps(shard_toy(ToyLM(n_blocks=N_BLOCKS)), 2)
    # never more than two blocks, and exactly two while one computes and one is prefetched
    # (== 2, not <= 2: prefetch really happens)
    assert max(window(e) for e in _forward(events)) == 2
    assert max(window(e) for e in _backward(events)) == 2
    for i, block in enumerate(BLOCKS):
        at_forward = events[index_of(events, "FORWARD_START", block)].gathered
        at_backward = events[index_of(events, "BACKWARD_START", block)].gathered
        ahead = {BLOCKS[i + 1]} if i + 1 < N_BLOCKS else set()
        behind = {BLOCKS[i - 1]} if i > 0 else set()
        assert at_forward == {"root", block, *ahead}, block
        assert at_backward == {"root", block, *behind}, block


def test_first_forward_holds_one_block(fake_pg: tuple) -> None:
    # no order recorded yet, so no forward prefetch; backward already prefetches
    first, _ = toy_steps(shard_toy(ToyLM(n_blocks=N_BLOCKS)), 2)
    assert max(window(e) for e in _forward(first)) == 1
    assert max(window(e) for e in _backward(first)) == 2


def test_nothing_stays_gathered_between_steps(fake_pg: tuple) -> None:
    model = shard_toy(ToyLM(n_blocks=N_BLOCKS))
    for events in toy_steps(model, 2):
        end_of_forward = events[index_of(events, "FORWARD_END", "root")]
        assert end_of_forward.gathered == {"root"}  # the root is kept for backward
        assert events[-1].kind == "BACKWARD_DONE" and events[-1].gathered == frozenset()
    assert not any(v.unit.gathered for v in fullshard.units(model))


def test_shard_grad_op_keeps_every_block_until_backward(fake_pg: tuple) -> None:
    # reshard_after_forward=False: the user asked for that memory, so it does not count
    # against the window; every block stays gathered from its forward to its backward
    model = shard_toy(ToyLM(n_blocks=N_BLOCKS), reshard_blocks=False)
    for events in toy_steps(model, 2):
        end_of_forward = events[index_of(events, "FORWARD_END", "root")]
        assert end_of_forward.gathered == {"root", *BLOCKS}
        assert gathers(_backward(events)) == []
        for i, block in enumerate(BLOCKS):  # each is freed by its own backward
            after = events[index_of(events, "BACKWARD_END", block) + 1 :]
            free = next(e for e in after if e.kind == "FREE")
            assert free.unit == block and free.gathered == {"root", *BLOCKS[:i]}
        assert events[-1].gathered == frozenset()


def test_a_resharded_root_is_freed_after_forward(fake_pg: tuple) -> None:
    _, events = toy_steps(shard_toy(ToyLM(n_blocks=N_BLOCKS), reshard_root=True), 2)
    end = index_of(events, "FORWARD_END", "root")
    assert (events[end + 1].kind, events[end + 1].unit) == ("FREE", "root")
    assert events[end + 1].gathered == frozenset()
    # gathered again first in backward; the root does not count against the window
    assert events[end + 2].kind == GATHER and events[end + 2].unit == "root"
    assert max(window(e) for e in _backward(events)) == 2


@pytest.mark.parametrize("reshard_blocks", [None, False])
def test_forward_without_grad_frees_everything(fake_pg: tuple, reshard_blocks: bool | None) -> None:
    # no backward will come: the root and blocks kept for it (SHARD_GRAD_OP) are freed when
    # the forward ends, and nothing is reduced
    model = shard_toy(ToyLM(n_blocks=N_BLOCKS), reshard_blocks=reshard_blocks)
    rec = StepRecorder(model)
    idx = batches(1, 4)[0][1]
    loss_of(model, idx).backward()  # a first step records the forward order
    with torch.no_grad():
        events = rec.record(lambda: loss_of(model, idx))
    assert [e.unit for e in events if e.kind == "FREE"] == [*BLOCKS, "root"]
    assert events[-1].gathered == frozenset()
    assert not any(e.kind == "reduce_scatter" for e in events)
    assert not any(v.unit.gathered for v in fullshard.units(model))


@pytest.mark.parametrize(
    ("strategy", "raf", "kept"),
    [
        ("full_shard", None, False),
        ("full_shard", False, True),
        ("shard_grad_op", None, True),
        ("shard_grad_op", True, False),
        ("full_shard", 2, False),
    ],
)
def test_the_trainers_reshard_option_replaces_the_strategys(
    fake_pg: tuple, strategy: str, raf: bool | int | None, kept: bool
) -> None:
    # fullshard train's --reshard-after-forward and --cpu-offload (fullshard.app.models.wrap): a value
    # given replaces the strategy's for the blocks; the root keeps the plan's rule (kept for
    # backward); N < the 4 ranks keeps the blocks sharded over N between forward and backward
    from fullshard.app.config import ParallelismConfig
    from fullshard.app.models.wrap import shard_model

    model = ToyLM(n_blocks=N_BLOCKS)
    raf_word = None if raf is None else str(raf).lower()  # the flag's words
    parallelism = ParallelismConfig(
        strategy=strategy, reshard_after_forward=raf_word, cpu_offload=True
    )
    shard_model(model, parallelism, [Block])
    for events in toy_steps(model, 2):
        end_of_forward = events[index_of(events, "FORWARD_END", "root")]
        assert end_of_forward.gathered == ({"root", *BLOCKS} if kept else {"root"})
    views = fullshard.units(model)
    assert [v.name for v in views] == ["", *BLOCKS]
    assert all(v.unit.offload for v in views)
    sizes = [v.unit.post_forward.size if v.unit.post_forward else None for v in views]
    assert sizes == [None] + [raf if raf == 2 else None] * N_BLOCKS
