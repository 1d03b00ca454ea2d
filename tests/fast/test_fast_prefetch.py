"""Explicit prefetch (``set_modules_to_forward_prefetch`` / ``set_modules_to_backward_prefetch``):
the listed unit's all-gather is issued while the setting unit is about to compute, before the
listed unit's own forward or backward asks for it.

The targets skip a block (block 0 prefetches block 2, block 2 prefetches block 0), so implicit
prefetch (the next block) cannot pass for them: with prefetch a no-op, or the lists ignored,
these tests fail.
"""

from __future__ import annotations

import pytest
from recorder import GATHER, gathers, index_of, toy_steps, window
from toy import ToyLM, shard_toy

pytestmark = pytest.mark.fast

FORWARD, BACKWARD = "forward gather", "backward gather"


def _gather(events: list, unit: str, phase: str) -> int:
    for i, e in enumerate(events):
        if e.kind == GATHER and e.unit == unit and e.phase == phase:
            return i
    raise AssertionError(f"{unit} was not gathered for {phase}")


def _model(forward: bool = True, backward: bool = True) -> ToyLM:
    model = shard_toy(ToyLM())
    b0, _, b2 = model.blocks
    if forward:
        b0.set_modules_to_forward_prefetch([b2])
    if backward:
        b2.set_modules_to_backward_prefetch([b0])
    return model


def test_forward_prefetch_gathers_the_listed_unit_while_the_setter_computes(
    fake_pg: tuple,
) -> None:
    _, events = toy_steps(_model(backward=False), 2)
    at = _gather(events, "blocks.2", FORWARD)
    # issued when block 0 starts, before block 0 finishes, before block 1 is even gathered
    assert at < index_of(events, "FORWARD_START", "blocks.0")
    assert at < index_of(events, "FORWARD_END", "blocks.0")
    assert at < _gather(events, "blocks.1", FORWARD)
    assert at < index_of(events, "FORWARD_START", "blocks.2")
    # the list replaces the implicit choice: block 1 is gathered when its own forward starts
    assert _gather(events, "blocks.1", FORWARD) > index_of(events, "FREE", "blocks.0")
    assert gathers(events, FORWARD) == ["root", "blocks.0", "blocks.2", "blocks.1"]
    assert max(window(e) for e in events) == 2


def test_forward_prefetch_works_in_the_first_forward(fake_pg: tuple) -> None:
    # a list set before the root's first forward is handed over when the root builds the
    # schedule, so the first forward already prefetches (as FSDP2 does)
    first, _ = toy_steps(_model(backward=False), 2)
    assert _gather(first, "blocks.2", FORWARD) < index_of(first, "FORWARD_END", "blocks.0")


def test_backward_prefetch_gathers_the_listed_unit_while_the_setter_computes(
    fake_pg: tuple,
) -> None:
    for events in toy_steps(_model(forward=False), 2):  # from the first backward on
        at = _gather(events, "blocks.0", BACKWARD)
        # issued when block 2's backward starts, before it ends, before block 1 is gathered
        assert at < index_of(events, "BACKWARD_START", "blocks.2")
        assert at < index_of(events, "BACKWARD_END", "blocks.2")
        assert at < _gather(events, "blocks.1", BACKWARD)
        assert at < index_of(events, "BACKWARD_START", "blocks.0")
        assert gathers(events, BACKWARD) == ["blocks.2", "blocks.0", "blocks.1"]
        assert max(window(e) for e in events) == 2


def test_a_prefetch_list_longer_than_the_window_is_gathered_whole(fake_pg: tuple) -> None:
    # block 0 asks for blocks 1 and 2: both are gathered before block 0 computes, as FSDP2
    # does (a list of two asks for that memory), so three blocks are held at once; implicit
    # prefetch elsewhere still keeps the window of two
    model = shard_toy(ToyLM())
    b0, b1, b2 = model.blocks
    b0.set_modules_to_forward_prefetch([b1, b2])
    _, events = toy_steps(model, 2)
    start = index_of(events, "FORWARD_START", "blocks.0")
    assert _gather(events, "blocks.1", FORWARD) < _gather(events, "blocks.2", FORWARD) < start
    assert max(window(e) for e in events) == 3


def test_an_empty_list_turns_prefetch_off_for_that_unit(fake_pg: tuple) -> None:
    model = shard_toy(ToyLM())
    model.blocks[0].set_modules_to_forward_prefetch([])
    model.blocks[2].set_modules_to_backward_prefetch([])
    _, events = toy_steps(model, 2)
    # block 1 is gathered on demand in forward, and block 1 on demand in backward
    assert _gather(events, "blocks.1", FORWARD) > index_of(events, "FORWARD_END", "blocks.0")
    assert _gather(events, "blocks.1", BACKWARD) > index_of(events, "BACKWARD_END", "blocks.2")
    # the other units keep their implicit prefetch
    assert _gather(events, "blocks.2", FORWARD) < index_of(events, "FORWARD_START", "blocks.1")
    assert _gather(events, "blocks.0", BACKWARD) < index_of(events, "BACKWARD_START", "blocks.1")
