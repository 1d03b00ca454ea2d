"""NOTE [Issuing on the group itself] (``fullshard/comm/collectives.py``): a step's all-gathers
and reduce-scatters go to the process group's own methods, and to ``torch.distributed``'s
functions whenever a torch function mode is active (non-strict export maps those functions to
functional collectives through such a mode, so it must still see them). The mode is active in
forward; autograd runs backward without it, so there every collective takes the group's method
in both cases, as ``torch.distributed``'s functions would then do too."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

import fullshard.comm.collectives as coll
from fullshard import fully_shard
from fullshard.observe.c10d_counter import C10dCounter

pytestmark = pytest.mark.fast


class _Seen(TorchFunctionMode):
    """Every function a torch function mode is shown."""

    def __init__(self) -> None:
        super().__init__()
        self.funcs: list[Any] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.funcs.append(func)
        return func(*args, **(kwargs or {}))


def _counting(fn: Callable[..., Any], calls: list[str], name: str) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        calls.append(name)
        return fn(*args, **kwargs)

    return wrapper


def test_a_step_issues_on_the_group_and_a_mode_still_sees_torchs_functions(
    fake_pg: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16))
    fully_shard(model[0])
    fully_shard(model[2])
    fully_shard(model)
    x = torch.randn(4, 16)

    def step() -> None:
        model(x).sum().backward()
        model.zero_grad()

    step()  # the first forward's checks and set-up
    gather_name, scatter_name = (
        coll._all_gather_single.__name__,
        coll._reduce_scatter_single.__name__,
    )
    through_torch: list[str] = []
    monkeypatch.setattr(
        coll, "_all_gather_single", _counting(coll._all_gather_single, through_torch, "gather")
    )
    monkeypatch.setattr(
        coll,
        "_reduce_scatter_single",
        _counting(coll._reduce_scatter_single, through_torch, "scatter"),
    )

    with C10dCounter(known_only=True) as issued:
        step()
    assert issued.calls["all_gather"] >= 2 and issued.calls["reduce_scatter"] >= 2
    assert through_torch == []  # every one went to the group's own method

    with _Seen() as mode:  # active in forward (autograd's backward runs without it)
        step()
    seen = [getattr(f, "__name__", "") for f in mode.funcs]
    assert through_torch.count("gather") == seen.count(gather_name) >= 2
    assert through_torch.count("scatter") == seen.count(scatter_name)
