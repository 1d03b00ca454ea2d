"""NOTE [Interrupts] (``comm/desync.py``): a generation's token is on its groups' communication
context (a unit's ``Comm`` keeps the one of the generation it was built in) and is passed to
the waits explicitly, with no module-wide switch; without one, waits do not poll."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fullshard import fully_shard
from fullshard.comm.desync import Interrupt, Interrupted, interrupt_for, set_interrupt, timed_wait

pytestmark = pytest.mark.fast


class _Never:  # a collective a dead peer never completes
    def is_completed(self) -> bool:
        return False

    def wait(self, timeout: object = None) -> bool:
        raise AssertionError("a polled wait never blocks")


def test_a_units_comm_holds_its_generations_token(fake_pg: tuple[int, int]) -> None:
    newest = [0]
    token = Interrupt(lambda: newest[0] > 0, "generation 0 moved on")
    set_interrupt(token)
    try:
        model = fully_shard(nn.Linear(4, 4))
        comm = model._fullshard_state.unit.comm  # type: ignore[union-attr]
        assert comm.interrupt is token and interrupt_for(dist.new_group()) is token
        assert timed_wait(_Done(), timedelta(seconds=1), token)  # type: ignore[arg-type]
        newest[0] = 1  # the watcher saw generation 1
        with pytest.raises(Interrupted, match="generation 0 moved on while this rank waited"):
            timed_wait(_Never(), timedelta(seconds=5), comm.interrupt)  # type: ignore[arg-type]
    finally:
        set_interrupt(None)
    assert interrupt_for(None) is None  # outside live recovery: plain waits
    later = fully_shard(nn.Linear(4, 4))
    assert later._fullshard_state.unit.comm.interrupt is None  # type: ignore[union-attr]


class _Done:
    def is_completed(self) -> bool:
        return True

    def wait(self, timeout: object = None) -> bool:
        return True


def test_without_a_token_a_wait_does_not_poll(fake_pg: tuple[int, int]) -> None:
    work = dist.all_reduce(torch.ones(2), async_op=True)
    assert work is not None and timed_wait(work, timedelta(seconds=5))
