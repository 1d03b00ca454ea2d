"""FSDP x tensor parallel on a 2-D mesh: torchtitan's recipe, against one process in float64.

Each block's two linears are column- then row-parallel over mesh["tp"] (``parallelize_module``);
then every block and the root are ``fully_shard``-ed over mesh["dp"]. The TP ranks of one
data-parallel rank see the same batch; the reference model sees every data-parallel batch.

The 4-rank cases share one launch (the ``four_ranks`` fixture: a launch costs seconds, most
cases a fraction of one); each case builds its own mesh and model in a rank reset to a fresh
process's default dtype, and a case that raises fails its own test only.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
from harness import case_results, run_cases, run_ranks
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from fullshard import FullshardError, clip_grad_norm_, fully_shard
from fullshard.checkpoint import full_state_dict

DIM, HIDDEN, OUT = 8, 12, 5


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)
        self.norm = nn.LayerNorm(DIM)  # replicated on TP

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.down(torch.relu(self.up(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([MLP() for _ in range(2)])
        self.head = nn.Linear(DIM, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _batches(steps: int, dp: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randn(steps, dp, 3, DIM, generator=g, dtype=torch.float64)


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).square().mean()


def _other_dim(param: nn.Parameter) -> Shard:
    """FSDP2's test_init_2d_transformer_shard_diff_dim: a TP matrix is sharded over the
    data-parallel ranks on the dim TP does not shard (Shard(1) for a column-parallel weight)."""
    if isinstance(param, DTensor):
        for placement in param.placements:
            if isinstance(placement, Shard):
                return Shard(param.ndim - 1 - placement.dim)
    return Shard(0)


def _tp_fsdp(
    model: nn.Module, dp: int, tp: int, hsdp: bool = False, placement: Any = None
) -> nn.Module:
    names = ("replicate", "shard", "tp") if hsdp else ("dp", "tp")
    shape = (2, dp // 2, tp) if hsdp else (dp, tp)  # HSDP: 2 replicas
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    dp_mesh = mesh["replicate", "shard"] if hsdp else mesh["dp"]
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(block, mesh=dp_mesh, shard_placement_fn=placement)
    fully_shard(model, mesh=dp_mesh, shard_placement_fn=placement)
    return model


def _parity(rank: int, world: int, tp: int, hsdp: bool, other_dim: bool = False) -> dict:
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    ref = Net()
    placement = _other_dim if other_dim else None
    model = _tp_fsdp(copy.deepcopy(ref), world // tp, tp, hsdp, placement)
    dp_rank, dp = rank // tp, world // tp
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    data = _batches(3, dp)
    norms = []
    for step in range(3):
        _loss(model, data[step][dp_rank]).backward()
        _loss(ref, data[step].reshape(-1, DIM)).backward()
        norms.append(
            (
                clip_grad_norm_(model.parameters(), 1e9).item(),
                clip_grad_norm_(ref.parameters(), 1e9).item(),
            )
        )
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    export = full_state_dict(model, rank0_only=False)  # gathers over dp, joins over TP
    return {
        "diff": max((full[n] - p).abs().max().item() for n, p in ref.named_parameters()),
        "export_diff": max((export[n] - p).abs().max().item() for n, p in ref.named_parameters()),
        "norm_diff": max(abs(a - b) for a, b in norms),
        "dtensor": all(isinstance(p, DTensor) for p in model.parameters()),
        "placements": {n: str(p.placements) for n, p in model.named_parameters()},
    }


@pytest.mark.parametrize(("world", "tp", "hsdp"), [(4, 2, False), (4, 2, True)])
def test_fsdp_times_tp_matches_one_process(
    four_ranks: list[dict], world: int, tp: int, hsdp: bool
) -> None:
    results = case_results(four_ranks, ("parity", tp, hsdp))
    worst = {k: max(r[k] for r in results) for k in ("diff", "export_diff", "norm_diff")}
    print(f"\n{'HSDP' if hsdp else 'FSDP'} x TP{tp} at {world} ranks, float64: {worst}")
    for r in results:
        assert r["dtensor"]
        assert r["diff"] <= 1e-12, r
        assert r["export_diff"] <= 1e-12, r
        assert r["norm_diff"] <= 1e-12, r
        assert "_StridedShard" in r["placements"]["blocks.0.up.weight"]  # TP shards dim 0 too
        dp = ("Replicate(), " if hsdp else "") + "Shard(dim=0)"
        assert r["placements"]["blocks.0.down.bias"] == f"({dp}, Replicate())"
        norm = f"({dp})" if hsdp else f"({dp},)"  # not TP: the data-parallel placements only
        assert r["placements"]["blocks.0.norm.weight"] == norm


def test_tp_parameters_sharded_on_the_other_dim_match_one_process(
    four_ranks: list[dict],
) -> None:
    # shard_placement_fn returns Shard(1) for TP's Shard(0) weights and Shard(0) for its
    # Shard(1) ones (FSDP2's test_init_2d_transformer_shard_diff_dim): still exact
    for r in case_results(four_ranks, ("parity", 2, False, "other_dim")):
        assert r["diff"] <= 1e-12 and r["export_diff"] <= 1e-12 and r["norm_diff"] <= 1e-12, r
        assert r["placements"]["blocks.0.up.weight"] == "(Shard(dim=1), Shard(dim=0))"
        assert r["placements"]["blocks.0.down.weight"] == "(Shard(dim=0), Shard(dim=1))"


def _bad_mesh(rank: int, world: int) -> str:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    block = MLP()
    parallelize_module(block, mesh["dp"], {"up": ColwiseParallel()})  # TP over the dp mesh
    try:
        fully_shard(block, mesh=mesh["dp"])
    except FullshardError as e:
        return str(e)
    return ""


def test_tp_on_the_mesh_fullshard_shards_over_is_refused(four_ranks: list[dict]) -> None:
    for msg in case_results(four_ranks, "bad_mesh"):
        assert "up.weight" in msg and "mesh['tp']" in msg


def _save(rank: int, world: int, folder: str) -> None:
    import torch.distributed.checkpoint as dcp

    from fullshard import get_state_dict

    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    model = _tp_fsdp(Net(), 2, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = _batches(3, 2)
    for step in range(2):
        _loss(model, data[step][rank // 2]).backward()
        opt.step()
        opt.zero_grad()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=folder)


def _load_and_step(rank: int, world: int, folder: str) -> dict:
    import torch.distributed.checkpoint as dcp

    from fullshard import get_state_dict, set_state_dict

    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    ref = Net()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    torch.manual_seed(123)  # another init: everything must come from the checkpoint
    model = _tp_fsdp(Net(), 1, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=folder)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    data = _batches(3, 2)
    for step in range(3):  # the reference: every batch of both data-parallel ranks
        _loss(ref, data[step].reshape(-1, DIM)).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    _loss(model, data[2].reshape(-1, DIM)).backward()  # one data-parallel rank: the union
    opt.step()
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    return {"diff": max((full[n] - p).abs().max().item() for n, p in ref.named_parameters())}


def test_checkpoint_saved_at_dp2_tp2_loads_at_dp1_tp2(
    four_ranks: list[dict], checkpoint_folder: str
) -> None:
    case_results(four_ranks, "save")  # saved to checkpoint_folder, in the 4-rank launch
    for r in run_ranks(_load_and_step, 2, checkpoint_folder, timeout_s=180):
        assert r["diff"] <= 1e-12, r


TRAIN_FLAGS = (
    *["--max-steps", "3", "--batch-size", "8", "--seq-len", "64"],
    *["--eval-every", "0", "--eval-batches", "2", "--sample-tokens", "0"],
)


def _cli_rank(rank: int, world: int, argv: list[str]) -> None:
    """What a rank the CLI launched runs (``fullshard.app.cli.main`` in torchrun's environment),
    in a rank of the harness: the trainer joins the process group that is already there."""
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world)
    )
    from fullshard.app.cli import main

    assert main(argv) == 0


@pytest.mark.e2e
def test_train_tp2_on_4_ranks_reads_the_data_of_2_data_parallel_ranks(
    tmp_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The same global batches: TP splits each block's matrices, not the data. The Hugging
    # Face Llama plan through the CLI: the TP run is `fullshard train --nproc 4 --tp 2` through
    # the CLI's main and its launch (test_app_cli.main_in_process: no launcher interpreter of
    # its own); the data-parallel reference runs the ranks' side of the same CLI (same config,
    # trainer and data) on the harness's ranks, without a second launch.
    #
    # What the plans compute is test_the_cli_plans_match_one_process's, in float64. The
    # float32 losses of the two runs are not compared: they cannot be equal to the bit (a
    # row-parallel linear sums its inputs in two halves and adds the halves; the unsplit one
    # sums them in one kernel, in an order its blocking for this CPU sets), and no bound on
    # that rounding survives AdamW's steps (its division by sqrt(v) can make a gradient's
    # rounding as large as the step), so any tolerance would be one a CPU happens to meet.
    import json
    from pathlib import Path

    from test_app_cli import main_in_process

    model, tmp = "hf:llama-tiny", str(tmp_path)
    common = ["train", *TRAIN_FLAGS, "--runs-dir", tmp, "--model", model]
    # the harness's ranks first: a launch's ranks fork from the forkserver too, which keeps the
    # environment it started in (the launch's, with its config, when the launch started it)
    run_ranks(_cli_rank, 2, [*common, "--name", "dp", "--nproc", "2"], timeout_s=300)
    argv = [*common, "--name", "tp", "--nproc", "4", "--tp", "2"]
    assert main_in_process(argv, monkeypatch, deadline_s=300) == 0
    tp, dp = (json.loads((Path(tmp) / n / "summary.json").read_text()) for n in ("tp", "dp"))
    assert tp["world_size"] == 4 and dp["world_size"] == 2
    assert tp["data_state"] == dp["data_state"]  # rank 0 drew as many rows as dp rank 0
    assert tp["end_loss"] < tp["start_loss"]  # it trained
    # what each rank draws (the trainer's rank_data, here in this process): both ranks of a
    # TP pair the batches of one data-parallel rank of 2, to the bit
    from fullshard.app.config import TrainConfig
    from fullshard.app.dims import ParallelDims
    from fullshard.app.train.build import rank_data
    from fullshard.app.train.trainer import read_text

    def first_batches(world: int, tp: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        cfg = TrainConfig.of(model=model, batch_size=8, seq_len=64, nproc=world, tp=tp)
        tokenizer, tokens = read_text(cfg)
        dims = ParallelDims(world, world, tp)
        data = [rank_data(cfg, dims, tokenizer, tokens, r).sampler for r in range(world)]
        return [s.next_batch() for s in data]

    dp_batches = first_batches(2, 1)
    for rank, (x, y) in enumerate(first_batches(4, 2)):
        assert torch.equal(x, dp_batches[rank // 2][0]) and torch.equal(y, dp_batches[rank // 2][1])


def _cli_plan_tp(rank: int, world: int, name: str) -> dict:
    # What `fullshard train --model NAME --tp 2` builds (app/models/tensor_parallel.py's plan
    # for the built-in GPT's or a Llama's blocks, then fully_shard over dp), against one
    # process on the whole batch, in float64
    from fullshard.app.models.gpt import build_model, lm_loss
    from fullshard.app.models.hf import build_hf_model
    from fullshard.app.models.tensor_parallel import apply_tensor_parallel

    torch.set_default_dtype(torch.float64)
    hf = name.removeprefix("hf:")
    ref = build_hf_model(hf, 64, seed=3) if hf != name else build_model(name, 64, seed=3)
    ref = ref.double()
    model = copy.deepcopy(ref)
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    blocks = [m for m in model.modules() if isinstance(m, model.unit_types)]
    apply_tensor_parallel(model, blocks, mesh["tp"])
    for block in blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    tokens = torch.randint(
        0, 64, (2, world // 2, 2, 17), generator=torch.Generator().manual_seed(5)
    )
    for step in range(2):
        lm_loss(model, tokens[step][rank // 2]).backward()
        lm_loss(ref, tokens[step].reshape(-1, 17)).backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    sharded_over_tp = [n for n, p in model.named_parameters() if len(p.placements) == 2]
    return {
        "diff": max((full[n] - p).abs().max().item() for n, p in ref.named_parameters()),
        "tp_params": len(sharded_over_tp),
    }


@pytest.mark.parametrize("name", ["tiny", "hf:llama-tiny"])
def test_the_cli_plans_match_one_process(four_ranks: list[dict], name: str) -> None:
    for r in case_results(four_ranks, ("cli_plan", name)):
        print(f"\n--tp 2 plan of {name} at 4 ranks, float64: {r}")
        # float64 parity, wider than the 1e-12 of the tests above: AdamW (lr 1e-2) divides each
        # update by sqrt(v) + 1e-8, so an entry whose gradient is near zero turns the split
        # sums' ~1e-16 rounding into more (measured after 2 steps: 5.6e-13 for the GPT's plan,
        # 1.7e-14 for Llama's); a wrong split or a stale gather moves weights by ~1e-2
        assert r["diff"] <= 1e-10, r
        assert r["tp_params"] > 0, r  # the plan really split the blocks' matrices


def _cuda_tp_mesh(rank: int, world: int) -> str:
    # a TP mesh of another device type than the data-parallel mesh: only a GPU machine can build
    # one, so the spec's mesh is stood in for by one that says "cuda"
    import dataclasses
    import types

    from fullshard.engine import collect

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    block = MLP()
    parallelize_module(block, mesh["tp"], {"up": ColwiseParallel()})
    real = collect.TPSpec.of

    def of(param: torch.Tensor) -> collect.TPSpec | None:
        spec = real(param)
        fake = types.SimpleNamespace(device_type="cuda", size=lambda: 2, ndim=1)
        return None if spec is None else dataclasses.replace(spec, mesh=fake)  # type: ignore[arg-type]

    collect.TPSpec.of = staticmethod(of)  # type: ignore[method-assign]
    try:
        fully_shard(block, mesh=mesh["dp"])
    except FullshardError as e:
        return str(e)
    finally:
        collect.TPSpec.of = staticmethod(real)  # type: ignore[method-assign]
    return ""


def test_a_tp_mesh_of_another_device_type_is_refused_on_every_rank(
    four_ranks: list[dict],
) -> None:
    for msg in case_results(four_ranks, "cuda_tp_mesh"):
        assert "up.weight" in msg and "'cuda' mesh" in msg and "init_device_mesh" in msg


def _int_reshard(rank: int, world: int) -> str:
    # dp 4 (so 2 is a smaller group than the shard group) and a TP mesh of one rank
    mesh = init_device_mesh("cpu", (4, 1), mesh_dim_names=("dp", "tp"))
    block = MLP()
    parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    try:
        fully_shard(block, mesh=mesh["dp"], reshard_after_forward=2)
    except FullshardError as e:
        return str(e)
    return ""


def test_an_int_reshard_after_forward_is_refused_for_tp_units(four_ranks: list[dict]) -> None:
    for msg in case_results(four_ranks, "int_reshard"):
        assert "tensor-parallel" in msg and "reshard_after_forward=2" in msg


def _cases(rank: int, world: int, folder: str) -> dict:
    """Every 4-rank case in turn: its result, or the traceback it raised. The refusals come
    last, after the runs that train (``_cuda_tp_mesh`` patches the engine, and restores it)."""
    cases: dict[Any, tuple[Callable[..., Any], tuple]] = {
        ("parity", 2, False): (_parity, (2, False)),
        ("parity", 2, True): (_parity, (2, True)),
        ("parity", 2, False, "other_dim"): (_parity, (2, False, True)),
        "save": (_save, (folder,)),
        ("cli_plan", "tiny"): (_cli_plan_tp, ("tiny",)),
        ("cli_plan", "hf:llama-tiny"): (_cli_plan_tp, ("hf:llama-tiny",)),
        "bad_mesh": (_bad_mesh, ()),
        "cuda_tp_mesh": (_cuda_tp_mesh, ()),
        "int_reshard": (_int_reshard, ()),
    }
    return run_cases(rank, world, cases)


@pytest.fixture(scope="module")
def checkpoint_folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("dp2_tp2"))


@pytest.fixture(scope="module")
def four_ranks(checkpoint_folder: str) -> list[dict]:
    return run_ranks(_cases, 4, checkpoint_folder, timeout_s=600)
