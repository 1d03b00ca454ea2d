"""The multi-rank half of the GPU checks (``gpu_check.py``): checks that run inside N spawned ranks.

A *group* is one process group: a backend, a world size and a device (NCCL one GPU per rank;
gloo with every rank on ``cuda:0``; gloo on the CPU for ``--cpu``). Each rank runs the group's
selected checks in order and writes its verdicts to a JSON file; the driver merges the ranks (a
check passes when it passes on every rank). A check that raises ends the group on that rank
(the others then fail at their next collective, bounded by the timeouts), so one failure is
never reported as a hang.

Checks (names after the group's, e.g. ``gloo2.parity.full_shard``):

- ``parity.<strategy>``: 5 AdamW steps with clipping of a small residual MLP sharded by the
  strategy, against one unsharded model fed every rank's batch: max parameter difference;
- ``bf16``: 20 steps in bf16 (fp32 reduce) track the fp32 losses;
- ``offload``: CPU offload keeps shards on the CPU and matches the reference;
- ``checkpoint``: 3 steps, a sharded save (CheckpointManager, atomic commit), a fresh model and
  optimizer loaded from it, and one more step on both: the same parameters.
"""

from __future__ import annotations

import copy
import inspect
import json
import os
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from fullshard import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    clip_grad_norm_,
    get_state_dict,
    parallelize,
    set_state_dict,
)
from fullshard.app.models.gpt import lm_loss
from fullshard.checkpoint import CheckpointManager
from fullshard.comm import control
from fullshard.policies import STRATEGY_NAMES

