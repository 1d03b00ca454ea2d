"""What makes this layer possible: the engine runs over torch's fake process group, where it skips
its desync verdict (NOTE [Backends that move no data] in ``fullshard/comm/desync.py``), and
only there: a backend that moves data is checked as before."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from fullshard.comm.desync import TAG_LEN, DesyncError, Position, Verdict, moves_data
from fullshard.policies import Phase

pytestmark = pytest.mark.fast


def _mispaired_gather(verdict: Verdict) -> None:
    """Two ranks' all-gather tags that disagree (the second rank ran another unit)."""
    rows = torch.tensor([[0xA5, 0, 1, 1, 7], [0xA5, 0, 2, 1, 7]], dtype=torch.float32)
    assert rows.shape[1] == TAG_LEN
    pos = Position(7, 0, "all_gather", "blocks.0", Phase.FORWARD, 1)
    verdict.gather(rows, 0, pos, None)


def _bad_sums(verdict: Verdict, world: int) -> None:
    """Summed reduce-scatter columns that are neither 0 nor the world size."""
    pos = Position(9, 0, "reduce_scatter", "blocks.0", Phase.BACKWARD, 1)
    verdict.reduce_sums(torch.ones(3), world, pos, None, ["w"])


def test_the_fake_group_skips_the_verdict(fake_pg: tuple[int, int]) -> None:
    assert not moves_data(None)
    verdict = Verdict()
    _mispaired_gather(verdict)
    _bad_sums(verdict, fake_pg[1])
    verdict.flush()  # nothing was kept to raise later either


@pytest.fixture
def gloo_one_rank() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_backend_that_moves_data_is_still_checked(gloo_one_rank: None) -> None:
    assert moves_data(None)
    with pytest.raises(DesyncError, match="paired different all-gathers"):
        _mispaired_gather(Verdict())
    deferred = Verdict(defer_cpu=True)  # the GPU's path: checked when the step closes
    _mispaired_gather(deferred)
    with pytest.raises(DesyncError, match="paired different all-gathers"):
        deferred.flush()
