"""Muon over sharded parameters, side by side (issue 42): one run per world size, gloo on CPU.

Variants, each on the same seeded model (``--units`` bias-free ``--dim`` x ``--dim`` linears,
each its own unit, ``--rows`` rows of data per rank), in alternating rounds (A B C ... A B C):

- ``fullshard.optim.Muon``: each matrix's Newton–Schulz on one owner rank (NOTE [Matrices on
  owners]);
- ``torch.optim.Muon (fullshard)``: torch's Muon over fullshard's DTensor parameters;
- ``torch.optim.Muon (FSDP2)``: torch's Muon over torch FSDP2's DTensor parameters;
- ``AdamW (fullshard)`` and ``AdamW (FSDP2)``: torch's AdamW over the same parameters.

Per variant: the median over rounds of the slowest rank's optimizer step (the ranks start it
together, after a barrier) and whole step (forward, backward, barrier, step), in ms; what one step's collectives move (counted at the c10d
dispatcher: calls and bytes by kind, the bytes of each op's largest buffer; DTensor's own
collectives by ``CommDebugMode``, calls only), what the
exchange sends off each rank, the Newton–Schulz FLOPs each rank runs, and the optimizer state
per rank; for fullshard's Muon, the CPU time of a step and its wall time in Newton–Schulz and
in the exchange (waits included). One unsharded process's Muon step on the same model is timed in the same rounds (rank
0 alone, the other ranks waiting: "x 1-proc" divides by it), and before the ranks start in this
process (one thread, as each rank). Prints a table and writes ``--out`` (JSON).

    python benchmarks/bench_muon.py --nproc 2 4 --out docs/muon_bench.json
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

VARIANTS = (
    "fullshard.optim.Muon",
    "torch.optim.Muon (fullshard)",
    "torch.optim.Muon (FSDP2)",
    "AdamW (fullshard)",
    "AdamW (FSDP2)",
)
LR = 0.02


def _model(units: int, dim: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(dim, dim, bias=False) for _ in range(units)])


def _optimizer(variant: str, model: nn.Module) -> torch.optim.Optimizer:
    from fullshard.optim import Muon

    if variant.startswith("fullshard.optim.Muon"):
        return Muon(model.parameters(), lr=LR)
    if variant.startswith("torch.optim.Muon"):
        return torch.optim.Muon(model.parameters(), lr=LR)
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def _timed(fn: Any, rounds: int, warmup: int) -> float:
    times = []
    for r in range(warmup + rounds):
        t0 = time.perf_counter()
        fn()
        if r >= warmup:
            times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def one_process(args: argparse.Namespace) -> dict[str, float]:
    """One unsharded process's optimizer steps (and whole step on ``--rows`` rows)."""
    torch.set_num_threads(1)
    out = {}
    x = torch.randn(args.rows, args.dim)
    for name in ("torch.optim.Muon", "AdamW"):
        model = _model(args.units, args.dim)
        opt = _optimizer(name, model)
        model(x).square().mean().backward()
        out[f"{name} step ms"] = _timed(opt.step, args.rounds, args.warmup)

        def whole(model: nn.Module = model, opt: torch.optim.Optimizer = opt) -> None:
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()

        out[f"{name} whole step ms"] = _timed(whole, max(3, args.rounds // 3), 1)
    return out


def _instrument(opt: torch.optim.Optimizer) -> dict[str, float]:
    """Time ``opt``'s Newton–Schulz (the owner's work) and its two all-to-alls (each from
    issue to landing: the waits for the other ranks included) in every step, into the dict
    returned (seconds; the caller zeroes it before a step)."""
    from fullshard.optim.exchange import Exchange

    parts = {"newton_schulz": 0.0, "exchange": 0.0}

    def timed(key: str, fn: Any) -> Any:
        def run(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                parts[key] += time.perf_counter() - t0

        return run

    whole = opt.whole  # type: ignore[attr-defined]
    opt.whole = timed("newton_schulz", whole)  # type: ignore[attr-defined]
    Exchange._route = timed("exchange", Exchange._route)  # type: ignore[method-assign]
    return parts


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    from torch.distributed.tensor import DTensor

    total = 0
    for state in opt.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                t = v._local_tensor if isinstance(v, DTensor) else v
                total += t.numel() * t.element_size()
    return total


def _rank(rank: int, world: int, store: str, args: argparse.Namespace, result: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    from torch.distributed.fsdp import fully_shard as fsdp2_shard
    from torch.distributed.tensor.debug import CommDebugMode

    from fullshard import fully_shard
    from fullshard.observe.c10d_counter import C10dCounter
    from fullshard.optim.exchange import ns_flops

    x = torch.randn(args.rows, args.dim, generator=torch.Generator().manual_seed(rank))
    models: dict[str, nn.Module] = {}
    opts: dict[str, torch.optim.Optimizer] = {}
    for variant in VARIANTS:
        model = _model(args.units, args.dim)
        shard = fsdp2_shard if "FSDP2" in variant else fully_shard
        for layer in model:
            shard(layer)
        shard(model)
        models[variant], opts[variant] = model, _optimizer(variant, model)
    # one unsharded process's Muon step, in the same rounds: rank 0 alone while the others wait
    alone = _model(args.units, args.dim)
    alone_opt = _optimizer("torch.optim.Muon", alone)
    for p in alone.parameters():
        p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(1))
    alone_ms: list[float] = []
    alone_cpu: list[float] = []
    opt_ms: dict[str, list[float]] = {v: [] for v in VARIANTS}
    opt_cpu: dict[str, list[float]] = {v: [] for v in VARIANTS}
    whole_ms: dict[str, list[float]] = {v: [] for v in VARIANTS}
    parts = _instrument(opts["fullshard.optim.Muon"])
    split: dict[str, list[float]] = {k: [] for k in parts}
    for r in range(args.warmup + args.rounds):
        for variant in VARIANTS:
            model, opt = models[variant], opts[variant]
            dist.barrier()
            t0 = time.perf_counter()
            model(x).square().mean().backward()
            # the ranks start the step together: its time is its own, not the backward's skew
            dist.barrier()
            for k in parts:
                parts[k] = 0.0
            c1, t1 = time.process_time(), time.perf_counter()
            opt.step()
            t2, c2 = time.perf_counter(), time.process_time()
            opt.zero_grad()
            if r >= args.warmup:
                opt_ms[variant].append(1e3 * (t2 - t1))
                opt_cpu[variant].append(1e3 * (c2 - c1))
                whole_ms[variant].append(1e3 * (t2 - t0))
                if variant == "fullshard.optim.Muon":
                    for k, v in parts.items():
                        split[k].append(1e3 * v)
        dist.barrier()
        if rank == 0:
            c0, t0 = time.process_time(), time.perf_counter()
            alone_opt.step()
            if r >= args.warmup:
                alone_ms.append(1e3 * (time.perf_counter() - t0))
                alone_cpu.append(1e3 * (time.process_time() - c0))
        dist.barrier()
    figures: dict[str, dict[str, Any]] = {}
    for variant in VARIANTS:
        model, opt = models[variant], opts[variant]
        with C10dCounter(known_only=True) as fb:
            model(x).square().mean().backward()
        with CommDebugMode() as dtensor, C10dCounter() as step:
            opt.step()
        opt.zero_grad()
        fig: dict[str, Any] = {
            "step_calls": dict(step.calls),
            "step_bytes": dict(step.bytes),
            # DTensor's own collectives (functional: the c10d counter does not see them)
            "step_dtensor_calls": {str(k): v for k, v in dtensor.get_comm_counts().items()},
            "forward_backward_bytes": dict(fb.bytes),
            "state_bytes": _state_bytes(opt),
        }
        plans = getattr(opt, "_plans", None)
        if plans:
            (plan,) = plans.values()
            shapes = [tuple(p.shape) for p in model.parameters()]
            out_elems, back_elems = plan.sent()
            fig.update(
                owned=plan.owned,
                ns_flops=sum(ns_flops(shapes[i], 5) for i in plan.owned),
                exchange_sent_bytes=2 * (out_elems + back_elems),  # bf16 both ways
            )
        figures[variant] = fig
    figures["fullshard.optim.Muon"]["step_parts_ms"] = {
        k: statistics.median(v) for k, v in split.items()
    }
    for variant in VARIANTS:
        figures[variant]["opt_step_cpu_ms"] = statistics.median(opt_cpu[variant])
    mine = {
        "opt_ms": opt_ms,
        "whole_ms": whole_ms,
        "figures": figures,
        "alone_ms": alone_ms,
        "alone_cpu_ms": alone_cpu,
    }
    every = [None] * world
    dist.all_gather_object(every, mine)
    if rank == 0:
        with open(result, "w") as f:
            json.dump(every, f)
    dist.barrier()
    dist.destroy_process_group()


def _summary(every: list[dict[str, Any]]) -> dict[str, Any]:
    """Per variant: the medians of the slowest rank's times, and each rank's figures; the
    unsharded process's step, timed in the same rounds."""
    out: dict[str, Any] = {
        "one process in the rounds": statistics.median(every[0]["alone_ms"]),
        "one process in the rounds, cpu": statistics.median(every[0]["alone_cpu_ms"]),
    }
    for variant in VARIANTS:
        slowest_opt = [max(ms) for ms in zip(*(e["opt_ms"][variant] for e in every), strict=True)]
        slowest_whole = [
            max(ms) for ms in zip(*(e["whole_ms"][variant] for e in every), strict=True)
        ]
        out[variant] = {
            "opt_step_ms": statistics.median(slowest_opt),
            "whole_step_ms": statistics.median(slowest_whole),
            "per_rank": [e["figures"][variant] for e in every],
        }
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--units", type=int, default=8)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--rows", type=int, default=8192, help="rows of data per rank")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--out", default="", help="JSON file for the figures")
    args = ap.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    from fullshard.optim.exchange import ns_flops

    res: dict[str, Any] = {
        "units": args.units,
        "dim": args.dim,
        "rows_per_rank": args.rows,
        "rounds": args.rounds,
        "torch": torch.__version__,
        "threads_per_process": 1,
        "one_process": one_process(args),
        "ns_flops_total": args.units * ns_flops((args.dim, args.dim), 5),
        "params_bytes": args.units * args.dim * args.dim * 4,
    }
    for world in args.nproc:
        with tempfile.TemporaryDirectory() as tmp:
            result = os.path.join(tmp, "result.json")
            store = os.path.join(tmp, "store")
            mp.spawn(_rank, args=(world, store, args, result), nprocs=world)
            with open(result) as f:
                res[str(world)] = _summary(json.load(f))
    one = res["one_process"]
    print(
        f"{args.units} units of {args.dim}x{args.dim}, {args.rows} rows per rank, medians of "
        f"{args.rounds} alternating rounds (the slowest rank's), one thread per process"
    )
    print(
        f"one unsharded process: Muon step {one['torch.optim.Muon step ms']:.1f} ms, AdamW "
        f"step {one['AdamW step ms']:.1f} ms; Newton-Schulz {res['ns_flops_total'] / 1e9:.2f} "
        "GFLOP in all"
    )
    for world in args.nproc:
        table = dict(res[str(world)])
        alone = table.pop("one process in the rounds")
        alone_cpu = table.pop("one process in the rounds, cpu")
        adamw = table["AdamW (fullshard)"]["whole_step_ms"]
        print(
            f"\n{world} ranks (one unsharded process's Muon step in the same rounds: "
            f"{alone:.1f} ms)\n                                 opt step   x 1-proc   whole step  x AdamW"
        )
        for variant, row in table.items():
            ratio = row["opt_step_ms"] / alone
            print(
                f"  {variant:30s} {row['opt_step_ms']:8.1f} ms {ratio:6.2f}x "
                f"{row['whole_step_ms']:9.1f} ms {row['whole_step_ms'] / adamw:6.2f}x"
            )
        ours = table["fullshard.optim.Muon"]["per_rank"]
        print(
            "  fullshard.optim.Muon per rank: NS GFLOP "
            + ", ".join(f"{r['ns_flops'] / 1e9:.2f}" for r in ours)
            + "; exchange sends KiB "
            + ", ".join(f"{r['exchange_sent_bytes'] / 1024:.0f}" for r in ours)
            + "; state KiB "
            + ", ".join(f"{r['state_bytes'] / 1024:.0f}" for r in ours)
        )
        print(
            "  fullshard.optim.Muon per rank, median ms of a step: "
            + "; ".join(
                f"rank {k}: CPU {r['opt_step_cpu_ms']:.1f}, Newton-Schulz "
                f"{r['step_parts_ms']['newton_schulz']:.1f}, exchange "
                f"{r['step_parts_ms']['exchange']:.1f}"
                for k, r in enumerate(ours)
            )
            + f" (one process: CPU {alone_cpu:.1f})"
        )
        fb = ours[0]["forward_backward_bytes"]
        print(f"  one forward+backward's collectives (rank 0, c10d bytes by kind): {fb}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