STRATEGIES = STRATEGY_NAMES
TOLERANCE = 1e-4  # float32, TF32 off; GPU kernels may still sum in another order


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d + 3)  # odd sizes: shards need padding
        self.fc2 = nn.Linear(4 * d + 3, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Net(nn.Module):
    def __init__(self, vocab: int = 101, d: int = 64, n: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def strategies_for(world: int) -> list[str]:
    """The strategies that mean something at ``world`` ranks (hybrid: an even world >= 4)."""
    return [s for s in STRATEGIES if not s.startswith("hybrid") or (world >= 4 and world % 2 == 0)]


def check_names(world: int) -> list[str]:
    """Every check a group of ``world`` ranks runs, in order."""
    return [*(f"parity.{s}" for s in strategies_for(world)), "bf16", "offload", "checkpoint"]


def _data(world: int, steps: int, device: torch.device) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        [torch.randint(101, (4, 33), generator=g).to(device) for _ in range(world)]
        for _ in range(steps)
    ]


def _shard(model: nn.Module, strategy: str, device: torch.device, **kw: Any) -> nn.Module:
    # hybrid: 2 replicas of world/2 shards; the other strategies find the device themselves
    # (where the model is: a GPU shared over gloo included)
    world = control.world_size()
    mesh = None
    if strategy.startswith("hybrid"):
        names = ("replicate", "shard")
        mesh = init_device_mesh(device.type, (2, world // 2), mesh_dim_names=names)
    return parallelize(model, strategy=strategy, unit_types=(Block,), mesh=mesh, **kw)


def _full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    sd = model.state_dict()
    return {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in sd.items()}


def _train(
    rank: int, world: int, device: torch.device, strategy: str, steps: int, **kw: Any
) -> dict:
    torch.manual_seed(0)
    ref = Net().to(device)
    model = _shard(copy.deepcopy(ref), strategy, device, **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    data = _data(world, steps, device)
    losses = []
    for step in range(steps):
        loss = lm_loss(model, data[step][rank])
        loss.backward()
        clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        for r in range(world):
            lm_loss(ref, data[step][r]).backward()
        for p in ref.parameters():
            p.grad.div_(world)  # type: ignore[union-attr]
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        ref_opt.step()
        ref_opt.zero_grad()
        losses.append(loss.item())
    full = _full_params(model)
    diff = max((full[k].to(device) - v).abs().max().item() for k, v in ref.state_dict().items())
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else 0.0
    shard_device = str(next(model.parameters()).device)
    return {"diff": diff, "losses": losses, "shard_device": shard_device, "peak_mib": peak}


def _parity(strategy: str) -> Callable[[int, int, torch.device], tuple[bool, str]]:
    def check(rank: int, world: int, device: torch.device) -> tuple[bool, str]:
        r = _train(rank, world, device, strategy, 5)
        ok = r["diff"] < TOLERANCE and r["shard_device"].startswith(device.type)
        where = f"shards on {r['shard_device']}, peak {r['peak_mib']:.0f} MiB"
        return ok, f"max parameter difference {r['diff']:.2e} after 5 steps, {where}"

    return check


def _bf16(rank: int, world: int, device: torch.device) -> tuple[bool, str]:
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    a = _train(rank, world, device, "full_shard", 20)
    b = _train(rank, world, device, "full_shard", 20, mp_policy=policy)
    gap = max(abs(x - y) / x for x, y in zip(a["losses"][-5:], b["losses"][-5:], strict=True))
    return gap < 0.05, f"max relative loss gap to fp32 over the last 5 of 20 steps {gap:.4f}"


def _offload(rank: int, world: int, device: torch.device) -> tuple[bool, str]:
    r = _train(rank, world, device, "full_shard", 5, offload_policy=CPUOffloadPolicy())
    ok = r["diff"] < TOLERANCE and r["shard_device"] == "cpu"
    return ok, f"shards on {r['shard_device']}, max parameter difference {r['diff']:.2e}"


def _checkpoint(rank: int, world: int, device: torch.device) -> tuple[bool, str]:
    work_dir = os.environ["GPU_CHECK_WORK_DIR"]  # the group's folder, the same on every rank
    data = _data(world, 4, device)

    def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = _shard(Net().to(device), "full_shard", device)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(model: nn.Module, opt: torch.optim.Optimizer, batch: torch.Tensor) -> None:
        lm_loss(model, batch).backward()
        opt.step()
        opt.zero_grad()

    model, opt = build(0)
    for i in range(3):
        step(model, opt, data[i][rank])
    manager = CheckpointManager(os.path.join(work_dir, "checkpoints"), keep=1)
    model_sd, optim_sd = get_state_dict(model, opt)
    path = manager.save(3, {"model": model_sd, "optim": optim_sd})
    step(model, opt, data[3][rank])
    fresh, fresh_opt = build(1)  # other weights: only the load can make them equal
    model_sd, optim_sd = get_state_dict(fresh, fresh_opt)
    state = {"model": model_sd, "optim": optim_sd}
    manager.load(state)
    set_state_dict(
        fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    step(fresh, fresh_opt, data[3][rank])
    a, b = _full_params(model), _full_params(fresh)
    diff = max((a[k] - b[k]).abs().max().item() for k in a)
    committed = os.path.isfile(os.path.join(path, "manifest.json"))
    ok = diff < 1e-6 and committed
    return ok, f"{path}: committed {committed}; after load + 1 step, max difference {diff:.2e}"


def _check(name: str) -> Callable[[int, int, torch.device], tuple[bool, str]]:
    if name.startswith("parity."):
        return _parity(name.split(".", 1)[1])
    return {"bf16": _bf16, "offload": _offload, "checkpoint": _checkpoint}[name]


def _device(backend: str, device_type: str, rank: int) -> torch.device:
    if device_type == "cpu":
        return torch.device("cpu")
    # NCCL: one GPU per rank; gloo: every rank on cuda:0 (what NCCL refuses, gloo accepts)
    return torch.device("cuda", rank if backend == "nccl" else 0)


def run_group_rank(
    rank: int,
    world: int,
    backend: str,
    device_type: str,
    store_path: str,
    out_path: str,
    names: list[str],
    timeout_s: float,
    lookup: Callable[[str], Callable[..., tuple[bool, str]]] | None = None,
) -> None:
    """One rank of a group (the target of the driver's spawn): run ``names``, write verdicts.
    ``lookup``: the check of a name (default: this module's; ``gpu_checks_cuda`` passes its)."""
    os.environ["FULLSHARD_TIMEOUT_S"] = str(timeout_s)  # bounds every fullshard wait
    os.environ["GPU_CHECK_WORK_DIR"] = os.path.dirname(store_path)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    device = _device(backend, device_type, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = False  # parity in float32, not TF32
        torch.backends.cudnn.allow_tf32 = False
    else:
        torch.set_num_threads(1)
    extra: dict[str, Any] = {}
    if backend == "nccl" and "device_id" in inspect.signature(dist.init_process_group).parameters:
        extra["device_id"] = device
    verdicts: list[dict[str, Any]] = []
    failed = False
    try:
        dist.init_process_group(
            backend,
            store=dist.FileStore(store_path, world),
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=timeout_s),
            **extra,
        )
        for name in names:
            t0 = time.perf_counter()
            try:
                ok, info = (lookup or _check)(name)(rank, world, device)
            except Exception:
                ok, failed = False, True
                last = traceback.format_exc().strip().splitlines()[-1]  # "Type: message"
                info = f"raised {last[:300]}"
            verdicts.append(
                {"name": name, "ok": ok, "info": info, "s": round(time.perf_counter() - t0, 1)}
            )
            _write(out_path, verdicts)
            if failed:
                break  # the ranks may be out of step now: the rest of the group is not run
        if not failed:
            control.host_barrier(what="gpu_check leave barrier")  # NOTE [Leaving together]
    finally:
        _write(out_path, verdicts)
        if dist.is_initialized():
            dist.destroy_process_group()


def _write(path: str, verdicts: list[dict[str, Any]]) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(verdicts, f)
    os.replace(path + ".tmp", path)
