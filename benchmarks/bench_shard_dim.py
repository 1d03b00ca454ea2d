"""What sharding the 2-D weights on dim 1 (``shard_placement_fn``) costs a unit's copies.

One GPT-2 block's parameters (d=768 by default: qkv, proj, fc and fc2 weights, biases, norms)
laid out by ``FlatLayout`` for N ranks, with every weight ``Shard(0)`` or ``Shard(1)``
(NOTE [Flat unit layout]). Times, in one process with one thread (what a rank does), alternating
the variants round by round and taking medians:

- ``copy_out``: rank-major all-gather output -> parameter-major gathered storage (each forward
  and backward gather): one ``split_with_sizes_copy`` for dim-0 slots, one strided copy per
  Shard(1) slot;
- ``pack``: full gradients -> rank-major reduce-scatter input (each backward): ``_chunk_cat``
  for dim-0 slots, one strided copy per Shard(1) slot.

No collective runs: the collectives move the same bytes either way (Shard(1) has no padding).

Usage: ``python benchmarks/bench_shard_dim.py [--dim 768] [--worlds 2,4,8] [--rounds 15]
[--device cpu] [--out docs/bench/shard_dim.json]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from fullshard.shard.layout import FlatLayout


def block_shapes(d: int) -> list[torch.Size]:
    rows = [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (4 * d, d), (4 * d,)]
    return [torch.Size(s) for s in [*rows, (d, 4 * d), (d,)]]


def measure(d: int, world: int, rounds: int, device: torch.device) -> dict[str, float]:
    shapes = block_shapes(d)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fns: dict[str, Callable[[], object]] = {}
    for name, dims in (("shard0", None), ("shard1", [len(s) - 1 for s in shapes])):
        gather = FlatLayout(shapes, world, tail=5, dims=dims)  # a shard ends in its tag
        grad = FlatLayout(shapes, world, dims=dims)
        out = torch.randn(gather.total_numel, device=device)
        storage = torch.empty(gather.total_numel, device=device)
        grads = [torch.randn(s, device=device) for s in shapes]
        fns[f"{name} copy_out"] = lambda g=gather, o=out, st=storage: g.copy_out(o, st)
        fns[f"{name} pack"] = lambda g=grad, gs=grads: g.pack_for_reduce(
            gs, dtype=torch.float32, device=device
        )
    reps = 20 if device.type == "cuda" else 5
    times: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(rounds + 2):  # two warm-up rounds
        for k, fn in fns.items():
            sync()
            t = time.perf_counter()
            for _ in range(reps):
                fn()
            sync()
            if r >= 2:
                times[k].append((time.perf_counter() - t) / reps * 1e3)
    res = {f"{k} ms": statistics.median(v) for k, v in times.items()}
    for op in ("copy_out", "pack"):
        res[f"{op} shard1/shard0"] = res[f"shard1 {op} ms"] / res[f"shard0 {op} ms"]
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--worlds", default="2,4,8")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    torch.set_num_threads(1)
    device = torch.device(args.device)
    results = {}
    for world in (int(w) for w in args.worlds.split(",")):
        res = measure(args.dim, world, args.rounds, device)
        results[f"d{args.dim}_world{world}"] = res
        print(f"d={args.dim} world={world}: " + ", ".join(f"{k} {v:.3f}" for k, v in res.items()))
    if args.out:
        meta = {"dim": args.dim, "device": args.device, "threads": 1, "rounds": args.rounds}
        with open(args.out, "w") as f:
            json.dump({"config": meta, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
