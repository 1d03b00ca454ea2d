"""Programs whose ranks differ (issue 34): parameters some ranks did not use, units some ranks
skip, and an undeclared skip, against one process on the union of the data (float64)."""

from __future__ import annotations

import functools
from typing import Any

import pytest
from conditional_programs import (
    MoELM,
    emulated,
    moe_batches,
    moe_loss,
    shard_moe,
    shard_vlm,
    tiny_llava,
    train,
    vlm_batches,
    vlm_loss,
)
from harness import case_results, run_cases, run_ranks

TOL = 1e-12


def _moe(rank: int, world: int, how: str) -> dict[str, Any]:
    import torch

    micro = 2 if how == "accumulate" else 1
    ref_dtype = torch.float32 if how == "mixed" else None
    return train(
        rank,
        world,
        lambda: MoELM().double(),
        lambda m: shard_moe(m, how, world),  # type: ignore[arg-type]
        moe_loss,
        moe_batches(3, micro, world),
        ref_dtype,
    )


def _vlm(rank: int, world: int, images: list[list[bool]], optional: bool) -> dict[str, Any]:
    try:
        return train(
            rank,
            world,
            tiny_llava,
            lambda m: shard_vlm(m, optional),
            vlm_loss,
            vlm_batches(images),
        )
    except Exception as exc:  # the undeclared skip: the error every rank must raise
        return {"error": f"{type(exc).__name__}: {exc}"}


def _optional_root(rank: int, world: int) -> str:
    from fullshard import fully_shard

    model = MoELM().double()
    fully_shard(model).set_optional()
    try:
        model(moe_batches(1, 1, world)[0][0][rank]["idx"])
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return ""


def _cases(world: int) -> dict[str, Any]:
    some = [r == 0 for r in range(world)]  # only rank 0's batch holds an image
    every, none = [True] * world, [False] * world
    cases: dict[str, Any] = {
        f"moe {how}": (_moe, (how,))
        for how in (
            ["plain", "accumulate", "mixed", "offload", "deterministic", "experts_optional"]
            if world == 2
            else ["plain", "hsdp"]
        )
    }
    cases["vlm optional"] = (_vlm, ([some, none, every], True))
    cases["optional root"] = (_optional_root, ())
    cases["vlm undeclared, first step"] = (_vlm, ([some, every], False))
    cases["vlm undeclared, later step"] = (_vlm, ([every, some], False))
    # no image anywhere in step 2: the encoder is in no recorded order when rank 0 runs it
    cases["vlm undeclared, after a step without it"] = (_vlm, ([every, none, some], False))
    return cases


@functools.cache
def _launch(world: int) -> list[dict]:
    return run_ranks(run_cases, world, _cases(world), timeout_s=300)


WORLDS = [2, 4]


@pytest.mark.parametrize("world", WORLDS)
def test_experts_some_ranks_did_not_use_train_as_one_process(world: int) -> None:
    # NOTE [Which gradients exist]: a rank that did not use an expert contributes zero
    for name in _cases(world):
        if not name.startswith("moe"):
            continue
        res = case_results(_launch(world), name)
        assert max(res[0]["diffs"]) <= TOL, (name, res[0]["diffs"])
        # the case happened: an expert used on some ranks only (and, at 2 ranks, by none)
        used = res[0]["used"]
        partly = nobody = 0
        for step in used:
            for layer in range(len(step[0])):
                for e in range(8):
                    n = sum(e in ranks[layer] for ranks in step)
                    partly += 0 < n < len(step)
                    nobody += n == 0
        assert partly > 0, used
        if world == 2:
            assert nobody > 0, used


@pytest.mark.parametrize("world", WORLDS)
def test_an_optional_vision_tower_trains_as_one_process(world: int) -> None:
    # NOTE [Optional units]: images on rank 0 only, then on no rank, then on every rank
    res = case_results(_launch(world), "vlm optional")
    for r in res:
        assert "error" not in r, r
        assert max(r["diffs"]) <= TOL, r["diffs"]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("when", ["first step", "later step", "after a step without it"])
def test_an_undeclared_skip_is_one_clear_error_on_every_rank(world: int, when: str) -> None:
    # NOTE [Units every rank runs]: never a hang, an abort in the transport, or a wrong answer
    res = case_results(_launch(world), f"vlm undeclared, {when}")
    for r in res:
        assert r.get("error", "").startswith("DesyncError"), r
        assert "vision_tower.encoder" in r["error"] and "set_optional()" in r["error"], r["error"]
    if when == "later step":
        others = ", ".join(map(str, range(1, world)))
        assert f"ran on rank(s) 0 and not on rank(s) {others}" in res[0]["error"], res[0]


def test_the_cuda_path_of_each_mechanism_under_the_emulation() -> None:
    # the CUDA code path (virtual streams, NCCL-modelled collectives, deferred verdicts): no
    # ordering error, one process's answer, and no host synchronisation after the first step
    # (which lazy init and the first forward's checks read in)
    cases = {c: (emulated, (c,)) for c in ("moe", "experts", "vlm")}
    res = run_ranks(run_cases, 2, cases, timeout_s=300)
    for case in cases:
        for r in case_results(res, case):
            assert r["error"] is None, (case, r["error"])
            assert max(r["diffs"]) <= TOL, (case, r["diffs"])
            assert r["syncs"][1:] == [0, 0], (case, r["syncs"])


def test_the_root_cannot_be_optional() -> None:
    # it starts every forward; refused on every rank at its first forward, with what to do
    for r in case_results(_launch(2), "optional root"):
        assert r.startswith("FullshardError") and "is the root" in r, r
