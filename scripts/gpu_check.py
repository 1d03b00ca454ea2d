"""GPU check: the engine and every strategy on CUDA with NCCL, mixed precision and offload included.

One command, a few minutes:  ``python scripts/gpu_check.py``  (world size = visible GPUs).
``--cpu`` runs the very same checks on gloo/CPU (2 ranks) so the script itself is tested where no
GPU exists. Prints one line per check and exits non-zero if any check fails.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from fullshard import CPUOffloadPolicy, MixedPrecisionPolicy, clip_grad_norm_, parallelize


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d + 3)
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


def _loss(model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    logits = model(idx[:, :-1]).float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1))


def _train(
    rank: int, world: int, device: torch.device, strategy: str, steps: int, **kw: object
) -> dict:
    torch.manual_seed(0)
    ref = Net().to(device)
    mesh = None
    if strategy.startswith("hybrid"):
        mesh = init_device_mesh(device.type, (2, world // 2), mesh_dim_names=("replicate", "shard"))
    model = parallelize(copy.deepcopy(ref), strategy=strategy, unit_types=(Block,), mesh=mesh, **kw)  # type: ignore[arg-type]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    data = [
        [torch.randint(101, (4, 33), generator=g).to(device) for _ in range(world)]
        for _ in range(steps)
    ]
    losses = []
    for step in range(steps):
        loss = _loss(model, data[step][rank])
        loss.backward()
        clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        for r in range(world):
            _loss(ref, data[step][r]).backward()
        for p in ref.parameters():
            p.grad.div_(world)  # type: ignore[union-attr]
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        ref_opt.step()
        ref_opt.zero_grad()
        losses.append(loss.item())
    sd = model.state_dict()
    full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in sd.items()}
    diff = max((full[k].to(device) - v).abs().max().item() for k, v in ref.state_dict().items())
    return {
        "diff": diff,
        "losses": losses,
        "shard_device": str(next(model.parameters()).device),
        "peak_mib": torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else 0.0,
    }


def _checks(rank: int, world: int, device: torch.device) -> list[tuple[str, bool, str]]:
    out: list[tuple[str, bool, str]] = []
    tol = 1e-4  # float32 on GPU: kernels may reorder sums
    strategies = ["full_shard", "shard_grad_op", "no_shard"]
    if world >= 4 and world % 2 == 0:
        strategies += ["hybrid_shard", "hybrid_shard_zero2"]
    for s in strategies:
        r = _train(rank, world, device, s, 5)
        out.append(
            (
                f"parity {s}",
                r["diff"] < tol,
                f"max param diff {r['diff']:.2e}, peak {r['peak_mib']:.0f} MiB",
            )
        )
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    a = _train(rank, world, device, "full_shard", 20)
    b = _train(rank, world, device, "full_shard", 20, mp_policy=bf16)
    gap = max(abs(x - y) / x for x, y in zip(a["losses"][-5:], b["losses"][-5:], strict=True))
    out.append(
        ("bf16 tracks fp32", gap < 0.05, f"max relative loss gap over last 5 of 20 steps {gap:.4f}")
    )
    off = _train(rank, world, device, "full_shard", 5, offload_policy=CPUOffloadPolicy())
    ok = off["diff"] < tol and off["shard_device"] == "cpu"
    out.append(
        ("cpu offload", ok, f"shards on {off['shard_device']}, max param diff {off['diff']:.2e}")
    )
    return out


def _worker(rank: int, world: int, store: str, cpu: bool, result: str) -> None:
    backend = "gloo" if cpu else "nccl"
    device = torch.device("cpu") if cpu else torch.device("cuda", rank)
    if not cpu:
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    else:
        torch.set_num_threads(1)
    dist.init_process_group(
        backend, store=dist.FileStore(store, world), rank=rank, world_size=world
    )
    try:
        res = _checks(rank, world, device)
    except Exception:
        res = [("exception", False, traceback.format_exc())]
    if rank == 0:
        with open(result, "w") as f:
            for name, ok, info in res:
                f.write(f"{'PASS' if ok else 'FAIL'}  {name}: {info}\n")
    dist.barrier()  # leave together: tearing down gloo while a peer still works can abort
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="run the same checks on gloo/CPU, 2 ranks")
    ap.add_argument("--nproc", type=int, default=0, help="ranks (default: GPUs, or 2 with --cpu)")
    args = ap.parse_args()
    if not args.cpu and not torch.cuda.is_available():
        print("no CUDA GPU visible: nothing to check (use --cpu for a dry run on gloo)")
        return 0
    world = args.nproc or (2 if args.cpu else torch.cuda.device_count())
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.txt")
        mp.spawn(_worker, args=(world, os.path.join(tmp, "store"), args.cpu, result), nprocs=world)
        with open(result) as f:
            text = f.read()
    device = "cpu (gloo)" if args.cpu else f"{torch.cuda.get_device_name(0)} x{world} (nccl)"
    print(f"fullshard GPU check on {device}, world size {world}, torch {torch.__version__}")
    print(text, end="")
    return 0 if "FAIL" not in text else 1


if __name__ == "__main__":
    sys.exit(main())
