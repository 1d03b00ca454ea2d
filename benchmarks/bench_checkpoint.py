"""Checkpoint save/load time and size for a built-in model (the figures in the issue notes).

Usage: ``python benchmarks/bench_checkpoint.py [--model demo] [--nproc 2] [--repeats 3]``

Each rank (gloo, 1 thread) builds the model, shards it (FULL_SHARD), takes one AdamW step (so
the optimizer state exists), then times, as medians over ``--repeats``: a synchronous save
(write + atomic commit + manifest), the time an async save blocks training, the async save's
completion, a verified load, and the checkpoint's size on disk. Also writes JSON next to
``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fullshard import get_state_dict, set_state_dict
from fullshard.app.config import ParallelismConfig
from fullshard.app.models.gpt import build_model, count_params, lm_loss, unit_types_of
from fullshard.app.models.wrap import shard_model
from fullshard.checkpoint import CheckpointManager


def _size(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))


def _worker(rank: int, world: int, tmp: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", store=dist.FileStore(os.path.join(tmp, "store"), world), rank=rank, world_size=world
    )
    model = build_model(args.model, 256, seed=0)
    params = count_params(model)
    shard_model(model, ParallelismConfig(), unit_types_of(model))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(256, (2, 65))
    lm_loss(model, x).backward()
    opt.step()
    times: dict[str, list[float]] = {
        "save_s": [],
        "async_block_s": [],
        "async_total_s": [],
        "load_s": [],
    }
    size = 0
    for i in range(args.repeats):
        root = os.path.join(tmp, f"sync{i}")
        mgr = CheckpointManager(root)
        dist.barrier()
        t0 = time.perf_counter()
        msd, osd = get_state_dict(model, opt)
        folder = mgr.save(1, {"model": msd, "optim": osd})
        times["save_s"].append(time.perf_counter() - t0)
        size = _size(folder)
        amgr = CheckpointManager(os.path.join(tmp, f"async{i}"), async_save=True)
        dist.barrier()
        t0 = time.perf_counter()
        msd, osd = get_state_dict(model, opt)
        amgr.save(1, {"model": msd, "optim": osd})
        times["async_block_s"].append(time.perf_counter() - t0)
        amgr.wait()
        times["async_total_s"].append(time.perf_counter() - t0)
        dist.barrier()
        t0 = time.perf_counter()
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        mgr.load(state)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        times["load_s"].append(time.perf_counter() - t0)
    if rank == 0:
        res = {
            "model": args.model,
            "params": params,
            "world": world,
            "checkpoint_mib": size / 2**20,
            **{k: statistics.median(v) for k, v in times.items()},
        }
        with open(os.path.join(tmp, "res.json"), "w") as f:
            json.dump(res, f)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    tmp = tempfile.mkdtemp()
    try:
        mp.spawn(_worker, args=(args.nproc, tmp, args), nprocs=args.nproc)
        with open(os.path.join(tmp, "res.json")) as f:
            res = json.load(f)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(
        f"{res['model']} ({res['params'] / 1e6:.2f}M params) on {res['world']} ranks: checkpoint "
        f"{res['checkpoint_mib']:.1f} MiB; save {res['save_s'] * 1e3:.0f} ms; async save blocks "
        f"{res['async_block_s'] * 1e3:.0f} ms (done after {res['async_total_s'] * 1e3:.0f} ms); "
        f"load {res['load_s'] * 1e3:.0f} ms"
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
