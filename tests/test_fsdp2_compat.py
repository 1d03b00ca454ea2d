"""FSDP2 compatibility: the same FSDP2-style programs under torch's ``fully_shard`` and under
fullshard's, each against one process in float64 (``tests/fsdp2_programs.py``).

Each case prints its largest difference under both imports (``pytest -s`` shows them).

Every program of one world size runs in one launch per import (``_launch``: each launch costs
seconds, a program a fraction of one), each program on a model of its own and seeded itself,
as ``fsdp2_gaps.gaps_program`` runs its cases; a program that raises fails its own tests only.
The two imports never share a launch: fullshard's CPU generator for sharded init
(``test_meta_init_after_sharding``) must not meet torch's.
"""

from __future__ import annotations

import functools
import traceback
from collections.abc import Callable
from typing import Any

import fsdp2_dropin
import fsdp2_gaps
import fsdp2_programs as progs
import pytest
import torch
from harness import run_ranks

IMPLS = ("torch", "fullshard")
EXACT = 1e-12

# every program, and the world size it runs at
WORLD: dict[Callable[..., Any], int] = {
    progs.clip_program: 2,
    progs.dcp_program: 2,
    progs.ema_program: 2,
    progs.generate_program: 2,
    progs.hsdp_accumulation_program: 4,
    progs.lora_program: 2,
    progs.reshard_int_program: 4,
    progs.list_program: 2,
    fsdp2_gaps.gaps_program: 2,
    fsdp2_dropin.dropin_program: 2,
    progs.meta_init_program: 2,
    progs.mixed_precision_program: 2,
    progs.shard_placement_program: 2,
}
BY_NAME = {program.__name__: program for program in WORLD}


def _programs(rank: int, world: int, impl: str, names: list[str]) -> dict[str, dict]:
    """Each named program in turn under ``impl``: its result, or the traceback it raised."""
    out: dict[str, dict] = {}
    for name in names:
        try:
            out[name] = {"result": BY_NAME[name](rank, world, impl)}
        except Exception:
            out[name] = {"raised": traceback.format_exc()}
    return out


@functools.cache
def _launch(world: int, impl: str) -> list[dict[str, dict]]:
    names = [program.__name__ for program, w in WORLD.items() if w == world]
    return run_ranks(_programs, world, impl, names, timeout_s=600)


def _both(program: Callable[..., Any]) -> dict[str, list[dict]]:
    """``program``'s result on every rank, under each import."""
    out = {}
    for impl in IMPLS:
        per_rank = [r[program.__name__] for r in _launch(WORLD[program], impl)]
        for r in per_rank:
            assert "raised" not in r, (impl, r.get("raised"))
        out[impl] = [r["result"] for r in per_rank]
    return out


def _report(case: str, res: dict[str, list[dict]]) -> None:
    figures = ", ".join(f"{i} {max(r['diff'] for r in res[i]):.1e}" for i in IMPLS)
    print(f"\ncompat {case}: largest difference from one process: {figures}")


@pytest.mark.parametrize(
    "case, program, world",
    [
        ("clip_grad_norm_", progs.clip_program, 2),
        ("DCP state dicts", progs.dcp_program, 2),
        ("EMA, redistribute", progs.ema_program, 2),
        ("generate", progs.generate_program, 2),
        ("HSDP accumulation", progs.hsdp_accumulation_program, 4),
        ("LoRA mixed dtypes", progs.lora_program, 2),
        ("reshard_after_forward=2", progs.reshard_int_program, 4),
        ("fully_shard([norm, head])", progs.list_program, 2),
    ],
)
def test_fsdp2_program_matches_one_process_under_both_imports(
    case: str, program: Callable[..., Any], world: int
) -> None:
    assert WORLD[program] == world
    res = _both(program)
    _report(case, res)
    for impl in IMPLS:
        for r in res[impl]:
            assert r["diff"] <= EXACT, (impl, r)


