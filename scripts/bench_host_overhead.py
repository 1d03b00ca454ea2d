"""Host overhead per unit: fullshard against torch FSDP2, over torch's fake process group.

Issue 21. On the fake backend (``FakeStore``, backend ``"fake"``) collectives move no data, so
one process plays rank 0 of N and what a step costs beyond the plain model is the FSDP's own
host work: hooks, schedule, views, DTensor wrapping, copies into and out of collective buffers.
The model is a root module of 32 units, each ``Sequential(Linear(64, 64), GELU(), Linear(64,
64))``; each unit is ``fully_shard``-ed, then the root. One thread. A step is forward,
``.sum().backward()``, an optimizer step (``--optim``, the same for all variants) and
``zero_grad()`` on a ``--batch`` x 64 input. Three variants, built in one process per world size
(a subprocess each, so every world size gets a fresh fake group):

- ``plain``: the same model, unsharded (no FSDP);
- ``fullshard``: ``from fullshard import fully_shard``;
- ``fsdp2``: ``from torch.distributed.fsdp import fully_shard``.

Rounds alternate the variants (A B C D A B C D ...: the fourth is below), ``--steps`` steps
each, after ``--warmup`` rounds; a variant's figure is the median over ``--rounds`` rounds of
its mean step time. Host overhead per unit per step of an FSDP = (its median - plain's median)
/ 32. Prints a table and writes ``--out`` (JSON): per world size the three medians (ms), the
two per-unit overheads (ms) and the ratio fullshard / fsdp2.

Torch's fake group is not free: its all-gather copies the shard into every rank's chunk of the
output, O(world) host work that both FSDPs pay. So a fourth entry of the rounds times the fake
collectives of a step alone (2 all-gathers + 1 reduce-scatter per unit), and the table and JSON
also give the ratio with that cost taken off both overheads. ``--profile N`` runs N fullshard
steps under cProfile at the first world size and prints fullshard's own functions, top 25 by
cumulative and by total time, per unit per step.

    PYTHONPATH=src .venv/bin/python scripts/bench_host_overhead.py --world 8,64
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

UNITS = 32
DIM = 64
VARIANTS = ("plain", "fullshard", "fsdp2")
# not a model: the fake backend's own collectives of one step (see _collectives)
COLLECTIVES = "fake collectives"


class Root(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.units = nn.ModuleList(
            nn.Sequential(nn.Linear(DIM, DIM), nn.GELU(), nn.Linear(DIM, DIM)) for _ in range(UNITS)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for unit in self.units:
            x = unit(x)
        return x


def _build(variant: str) -> nn.Module:
    torch.manual_seed(0)
    model = Root()
    if variant == "plain":
        return model
    if variant == "fullshard":
        from fullshard import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard  # type: ignore[no-redef]
    for unit in model.units:
        fully_shard(unit)
    fully_shard(model)
    return model


def _optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-3)


def _stepper(variant: str, args: argparse.Namespace) -> Callable[[], None]:
    model = _build(variant)
    opt = _optimizer(args.optim, model.parameters())
    x = torch.randn(args.batch, DIM)

    def step() -> None:
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()

    return step


def _collectives(world: int) -> Callable[[], None]:
    """What both FSDPs ask of the fake backend in a step: per unit, two all-gathers (forward and
    backward) and one reduce-scatter of the unit's 8,320 elements, through ``torch.distributed``.

    Torch's fake group is not free: its all-gather copies the input into each of the world's
    chunks of the output (``FakeProcessGroup.hpp``), so its cost grows with the world size.
    Timed alongside the variants, it can be subtracted from both FSDPs' overheads.
    """
    numel = 2 * (DIM * DIM + DIM)
    shard = -(-numel // world)
    full, local = torch.empty(shard * world), torch.zeros(shard)
    # torch 2.13 deprecates the older names (fullshard takes the newer where it exists)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    def step() -> None:
        for _ in range(UNITS):
            for _ in range(2):
                gather(full, local, async_op=True).wait()
            scatter(local, full, async_op=True).wait()

    return step


def _profile(step: Callable[[], None], n: int, world: int) -> None:
    """cProfile ``n`` fullshard steps; print fullshard's own functions, per unit per step."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        step()
    prof.disable()
    stats = pstats.Stats(prof)
    total = stats.total_tt  # type: ignore[attr-defined]
    per = 1e3 / (n * UNITS)  # ms per unit per step, from seconds over n steps
    print(
        f"\ncProfile, fullshard, world {world}: {n} steps, {1e3 * total / n:.2f} ms per step "
        "under the profiler (its own cost inflates every call; compare rows, not totals)"
    )
    own = {k: v for k, v in stats.stats.items() if f"{os.sep}fullshard{os.sep}" in k[0]}  # type: ignore[attr-defined]
    for title, col in (("cumulative", 3), ("total (own)", 2)):
        rows = sorted(own.items(), key=lambda kv: kv[1][col], reverse=True)[:25]
        print(f"\nfullshard functions, top 25 by {title} time, ms per unit per step:")
        print(f"  {'cum':>7s} {'own':>7s} {'calls/unit/step':>15s}  function")
        for (path, line, fn), (_cc, nc, tt, ct, _callers) in rows:
            rel = path.split(f"{os.sep}fullshard{os.sep}", 1)[-1]
            calls = nc / (n * UNITS)
            print(f"  {ct * per:7.4f} {tt * per:7.4f} {calls:15.2f}  {rel}:{line} {fn}")


