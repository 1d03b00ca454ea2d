"""``fullshard.optim.Muon``: each matrix's Newton–Schulz on one owner rank, one process's answer.

One launch per world size (1, 2, 3, 4) runs every case of ``muon_programs.muon_program``;
the tests read them. Against one process (torch's ``Muon`` and ``AdamW`` on whole tensors):
bit for bit with torch's bf16 Newton–Schulz given the same gradients (every option, uneven and
empty shards, bf16 compute, CPU offload, frozen and skipped parameters, HSDP, tensor
parallel), within 1e-12 in a real fp64 training loop; the same bits at 1, 2 and 4 ranks under
``fullshard.deterministic``; a DCP checkpoint written at 2 ranks resumed at 3 exactly; the
exchange counted at the c10d level; the work and the state split over the ranks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from harness import case_results, run_ranks
from muon_programs import CONFIGS, muon_program

WORLDS = (1, 2, 3, 4)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[dict]]:
    folder = tmp_path_factory.mktemp("muon")
    # in this order: the DCP case saves at 2 ranks and loads at 3
    return {w: run_ranks(muon_program, w, str(folder), timeout_s=600) for w in WORLDS}


def _cases(runs: dict[int, list[dict]], world: int, key: Any) -> list[Any]:
    return case_results(runs[world], key)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_bit_for_bit_one_process_given_the_same_gradients(
    runs: dict[int, list[dict]], world: int
) -> None:
    keys = [("injected", k) for k in range(len(CONFIGS))]
    keys += [("injected", h) for h in ("bf16", "offload", "frozen", "skipped")]
    keys += [("injected", "hsdp")] if world == 4 else []
    for key in keys:
        for rank, out in enumerate(_cases(runs, world, key)):
            assert out["differing"] == [], (world, key, rank)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_cuda_path_orders_its_streams_and_never_waits_on_the_host(
    runs: dict[int, list[dict]], world: int
) -> None:
    for out in _cases(runs, world, "emulated"):
        assert out["error"] is None, out["error"]
        assert out["differing"] == []
        assert all(s == {} for s in out["syncs"][1:]), out["syncs"]  # after the plan's step


@pytest.mark.parametrize("world", [2, 3, 4])
def test_fp64_training_matches_one_process(runs: dict[int, list[dict]], world: int) -> None:
    for k in range(len(CONFIGS)):
        for out in _cases(runs, world, ("fp64", k)):
            assert out["diff"] <= 1e-12, (world, CONFIGS[k], out["diff"])
            assert out["warnings"] == []


@pytest.mark.parametrize("world", [2, 3, 4])
def test_torch_muon_over_sharded_parameters_works_and_warns_once(
    runs: dict[int, list[dict]], world: int
) -> None:
    for out in _cases(runs, world, "torch_muon"):
        assert out["diff"] <= 1e-12
        assert len(out["warnings"]) == 1, out["warnings"]  # three steps, one warning
        assert "fullshard.optim.Muon" in out["warnings"][0]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_a_step_is_two_all_to_alls_of_bf16_pieces(runs: dict[int, list[dict]], world: int) -> None:
    outs = _cases(runs, world, "comm")
    for out in outs:
        # nothing but the exchange: to the owners and back, each the larger of what this rank
        # sends (all its rows, bf16) and receives (its owned matrices, bf16)
        assert out["step_calls"] == {"all_to_all": 2}
        expected = 2 * max(out["local_elements"], out["owned_elements"])
        assert [b for _, b in out["step_log"]] == [expected, expected]
        # the backward's reduce-scatters of the same parameters (all-to-alls on gloo, fp32 and
        # whole) alone count at least twice both exchanges together
        assert 2 * sum(b for _, b in out["step_log"]) <= out["fb_bytes"]["all_to_all"]
    # what leaves the ranks: all but the owners' own rows, both ways
    total = out["total_state_bytes"] // 4
    sent = sum(a + b for a, b in (o["sent"] for o in outs))
    own = sum(o["owned_elements"] for o in outs)
    assert 0 < sent <= 2 * (total - own // world) and sent < 2 * total


@pytest.mark.parametrize("world", [2, 3, 4])
def test_owners_split_the_newton_schulz_work_and_the_state(
    runs: dict[int, list[dict]], world: int
) -> None:
    outs = _cases(runs, world, "comm")
    owned = [set(o["owned"]) for o in outs]
    assert sorted(i for s in owned for i in s) == list(range(8))  # each matrix one owner
    # eight equal matrices: 8/N each (3, 3, 2 at three ranks)
    assert sorted(len(s) for s in owned) == sorted(
        8 // world + (r < 8 % world) for r in range(world)
    )
    total = outs[0]["total_flops"]
    assert max(o["flops"] for o in outs) == total * max(len(s) for s in owned) // 8
    # the state is the momentum's rows beside the parameter's: 1/N, all of it once
    assert sum(o["state_bytes"] for o in outs) == outs[0]["total_state_bytes"]
    assert all(o["state_bytes"] == 4 * o["local_elements"] for o in outs)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def test_deterministic_gives_the_same_bits_at_1_2_and_4_ranks(
    runs: dict[int, list[dict]],
) -> None:
    one = _cases(runs, 1, "deterministic")[0]
    for world in (2, 4):
        for out in _cases(runs, world, "deterministic"):
            for precision, weights in out.items():
                for name, t in weights.items():
                    assert torch.equal(_bits(t), _bits(one[precision][name])), (world, name)


def test_tensor_parallel_pieces_that_are_not_rows(runs: dict[int, list[dict]]) -> None:
    for out in _cases(runs, 4, "tp"):
        assert out["differing"] == []
        # the exchange saw a strided layout (column-parallel over dp) and column blocks
        assert "_StridedShard" in out["placements"]["layers.2.weight"]
        assert "Shard(dim=1)" in out["placements"]["layers.3.weight"]


def test_dcp_checkpoint_at_2_ranks_resumes_exactly_at_3(runs: dict[int, list[dict]]) -> None:
    two, three = _cases(runs, 2, "dcp")[0], _cases(runs, 3, "dcp")
    for out in three:
        for part in ("weights", "state"):
            assert out[part].keys() == two[part].keys()
            for name, t in two[part].items():
                assert torch.equal(_bits(out[part][name]), _bits(t)), (part, name)
    assert any(k.endswith("momentum_buffer") for k in two["state"])


def test_no_case_was_left_out(runs: dict[int, list[dict]], tmp_path: Path) -> None:
    for world, results in runs.items():
        for key, value in results[0].items():
            assert "raised" not in value, (world, key, value.get("raised"))


def test_train_with_muon_resumed_at_4_ranks_equals_one_rank(tmp_path: Path) -> None:
    """``fullshard train --optimizer muon --deterministic``: one rank trains 4 steps, saving
    after 2; 4 ranks resume that checkpoint (the train state, DCP: the Muon momentum resharded
    1 -> 4) and end with one rank's weights and figures, bit for bit. A resume with the other
    optimizer is refused before launch."""
    from test_app_cli import converted, records, train_on_ranks

    from fullshard.app.cli import main

    common = [
        *["--optimizer", "muon", "--deterministic", "--model", "tiny"],
        *["--max-steps", "4", "--batch-size", "8", "--micro-batch-size", "2"],
        *["--seq-len", "32", "--sample-tokens", "0", "--log-every", "1"],
        *["--eval-every", "4", "--eval-batches", "1", "--no-progress"],
        "--runs-dir",
        str(tmp_path),
        "--save-every",
        "2",
    ]
    assert [r["status"] for r in train_on_ranks([*common, "--name", "one"], world=1)] == [0]
    half = str(tmp_path / "one" / "checkpoints" / "step_00000002")
    resumed = train_on_ranks([*common, "--name", "moved", "--resume", half], world=4)
    assert [r["status"] for r in resumed] == [0] * 4, resumed[0]["stderr"]
    one, moved = (
        converted(tmp_path / n / "checkpoints" / "step_00000004", tmp_path / f"{n}.safetensors")
        for n in ("one", "moved")
    )
    for name, t in one.items():
        assert torch.equal(_bits(moved[name]), _bits(t)), name
    keys = ("step", "loss", "grad_norm")
    ours = [{k: r.get(k) for k in keys} for r in records(tmp_path / "moved")]
    assert ours == [{k: r.get(k) for k in keys} for r in records(tmp_path / "one")][2:]
    adamw = [a for a in common if a not in ("--optimizer", "muon")]
    assert main(["train", *adamw, "--name", "other", "--resume", half]) == 2
