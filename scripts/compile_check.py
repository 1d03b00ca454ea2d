"""torch.compile over a sharded model: graph breaks, compiled graphs and steps/s, eager vs compiled.

Three variants of the same FULL_SHARD model (same initial weights, same batches), each its own
copy, trained side by side on every rank:

- ``eager``: no compilation;
- ``blocks``: each unit's block compiled on its own (``block.compile()``);
- ``whole``: ``torch.compile(model)`` on the whole model, Dynamo's default dynamic setting.

(and, counted only, ``fsdp2 whole``: torch's FSDP2 under ``torch.compile(model)``.)

First, for each compiled variant alone (``torch._dynamo.reset()`` before it), two training steps
count what Dynamo did: graph breaks (``counters["graph_break"]``), graphs compiled, the torch
calls captured in them, and the frames it gave up on (ran eagerly: a graph break inside a loop
cannot be resumed, so the whole frame falls back and its callees are compiled on their own).
Then, after ``--warmup`` untimed steps, ``--rounds`` rounds alternate the variants (A B C A B C
...); each step (forward, backward, AdamW step) is timed on rank 0 between barriers; the figure
is the median, as steps/s. The largest difference of each variant's loss from the eager loss
over the timed steps says the variants trained alike.

``--traced-hooks`` measures the engine as it was before NOTE [Hooks run outside torch.compile]
(the forward hooks traced by Dynamo); it only counts. With the default dynamic setting
``torch.compile(model)`` then fails with an InductorError on ``resize_storage_bytes_`` (shown
as the variant's error); ``--dynamic false`` runs it.

    python scripts/compile_check.py --model small --nproc 2 --out docs/compile_small.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from typing import Any

import torch
import torch._dynamo
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch._dynamo.utils import counters

VOCAB = 256
COMPILED = ("blocks", "whole")
COUNTED = (*COMPILED, "fsdp2 whole")  # torch's FSDP2 under torch.compile(model), for reference


def _build(args: argparse.Namespace, variant: str) -> tuple[nn.Module, nn.Module]:
    """(the module to call, the sharded model) of one variant."""
    from fullshard.app.config import ParallelismConfig
    from fullshard.app.models.gpt import build_model, unit_types_of
    from fullshard.app.models.wrap import shard_model

    model = build_model(args.model, VOCAB, seed=0, device="cpu")
    types = unit_types_of(model)
    if variant.startswith("fsdp2"):
        from torch.distributed.fsdp import fully_shard

        for m in model.modules():
            if isinstance(m, types):
                fully_shard(m)
        fully_shard(model)
    else:
        shard_model(model, ParallelismConfig(), types)
    dynamic = None if args.dynamic == "default" else False
    if variant == "blocks":
        for m in model.modules():
            if isinstance(m, types):
                m.compile(dynamic=dynamic)
    if variant.endswith("whole"):
        return torch.compile(model, dynamic=dynamic), model
    return model, model


def _step(run: nn.Module, opt: torch.optim.Optimizer, batch: torch.Tensor) -> float:
    from fullshard.app.models.gpt import lm_loss

    loss = lm_loss(run, batch)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return float(loss.detach())


def _reason(key: str) -> str:
    """The first line of a graph-break reason, without Dynamo's boilerplate."""
    return key.strip().splitlines()[0][:120]


def _count(args: argparse.Namespace, variant: str, batches: list[torch.Tensor]) -> dict[str, Any]:
    """What Dynamo did over two steps of ``variant``, compiled from scratch."""
    torch._dynamo.reset()
    counters.clear()
    run, model = _build(args, variant)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    error = ""
    try:
        for batch in batches[:2]:
            _step(run, opt, batch)
    except Exception as e:  # the --traced-hooks failure this script documents
        error = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160]}"
    reasons: Counter[str] = Counter()
    for key, n in counters["graph_break"].items():
        reasons[_reason(key)] += n
    frames = counters["frames"]
    return {
        "graph_breaks": sum(counters["graph_break"].values()),
        "graphs": counters["stats"]["unique_graphs"],
        "frames_given_up": frames["total"] - frames["ok"],
        "ops_in_graphs": counters["stats"]["calls_captured"],
        "break_reasons": dict(reasons.most_common(8)),
        "error": error,
    }


