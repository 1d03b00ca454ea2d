"""Optimizer-step time over sharded parameters: DTensor parameters against plain local shards.

Issue 12 made fullshard's sharded parameters DTensors (as FSDP2's). A torch optimizer then
dispatches every op through DTensor. This measures what that costs, side by side in one run,
2 gloo ranks on CPU, one thread each:

- ``fullshard``: ``torch.optim.AdamW(model.parameters())`` over fullshard's DTensor parameters;
- ``plain shards``: the same optimizer over plain tensors viewing the same local shards (what
  fullshard's parameters were before: the cost without DTensor dispatch);
- ``fsdp2``: torch FSDP2's DTensor parameters.

Each with ``foreach`` (torch's default) and ``fused``. Rounds alternate the variants (A B C A B C
...); the figure is the median step time of rank 0, in ms. Writes ``--out`` (JSON) and prints a
table.

    python benchmarks/bench_optim.py --model small --rounds 30 --out docs/optim_step_small.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from fullshard.engine.local_step import LOCAL_STEPS

VOCAB = 256


def _variants(model_name: str) -> dict[str, list[nn.Parameter]]:
    """Parameters with gradients, per variant."""
    from torch.distributed.fsdp import fully_shard as fsdp2_shard

    from fullshard import fully_shard
    from fullshard.app.models.gpt import build_model, unit_types_of

    out: dict[str, list[nn.Parameter]] = {}
    for name, shard in (("fullshard", fully_shard), ("fsdp2", fsdp2_shard)):
        model = build_model(model_name, VOCAB, seed=0, device="cpu")
        units = unit_types_of(model)
        for m in [m for m in model.modules() if m is not model and isinstance(m, units)]:
            shard(m)
        shard(model)
        x = torch.randint(VOCAB, (2, 16))
        out_ = model(x)
        logits = out_ if isinstance(out_, torch.Tensor) else out_.logits
        logits.float().square().mean().backward()
        out[name] = list(model.parameters())
    plain = []
    for p in out["fullshard"]:
        q = nn.Parameter(p._local_tensor)  # type: ignore[attr-defined]  # the same memory
        q.grad = p.grad._local_tensor  # type: ignore[union-attr]
        plain.append(q)
    out["plain shards"] = plain
    return out


def _rank(rank: int, world: int, store: str, args: argparse.Namespace, result: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    params = _variants(args.model)
    opts: dict[str, torch.optim.Optimizer] = {}
    for name, ps in params.items():
        for mode in ("foreach", "fused"):
            kw = {"foreach": True} if mode == "foreach" else {"fused": True}
            opts[f"{name} {mode}"] = torch.optim.AdamW(ps, lr=1e-4, **kw)
            if name == "fullshard":  # the same parameters, stepped as DTensors (hook off)
                opts[f"fullshard DTensor step {mode}"] = torch.optim.AdamW(ps, lr=1e-4, **kw)
    times: dict[str, list[float]] = {k: [] for k in opts}
    for r in range(args.warmup + args.rounds):
        for key, opt in opts.items():
            LOCAL_STEPS.enabled = "DTensor step" not in key
            dist.barrier()
            t0 = time.perf_counter()
            opt.step()
            if r >= args.warmup:
                times[key].append(time.perf_counter() - t0)
    if rank == 0:
        med = {k: 1e3 * statistics.median(v) for k, v in times.items()}
        n_params = len(params["fullshard"])
        numel = sum(p._local_tensor.numel() for p in params["fullshard"])  # type: ignore[attr-defined]
        with open(result, "w") as f:
            json.dump({"median_ms": med, "params": n_params, "local_numel": numel}, f)
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small", help="built-in model (default: small)")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--out", default="", help="JSON file for the figures")
    args = ap.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.json")
        mp.spawn(
            _rank, args=(args.nproc, os.path.join(tmp, "store"), args, result), nprocs=args.nproc
        )
        with open(result) as f:
            res: dict[str, Any] = json.load(f)
    res.update(model=args.model, nproc=args.nproc, rounds=args.rounds, torch=torch.__version__)
    med = res["median_ms"]
    base = med["plain shards foreach"]
    print(
        f"AdamW step, {args.model}: {res['params']} parameters, {res['local_numel']:,} elements "
        f"per rank, {args.nproc} ranks, median of {args.rounds} alternating rounds"
    )
    for key, ms in med.items():
        print(f"  {key:24s} {ms:8.2f} ms  ({ms / base:.2f}x plain shards foreach)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
