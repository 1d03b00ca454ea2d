"""What each unit does at each point of a step (``engine/schedule.py``), seen from one rank: the
order of the all-gathers, the points each unit passes, and when it reduce-scatters."""

from __future__ import annotations

from itertools import pairwise

import pytest
from recorder import GATHER, REDUCE, gathers, index_of, kinds, toy_steps
from toy import ToyLM, shard_toy

pytestmark = pytest.mark.fast

BLOCKS = ["blocks.0", "blocks.1", "blocks.2"]
FORWARD, BACKWARD = "forward gather", "backward gather"


@pytest.mark.parametrize(
    "fake_pg", [(0, 4), (3, 4), (1, 3)], ids=["rank0of4", "rank3of4", "rank1of3"], indirect=True
)
def test_gathers_run_in_forward_order_then_in_reverse(fake_pg: tuple[int, int]) -> None:
    # the root keeps its parameters for backward (reshard_after_forward=None: False for the
    # root): it is gathered once per step, the blocks twice, the second time in reverse
    for events in toy_steps(shard_toy(ToyLM()), 2):
        assert gathers(events, FORWARD) == ["root", *BLOCKS]
        assert gathers(events, BACKWARD) == BLOCKS[::-1]
        assert gathers(events) == ["root", *BLOCKS, *BLOCKS[::-1]]  # nothing else is gathered


def test_a_resharded_root_is_gathered_first_in_backward(fake_pg: tuple[int, int]) -> None:
    for events in toy_steps(shard_toy(ToyLM(), reshard_root=True), 2):
        assert gathers(events, FORWARD) == ["root", *BLOCKS]
        assert gathers(events, BACKWARD) == ["root", *BLOCKS[::-1]]


def test_shard_grad_op_gathers_in_forward_only(fake_pg: tuple[int, int]) -> None:
    for events in toy_steps(shard_toy(ToyLM(), reshard_blocks=False), 2):
        assert gathers(events) == ["root", *BLOCKS]
        assert kinds(events, REDUCE) == [(REDUCE, u) for u in [*BLOCKS[::-1], "root"]]


def test_first_forward_gathers_on_demand_later_ones_ahead(fake_pg: tuple[int, int]) -> None:
    # NOTE [Prefetch order]: the first forward cannot know the order yet, so each block is
    # gathered when its own forward starts; from the second forward on, block i+1's gather is
    # issued before block i computes (it overlaps block i's compute)
    first, second = toy_steps(shard_toy(ToyLM()), 2)
    for i, block in enumerate(BLOCKS[1:]):
        previous = BLOCKS[i]
        assert index_of(first, GATHER, block) > index_of(first, "FORWARD_END", previous)
        assert index_of(second, GATHER, block) < index_of(second, "FORWARD_START", previous)
    # the root's forward prefetches the first block
    assert index_of(second, GATHER, "blocks.0") < index_of(second, "FORWARD_START", "root")


def _points(events: list, unit: str) -> list[str]:
    return [e.kind for e in events if e.unit == unit and e.kind not in (GATHER, REDUCE)]


@pytest.mark.parametrize(
    "kwargs, block_points, root_points",
    [
        pytest.param(
            {},
            ["FORWARD_START", "FORWARD_END", "FREE", "BACKWARD_START", "BACKWARD_END", "FREE"],
            [
                *["FORWARD_START", "FORWARD_END", "BACKWARD_START", "BACKWARD_END"],
                *["FREE", "BACKWARD_DONE"],
            ],
            id="full_shard",
        ),
        pytest.param(
            {"reshard_blocks": False},
            ["FORWARD_START", "FORWARD_END", "BACKWARD_START", "BACKWARD_END", "FREE"],
            [
                *["FORWARD_START", "FORWARD_END", "BACKWARD_START", "BACKWARD_END"],
                *["FREE", "BACKWARD_DONE"],
            ],
            id="shard_grad_op",
        ),
        pytest.param(
            {"reshard_root": True},
            ["FORWARD_START", "FORWARD_END", "FREE", "BACKWARD_START", "BACKWARD_END", "FREE"],
            [
                *["FORWARD_START", "FORWARD_END", "FREE", "BACKWARD_START"],
                *["BACKWARD_END", "FREE", "BACKWARD_DONE"],
            ],
            id="root_resharded",
        ),
    ],
)
def test_points_of_each_unit(
    fake_pg: tuple[int, int], kwargs: dict, block_points: list[str], root_points: list[str]
) -> None:
    _, events = toy_steps(shard_toy(ToyLM(), **kwargs), 2)  # the second step: the steady state
    for block in BLOCKS:
        assert _points(events, block) == block_points, block
    assert _points(events, "root") == root_points
    # across units: forwards nest inside the root's, backwards run in reverse, and the step
    # ends with BACKWARD_DONE
    assert kinds(events, "FORWARD_START") == [("FORWARD_START", u) for u in ["root", *BLOCKS]]
    assert kinds(events, "FORWARD_END") == [("FORWARD_END", u) for u in [*BLOCKS, "root"]]
    assert kinds(events, "BACKWARD_START") == [
        ("BACKWARD_START", u) for u in ["root", *BLOCKS[::-1]]
    ]
    assert kinds(events, "BACKWARD_END") == [("BACKWARD_END", u) for u in [*BLOCKS[::-1], "root"]]
    assert events[-1].kind == "BACKWARD_DONE"


