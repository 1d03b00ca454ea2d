"""Pipeline parallelism x FSDP (issue 41 item 3; NOTE [What pipelining reads from an FSDP2
module]): torch's pipelining schedules over fully sharded stages on 4 gloo ranks (pp 2 x dp 2),
under each import order, give torch's weights and one process's, with one gradient reduction
per unit per step, as torch's FSDP2 does.

Two launches (``pipeline_programs.pipeline_program``): the import order is the process's, and
``install()`` before pipelining's first import needs a process that has not imported it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from harness import run_ranks
from pipeline_programs import SCHEDULES, pipeline_program, reference_weights

ORDERS = ("install_before", "install_after", "direct")
PARITY = 1e-12  # fp64 against one process: the same sums in another order


@pytest.fixture(scope="module")
def runs() -> dict[tuple[str, str], list[dict[str, Any]]]:
    """(order, schedule) -> every rank's result: the two launches."""
    out: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for orders in (["install_before"], ["torch", "install_after", "direct"]):
        results = run_ranks(pipeline_program, 4, orders, timeout_s=240)
        for key in results[0]:
            out[key] = [r[key] for r in results]
    return out


def _weights(ranks: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """The whole model: each rank's stages (the dp ranks of a stage hold the same weights)."""
    merged: dict[str, torch.Tensor] = {}
    for r in ranks:
        for name, w in r["weights"].items():
            if name in merged:
                assert torch.equal(merged[name], w), name
            merged[name] = w
    return merged


def _reductions(rank: dict[str, Any]) -> list[int]:
    """Gradient reductions per step at the c10d level: FSDP2's reduce-scatter, or fullshard's
    all-to-all that stands for it on gloo (NOTE [Reduce-scatter on gloo])."""
    return [c.get("reduce_scatter", 0) + c.get("all_to_all", 0) for c in rank["counts"]]


def _gathers(rank: dict[str, Any]) -> list[int]:
    return [c.get("all_gather", 0) for c in rank["counts"]]


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_torch_pipelines_its_fsdp2_like_one_process(runs: dict, schedule: str) -> None:
    """The control: torch's FSDP2 under the schedule equals one process and reduces each unit
    once per step."""
    ranks = runs["torch", schedule]
    assert _max_diff(_weights(ranks), reference_weights(schedule)) <= PARITY
    for r in ranks:
        assert _reductions(r) == [r["units"]] * len(r["counts"])


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("order", ORDERS)
def test_pipeline_gives_torchs_weights_and_reductions(
    runs: dict, order: str, schedule: str
) -> None:
    """Under every import order: torch's weights bit for bit, one process's to 1e-12, and per
    rank and step torch's reductions (one per unit: pipelining's no-sync and REDUCE_GRAD
    honoured) and torch's all-gathers (its UNSHARD / RESHARD and reshard-after-backward
    requests honoured)."""
    ours, torchs = runs[order, schedule], runs["torch", schedule]
    for rank, (r, t) in enumerate(zip(ours, torchs, strict=True)):
        got = {"reductions": _reductions(r), "all-gathers": _gathers(r)}
        want = {"reductions": _reductions(t), "all-gathers": _gathers(t)}
        assert got == want, f"rank {rank}, per step: {got}; torch's: {want}"
        assert got["reductions"] == [r["units"]] * len(r["counts"]), (rank, r["units"])
        assert all(c.get("all_reduce", 0) == 0 for c in r["counts"]), rank
    weights = _weights(ours)
    reference = _weights(torchs)
    assert weights.keys() == reference.keys()
    for name in weights:
        assert torch.equal(weights[name], reference[name]), (name, order, schedule)
    assert _max_diff(weights, reference_weights(schedule)) <= PARITY