def test_what_torchs_fsdp2_tests_exercise_matches_one_process_under_both_imports() -> None:
    # every case of fsdp2_gaps.CASES, one program
    res = _both(fsdp2_gaps.gaps_program)
    for case in fsdp2_gaps.CASES:
        per = {i: [r[case] for r in res[i]] for i in IMPLS}
        _report(case, per)
        for impl in IMPLS:
            for r in per[impl]:
                assert r["diff"] <= EXACT, (case, impl, r)
                assert all(v for k, v in r.items() if k != "diff"), (case, impl, r)


def test_dcp_options_and_fullshard_state_dicts_agree_with_torch() -> None:
    res = _both(progs.dcp_program)
    for impl in IMPLS:
        for r in res[impl]:
            assert r["on_cpu"] and r["optim_full_shape"] and r["frozen_skipped"], (impl, r)
            assert r["strict_raises"], (impl, r)
    for r in res["fullshard"]:
        # fullshard.get_state_dict gives what torch's get_state_dict gives for the same model
        assert r["agree_model"] == 0.0 and r["agree_optim"] == 0.0, r


def test_lora_base_stays_frozen() -> None:
    for r in _both(progs.lora_program)["fullshard"]:
        assert r["base_grad_none"]


def test_meta_init_after_sharding() -> None:
    # FSDP2 on CPU draws the same shard on every rank for the same seed (DTensor's random ops
    # slice one full draw only on CUDA-like devices). fullshard draws independent shards of the
    # same distribution on CPU (its CPU generator cannot be offset like CUDA's Philox); on CUDA
    # both use DTensor's offset-based generator and agree (docs/design.md).
    res = _both(progs.meta_init_program)
    for r in res["torch"]:
        assert r["identical_shards"]
    for r in res["fullshard"]:
        assert not r["identical_shards"]
        assert abs(r["std"] - 0.02) < 0.005 and r["loss_finite"], r


def test_mixed_precision_policy_matches_fsdp2() -> None:
    # bf16 is not exact against one process in float64, so the two imports are compared with
    # each other, bit for bit: at 2 ranks both compute a rank's bf16 gradients with the same
    # kernels on the same rows and weights, accumulate the unsynchronised micro-batch's in
    # bf16, add two ranks' (one addition: the same bits in either order) and halve the sum
    # (exact, wherever the division happens). Nothing is left for a CPU's rounding to change
    # on one side only.
    assert WORLD[progs.mixed_precision_program] == 2
    res = _both(progs.mixed_precision_program)
    for t, f in zip(res["torch"], res["fullshard"], strict=True):
        assert t["out_dtype"] == f["out_dtype"] == "torch.float32"
        assert t["grad_dtype"] == f["grad_dtype"] == "torch.float32"
        assert t["grads"].keys() == f["grads"].keys()
        differ = [k for k in t["grads"] if not torch.equal(t["grads"][k], f["grads"][k])]
        assert not differ, differ


def test_shard_placement_fn_matches_fsdp2() -> None:
    # Shard(1) weights beside uneven Shard(0) ones: the same placements under both imports,
    # each equal to one process
    res = _both(progs.shard_placement_program)
    _report("shard_placement_fn", res)
    for impl in IMPLS:
        for r in res[impl]:
            assert r["diff"] <= EXACT, (impl, r)
    assert res["torch"][0]["placements"] == res["fullshard"][0]["placements"]
    assert "Shard(dim=1)" in res["fullshard"][0]["placements"]["head.weight"]


def test_what_frameworks_and_the_rest_of_torchs_tests_exercise_under_both_imports() -> None:
    # every case of fsdp2_dropin.CASES (issue 33), one program
    res = _both(fsdp2_dropin.dropin_program)
    for case in fsdp2_dropin.CASES:
        per = {i: [r[case] for r in res[i]] for i in IMPLS}
        _report(case, per)
        for impl in IMPLS:
            for r in per[impl]:
                assert "raised" not in r, (case, impl, r["raised"])
                assert r["diff"] <= EXACT, (case, impl, r)
                assert all(v is True for k, v in r.items() if k != "diff"), (case, impl, r)