def _rank(rank: int, world: int, store: str, args: argparse.Namespace, result: str) -> None:
    from fullshard.app.commands.bench_variants import make_batches
    from fullshard.engine.hooks import FSDPState

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    if args.traced_hooks:  # the hooks as they were: plain functions Dynamo traces into
        for name in ("pre_forward", "post_forward"):
            setattr(FSDPState, name, getattr(FSDPState, name).__wrapped__)
    n = args.warmup + args.rounds
    batches = make_batches(args.batch_size, args.seq_len, rank, max(n, 2), torch.device("cpu"))
    counts = {v: _count(args, v, batches) for v in COUNTED}
    out: dict[str, Any] = {"dynamo": counts}
    if not args.traced_hooks:
        torch._dynamo.reset()
        variants = {v: _build(args, v) for v in ("eager", *COMPILED)}
        opts = {v: torch.optim.AdamW(m.parameters(), lr=1e-4) for v, (_, m) in variants.items()}
        times: dict[str, list[float]] = {v: [] for v in variants}
        losses: dict[str, list[float]] = {v: [] for v in variants}
        for r in range(n):
            for v, (run, _) in variants.items():
                dist.barrier()
                t0 = time.perf_counter()
                loss = _step(run, opts[v], batches[r])
                dist.barrier()
                if r >= args.warmup:
                    times[v].append(time.perf_counter() - t0)
                    losses[v].append(loss)
        out["median_step_s"] = {v: statistics.median(t) for v, t in times.items()}
        out["max_loss_diff_vs_eager"] = {
            v: max(abs(a - b) for a, b in zip(losses[v], losses["eager"], strict=True))
            for v in variants
        }
    if rank == 0:
        with open(result, "w") as f:
            json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small", help="built-in model (default: small)")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank (default: 1)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--dynamic", choices=("default", "false"), default="default")
    ap.add_argument("--traced-hooks", action="store_true", help="count the old engine's breaks")
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
    res.update(
        model=args.model,
        nproc=args.nproc,
        threads=args.threads,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        rounds=args.rounds,
        dynamic=args.dynamic,
        traced_hooks=args.traced_hooks,
        torch=torch.__version__,
    )
    hooks = "traced (before)" if args.traced_hooks else "outside the graph"
    print(
        f"torch.compile, {args.model}, FULL_SHARD, {args.nproc} ranks x {args.threads} thread, "
        f"batch {args.batch_size} x {args.seq_len}, dynamic={args.dynamic}, hooks {hooks}"
    )
    head = ("variant", "breaks", "graphs", "ops in graphs", "frames given up")
    print("  {:11s} {:>6s} {:>6s} {:>13s} {:>15s}".format(*head))
    for v, c in res["dynamo"].items():
        print(
            f"  {v:11s} {c['graph_breaks']:6d} {c['graphs']:6d} {c['ops_in_graphs']:13d} "
            f"{c['frames_given_up']:15d}  {c['error']}"
        )
        for reason, k in c["break_reasons"].items():
            print(f"      {k:3d} x {reason}")
    if "median_step_s" in res:
        med = res["median_step_s"]
        print(f"  median of {args.rounds} alternating rounds (rank 0):")
        for v, s in med.items():
            print(
                f"  {v:11s} {1 / s:7.2f} steps/s  {1e3 * s:8.1f} ms/step  "
                f"({med['eager'] / s:.2f}x eager)  max |loss - eager| "
                f"{res['max_loss_diff_vs_eager'][v]:.1e}"
            )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
