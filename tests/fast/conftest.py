"""The single-process layer: one process plays rank r of N over torch's fake process group.

Collectives move no data there (NOTE [Backends that move no data] in
``fullshard/comm/desync.py``), so these tests check *when* the engine gathers, frees and
reduces, not the numbers: schedule, prefetch, the gathered window and the hooks, in
milliseconds. Numbers are the parity layer's job (the multi-process tests).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

# (rank, world) a test plays unless it asks for others (``indirect`` parametrization): rank 1
# of 4 has uneven and empty shards of the toy's odd shapes
DEFAULT_RANK_WORLD = (1, 4)


@pytest.fixture
def fake_pg(request: pytest.FixtureRequest) -> Iterator[tuple[int, int]]:
    """Init the default process group as rank r of N on the fake backend; destroy it after.

    One thread, as each rank of the multi-process harness has: the toy's tensors are tiny, and
    on a shared 2-core machine torch's thread pool made a step ten times slower, not faster.
    """
    rank, world = getattr(request, "param", DEFAULT_RANK_WORLD)
    assert not dist.is_initialized(), "a process group leaked from an earlier test"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield rank, world
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(threads)