def test_each_unit_reduce_scatters_once_right_after_its_backward(fake_pg: tuple[int, int]) -> None:
    for events in toy_steps(shard_toy(ToyLM()), 2):
        order = [*BLOCKS[::-1], "root"]
        assert kinds(events, REDUCE) == [(REDUCE, u) for u in order]
        for unit in order:
            # issued at the unit's BACKWARD_END, before its gathered storage is freed
            at = index_of(events, REDUCE, unit)
            assert index_of(events, "BACKWARD_END", unit) < at < _free_in_backward(events, unit)
        for unit, following in pairwise(BLOCKS[::-1]):
            # not held back: it overlaps the backward of the unit that comes next
            assert index_of(events, REDUCE, unit) < index_of(events, "BACKWARD_START", following)


def _free_in_backward(events: list, unit: str) -> int:
    start = index_of(events, "BACKWARD_END", unit)
    return next(
        i for i in range(start, len(events)) if events[i].kind == "FREE" and events[i].unit == unit
    )


def test_micro_batches_without_sync_reduce_nothing(fake_pg: tuple[int, int]) -> None:
    model = shard_toy(ToyLM())
    model.set_requires_gradient_sync(False)
    for events in toy_steps(model, 2):
        assert kinds(events, REDUCE) == []
        assert gathers(events, BACKWARD) == BLOCKS[::-1]  # the schedule is otherwise the same
    model.set_requires_gradient_sync(True)
    (events,) = toy_steps(model, 1)
    assert kinds(events, REDUCE) == [(REDUCE, u) for u in [*BLOCKS[::-1], "root"]]


def test_checkpointed_blocks_reuse_the_backward_gather(fake_pg: tuple[int, int]) -> None:
    # non-reentrant activation checkpointing recomputes each block inside its backward: the
    # recompute runs on the unit gathered for backward, so the schedule is the plain one
    plain = toy_steps(shard_toy(ToyLM()), 2)[1]
    recomputed = toy_steps(shard_toy(ToyLM(checkpoint="non-reentrant")), 2)[1]
    assert [(e.kind, e.unit, e.phase) for e in recomputed] == [
        (e.kind, e.unit, e.phase) for e in plain
    ]


def test_max_input_buffers_lets_that_many_reduce_scatters_be_in_flight(fake_pg: tuple) -> None:
    # set_reduce_scatter_max_input_buffers(k): when a unit's backward ends, up to k earlier
    # reduce-scatters may still be in flight (packed inputs held); the default finishes the
    # previous one before the next is issued
    import fullshard
    from fullshard import FSDPModule

    for k in (1, 2, 3):
        model = shard_toy(ToyLM())
        if k > 1:
            model.set_reduce_scatter_max_input_buffers(k)
        units = [m._fullshard_state.unit for m in model.modules() if isinstance(m, FSDPModule)]
        in_flight: list[int] = []

        def count(
            point: fullshard.Point, unit: object, units: list = units, in_flight: list = in_flight
        ) -> None:
            if point is fullshard.Point.BACKWARD_END:
                in_flight.append(sum(u.reduce_in_flight is not None for u in units))

        toy_steps(model, 1)  # the schedule exists from the root's first forward
        fullshard.subscribe(model, count)
        toy_steps(model, 1)
        # 4 units, the root first in backward: at most min(k, units before) in flight
        assert max(in_flight) == min(k, 3), (k, in_flight)
