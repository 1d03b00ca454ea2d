"""torch's threaded test process group (how FSDP2 users unit-test: ``FSDPTestMultiThread``).

Its work objects take no timeout (``FutureWrappingWork::wait() with finite timeout not
implemented``), so fullshard's bounded wait must fall back to a plain wait there
(``fullshard.comm.desync.timed_wait``). Two ranks as two threads of this process, under both
imports, each against one process in float64.
"""

from __future__ import annotations

import copy

import fsdp2_programs as progs
import pytest
import torch
from fsdp2_programs import Net, _ref_step, max_diff
from torch.testing._internal.common_distributed import spawn_threads_and_init_comms
from toy import batches, loss_of

WORLD = 2


class _Self:
    """What ``spawn_threads_and_init_comms`` passes as ``self`` (it wraps test methods)."""


@pytest.mark.parametrize("impl", ["torch", "fullshard"])
def test_training_on_the_threaded_process_group_matches_one_process(impl: str) -> None:
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        ref0 = Net()  # built once: threads share the process's RNG
        data = batches(2, WORLD)
        diffs: dict[int, float] = {}

        @spawn_threads_and_init_comms(world_size=WORLD)
        def train(_: _Self) -> None:
            rank = torch.distributed.get_rank()
            model, ref = copy.deepcopy(ref0), copy.deepcopy(ref0)
            progs.shard(model, impl)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
            for step in range(2):
                loss_of(model, data[step][rank]).backward()
                _ref_step(ref, data[step], WORLD)
                for o in (opt, ref_opt):
                    o.step()
                    o.zero_grad()
            diffs[rank] = max_diff(dict(model.named_parameters()), dict(ref.named_parameters()))

        train(_Self())
    finally:
        torch.set_default_dtype(torch.float32)
    print(f"\nthreaded process group, {impl}: largest difference {max(diffs.values()):.1e}")
    assert sorted(diffs) == list(range(WORLD))
    assert max(diffs.values()) <= 1e-12, diffs
