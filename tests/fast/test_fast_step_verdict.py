"""NOTE [The step's verdict on the device] (``app/train/verdict.py``) in one process: rows read
``lag`` steps late unless urgent, the device schedule counting applied steps only, its state
written back for checkpoints, and who decides the step (``app/train/build.device_decides``)."""

from __future__ import annotations

import pytest
import torch

from fullshard import CPUOffloadPolicy, fully_shard
from fullshard.app.config import OptimizerConfig
from fullshard.app.train.build import device_decides, lr_lambda
from fullshard.app.train.verdict import DeviceSchedule, StepVerdicts
from fullshard.testing import cuda_emulation, sync_counts
from fullshard.testing.emulation import as_host

pytestmark = pytest.mark.fast


def _row(step: int, nonfinite: bool = False) -> torch.Tensor:
    return torch.tensor([float(step), 1.0, float(nonfinite), 0.0], dtype=torch.float64)


def test_rows_are_read_a_step_late_on_the_device_and_at_once_when_urgent() -> None:
    with cuda_emulation(all_device=True):
        v = StepVerdicts(lag=1)
        assert [x.step for x in v.push(1, _row(1) * 1, now=False)] == []
        assert [x.step for x in v.push(2, _row(2, True) * 1, now=False)] == [1]
        got = v.push(3, _row(3) * 1, now=True)  # a logged step: its own row too
        assert [(x.step, x.nonfinite) for x in got] == [(2, True), (3, False)]
        assert not any(k == "event.synchronize" for k, _ in sync_counts())
    assert [x.step for x in StepVerdicts(lag=0).push(5, _row(5), now=False)] == [5]


def test_the_device_schedule_counts_applied_steps_only_and_saves_as_lambda_lr() -> None:
    warmup, total, ratio = 2, 10, 0.1
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([p], lr=0.5)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_lambda(s, warmup, total, ratio))
    d = DeviceSchedule(
        opt, sched, lambda s: lr_lambda(s, warmup, total, ratio), total, torch.device("cpu")
    )
    for ok in (1.0, 1.0, 0.0, 1.0):  # the third step was skipped
        d.step(torch.tensor(ok, dtype=torch.float64))
    want = 0.5 * lr_lambda(3, warmup, total, ratio)
    # float32, as CUDA's fused AdamW reads a tensor lr (NOTE [Kernel contracts]); the count of
    # applied steps stays float64
    assert opt.param_groups[0]["lr"].dtype == torch.float32 and d.applied.dtype == torch.float64
    assert float(opt.param_groups[0]["lr"]) == float(torch.tensor(want, dtype=torch.float32))
    with d.as_floats():
        assert sched.state_dict()["last_epoch"] == 3
        assert isinstance(opt.param_groups[0]["lr"], float)
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor)
    # as a checkpoint loads it; past the schedule's end (12) the last value holds, as in the
    # function: the device's rates are the host's formula, rounded to float32
    for last in (7, 12):
        sched.last_epoch = last
        d.reload()
        want = 0.5 * lr_lambda(last, warmup, total, ratio)
        assert float(opt.param_groups[0]["lr"]) == float(torch.tensor(want, dtype=torch.float32))


@pytest.mark.parametrize("offload", [False, True])
def test_the_host_decides_where_the_optimizers_parameters_live_in_host_memory(
    fake_pg: tuple[int, int], offload: bool
) -> None:
    """``device_decides`` asks the sharded parameters, not the flag: on the CUDA path fused
    AdamW's device verdict unless one of them is in host memory (``CPUOffloadPolicy``'s pinned
    shards, or a model offloaded some other way), where the host's kernel would read a device
    lr and found_inf before their copies land (NOTE [Kernel contracts])."""
    fused = OptimizerConfig()  # adamw, auto: fused where the device decides
    with cuda_emulation(all_device=True):
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        fully_shard(model, offload_policy=CPUOffloadPolicy() if offload else None)
        device = torch.device("cpu")  # the emulated CUDA device
        assert device_decides(fused, model.parameters(), device) is not offload
        host = as_host(torch.zeros(3))  # a plain parameter the user keeps on the host
        assert not device_decides(fused, [*model.parameters(), host], device)
        assert not device_decides(OptimizerConfig(impl="foreach"), model.parameters(), device)
    # off the CUDA path (plain CPU) the host decides whatever the parameters
    assert not device_decides(fused, model.parameters(), device)
