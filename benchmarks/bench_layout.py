"""Shard-layout micro-benchmark behind docs/design.md: what one unit's gather costs per layout.

Runs 2 gloo ranks (1 thread each) on one transformer block's parameters and times, alternating
A B C D ... and taking medians:

- ``flat-views`` (fullshard): per-parameter dim-0 shards as views of one flat buffer; one
  all-gather with no copy-in, then one ``split_with_sizes_copy`` into the parameters.
- ``flat-concat`` (FSDP1-style): the unit flattened and split into contiguous 1/N slices; one
  all-gather straight into the buffer the parameters view (no copy at all), but shards are flat
  slices, not rows, so optimizer state and state dicts need communication to be per-parameter.
- ``copy-in`` (FSDP2-style): per-parameter shards as separate tensors; copy them into a send
  buffer, one all-gather, copy out.
- ``per-param``: one all-gather per parameter (no copies, many small collectives).

Usage: ``python benchmarks/bench_layout.py [--dim 256] [--iters 30] [--out docs/layout_bench.json]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fullshard.shard.layout import FlatLayout, chunk_of


def block_shapes(d: int) -> list[torch.Size]:
    return [
        torch.Size(s)
        for s in [
            (d,),
            (d,),
            (3 * d, d),
            (3 * d,),
            (d, d),
            (d,),
            (d,),
            (d,),
            (4 * d, d),
            (4 * d,),
            (d, 4 * d),
            (d,),
        ]
    ]


def _worker(rank: int, world: int, store: str, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    shapes = block_shapes(args.dim)
    fulls = [torch.randn(s) for s in shapes]
    layout = FlatLayout(shapes, world)
    flat = torch.zeros(layout.shard_numel)
    layout.pack_shard(fulls, rank, flat)
    storage = torch.empty(layout.total_numel)
    own = [chunk_of(f, world, rank).clone() for f in fulls]
    numel = sum(s.numel() for s in shapes)
    per = -(-numel // world)
    concat_shard = torch.zeros(per)
    concat_full = torch.empty(per * world)

    # Every case frees and re-allocates its gathered memory, as FSDP does between uses.
    def refresh(t: torch.Tensor) -> None:
        nbytes = t.untyped_storage().nbytes()
        t.untyped_storage().resize_(0)
        t.untyped_storage().resize_(nbytes)

    def flat_views() -> None:
        out_buf = torch.empty(layout.total_numel)
        dist.all_gather_into_tensor(out_buf, flat)
        refresh(storage)
        layout.copy_out(out_buf, storage)

    def flat_concat() -> None:
        refresh(concat_full)
        dist.all_gather_into_tensor(concat_full, concat_shard)

    def copy_in() -> None:
        send = torch.zeros(layout.shard_numel)
        for i, t in enumerate(own):
            layout.shard_view(send, i, rank).copy_(t)
        out_buf = torch.empty(layout.total_numel)
        dist.all_gather_into_tensor(out_buf, send)
        refresh(storage)
        layout.copy_out(out_buf, storage)

    def per_param() -> None:
        for i, s in enumerate(layout.slots):
            send = torch.zeros(s.padded_numel)
            send[: own[i].numel()] = own[i].reshape(-1)
            recv = torch.empty(s.padded_numel * world)
            dist.all_gather_into_tensor(recv, send)

    cases = {
        "flat-views": flat_views,
        "flat-concat": flat_concat,
        "copy-in": copy_in,
        "per-param": per_param,
    }
    times: dict[str, list[float]] = {k: [] for k in cases}
    for fn in cases.values():
        fn()  # warm-up
    for _ in range(args.iters):
        for name, fn in cases.items():  # alternate A B C D so drift hits every case alike
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    if rank == 0:
        res = {
            "world": world,
            "dim": args.dim,
            "unit_params": numel,
            "unit_mib": numel * 4 / 2**20,
            "median_ms": {k: 1e3 * statistics.median(v) for k, v in times.items()},
            "collectives_per_gather": {
                "flat-views": 1,
                "flat-concat": 1,
                "copy-in": 1,
                "per-param": len(shapes),
            },
        }
        with open(out, "w") as f:
            json.dump(res, f, indent=2)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--out", default="docs/layout_bench.json")
    args = ap.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with tempfile.TemporaryDirectory() as tmp:
        res_path = os.path.join(tmp, "res.json")
        mp.spawn(
            _worker,
            args=(args.world, os.path.join(tmp, "store"), args, res_path),
            nprocs=args.world,
        )
        with open(res_path) as f:
            res = json.load(f)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=2)
    base = res["median_ms"]["flat-concat"]
    print(f"unit: {res['unit_params']:,} params ({res['unit_mib']:.2f} MiB), {res['world']} ranks")
    print(f"{'layout':<12} {'median ms':>10} {'vs flat-concat':>15} {'collectives':>12}")
    for name, ms in res["median_ms"].items():
        print(
            f"{name:<12} {ms:>10.3f} {ms / base:>14.2f}x {res['collectives_per_gather'][name]:>12}"
        )


if __name__ == "__main__":
    main()