def _worker(args: argparse.Namespace) -> dict[str, Any]:
    """One world size: rank 0 of ``args.world_one`` on the fake backend, all three variants."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.set_num_threads(1)
    world = args.world_one
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        steps = {v: _stepper(v, args) for v in VARIANTS}
        steps[COLLECTIVES] = _collectives(world)
        times: dict[str, list[float]] = {v: [] for v in steps}
        for r in range(args.warmup + args.rounds):
            for v, step in steps.items():
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    step()
                dt = (time.perf_counter() - t0) / args.steps
                if r >= args.warmup:
                    times[v].append(dt)
        if args.profile:
            _profile(steps["fullshard"], args.profile, world)
    finally:
        dist.destroy_process_group()
    med = {v: 1e3 * statistics.median(t) for v, t in times.items()}
    over = {v: (med[v] - med["plain"]) / UNITS for v in ("fullshard", "fsdp2")}
    coll = med.pop(COLLECTIVES) / UNITS
    return {
        "median_step_ms": med,
        "overhead_per_unit_ms": over,
        "ratio_fullshard_over_fsdp2": over["fullshard"] / over["fsdp2"],
        "fake_collectives_per_unit_ms": coll,
        "ratio_without_fake_collectives": (over["fullshard"] - coll) / (over["fsdp2"] - coll),
        # spread of the per-round overheads: how far to trust the medians on a busy machine
        "round_overhead_per_unit_ms_iqr": {
            v: _iqr([(a - b) * 1e3 / UNITS for a, b in zip(times[v], times["plain"], strict=True)])
            for v in ("fullshard", "fsdp2")
        },
    }


def _iqr(xs: list[float]) -> list[float]:
    q = statistics.quantiles(xs, n=4)
    return [q[0], q[2]]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", default="8,64", help="world sizes, comma-separated (default 8,64)")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3, help="steps per variant per round")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--optim", choices=("adamw", "sgd"), default="adamw")
    ap.add_argument("--profile", type=int, default=0, help="cProfile N fullshard steps")
    ap.add_argument("--out", default="docs/bench/host_overhead.json", help="JSON ('' for none)")
    ap.add_argument("--world-one", type=int, default=0, help=argparse.SUPPRESS)  # the subprocess
    args = ap.parse_args()
    if args.world_one:  # a subprocess: one world size, the result as JSON on the last line
        res = _worker(args)
        print(json.dumps(res))
        return 0

    worlds = [int(w) for w in args.world.split(",") if w]
    results: dict[str, Any] = {}
    for i, world in enumerate(worlds):
        cmd = [sys.executable, os.path.abspath(__file__), "--world-one", str(world)]
        for flag in ("rounds", "warmup", "steps", "batch", "optim"):
            cmd += [f"--{flag}", str(getattr(args, flag))]
        if args.profile and i == 0:
            cmd += ["--profile", str(args.profile)]
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True)
        *printed, last = proc.stdout.rstrip("\n").split("\n")
        if printed:
            print("\n".join(printed))
        results[str(world)] = json.loads(last)

    print(
        f"\nHost overhead per unit, {UNITS} units of Linear({DIM},{DIM})-GELU-Linear({DIM},{DIM}), "
        f"batch {args.batch}, {args.optim}, fake group at rank 0, 1 thread; medians of "
        f"{args.rounds} alternating rounds of {args.steps} steps"
    )
    head = ["world", "plain", "fullshard", "fsdp2", "fs/unit", "f2/unit", "ratio", "coll/unit"]
    head.append("ratio-coll")
    print("  " + " ".join(f"{h:>10s}" for h in head) + "   (ms)")
    for key, res in results.items():
        m, o = res["median_step_ms"], res["overhead_per_unit_ms"]
        row = [m["plain"], m["fullshard"], m["fsdp2"], o["fullshard"], o["fsdp2"]]
        cells = [f"{key:>10s}"] + [f"{x:10.3f}" for x in row]
        cells.append(f"{res['ratio_fullshard_over_fsdp2']:9.2f}x")
        cells.append(f"{res['fake_collectives_per_unit_ms']:10.3f}")
        cells.append(f"{res['ratio_without_fake_collectives']:9.2f}x")
        print("  " + " ".join(cells))
    print(
        "  fs/unit, f2/unit: (median step - plain's) / units; ratio = fs/unit / f2/unit (below 1:"
        " fullshard costs less);\n  coll/unit: the fake backend's own 2 all-gathers + 1"
        " reduce-scatter per unit; ratio-coll: the ratio with coll/unit taken off both"
    )
    if args.out:
        doc = {
            "what": "host overhead per unit per step = (median step - plain median) / units",
            "fake_collectives": "the fake backend's 2 all-gathers + 1 reduce-scatter per unit, "
            "timed alone in the same rounds; ratio_without_fake_collectives takes it off both",
            "units": UNITS,
            "unit": f"Sequential(Linear({DIM}, {DIM}), GELU(), Linear({DIM}, {DIM}))",
            "batch": args.batch,
            "optimizer": args.optim,
            "rounds": args.rounds,
            "steps_per_round": args.steps,
            "warmup_rounds": args.warmup,
            "threads": 1,
            "backend": "fake (FakeStore), rank 0",
            "torch": torch.__version__,
            "worlds": results,
        }
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
